"""The gateway refuses to open the API to the network without keys, and reads keys files strictly."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.cli.main import main as halfmoon
from halfmoon.core.tenants import KeyRing, key_digest
from halfmoon.runtime.config import load_config
from halfmoon.services.gateway.service import GatewayConfig


class TestNoKeysMeansLoopbackOnly:
    def test_gateway_refuses_a_public_address_without_keys(self, tiny_model_dir: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            load_config(GatewayConfig, ["--host", "0.0.0.0"], env={"HALFMOON_MODEL_DIR": str(tiny_model_dir)})
        assert "api_keys_file" in capsys.readouterr().err

    @pytest.mark.parametrize("argv", [["--host", "127.0.0.1"], ["--host", "0.0.0.0", "--insecure-no-auth"],
                                      ["--host", "0.0.0.0", "--api-keys-file", "keys"]])
    def test_loopback_keys_or_an_explicit_flag_are_accepted(self, tiny_model_dir: Path, argv: list[str]) -> None:
        config = load_config(GatewayConfig, argv, env={"HALFMOON_MODEL_DIR": str(tiny_model_dir)})
        assert config.host == argv[1]

    def test_halfmoon_up_refuses_before_starting_anything(self, tmp_path: Path) -> None:
        with pytest.raises(SystemExit, match="--insecure-no-auth"):
            halfmoon(["up", "--host", "0.0.0.0", "--run-dir", str(tmp_path / "run")])
        assert not (tmp_path / "run" / "nats-server.conf").exists()


class TestOwnNatsUser:
    """A gateway's NATS user may submit and read streams for one gateway id: it must be this gateway's."""

    @pytest.mark.parametrize(("instance_id", "user", "fix"), [
        ("gateway-0", "gateway-gateway-1", "HALFMOON_INSTANCE_ID (instance_id)=gateway-1"),
        ("", "gateway-gateway-1", "HALFMOON_INSTANCE_ID (instance_id)=gateway-1"),
        ("gateway-0", "gateway", "credentials of gateway-gateway-0"),
    ])
    def test_another_gateways_or_a_roles_user_is_refused_with_the_fix(self, tiny_model_dir: Path, instance_id: str,
                                                                      user: str, fix: str) -> None:
        with pytest.raises(ValueError, match="not the NATS user of gateway") as refused:
            GatewayConfig(model_dir=str(tiny_model_dir), instance_id=instance_id, nats_user=user, nats_password="x")
        assert fix in str(refused.value)

    def test_its_own_user_is_accepted(self, tiny_model_dir: Path) -> None:
        config = GatewayConfig(model_dir=str(tiny_model_dir), instance_id="gateway-1", nats_user="gateway-gateway-1",
                               nats_password="x")
        assert config.nats_user == "gateway-gateway-1"


class TestKeysFile:
    def test_keys_map_to_tenants_with_limits(self) -> None:
        hidden = key_digest("sk-hidden-0123456789").hex()
        ring = KeyRing.parse(f"# comment\nsk-0123456789abcdef acme 10 1000\n\nsha256:{hidden} globex\n")
        acme, globex = ring.tenant("sk-0123456789abcdef"), ring.tenant("sk-hidden-0123456789")
        assert acme is not None and (acme.name, acme.requests_per_minute, acme.tokens_per_minute) == ("acme", 10, 1000)
        assert globex is not None and globex.name == "globex" and not globex.limited
        assert ring.tenant("sk-0123456789abcdeX") is None and ring.limited

    @pytest.mark.parametrize(("text", "message"), [
        ("", "no keys"),
        ("short acme", "at least 16"),
        ("sk-0123456789abcdef", "KEY TENANT"),
        ("sk-0123456789abcdef a/b", "tenant"),
        ("sk-0123456789abcdef acme ten", "integers"),
        ("sk-0123456789abcdef acme\nsk-0123456789abcdef beta", "duplicate"),
        ("sk-0123456789abcdef acme 5\nsk-0123456789abcdeX acme 6", "different limits"),
    ])
    def test_bad_files_name_the_line_and_the_problem(self, text: str, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            KeyRing.parse(text, "keys")

"""infra/entrypoint.py, run as the container runs it: per-replica settings, then exec the command."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, service_env

ENTRYPOINT = REPO_ROOT / "infra" / "entrypoint.py"
_spec = importlib.util.spec_from_file_location("halfmoon_entrypoint", ENTRYPOINT)
_module = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_module)  # type: ignore[union-attr]
role_of = _module.role_of
# The command the entrypoint execs: reports its environment and whether its NVMe slot lock is held
# (by trying to take it from a fresh descriptor), then waits for one line on stdin.
PROBE = """
import fcntl, json, os, sys
env = {k: v for k, v in os.environ.items() if k.startswith("HALFMOON_")}
held = False
if "HALFMOON_NVME_DIR" in env:
    fd = os.open(env["HALFMOON_NVME_DIR"] + ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = True
print(json.dumps({"env": env, "held": held}), flush=True)
sys.stdin.readline()
"""


def start(**env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ENTRYPOINT), sys.executable, "-c", PROBE],
        env=service_env(**env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def report(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the command did not run (exit {proc.wait()})"
    return json.loads(line)


def finish(proc: subprocess.Popen[str]) -> None:
    proc.communicate("\n", timeout=30)
    assert proc.returncode == 0


class TestAdvertiseHost:
    def test_wildcard_listener_advertises_own_address(self) -> None:
        proc = start(HALFMOON_HOST="0.0.0.0")
        advertised = report(proc)["env"]["HALFMOON_ADVERTISE_HOST"]
        finish(proc)
        assert ipaddress.ip_address(advertised).version == 4
        assert advertised == socket.gethostbyname(socket.gethostname())

    def test_explicit_address_is_kept(self) -> None:
        proc = start(HALFMOON_HOST="0.0.0.0", HALFMOON_ADVERTISE_HOST="10.1.2.3")
        assert report(proc)["env"]["HALFMOON_ADVERTISE_HOST"] == "10.1.2.3"
        finish(proc)

    def test_specific_listener_needs_nothing(self) -> None:
        proc = start(HALFMOON_HOST="127.0.0.1")
        assert "HALFMOON_ADVERTISE_HOST" not in report(proc)["env"]
        finish(proc)


class TestNvmeSlots:
    def test_replicas_get_distinct_slots_held_for_their_lifetime(self, tmp_path: Path) -> None:
        first, second = start(HALFMOON_NVME_ROOT=str(tmp_path)), start(HALFMOON_NVME_ROOT=str(tmp_path))
        a, b = report(first), report(second)
        assert {a["env"]["HALFMOON_NVME_DIR"], b["env"]["HALFMOON_NVME_DIR"]} == {
            str(tmp_path / "slot-0"),
            str(tmp_path / "slot-1"),
        }
        assert a["held"] and b["held"], "the exec'd service must keep its slot locked"
        assert "HALFMOON_NVME_ROOT" not in a["env"]
        assert Path(a["env"]["HALFMOON_NVME_DIR"]).is_dir()
        freed = a["env"]["HALFMOON_NVME_DIR"]
        finish(first)
        third = start(HALFMOON_NVME_ROOT=str(tmp_path))
        assert report(third)["env"]["HALFMOON_NVME_DIR"] == freed, "a restarted replica takes the free slot back"
        finish(third)
        finish(second)

    def test_no_command_is_an_error(self) -> None:
        result = subprocess.run(
            [sys.executable, str(ENTRYPOINT)], check=False, capture_output=True, text=True, timeout=30
        )
        assert result.returncode != 0 and "usage" in result.stderr


def make_secrets(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "secrets", str(directory), *args], check=True,
                          env=service_env(), capture_output=True, text=True, timeout=60)


class TestSecretsJob:
    def test_generated_once_private_and_kept_on_the_next_up(self, tmp_path: Path) -> None:
        secrets = tmp_path / "secrets"
        make_secrets(secrets, "--if-missing")
        keys = (secrets / "api-keys").read_text()
        assert all(f.stat().st_mode & 0o077 == 0 for f in secrets.iterdir()), "a credential readable by others"
        identity = json.loads((secrets / "s3.json").read_text())["identities"][0]["credentials"][0]
        s3 = dict(line.split("=", 1) for line in (secrets / "s3.env").read_text().split())
        assert identity == {"accessKey": s3["AWS_ACCESS_KEY_ID"], "secretKey": s3["AWS_SECRET_ACCESS_KEY"]}
        assert "already" in make_secrets(secrets, "--if-missing").stdout
        assert (secrets / "api-keys").read_text() == keys
        make_secrets(secrets)  # without the flag: a fresh set (rotation)
        assert (secrets / "api-keys").read_text() != keys


class TestSecrets:
    def test_a_service_gets_its_roles_credentials_and_nothing_it_set_is_replaced(self, tmp_path: Path) -> None:
        secrets = tmp_path / "secrets"
        make_secrets(secrets, "--tenants", "a,b")
        proc = start(HALFMOON_SECRETS_DIR=str(secrets), HALFMOON_SECRETS_ROLE="gateway",
                     HALFMOON_NATS_URL="nats://nats:4222", HALFMOON_GATEWAY_SLOT="3")
        env = report(proc)["env"]
        finish(proc)
        assert (env["HALFMOON_INSTANCE_ID"], env["HALFMOON_NATS_USER"]) == ("gateway-3", "gateway-gateway-3")
        assert env["HALFMOON_NATS_PASSWORD"]
        assert env["HALFMOON_API_KEYS_FILE"] == str(secrets / "api-keys")
        assert env["HALFMOON_CLUSTER_SECRET_FILE"] == str(secrets / "cluster-secret")
        assert "HALFMOON_S3_ACCESS_KEY" not in env  # only a transfer node gets the S3 keys
        proc = start(HALFMOON_SECRETS_DIR=str(secrets), HALFMOON_SECRETS_ROLE="transfer",
                     HALFMOON_S3_ACCESS_KEY="mine")
        env = report(proc)["env"]
        finish(proc)
        assert env["HALFMOON_NATS_USER"] == "transfer" and env["HALFMOON_S3_ACCESS_KEY"] == "mine"
        assert env["HALFMOON_S3_SECRET_KEY"] and "HALFMOON_API_KEYS_FILE" not in env

    def test_gateway_replicas_claim_distinct_slots_while_they_live(self, tmp_path: Path) -> None:
        secrets, slots = tmp_path / "secrets", tmp_path / "gateway-slots"
        make_secrets(secrets, "--gateways", "2")
        claim = {"HALFMOON_SECRETS_DIR": str(secrets), "HALFMOON_SECRETS_ROLE": "gateway",
                 "HALFMOON_GATEWAY_SLOTS": str(slots)}
        first, second = start(**claim), start(**claim)
        a, b = report(first)["env"], report(second)["env"]
        assert {(e["HALFMOON_INSTANCE_ID"], e["HALFMOON_NATS_USER"]) for e in (a, b)} == {
            ("gateway-0", "gateway-gateway-0"), ("gateway-1", "gateway-gateway-1")}
        assert a["HALFMOON_NATS_PASSWORD"] != b["HALFMOON_NATS_PASSWORD"]
        full = subprocess.run([sys.executable, str(ENTRYPOINT), "true"], check=False, capture_output=True, text=True,
                              env=service_env(**claim), timeout=30)
        assert full.returncode != 0 and "--gateways" in full.stderr, "a third replica has no slot of its own"
        finish(first)
        third = start(**claim)
        assert report(third)["env"]["HALFMOON_INSTANCE_ID"] == a["HALFMOON_INSTANCE_ID"], "the freed slot is taken"
        finish(third)
        finish(second)

    def test_a_gateway_without_a_slot_stops_with_the_fix(self, tmp_path: Path) -> None:
        make_secrets(tmp_path)
        result = subprocess.run([sys.executable, str(ENTRYPOINT), "true"], check=False, capture_output=True, text=True,
                                env=service_env(HALFMOON_SECRETS_DIR=str(tmp_path), HALFMOON_SECRETS_ROLE="gateway"),
                                timeout=30)
        assert result.returncode != 0 and "HALFMOON_GATEWAY_SLOTS" in result.stderr

    def test_the_role_is_the_commands_unless_named(self) -> None:
        assert role_of(["python", "-m", "halfmoon.services.cache_manager"]) == "cache-manager"
        assert role_of(["python3", "-X", "dev", "-m", "halfmoon.services.decode", "--port", "1"]) == "decode"
        assert role_of(["halfmoon", "secrets", "/secrets"]) == ""

    def test_a_missing_role_file_stops_the_start_with_the_fix(self, tmp_path: Path) -> None:
        result = subprocess.run([sys.executable, str(ENTRYPOINT), "true"], check=False, capture_output=True, text=True,
                                env=service_env(HALFMOON_SECRETS_DIR=str(tmp_path), HALFMOON_SECRETS_ROLE="decode"),
                                timeout=30)
        assert result.returncode != 0 and "halfmoon secrets" in result.stderr

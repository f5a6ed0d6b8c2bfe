"""NATS over TLS with what `halfmoon certs` and `halfmoon secrets` write: a service with its role's
credentials and client certificate connects; one without a client certificate, or trusting another CA,
does not."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from halfmoon.cli.main import main as halfmoon
from halfmoon.deploy.nats_auth import NatsAuth
from halfmoon.deploy.processes import free_port, nats_server_binary, wait_for_port
from halfmoon.runtime.config import ServiceConfig
from halfmoon.runtime.host import connect_nats


class TlsNats:
    def __init__(self, url: str, certs: Path, auth: NatsAuth) -> None:
        self.url, self.certs, self.auth = url, certs, auth

    def config(self, role: str, cert: bool = True, ca: Path | None = None) -> ServiceConfig:
        files = {"nats_tls_cert": str(self.certs / f"{role}.pem"),
                 "nats_tls_key": str(self.certs / f"{role}-key.pem")} if cert else {}
        return ServiceConfig(nats_url=self.url, namespace="tls", connect_timeout_s=5,
                             nats_tls_ca=str(ca or self.certs / "ca.pem"), nats_user=role,
                             nats_password=self.auth.passwords[role], **files)


@pytest.fixture
def tls_nats(tmp_path: Path) -> Iterator[TlsNats]:
    certs = tmp_path / "certs"
    assert halfmoon(["certs", str(certs), "--hosts", "localhost,127.0.0.1"]) == 0
    assert (certs / "gateway-key.pem").stat().st_mode & 0o777 == 0o600
    port, secrets = free_port(), tmp_path / "secrets"
    assert halfmoon(["secrets", str(secrets), "--namespace", "tls", "--nats-host", "127.0.0.1", "--nats-port", str(port),
                     "--store-dir", str(tmp_path / "js"), "--monitor-port", "0", "--tls-dir", str(certs)]) == 0
    auth = NatsAuth.load(secrets / "nats-credentials.json")
    proc = subprocess.Popen([nats_server_binary(), "-c", str(secrets / "nats-server.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 10, proc)
        yield TlsNats(f"tls://127.0.0.1:{port}", certs, auth)
    finally:
        proc.terminate()
        proc.wait(10)


class TestNatsTls:
    async def test_a_service_with_its_client_certificate_connects(self, tls_nats: TlsNats) -> None:
        nc = await connect_nats(tls_nats.config("conductor"), "conductor-0", "conductor")
        try:
            assert nc.is_connected
            await nc.flush()
        finally:
            await nc.close()

    async def test_no_client_certificate_is_refused(self, tls_nats: TlsNats) -> None:
        with pytest.raises(ConnectionError):
            await connect_nats(tls_nats.config("conductor", cert=False), "conductor-0", "conductor")

    async def test_a_server_from_another_ca_is_not_trusted(self, tls_nats: TlsNats, tmp_path: Path) -> None:
        assert halfmoon(["certs", str(tmp_path / "other")]) == 0
        with pytest.raises(ConnectionError):
            await connect_nats(tls_nats.config("conductor", ca=tmp_path / "other" / "ca.pem"), "conductor-0", "conductor")

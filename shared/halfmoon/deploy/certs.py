"""A private CA, a NATS server certificate and one client certificate per role, for TLS between
services and NATS where that link crosses hosts (compose networks, Kubernetes pods)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from halfmoon.deploy.nats_auth import write_private

VALID_DAYS = 825  # the longest leaf lifetime clients commonly accept


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "halfmoon"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write(directory: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    write_private(directory / f"{stem}-key.pem", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class CertificateAuthority:
    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key, self.cert = key, cert

    @classmethod
    def create(cls, now: datetime.datetime) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name("halfmoon CA")).issuer_name(_name("halfmoon CA"))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    def issue(self, common_name: str, hosts: Sequence[str], server: bool,
              now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
        return key, builder.sign(self.key, hashes.SHA256())


def write_certificates(directory: Path, server_hosts: Sequence[str], clients: Sequence[str]) -> list[Path]:
    """``ca.pem`` (+ key), ``server.pem`` for ``server_hosts`` (DNS names or IPs) and
    ``<client>.pem`` per client; keys are 0600. Returns the certificate paths."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)  # tolerate clock skew
    ca = CertificateAuthority.create(now)
    _write(directory, "ca", ca.key, ca.cert)
    _write(directory, "server", *ca.issue(server_hosts[0], server_hosts, server=True, now=now))
    for client in clients:
        _write(directory, client, *ca.issue(client, (), server=False, now=now))
    return [directory / f"{stem}.pem" for stem in ("ca", "server", *clients)]

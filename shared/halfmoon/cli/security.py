"""`halfmoon secrets DIR` and `halfmoon certs DIR`: what a multi-host deployment (compose,
Kubernetes) needs to run with authentication on, written once and mounted into the services."""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

from halfmoon.deploy.nats_auth import ROLES, NatsAuth, TlsFiles, write_private


def _secrets(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    auth = NatsAuth.generate(args.namespace)
    auth.save(out / "nats-credentials.json")
    tls = None
    if args.tls_dir:
        tls_dir = Path(args.tls_dir)
        tls = TlsFiles(tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server-key.pem")
    write_private(out / "nats-server.conf", auth.server_config(args.nats_host, args.nats_port, Path(args.store_dir),
                                                              tls))
    for role in ROLES:
        write_private(out / f"{role}.env", "".join(f"{k}={v}\n" for k, v in auth.env(role).items()))
    keys = [(f"sk-hm-{secrets.token_urlsafe(32)}", tenant) for tenant in args.tenants.split(",") if tenant]
    write_private(out / "api-keys", "# KEY TENANT [RPM] [TPM]\n" + "".join(f"{k} {t}\n" for k, t in keys))
    write_private(out / "auth-secret", secrets.token_hex(32) + "\n")
    print(f"wrote {out}/: nats-server.conf, nats-credentials.json, <role>.env for {', '.join(ROLES)}, "
          f"api-keys ({len(keys)} keys), auth-secret (all mode 0600)")
    return 0


def _certs(args: argparse.Namespace) -> int:
    from halfmoon.deploy.certs import write_certificates  # cryptography loads only for this command

    paths = write_certificates(Path(args.dir), args.hosts.split(","), [r for r in ROLES])
    print(f"wrote {len(paths)} certificates and their keys (0600) to {args.dir}: ca.pem, server.pem "
          f"(for {args.hosts}), and one client certificate per role")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    sec = subparsers.add_parser("secrets", help="NATS users and config, API keys and the tenant-salt secret")
    sec.add_argument("dir", help="output directory (files are mode 0600)")
    sec.add_argument("--namespace", default="halfmoon", help="NATS subject namespace of the deployment")
    sec.add_argument("--tenants", default="default", help="comma-separated tenants to make one API key each for")
    sec.add_argument("--nats-host", default="0.0.0.0", help="address nats-server listens on")
    sec.add_argument("--nats-port", type=int, default=4222, help="port nats-server listens on")
    sec.add_argument("--store-dir", default="/data/nats", help="JetStream store inside the NATS container")
    sec.add_argument("--tls-dir", help="where `halfmoon certs` output is mounted in the NATS container (TLS on)")
    sec.set_defaults(func=_secrets)
    certs = subparsers.add_parser("certs", help="a CA, a NATS server certificate and per-role client certificates")
    certs.add_argument("dir", help="output directory")
    certs.add_argument("--hosts", default="nats,localhost,127.0.0.1",
                       help="comma-separated DNS names and IPs the NATS server is reached by")
    certs.set_defaults(func=_certs)

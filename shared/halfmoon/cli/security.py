"""`halfmoon secrets DIR` and `halfmoon certs DIR`: what a multi-host deployment (compose,
Kubernetes) needs to run with authentication on, written once and mounted into the services;
`halfmoon jetstream`: the JetStream buckets the services use, made as the operator once NATS runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from pathlib import Path

from halfmoon.core.cluster_keys import new_secret
from halfmoon.deploy.jetstream import LEADERSHIP_TTL_S, create_buckets_as_operator
from halfmoon.deploy.nats_auth import ROLE_USERS, ROLES, NatsAuth, TlsFiles, write_private
from halfmoon.protocol.permissions import gateway_user

COMPLETE = ".complete"  # written after every other file
DEFAULT_GATEWAY_SLOTS = 8


def _s3_identity(access: str, secret: str) -> str:
    """SeaweedFS's S3 identity file admitting exactly this key pair."""
    return json.dumps({"identities": [{"name": "halfmoon", "credentials": [{"accessKey": access, "secretKey": secret}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, indent=1)


def _secrets(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if args.if_missing and (out / COMPLETE).exists():
        print(f"{out}/ already holds a deployment's secrets; left as they are")
        return 0
    gateways = [f"gateway-{n}" for n in range(args.gateways)]  # the slots gateway replicas claim (infra/entrypoint.py)
    auth = NatsAuth.generate(args.namespace, gateways)
    auth.save(out / "nats-credentials.json")
    tls = None
    if args.tls_dir:
        tls_dir = Path(args.tls_dir)
        tls = TlsFiles(tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server-key.pem")
    write_private(out / "nats-server.conf", auth.server_config(args.nats_host, args.nats_port, Path(args.store_dir),
                                                              tls, args.monitor_port))
    # for a server whose config is someone else's (a NATS cluster): `include` this file
    write_private(out / "nats-authorization.conf", json.dumps(auth.authorization(), indent=1))
    for stale in out.glob("gateway-*.env"):  # a replica would claim a slot whose user is gone
        stale.unlink()
    for name, user in (*((r, r) for r in ROLE_USERS), *((g, gateway_user(g)) for g in gateways)):
        write_private(out / f"{name}.env", "".join(f"{k}={v}\n" for k, v in auth.env(user).items()))
    keys = [(f"sk-hm-{secrets.token_urlsafe(32)}", tenant) for tenant in args.tenants.split(",") if tenant]
    write_private(out / "api-keys", "# KEY TENANT [RPM] [TPM]\n" + "".join(f"{k} {t}\n" for k, t in keys))
    write_private(out / "auth-secret", secrets.token_hex(32) + "\n")
    write_private(out / "cluster-secret", new_secret() + "\n")
    access, secret = f"hm{secrets.token_hex(8)}", secrets.token_urlsafe(30)
    write_private(out / "s3.json", _s3_identity(access, secret))
    write_private(out / "s3.env", f"HALFMOON_S3_ACCESS_KEY={access}\nHALFMOON_S3_SECRET_KEY={secret}\n"
                                  f"AWS_ACCESS_KEY_ID={access}\nAWS_SECRET_ACCESS_KEY={secret}\n")
    write_private(out / COMPLETE, "")  # last: a run cut short is redone by the next --if-missing
    print(f"wrote {out}/: nats-server.conf, nats-authorization.conf, nats-credentials.json, <role>.env for "
          f"{', '.join(ROLE_USERS)}, gateway-<n>.env for {len(gateways)} gateway slots, "
          f"api-keys ({len(keys)} keys), auth-secret, cluster-secret, s3.json and s3.env (all mode 0600)")
    return 0


def _certs(args: argparse.Namespace) -> int:
    from halfmoon.deploy.certs import write_certificates  # cryptography loads only for this command

    paths = write_certificates(Path(args.dir), args.hosts.split(","), list(ROLES))
    print(f"wrote {len(paths)} certificates and their keys (0600) to {args.dir}: ca.pem, server.pem "
          f"(for {args.hosts}), and one client certificate per role")
    return 0


def _jetstream(args: argparse.Namespace) -> int:
    asyncio.run(create_buckets_as_operator(args.url, Path(args.credentials), args.leadership_ttl_s))
    print("JetStream buckets ready")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    sec = subparsers.add_parser("secrets", help="NATS users and config, API keys and the tenant-salt secret")
    sec.add_argument("dir", help="output directory (files are mode 0600)")
    sec.add_argument("--namespace", default="halfmoon", help="NATS subject namespace of the deployment")
    sec.add_argument("--tenants", default="default", help="comma-separated tenants to make one API key each for")
    sec.add_argument("--gateways", type=int, default=DEFAULT_GATEWAY_SLOTS,
                     help="gateway slots: NATS users gateway-0.. (each gateway replica runs as one; more replicas "
                          "than slots do not start)")
    sec.add_argument("--nats-host", default="0.0.0.0", help="address nats-server listens on")
    sec.add_argument("--nats-port", type=int, default=4222, help="port nats-server listens on")
    sec.add_argument("--store-dir", default="/data", help="JetStream store inside the NATS container")
    sec.add_argument("--monitor-port", type=int, default=8222, help="nats-server monitoring port (0: off)")
    sec.add_argument("--if-missing", action="store_true",
                     help="do nothing when DIR already holds a complete set (a one-shot job run at every `up`)")
    sec.add_argument("--tls-dir", help="where `halfmoon certs` output is mounted in the NATS container (TLS on)")
    sec.set_defaults(func=_secrets)
    certs = subparsers.add_parser("certs", help="a CA, a NATS server certificate and per-role client certificates")
    certs.add_argument("dir", help="output directory")
    certs.add_argument("--hosts", default="nats,localhost,127.0.0.1",
                       help="comma-separated DNS names and IPs the NATS server is reached by")
    certs.set_defaults(func=_certs)
    js = subparsers.add_parser("jetstream", help="create the JetStream buckets the services use (as admin; idempotent)")
    js.add_argument("--url", required=True, help="the NATS server")
    js.add_argument("--credentials", required=True, help="nats-credentials.json, as `halfmoon secrets` wrote it")
    js.add_argument("--leadership-ttl-s", type=float, default=LEADERSHIP_TTL_S,
                    help="the cache-managers' leadership_ttl_s (every one must run with this value)")
    js.set_defaults(func=_jetstream)

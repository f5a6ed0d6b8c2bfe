"""Who may publish and subscribe to what on NATS, per service role, built from :class:`Subjects`
so the allow-lists cannot drift from the subjects the services use.

Each role connects as its own NATS user with these permissions (see ``halfmoon.deploy.nats_auth``).
The server enforces them: a gateway cannot submit to a decode instance, publish a token stream or
declare an instance down; only the conductor may publish InstanceDown for others, and every
instance heartbeats and says goodbye only on its own role's registry subject. Request/reply
answers go to per-role inbox prefixes, so one role cannot read another's replies.
"""

from __future__ import annotations

from typing import NamedTuple

from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import CACHE_OPERATIONS, Subjects

ADMIN = "admin"  # the operator: the launcher's readiness watch, taps and tests; everything
# An engine outside Halfmoon's services that uses the pool (vLLM with connectors/vllm.py): the pool
# protocol and its replies, nothing else (no heartbeats, no work, no streams)
KV_CLIENT = "kv-client"


class Permissions(NamedTuple):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool  # answers requests: may publish to the reply subject of a message it received


def inbox_prefix(role: str) -> str:
    """Where ``role``'s request replies arrive (set as nats-py's ``inbox_prefix``)."""
    return f"_INBOX_{role}"


def rate_limit_bucket(subjects: Subjects) -> str:
    """The JetStream key-value bucket the gateways share their tenants' rate windows in."""
    return "halfmoon_ratelimit_" + subjects.namespace.replace(".", "_")


def leadership_bucket(subjects: Subjects) -> str:
    """The JetStream key-value bucket holding which instance of a role is the active one (cache-manager)."""
    return "halfmoon_leaders_" + subjects.namespace.replace(".", "_")


def _jetstream_kv(bucket: str) -> tuple[str, ...]:
    """Use of one key-value bucket, never its creation: STREAM.CREATE takes the new stream's subjects from
    the request, so it would let a role capture every subject (the operator creates buckets at deploy time)."""
    stream = f"KV_{bucket}"
    return (f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>", f"$KV.{bucket}.>")


def role_permissions(subjects: Subjects, role: Role | str) -> Permissions:
    """The allow-lists of one role (``Role``, ``ADMIN`` or ``KV_CLIENT``)."""
    if role == ADMIN:
        return Permissions(publish=(">",), subscribe=(">",), responds=True)
    s = subjects
    pool = tuple(s.cache(op) for op in ("lookup", "release", "remove", "corrupt", "put_start", "put_end"))
    if role == KV_CLIENT:
        return Permissions(publish=pool, subscribe=(f"{inbox_prefix(KV_CLIENT)}.>",), responds=False)
    role = Role(role)
    own = (s.heartbeat_from(role.value), s.down_from(role.value))
    inbox = (f"{inbox_prefix(role.value)}.>",)
    engine_listens = (s.heartbeat, s.down, s.cancel, s.resume_any)  # transfer nodes' whereabouts; cancellations
    if role is Role.GATEWAY:
        return Permissions(publish=(*own, s.schedule, s.prefill_submit_any, s.cancel, s.resume_any,
                                    *_jetstream_kv(rate_limit_bucket(s))),
                           subscribe=(s.stream_any, s.down, *inbox), responds=False)
    if role is Role.CONDUCTOR:
        return Permissions(publish=(*own, s.kv_snapshot, s.placed),
                           subscribe=(s.schedule, s.heartbeat, s.down, s.kv_events, s.placed, s.work_done, s.cancel,
                                      *inbox), responds=True)
    if role is Role.PREFILL:  # prefill instances of one pipeline (CPP) pass a chunk's hidden states on
        return Permissions(publish=(*own, s.work_done_from(role.value), s.stream_any, s.kv_events, s.decode_submit_any,
                                    s.decode_kv_any, s.prefill_stage_any, *pool),
                           subscribe=(s.prefill_submit_any, s.prefill_stage_any, s.kv_snapshot, *engine_listens,
                                      *inbox), responds=True)
    if role is Role.AGGREGATED:  # a prefill instance that decodes itself: it hands nothing to decode
        return Permissions(publish=(*own, s.work_done_from(role.value), s.stream_any, s.kv_events, *pool),
                           subscribe=(s.prefill_submit_any, s.kv_snapshot, *engine_listens, *inbox), responds=True)
    if role is Role.DECODE:
        return Permissions(publish=(*own, s.work_done_from(role.value), s.stream_any, *pool),
                           subscribe=(s.decode_submit_any, s.decode_kv_any, *engine_listens, *inbox),
                           responds=True)
    if role is Role.CACHE_MANAGER:
        return Permissions(publish=(*own, s.transfer_orders_any, *_jetstream_kv(leadership_bucket(s))),
                           subscribe=(*(s.cache(op) for op in sorted(CACHE_OPERATIONS)), s.heartbeat, s.down, *inbox),
                           responds=True)
    return Permissions(publish=own, subscribe=(s.transfer_orders_any, *inbox), responds=True)  # transfer

"""Who may publish and subscribe to what on NATS, per service role, built from :class:`Subjects`
so the allow-lists cannot drift from the subjects the services use.

Each role connects as its own NATS user with these permissions (see ``halfmoon.deploy.nats_auth``),
and each gateway instance as a user of its own (``gateway_user``). The server enforces them: a gateway
cannot submit to a decode instance, publish a token stream or declare an instance down; it submits to
prefill only on subjects naming itself, and reads only its own requests' streams and its own replies.
Only the conductor may publish InstanceDown for others, and every instance heartbeats and says goodbye
only on its own role's registry subject. Request/reply answers go to per-user inbox prefixes, so one
role (or gateway) cannot read another's replies.
"""

from __future__ import annotations

from typing import NamedTuple

from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import CACHE_OPERATIONS, Subjects, check_token

ADMIN = "admin"  # the operator: the launcher's readiness watch, taps and tests; everything
# An engine outside Halfmoon's services that uses the pool (vLLM with connectors/vllm.py): the pool
# protocol and its replies, nothing else (no heartbeats, no work, no streams)
KV_CLIENT = "kv-client"
# The online planner of a compose or Kubernetes deployment: it reads the engines' heartbeats and the
# conductors' placements and rejections, and publishes nothing (it acts through the platform's API, not NATS)
PLANNER = "planner"


class Permissions(NamedTuple):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool  # answers requests: may publish to the reply subject of a message it received


def inbox_prefix(user: str) -> str:
    """Where the request replies of NATS user ``user`` (a role, or a ``gateway_user``) arrive (set as
    nats-py's ``inbox_prefix``)."""
    return f"_INBOX_{user}"


_GATEWAY_USER = f"{Role.GATEWAY.value}-"


def gateway_user(instance_id: str) -> str:
    """The NATS user of gateway instance ``instance_id``: one per gateway, so that its credentials submit,
    and read streams and replies, for its own requests only."""
    return _GATEWAY_USER + check_token(instance_id, "gateway instance id")


def gateway_of_user(user: str) -> str | None:
    """The gateway instance id a NATS user is scoped to; None for a role's user."""
    return user[len(_GATEWAY_USER):] if user.startswith(_GATEWAY_USER) else None


def nats_user(role: Role | str, instance_id: str) -> str:
    """The NATS user an instance of ``role`` connects as: a gateway its own, everyone else its role's."""
    return gateway_user(instance_id) if role == Role.GATEWAY else Role(role).value


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


def user_permissions(subjects: Subjects, user: str) -> Permissions:
    """The allow-lists of one NATS user: a ``gateway_user``, or a role's (see ``role_permissions``)."""
    gateway = gateway_of_user(user)
    return role_permissions(subjects, user) if gateway is None else gateway_permissions(subjects, gateway)


def gateway_permissions(subjects: Subjects, instance_id: str) -> Permissions:
    """One gateway instance's: submits naming itself, its own requests' streams, its own replies."""
    s = subjects
    own = (s.heartbeat_from(Role.GATEWAY.value), s.down_from(Role.GATEWAY.value))
    return Permissions(publish=(*own, s.schedule, s.prefill_submit_from(instance_id), s.cancel, s.resume_any,
                                *_jetstream_kv(rate_limit_bucket(s))),
                       subscribe=(s.streams_of(instance_id), s.down, f"{inbox_prefix(gateway_user(instance_id))}.>"),
                       responds=False)


def role_permissions(subjects: Subjects, role: Role | str) -> Permissions:
    """The allow-lists of one role (``Role``, ``ADMIN``, ``KV_CLIENT`` or ``PLANNER``); a gateway's are its instance's
    (``gateway_permissions``)."""
    if role == Role.GATEWAY:
        raise ValueError("each gateway instance has a user of its own: gateway_permissions(subjects, instance_id)")
    if role == ADMIN:
        return Permissions(publish=(">",), subscribe=(">",), responds=True)
    s = subjects
    pool = tuple(s.cache(op) for op in ("lookup", "release", "remove", "corrupt", "put_start", "put_end"))
    if role == KV_CLIENT:
        return Permissions(publish=pool, subscribe=(f"{inbox_prefix(KV_CLIENT)}.>",), responds=False)
    if role == PLANNER:
        return Permissions(publish=(), subscribe=(s.heartbeat, s.placed, s.rejected), responds=False)
    role = Role(role)
    own = (s.heartbeat_from(role.value), s.down_from(role.value))
    inbox = (f"{inbox_prefix(role.value)}.>",)
    engine_listens = (s.heartbeat, s.down, s.cancel, s.resume_any)  # transfer nodes' whereabouts; cancellations
    if role is Role.CONDUCTOR:
        return Permissions(publish=(*own, s.kv_snapshot, s.placed, s.rejected),
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

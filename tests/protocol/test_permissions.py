"""Allow-lists as data: each gateway instance's user is scoped to its own submits, streams and replies
(tests/security/test_nats_permissions.py checks that a NATS server enforces them)."""

from __future__ import annotations

import pytest

from halfmoon.deploy.nats_auth import ROLE_USERS, NatsAuth
from halfmoon.protocol.permissions import (
    PLANNER,
    gateway_of_user,
    gateway_permissions,
    gateway_user,
    inbox_prefix,
    nats_user,
    role_permissions,
    user_permissions,
)
from halfmoon.protocol.registry import Role
from halfmoon.protocol.subjects import Subjects

S = Subjects("t")


def matches(pattern: str, subject: str) -> bool:
    """NATS matching: ``*`` is one token, a last ``>`` one or more."""
    wanted, tokens = pattern.split("."), subject.split(".")
    if wanted[-1] == ">":
        return len(tokens) >= len(wanted) and matches(".".join(wanted[:-1]), ".".join(tokens[:len(wanted) - 1]))
    return len(wanted) == len(tokens) and all(w in ("*", t) for w, t in zip(wanted, tokens, strict=True))


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(matches(pattern, subject) for pattern in patterns)


class TestGatewayPermissions:
    def test_a_gateway_submits_reads_and_hears_replies_for_itself_only(self) -> None:
        mine = gateway_permissions(S, "gateway-0")
        assert allowed(mine.publish, S.prefill_submit("prefill-7", "gateway-0"))
        assert not allowed(mine.publish, S.prefill_submit("prefill-7", "gateway-1"))
        assert allowed(mine.subscribe, S.stream("gateway-0", "cmpl-1"))
        assert not allowed(mine.subscribe, S.stream("gateway-1", "cmpl-1"))
        assert allowed(mine.subscribe, f"{inbox_prefix(gateway_user('gateway-0'))}.abc")
        assert not allowed(mine.subscribe, f"{inbox_prefix(gateway_user('gateway-1'))}.abc")
        assert not allowed(mine.subscribe, f"{inbox_prefix('gateway-gateway-01')}.abc")  # a prefix is no scope
        assert not mine.responds

    def test_workers_take_submits_from_every_gateway(self) -> None:
        for role in (Role.PREFILL, Role.AGGREGATED):
            assert allowed(role_permissions(S, role).subscribe, S.prefill_submit("prefill-0", "gateway-5"))

    def test_the_shared_gateway_role_has_no_permissions_of_its_own(self) -> None:
        with pytest.raises(ValueError, match="own"):
            role_permissions(S, Role.GATEWAY)

    def test_users_name_their_scope(self) -> None:
        assert gateway_of_user(gateway_user("gateway-2")) == "gateway-2"
        assert gateway_of_user("conductor") is None
        assert nats_user(Role.GATEWAY, "gateway-2") == "gateway-gateway-2"
        assert nats_user(Role.DECODE, "decode-2") == "decode"
        assert user_permissions(S, "gateway-gateway-2") == gateway_permissions(S, "gateway-2")


class TestRejectionNotes:
    def test_conductors_publish_them_and_only_the_planner_reads_them(self) -> None:
        users = {user: user_permissions(S, user) for user in (*ROLE_USERS, gateway_user("gateway-0"))}
        assert {user for user, p in users.items() if allowed(p.publish, S.rejected)} == {"admin", "conductor"}
        assert {user for user, p in users.items() if allowed(p.subscribe, S.rejected)} == {"admin", PLANNER}
        assert S.rejected == "t.v1.conductor.rejected" and S.rejected != S.placed


class TestNatsAuth:
    def test_a_user_per_role_and_per_gateway_and_no_shared_gateway_user(self) -> None:
        auth = NatsAuth.generate("t", ["gateway-0", "gateway-1"])
        assert set(auth.passwords) == {*ROLE_USERS, "gateway-gateway-0", "gateway-gateway-1"}
        assert "gateway" not in auth.passwords and auth.gateways == ["gateway-0", "gateway-1"]
        users = {u["user"] for u in auth.authorization()["authorization"]["users"]}
        assert users == set(auth.passwords)
        env = auth.env("gateway-gateway-1")
        assert env["HALFMOON_INSTANCE_ID"] == "gateway-1" and env["HALFMOON_NATS_USER"] == "gateway-gateway-1"
        assert "HALFMOON_INSTANCE_ID" not in auth.env("conductor")

    def test_a_gateway_it_was_not_made_for_is_named_in_the_error(self) -> None:
        auth = NatsAuth.generate("t", ["gateway-0"])
        with pytest.raises(ValueError, match=r"gateway-9.*gateway-0"):
            auth.env(gateway_user("gateway-9"))

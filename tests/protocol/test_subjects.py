"""Subject naming: namespaced, versioned, and impossible to widen by accident."""

from __future__ import annotations

import pytest

from halfmoon.protocol import Subjects


class TestSubjects:
    def test_every_subject_is_under_namespace_and_version(self):
        s = Subjects("team-a")
        built = [
            s.schedule,
            s.prefill_submit("p0", "g0"),
            s.decode_submit("d0"),
            s.stream("g0", "r1"),
            s.heartbeat,
            s.down,
            s.cancel,
        ] + [s.cache(op) for op in ("put_start", "put_end", "lookup", "release", "report")]
        assert all(subject.startswith("team-a.v1.") for subject in built)
        assert len(set(built)) == len(built)
        assert s.prefill_submit("p0", "g0") == "team-a.v1.prefill.p0.submit.g0"
        assert s.stream("g0", "r1") == "team-a.v1.stream.g0.r1"

    def test_a_prefill_submit_names_its_gateway_last(self):
        s = Subjects("team-a")
        subject = s.prefill_submit("p0", "gateway-3")
        assert Subjects.submitter(subject) == "gateway-3"
        assert s.prefill_submit_to("p0") == "team-a.v1.prefill.p0.submit.*"  # what p0 subscribes to
        assert s.prefill_submit_from("gateway-3") == "team-a.v1.prefill.*.submit.gateway-3"  # what gateway-3 may send
        assert s.streams_of("gateway-3") == "team-a.v1.stream.gateway-3.*"
        with pytest.raises(ValueError):
            s.prefill_submit("p0", "g.*")

    def test_two_namespaces_never_collide(self):
        a, b = Subjects("a"), Subjects("b")
        assert a.schedule != b.schedule and a.heartbeat != b.heartbeat

    @pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", "", "x>"])
    def test_tokens_with_routing_characters_are_refused(self, bad):
        with pytest.raises(ValueError):
            Subjects().stream("g0", bad)
        with pytest.raises(ValueError):
            Subjects().stream(bad, "r1")
        with pytest.raises(ValueError):
            Subjects().decode_submit(bad)

    def test_dotted_namespace_is_allowed_but_wildcards_are_not(self):
        assert Subjects("org.team").schedule == "org.team.v1.conductor.schedule"
        with pytest.raises(ValueError):
            Subjects("org.*")

    def test_unknown_cache_operation(self):
        with pytest.raises(ValueError, match="unknown cache operation"):
            Subjects().cache("delete_everything")

"""Round trips of every message kind, and typed errors for everything that is not one."""

from __future__ import annotations

import msgspec
import pytest

from halfmoon.core.locations import Replica
from halfmoon.core.tiers import Tier
from halfmoon.protocol import (
    Ack,
    BlockLocation,
    CancelRequest,
    DecodeRequest,
    ErrorCode,
    ErrorEvent,
    ErrorReply,
    Heartbeat,
    InstanceDown,
    KernelReport,
    KVLocation,
    KVProgress,
    Leaving,
    Load,
    Placed,
    PrefillRequest,
    ProtocolError,
    Rejected,
    RejectReason,
    ResumeRequest,
    Role,
    SamplingParams,
    ScheduleAccepted,
    ScheduleRejected,
    ScheduleRequest,
    StepSample,
    TokenEvent,
    Usage,
    WorkDone,
    WorkOutcome,
    codecs,
)
from halfmoon.protocol.cache import (
    BlockReplicas,
    CacheAck,
    CorruptBlocks,
    Lookup,
    LookupResult,
    PutEnd,
    PutPlan,
    PutStart,
    Release,
    TransferReport,
)
from halfmoon.protocol.pipeline import MESSAGE_OVERHEAD, StageDone, StageWork, chunk_tokens
from halfmoon.protocol.pool import (
    KVEvents,
    OrderBatch,
    OrderResults,
    PoolOrder,
    PoolStatsReply,
    RemoveRequest,
    SnapshotRequest,
    StatsRequest,
    TierStat,
)
from halfmoon.protocol.scheduling import Readiness, ReadinessRequest

SAMPLING = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop=("\n\n",), logprobs=True)
LOC = BlockLocation(address="127.0.0.1:7000", offset=4096, size=2048, segment="seg0", key=b"\x01" * 32)
TAIL = BlockLocation(address="127.0.0.1:7000", offset=8192, size=512)
KV = KVLocation(block_size=4, num_tokens=6, blocks=(LOC,), partial=TAIL)

CASES = [
    (codecs.CACHE_CORRUPT, CorruptBlocks(reporter="prefill-0", blocks=(LOC,))),
    (
        codecs.SCHEDULE_REQUEST,
        ScheduleRequest(
            request_id="r-1",
            model="tiny",
            prompt_len=3,
            sampling=SAMPLING,
            deadline=1e9,
            prompt_token_ids=(5, 6, 7),
            block_keys=(b"k" * 32,),
            tenant_salt="t1",
        ),
    ),
    (
        codecs.SCHEDULE_REPLY,
        ScheduleAccepted(request_id="r-1", prefill_instance="p0", decode_instance="d0", predicted_ttft_ms=12.5),
    ),
    (
        codecs.SCHEDULE_REPLY,
        ScheduleRejected(request_id="r-1", reason=RejectReason.NO_DECODE_INSTANCE, message="none", retry_after_s=2.0),
    ),
    (codecs.SCHEDULE_REPLY, ErrorReply(code=ErrorCode.BAD_REQUEST, message="bad", retryable=False)),
    (codecs.SCHEDULE_REQUEST, ReadinessRequest()),
    (codecs.READINESS_REPLY, Readiness(conductor="conductor-0", ready=True, prefill=1, decode=2)),
    (codecs.SCHEDULE_REPLY, ScheduleAccepted(request_id="r-1", prefill_instance="p0", decode_instance="d0",
                                             prefill_incarnation="a1b2", decode_incarnation="c3d4")),
    (codecs.SCHEDULE_REPLY, ScheduleAccepted(request_id="r-1", prefill_instance="a0", decode_instance="a0",
                                             step_target_s=0.15)),
    (
        codecs.PREFILL_REQUEST,
        PrefillRequest(request_id="r-2", prompt_token_ids=(1, 2, 3), sampling=SAMPLING, decode_instance="a0",
                       deadline=1e9, step_target_s=0.15),
    ),
    (
        codecs.PREFILL_REQUEST,
        PrefillRequest(
            request_id="r-1",
            prompt_token_ids=(1, 2, 3),
            sampling=SAMPLING,
            decode_instance="d0",
            deadline=1e9,
        ),
    ),
    (
        codecs.DECODE_REQUEST,
        DecodeRequest(
            request_id="r-1",
            prompt_token_ids=(1, 2, 3, 4, 5, 6),
            first_token_id=9,
            first_logprob=-0.25,
            sampling=SAMPLING,
            kv=KV,
            gateway="gateway-0",
            prefill_instance="p0",
            deadline=1e9,
            cached_tokens=4,
        ),
    ),
    (codecs.KV_PROGRESS, KVProgress(request_id="r-1", block_size=4, num_tokens=6, indexes=(0,), blocks=(LOC,),
                                    layers_done=2)),
    (codecs.STAGE_WORK, StageWork(request_id="r-1", stages=("p0", "p1"), layer_bounds=(0, 2, 4), stage=1, index=1,
                                  start=4, token_ids=(5, 6), prompt_len=6, hidden=b"\x01" * 16, dtype="float32",
                                  sampling=SAMPLING, deadline=1.0, last=True, block_indexes=(0,), blocks=(LOC,),
                                  salts=(b"\x02" * 16,))),
    (codecs.STAGE_REPLY, StageDone(request_id="r-1", index=1, token_id=7, logprob=-0.5, text="x",
                                   finish_reason="prefill_done", written=(0,))),
    (codecs.SUBMIT_REPLY, Ack(request_id="r-1", instance_id="p0")),
    (codecs.CANCEL, CancelRequest(request_id="r-1", reason="client gone")),
    (codecs.CANCEL, CancelRequest(request_id="r-1", reason="migrated", attempt=0)),
    (codecs.RESUME, ResumeRequest(request_id="r-1", attempt=1, from_index=17)),
    (codecs.PLACED, Placed(conductor="conductor-1", prefill_instance="p0", decode_instance="d1", request_id="r-1",
                           prefill_s=0.25, prompt_tokens=6, ttl_s=61.0, decode_ttl_s=90.0)),
    (codecs.PLACED, Placed(conductor="conductor-1", prefill_instance="a0", decode_instance="a0", request_id="r-2",
                           prefill_s=9.25, prompt_tokens=2_725, max_tokens=32, paced=True)),
    (codecs.REJECTED, Rejected(conductor="conductor-1", request_id="r-1", reason=RejectReason.OVERLOADED,
                               prompt_tokens=6, max_tokens=16)),
    (codecs.WORK_DONE, WorkDone(request_id="r-1", instance_id="p0", outcome=WorkOutcome.COMPLETED)),
    (codecs.WORK_DONE, WorkDone(request_id="r-1", instance_id="d1", outcome=WorkOutcome.CANCELLED, attempt=2)),
    (
        codecs.DECODE_REQUEST,
        DecodeRequest(
            request_id="r-1", prompt_token_ids=(1, 2, 3, 4), output_token_ids=(5, 6), first_token_id=9,
            sampling=SAMPLING, kv=KV, gateway="gateway-0", prefill_instance="p0",
            deadline=1e9, attempt=1, tenant_salt="t",
        ),
    ),
    (
        codecs.DECODE_REQUEST,
        DecodeRequest(
            request_id="r-1", prompt_token_ids=(1, 2, 3), first_token_id=9, sampling=SAMPLING, kv=None,
            gateway="gateway-0", prefill_instance="p0", deadline=1e9,
        ),
    ),
    (codecs.STREAM, TokenEvent(request_id="r-1", index=12, token_ids=(9,), instance_id="d1", attempt=2)),
    (codecs.STREAM, TokenEvent(request_id="r-1", index=0, token_ids=(9,), logprobs=(-0.25,), instance_id="p0")),
    (
        codecs.STREAM,
        TokenEvent(
            request_id="r-1",
            index=1,
            token_ids=(4, 5),
            finish_reason="length",
            usage=Usage(prompt_tokens=6, completion_tokens=3, cached_tokens=4),
        ),
    ),
    (codecs.STREAM, ErrorEvent(request_id="r-1", code=ErrorCode.INSTANCE_DOWN, message="d0 died")),
    (
        codecs.HEARTBEAT,
        Heartbeat(
            instance_id="d0",
            role=Role.DECODE,
            address="halfmoon.v1.decode.d0.submit",
            load=Load(queue_len=1, running=4, free_kv_blocks=100, total_kv_blocks=128, tbt_ms=20.0,
                      steps=StepSample(steps=12, batch=3.5, kv_tokens=1800.0, seconds=0.021),
                      shared_steps=StepSample(steps=2, batch=3.0, kv_tokens=2100.0, seconds=0.3)),
            timestamp=1.5,
            interval_s=0.5,
            leaving=Leaving.DRAINING,
            model="tiny",
            kernels=KernelReport(kind="native", isa="avx2", reason="layer_ops: switched off (HALFMOON_LAYER_OPS_KERNEL=0)"),
        ),
    ),
    (codecs.DOWN, InstanceDown(instance_id="d0", role=Role.DECODE, reason="silent", timestamp=2.0)),
    (codecs.CACHE_PUT_START, PutStart(writer="p0", keys=(b"a", b"b"), sizes=(10, 10))),
    (codecs.CACHE_PUT_PLAN, PutPlan(placements=(LOC,), existing=(b"b",), expires=5.0)),
    (codecs.CACHE_PUT_END, PutEnd(writer="p0", keys=(b"a",))),
    (codecs.CACHE_LOOKUP, Lookup(keys=(b"a", b"b"), lease_s=3.0)),
    (
        codecs.CACHE_LOOKUP_RESULT,
        LookupResult(hits=(BlockReplicas(key=b"a", replicas=(LOC,)),), lease_id="l1", lease_expires=9.0),
    ),
    (codecs.CACHE_RELEASE, Release(lease_id="l1")),
    (codecs.CACHE_ACK, CacheAck(count=1)),
    (codecs.CACHE_REMOVE, RemoveRequest(keys=(b"a",))),
    (codecs.CACHE_STATS_REQUEST, StatsRequest()),
    (
        codecs.CACHE_STATS,
        PoolStatsReply(blocks=3, pending_puts=1, leases=1, lookups=7, hit_blocks=5, miss_blocks=2, orders_in_flight=0,
                       tiers=(TierStat(node="t0", tier="DRAM", used_bytes=10, capacity_bytes=100, blocks=3,
                                       available=True),)),
    ),
    (
        codecs.ORDER_BATCH,
        OrderBatch(orders=(PoolOrder(order_id=4, kind="demote", key=b"k" * 32, src=Replica("t0", Tier.DRAM, 64, 10),
                                     dst=Replica("t0", Tier.NVME, -1, 10)),), addresses={"t0": "127.0.0.1:7000"}),
    ),
    (codecs.ORDER_RESULTS, OrderResults(ok=(True, False), unavailable_tiers=(2,))),
    (codecs.KV_EVENTS, KVEvents(instance_id="p0", stored=(b"k" * 32,), evicted=(b"j" * 32,))),
    (codecs.KV_SNAPSHOT_REQUEST, SnapshotRequest()),
    (
        codecs.CACHE_REPORT,
        TransferReport(
            node_id="t0",
            address="127.0.0.1:7000",
            capacity_bytes=1 << 20,
            used_bytes=2048,
            added=(LOC,),
            removed=(b"z",),
            full=True,
        ),
    ),
]


class TestRoundTrip:
    @pytest.mark.parametrize(("codec", "message"), CASES, ids=lambda x: type(x).__name__)
    def test_decode_of_encode_is_identity(self, codec, message):
        decoded = codec.decode(codec.encode(message))
        assert decoded == message
        assert type(decoded) is type(message)

    def test_every_codec_is_exercised(self):
        names = {name for name in dir(codecs) if name.isupper()}
        used = {name for name in names if any(getattr(codecs, name) is codec for codec, _ in CASES)}
        assert used == names


class TestTypedDecodeErrors:
    def test_unknown_kind_on_a_subject(self):
        data = codecs.HEARTBEAT.encode(CASES[-1][1])
        with pytest.raises(ProtocolError) as info:
            codecs.STREAM.decode(data)
        assert info.value.code is ErrorCode.UNKNOWN_KIND
        assert "transfer_report" in info.value.message

    def test_future_version_is_refused_even_if_shape_matches(self):
        raw = msgspec.msgpack.decode(codecs.CANCEL.encode(CancelRequest(request_id="r-1")))
        raw["v"] = 2
        with pytest.raises(ProtocolError) as info:
            codecs.CANCEL.decode(msgspec.msgpack.encode(raw))
        assert info.value.code is ErrorCode.UNSUPPORTED_VERSION

    def test_future_version_with_new_shape_is_a_version_error_not_malformed(self):
        raw = {"kind": "cancel", "v": 7, "request_ref": {"nested": True}}
        with pytest.raises(ProtocolError) as info:
            codecs.CANCEL.decode(msgspec.msgpack.encode(raw))
        assert info.value.code is ErrorCode.UNSUPPORTED_VERSION

    def test_garbage_bytes(self):
        with pytest.raises(ProtocolError) as info:
            codecs.SCHEDULE_REQUEST.decode(b"\xc1not msgpack")
        assert info.value.code is ErrorCode.MALFORMED

    def test_wrong_field_type_names_the_field(self):
        raw = msgspec.msgpack.decode(codecs.CANCEL.encode(CancelRequest(request_id="r-1")))
        raw["request_id"] = 12
        with pytest.raises(ProtocolError) as info:
            codecs.CANCEL.decode(msgspec.msgpack.encode(raw))
        assert info.value.code is ErrorCode.MALFORMED
        assert "request_id" in info.value.message

    def test_invariant_violation_on_the_wire_is_malformed(self):
        raw = msgspec.msgpack.decode(codecs.STREAM.encode(next(m for _, m in CASES if isinstance(m, TokenEvent) and m.logprobs)))
        raw["logprobs"] = [-1.0, -2.0]
        with pytest.raises(ProtocolError) as info:
            codecs.STREAM.decode(msgspec.msgpack.encode(raw))
        assert info.value.code is ErrorCode.MALFORMED
        assert "logprobs" in info.value.message

    def test_a_step_target_that_is_no_duration_is_malformed(self):
        for codec, message in CASES:
            if not getattr(message, "step_target_s", 0.0):
                continue
            raw = msgspec.msgpack.decode(codec.encode(message))
            for bad in (-0.1, float("nan"), float("inf")):
                raw["step_target_s"] = bad
                with pytest.raises(ProtocolError) as info:
                    codec.decode(msgspec.msgpack.encode(raw))
                assert info.value.code is ErrorCode.MALFORMED and "step_target_s" in info.value.message

    def test_a_heartbeat_with_an_impossible_step_sample_is_malformed(self):
        beat = next(m for _, m in CASES if isinstance(m, Heartbeat) and m.load.steps is not None)
        raw = msgspec.msgpack.decode(codecs.HEARTBEAT.encode(beat))
        for bad in ({"steps": 0}, {"seconds": -0.1}, {"batch": float("nan")}):
            raw["load"]["steps"] = {**raw["load"]["steps"], **bad}
            with pytest.raises(ProtocolError) as info:
                codecs.HEARTBEAT.decode(msgspec.msgpack.encode(raw))
            assert info.value.code is ErrorCode.MALFORMED
            raw["load"]["steps"] = msgspec.msgpack.decode(codecs.HEARTBEAT.encode(beat))["load"]["steps"]

    def test_heartbeats_with_and_without_a_kernel_report_cross_old_and_new_peers(self):
        """``kernels`` is optional both ways: a new peer decodes an old heartbeat (no field), an old peer's
        Heartbeat (the struct before the field) decodes a new one."""

        class OldHeartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat", tag_field="kind"):
            v: int
            instance_id: str
            role: Role
            address: str
            load: Load
            timestamp: float
            interval_s: float
            leaving: Leaving | None = None
            model: str = ""

        beat = next(m for _, m in CASES if isinstance(m, Heartbeat) and m.kernels is not None)
        old = msgspec.msgpack.decode(codecs.HEARTBEAT.encode(beat), type=OldHeartbeat)
        assert (old.instance_id, old.load) == (beat.instance_id, beat.load)
        assert codecs.HEARTBEAT.decode(msgspec.msgpack.encode(old)) == msgspec.structs.replace(beat, kernels=None)
        raw = msgspec.msgpack.decode(codecs.HEARTBEAT.encode(beat))
        raw["kernels"] = {"kind": "compiled"}
        with pytest.raises(ProtocolError) as info:
            codecs.HEARTBEAT.decode(msgspec.msgpack.encode(raw))
        assert info.value.code is ErrorCode.MALFORMED

    def test_error_converts_to_reply(self):
        reply = ProtocolError(ErrorCode.UNKNOWN_KIND, "x").to_reply()
        assert codecs.SUBMIT_REPLY.decode(codecs.SUBMIT_REPLY.encode(reply)) == reply


class TestInvariants:
    def test_kv_progress_names_keyed_blocks_inside_the_request(self):
        progress = KVProgress(request_id="r", block_size=4, num_tokens=6, indexes=(1,), blocks=(LOC,), layers_done=1)
        assert (progress.tokens(0), progress.tokens(1)) == (4, 2)
        for bad in ({"indexes": (2,)}, {"blocks": (TAIL,)}, {"layers_done": 0}, {"indexes": (0, 1)}):
            fields = dict(request_id="r", block_size=4, num_tokens=6, indexes=(1,), blocks=(LOC,), layers_done=1)
            with pytest.raises(ValueError):
                KVProgress(**{**fields, **bad})

    def test_kv_location_needs_partial_block_iff_tail(self):
        with pytest.raises(ValueError, match="partial"):
            KVLocation(block_size=4, num_tokens=6, blocks=(LOC,))
        with pytest.raises(ValueError, match="partial"):
            KVLocation(block_size=4, num_tokens=4, blocks=(LOC,), partial=TAIL)
        with pytest.raises(ValueError, match="full blocks"):
            KVLocation(block_size=4, num_tokens=9, blocks=(LOC,), partial=TAIL)
        assert KV.partial_tokens == 2

    def test_decode_request_kv_must_cover_prompt_and_earlier_output(self):
        with pytest.raises(ValueError, match="kv covers"):
            DecodeRequest(request_id="r", prompt_token_ids=(1, 2, 3, 4, 5, 6), output_token_ids=(7,),
                          first_token_id=1, sampling=SAMPLING, kv=KV, gateway="g", prefill_instance="p",
                          deadline=0.0)
        with pytest.raises(ValueError, match="kv covers"):
            DecodeRequest(
                request_id="r",
                prompt_token_ids=(1, 2),
                first_token_id=1,
                sampling=SAMPLING,
                kv=KV,
                gateway="g",
                prefill_instance="p",
                deadline=0.0,
            )

    def test_request_id_must_be_a_subject_token(self):
        with pytest.raises(ValueError, match="subject token"):
            CancelRequest(request_id="a.b")  # would route to a different subject
        with pytest.raises(ValueError, match="subject token"):
            ScheduleRequest(request_id="x>", model="m", prompt_len=1, sampling=SAMPLING, deadline=0.0)

    def test_finish_reason_comes_with_usage(self):
        with pytest.raises(ValueError, match="usage"):
            TokenEvent(request_id="r", index=0, token_ids=(1,), finish_reason="stop")

    def test_cached_tokens_bounded_by_prompt(self):
        with pytest.raises(ValueError, match="cached_tokens"):
            Usage(prompt_tokens=2, completion_tokens=1, cached_tokens=3)

    def test_stage_work_is_one_chunk_of_one_stage_of_a_pipeline(self):
        fields = dict(request_id="r", stages=("p0", "p1"), layer_bounds=(0, 2, 4), stage=1, index=0, start=0,
                      token_ids=(1, 2), prompt_len=4, hidden=b"\x00" * 8, dtype="float32", sampling=SAMPLING,
                      deadline=0.0)
        assert StageWork(**fields).layers == range(2, 4)
        for bad in ({"stages": ("p0",), "layer_bounds": (0, 4)}, {"stages": ("p0", "p0")}, {"layer_bounds": (0, 3, 3)}, {"stage": 0},
                    {"stage": 2}, {"start": 3}, {"last": True}, {"hidden": b""}, {"stages": ("p0", "a.b")},
                    {"block_indexes": (0,), "blocks": (LOC,), "salts": (b"\x00" * 16,)},
                    {"start": 2, "last": True, "block_indexes": (0,), "blocks": (LOC,), "salts": (b"\x00",)}):
            with pytest.raises(ValueError):
                StageWork(**{**fields, **bad})

    def test_a_chunk_of_hidden_states_fits_one_nats_message(self):
        assert chunk_tokens(512, 1 << 20, 256) == 512  # the tiny model: 512 rows of 256 bytes
        rows = chunk_tokens(512, 1 << 20, 16384)  # a 70B model's rows (d = 8192, bf16)
        assert rows == (1 << 20) // 16384 - 4 and rows * 16384 + MESSAGE_OVERHEAD <= 1 << 20
        with pytest.raises(ValueError):
            chunk_tokens(512, 64 << 10, 16384)

"""One codec per subject direction: what each subject may carry (see docs/PROTOCOL.md)."""

from __future__ import annotations

from halfmoon.protocol.base import Ack, Codec, ErrorReply
from halfmoon.protocol.cache import (
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
from halfmoon.protocol.pipeline import StageDone, StageWork
from halfmoon.protocol.pool import (
                                  KVEvents,
                                  OrderBatch,
                                  OrderResults,
                                  PoolStatsReply,
                                  RemoveRequest,
                                  SnapshotRequest,
                                  StatsRequest,
)
from halfmoon.protocol.registry import Heartbeat, InstanceDown
from halfmoon.protocol.scheduling import (
                                  Placed,
                                  Readiness,
                                  ReadinessRequest,
                                  Rejected,
                                  ScheduleAccepted,
                                  ScheduleRejected,
                                  ScheduleRequest,
)
from halfmoon.protocol.stream import ErrorEvent, ResumeRequest, TokenEvent
from halfmoon.protocol.work import CancelRequest, DecodeRequest, KVProgress, PrefillRequest, WorkDone

SCHEDULE_REQUEST: Codec[ScheduleRequest | ReadinessRequest] = Codec(ScheduleRequest | ReadinessRequest)
SCHEDULE_REPLY: Codec[ScheduleAccepted | ScheduleRejected | ErrorReply] = Codec(
    ScheduleAccepted | ScheduleRejected | ErrorReply
)
READINESS_REPLY: Codec[Readiness | ErrorReply] = Codec(Readiness | ErrorReply)
PREFILL_REQUEST: Codec[PrefillRequest] = Codec(PrefillRequest)
DECODE_REQUEST: Codec[DecodeRequest] = Codec(DecodeRequest)
SUBMIT_REPLY: Codec[Ack | ErrorReply] = Codec(Ack | ErrorReply)
KV_PROGRESS: Codec[KVProgress] = Codec(KVProgress)
STAGE_WORK: Codec[StageWork] = Codec(StageWork)
STAGE_REPLY: Codec[StageDone | ErrorReply] = Codec(StageDone | ErrorReply)
CANCEL: Codec[CancelRequest] = Codec(CancelRequest)
WORK_DONE: Codec[WorkDone] = Codec(WorkDone)
RESUME: Codec[ResumeRequest] = Codec(ResumeRequest)
PLACED: Codec[Placed] = Codec(Placed)
REJECTED: Codec[Rejected] = Codec(Rejected)
STREAM: Codec[TokenEvent | ErrorEvent] = Codec(TokenEvent | ErrorEvent)
HEARTBEAT: Codec[Heartbeat] = Codec(Heartbeat)
DOWN: Codec[InstanceDown] = Codec(InstanceDown)
CACHE_PUT_START: Codec[PutStart] = Codec(PutStart)
CACHE_PUT_PLAN: Codec[PutPlan | ErrorReply] = Codec(PutPlan | ErrorReply)
CACHE_PUT_END: Codec[PutEnd] = Codec(PutEnd)
CACHE_LOOKUP: Codec[Lookup] = Codec(Lookup)
CACHE_LOOKUP_RESULT: Codec[LookupResult | ErrorReply] = Codec(LookupResult | ErrorReply)
CACHE_RELEASE: Codec[Release] = Codec(Release)
CACHE_ACK: Codec[CacheAck | ErrorReply] = Codec(CacheAck | ErrorReply)
CACHE_REPORT: Codec[TransferReport] = Codec(TransferReport)
ORDER_BATCH: Codec[OrderBatch] = Codec(OrderBatch)
ORDER_RESULTS: Codec[OrderResults | ErrorReply] = Codec(OrderResults | ErrorReply)
CACHE_STATS_REQUEST: Codec[StatsRequest] = Codec(StatsRequest)
CACHE_STATS: Codec[PoolStatsReply | ErrorReply] = Codec(PoolStatsReply | ErrorReply)
CACHE_REMOVE: Codec[RemoveRequest] = Codec(RemoveRequest)
CACHE_CORRUPT: Codec[CorruptBlocks] = Codec(CorruptBlocks)
KV_EVENTS: Codec[KVEvents] = Codec(KVEvents)
KV_SNAPSHOT_REQUEST: Codec[SnapshotRequest] = Codec(SnapshotRequest)

"""The wire protocol: NATS subjects and the msgspec messages they carry (docs/PROTOCOL.md)."""

from halfmoon.protocol.base import Ack, Codec, ErrorCode, ErrorReply, Message, ProtocolError, RemoteError
from halfmoon.protocol.registry import Heartbeat, InstanceDown, KernelReport, Leaving, Load, Role, StepSample
from halfmoon.protocol.sampling import SamplingParams
from halfmoon.protocol.scheduling import (
    Placed,
    Rejected,
    RejectReason,
    ScheduleAccepted,
    ScheduleRejected,
    ScheduleRequest,
)
from halfmoon.protocol.stream import ErrorEvent, FinishReason, ResumeRequest, StreamEvent, TokenEvent, Usage
from halfmoon.protocol.subjects import PROTOCOL_VERSION, Subjects, check_token
from halfmoon.protocol.work import (
    BlockLocation,
    CancelRequest,
    DecodeRequest,
    KVLocation,
    KVProgress,
    PrefillRequest,
    WorkDone,
    WorkOutcome,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Ack",
    "BlockLocation",
    "CancelRequest",
    "Codec",
    "DecodeRequest",
    "ErrorCode",
    "ErrorEvent",
    "ErrorReply",
    "FinishReason",
    "Heartbeat",
    "InstanceDown",
    "KVLocation",
    "KVProgress",
    "KernelReport",
    "Leaving",
    "Load",
    "Message",
    "Placed",
    "PrefillRequest",
    "ProtocolError",
    "RejectReason",
    "Rejected",
    "RemoteError",
    "ResumeRequest",
    "Role",
    "SamplingParams",
    "ScheduleAccepted",
    "ScheduleRejected",
    "ScheduleRequest",
    "StepSample",
    "StreamEvent",
    "Subjects",
    "TokenEvent",
    "Usage",
    "WorkDone",
    "WorkOutcome",
    "check_token",
]

"""Wire basics: the message base class, typed errors, and the msgpack codec.

Every message is a msgspec Struct tagged by ``kind`` and stamped with the protocol version
``v``; a subject carries a union of kinds and its :class:`Codec` decodes exactly that union.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Generic, TypeVar

import msgspec

from halfmoon.protocol.subjects import PROTOCOL_VERSION


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every NATS message. ``v`` is the protocol version that wrote it."""

    v: int = PROTOCOL_VERSION


class ErrorCode(StrEnum):
    """Machine-readable failure classes shared by replies, stream errors and the gateway."""

    MALFORMED = "malformed"  # bytes did not decode into the subject's message kinds
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_KIND = "unknown_kind"
    BAD_REQUEST = "bad_request"  # decoded, but the content is unacceptable
    UNAVAILABLE = "unavailable"  # nobody can take it right now (draining, no instance)
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    INSTANCE_DOWN = "instance_down"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class ErrorReply(Message, frozen=True, kw_only=True, tag="error"):
    """Reply to any request that failed; ``retryable`` says whether sending it again may work."""

    code: ErrorCode
    message: str
    retryable: bool = False


class Ack(Message, frozen=True, kw_only=True, tag="ack"):
    """Positive reply to a work submission: ``instance_id`` (its run ``incarnation``) now owns ``request_id``."""

    request_id: str
    instance_id: str
    incarnation: str = ""


class ProtocolError(Exception):
    """Raised locally when bytes are not a valid message of the expected kinds."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message

    def to_reply(self) -> ErrorReply:
        return ErrorReply(code=self.code, message=self.message)


class RemoteError(Exception):
    """Raised by a requester when the peer answered with an :class:`ErrorReply`."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code.value}: {reply.message}")
        self.reply = reply

    @property
    def code(self) -> ErrorCode:
        return self.reply.code


class _Peek(msgspec.Struct):
    """Just enough of any message to explain why a full decode failed."""

    v: int = 0
    kind: str = ""


M = TypeVar("M")

_encoder = msgspec.msgpack.Encoder()


class Codec(Generic[M]):
    """Encodes messages and decodes one subject's union of message kinds.

    ``decode`` never raises anything but :class:`ProtocolError`, whose code tells a future
    version or unknown kind apart from plain garbage.
    """

    def __init__(self, message_type: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        members = getattr(message_type, "__args__", None) or (message_type,)
        self._kinds = frozenset(m.__struct_config__.tag for m in members)

    @property
    def kinds(self) -> frozenset[str]:
        return self._kinds

    @staticmethod
    def encode(message: Message) -> bytes:
        return _encoder.encode(message)

    def decode(self, data: bytes) -> M:
        try:
            message = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._explain(data, exc) from exc
        if message.v != PROTOCOL_VERSION:
            raise _version_error(message.v)
        return message

    def _explain(self, data: bytes, exc: Exception) -> ProtocolError:
        try:
            peek = msgspec.msgpack.decode(data, type=_Peek)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return ProtocolError(ErrorCode.MALFORMED, f"not a protocol message: {exc}")
        if peek.v != PROTOCOL_VERSION:
            return _version_error(peek.v)
        if peek.kind not in self._kinds:
            return ProtocolError(
                ErrorCode.UNKNOWN_KIND, f"kind {peek.kind!r} not expected here; expected one of {sorted(self._kinds)}"
            )
        return ProtocolError(ErrorCode.MALFORMED, f"invalid {peek.kind!r} message: {exc}")


def _version_error(version: int) -> ProtocolError:
    return ProtocolError(
        ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version} not supported; this peer speaks {PROTOCOL_VERSION}"
    )

"""Typed engine errors: every failure a caller can act on has its own class."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of everything the engine raises on purpose."""

    code: str = "engine_error"


class InvalidRequestError(EngineError, ValueError):
    """The request is malformed; the engine state is untouched and other requests go on."""

    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context window."""

    code = "context_length_exceeded"


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request_id"


class UnknownRequestError(EngineError, KeyError):
    code = "unknown_request"


class ModelLoadError(EngineError):
    """The model directory is missing, unreadable, or not a supported causal LM."""

    code = "model_load_error"


class KVFormatError(EngineError):
    """A KV block payload is corrupt or was produced by a different model/layout."""

    code = "kv_format_error"


class OutOfKVBlocksError(EngineError):
    """A request can never fit the KV cache, even with the whole cache to itself."""

    code = "out_of_kv_blocks"

"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import math
import re

import msgspec
from fastapi.responses import JSONResponse

from halfmoon.protocol.base import ErrorCode


class ApiError(Exception):
    """Any failure the client should see; raised anywhere in a request, rendered once."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"^Object missing required field `(.+)`")


def from_validation(exc: msgspec.ValidationError) -> ApiError:
    """Turn msgspec's "Expected `int`, got `str` - at `$.max_tokens`" into a named 400."""
    text = str(exc)
    match = _PATH.search(text)
    path = match.group(1) if match else ""
    detail = _PATH.sub("", text)
    if missing := _MISSING.match(detail):
        name = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return invalid(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    if not path:
        return invalid(f"Invalid request body: {detail}.", code="invalid_type")
    return invalid(f"Invalid value for '{path}': {detail}.", param=path, code="invalid_type")


_BACKEND_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INSTANCE_DOWN: 503,
    ErrorCode.CANCELLED: 499,
}


def from_backend(code: ErrorCode, message: str, retry_after_s: float | None = None) -> ApiError:
    """Map a serving-path failure (conductor, prefill, decode) onto an HTTP error."""
    status = _BACKEND_STATUS.get(code, 500)
    type_ = "rate_limit_error" if status == 429 else None
    return ApiError(status, message, code=code.value, type_=type_, retry_after_s=retry_after_s)

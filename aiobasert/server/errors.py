"""Errors: `APIError` (an HTTP status with OpenAI's error body) and the mapping
from SDK exceptions to it."""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.responses import Response

from ..errors import (
    AioBaseRTError,
    ContextLengthExceededError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
)
from .protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger("aiobasert.server")

class APIError(Exception):
    """A request refused with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))
        self.headers = headers

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.body), status_code=self.status, headers=self.headers, media_type="application/json"
        )


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def api_error(exc: BaseException, *, log: bool = True) -> APIError:
    """The HTTP form of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        # OpenAI's wording: LangChain and litellm recognise an overflow by it.
        total = exc.prompt_tokens + exc.max_tokens
        message = (
            f"This model's maximum context length is {exc.max_context} tokens. However, you requested {total} "
            f"tokens ({exc.prompt_tokens} in the messages, {exc.max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )
        return APIError(400, message, param="messages", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):  # includes InvalidSamplingParamsError
        match = _SAMPLING_FIELD.match(str(exc))
        return APIError(400, str(exc), param=match.group(1) if match else None)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="server_error", code="engine_overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineClosedError):
        return APIError(503, "the server is shutting down", type="server_error", code="engine_closed")
    if isinstance(exc, AioBaseRTError):
        return APIError(500, f"the engine failed: {exc}", type="server_error", code="engine_error")
    if log:
        logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def aborted() -> APIError:
    return APIError(503, "the server is shutting down: the generation was aborted", type="server_error", code="aborted")


def error_param(message: str) -> str | None:
    """The top-level field a msgspec validation message points at (`... - at `$.field[0]``),
    or the unknown top-level field it names (`Object contains unknown field `x``)."""
    _, sep, path = message.rpartition("at `$.")
    if not sep:
        match = _UNKNOWN.match(message)
        return match.group(1) if match else None
    name = path.rstrip("`")
    for i, ch in enumerate(name):
        if ch in ".[":
            return name[:i]
    return name


_SAMPLING_FIELD = re.compile(r"invalid sampling parameter (\w+)")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`$")

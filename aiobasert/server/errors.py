"""Errors: `APIError` (an HTTP status with OpenAI's error body) and the mapping
from SDK exceptions to it."""

from __future__ import annotations

import logging
import re
from contextvars import ContextVar
from typing import Literal, Protocol

import msgspec
from starlette.responses import Response

from ..errors import (
    AioBaseRTError,
    ContextLengthExceededError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
)
from ..types import CONSTRAINT_FIELDS
from .protocol import ErrorDetail, ErrorResponse, SchemaFields

logger = logging.getLogger("aiobasert.server")


class ErrorWitness(Protocol):
    """Who hears of the errors the request being served answers with (the app's
    request middleware: it logs and counts them, see `oplog.py`)."""

    def answered(self, err: APIError) -> None:
        """`err` is about to be sent as the request's HTTP response."""

    def in_band(self, err: APIError) -> None:
        """`err` is sent as an error event inside a response already started."""


WITNESS: ContextVar[ErrorWitness | None] = ContextVar("aiobasert_error_witness", default=None)
"""Set by the app's middleware for each request it serves."""


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

    def response(self, path: str | None = None) -> Response:
        """The HTTP response: OpenAI's error body, or Anthropic's for a request to its API's `path`."""
        witness = WITNESS.get()
        if witness is not None:
            witness.answered(self)
        body = anthropic_error(self) if path in ANTHROPIC_PATHS else self.body
        return Response(
            msgspec.json.encode(body),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


class ErrorBody(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorObject(msgspec.Struct, kw_only=True):
    """Anthropic's error body (and a stream's `error` event)."""

    type: Literal["error"] = "error"
    error: ErrorBody


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
"""The routes of Anthropic's Messages API: their errors have its shape."""


def anthropic_error(err: APIError) -> ErrorObject:
    """An `APIError` in Anthropic's shape: its type by the status (`overloaded_error` for a full
    engine, `api_error` for the server's own failures), the field it names (OpenAI's `param`) in its
    message where the message does not already name it."""
    detail = err.body.error
    kind = _ERROR_TYPES.get(err.status, "overloaded_error" if detail.code == "engine_overloaded" else "api_error")
    message = detail.message
    if detail.param and detail.param not in message:
        message = f"{detail.param}: {message}"
    return ErrorObject(error=ErrorBody(type=kind, message=message))


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def api_error(exc: BaseException, *, log: bool = True) -> APIError:
    """The HTTP form of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        # OpenAI's wording: LangChain and litellm recognise an overflow by it.
        total = exc.prompt_tokens + exc.max_tokens
        fields = SCHEMA_FIELDS.get()
        conversation = fields.conversation if fields is not None else "messages"  # Responses: "input"
        message = (
            f"This model's maximum context length is {exc.max_context} tokens. However, you requested {total} "
            f"tokens ({exc.prompt_tokens} in the {conversation}, {exc.max_tokens} in the completion). "
            # The code in the text too: openai 3.x keeps only the message in the exception's
            # text, and LangChain maps an overflow by finding this code there.
            f"Please reduce the length of the {conversation} or completion. (context_length_exceeded)"
        )
        return APIError(400, message, param=conversation, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):  # includes InvalidSamplingParamsError
        schema = _schema_error(str(exc))
        if schema is not None:
            return schema
        match = _SAMPLING_FIELD.match(str(exc)) or _FIELD_FIRST.match(str(exc))
        fields = SCHEMA_FIELDS.get()
        if match and match.group(1) in CONSTRAINT_FIELDS and fields is not None and fields.constraint is not None:
            # the SDK names its own field (regex, choice, ...): the request's is the one it came from
            return APIError(400, f"{fields.constraint}: {exc}", param=fields.constraint)
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


def in_band_error(exc: BaseException) -> APIError:
    """The HTTP form of an error reported inside a response already started
    (an SSE error event), told to the request's witness."""
    err = api_error(exc)
    witness = WITNESS.get()
    if witness is not None:
        witness.in_band(err)
    return err


SCHEMA_FIELDS: ContextVar[SchemaFields | None] = ContextVar("aiobasert_schema_fields", default=None)
"""Set by `http.read_json` for the request being served (from its body type's
`schema_fields`): the engine reports a bad schema only once the request runs,
through whichever error path its response takes."""


def constraint_from(field: str) -> None:
    """The request's output constraint came from `field` (`structured_outputs`, `grammar`): the
    engine's errors about it (a bad regex, a grammar that does not compile, an invalid schema) name
    it, whichever error path its response takes."""
    fields = SCHEMA_FIELDS.get() or SchemaFields("", "tools[{}].function.parameters")
    SCHEMA_FIELDS.set(fields._replace(output=field, constraint=field))


def _schema_error(message: str) -> APIError | None:
    """A 400 naming the schema field for the engine's grammar errors, without the
    grammar's internals (its rules, its source), or None for other messages."""
    fields = SCHEMA_FIELDS.get()
    if fields is None:
        return None
    if message.startswith("invalid json_schema: "):
        why = message[len("invalid json_schema: ") :].split("\n", 1)[0]
        return APIError(
            400, f"{fields.output} is not a JSON Schema this server can enforce: {why}", param=fields.output
        )
    if message.startswith("invalid grammar: "):
        # llguidance: "at LINE(COL): failed to compile JSON schema: WHY\n  LINE | args_I: %json ..."
        found = _GRAMMAR_AT.search(message)
        rule = re.search(rf"^\s*{found.group(1)} \| args_(\d+):", message, re.M) if found else None
        if found is None or rule is None:
            return APIError(400, "the tools could not be compiled into an output grammar", param="tools")
        param = fields.tool.format(int(rule.group(1)))
        return APIError(400, f"{param} is not a JSON Schema this server can enforce: {found.group(2)}", param=param)
    return None


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
_FIELD_FIRST = re.compile(r"^(prompt): ")  # the SDK names the prompt first ("prompt: the text is N tokens ...")
_GRAMMAR_AT = re.compile(r"at (\d+)\(\d+\): failed to compile JSON schema: ([^\n]*)")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`$")

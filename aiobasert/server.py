"""An OpenAI-compatible HTTP server over one `Engine` (Starlette + uvicorn).

```bash
pip install 'aiobasert[server]'
aiobasert serve --model model.base --port 8000
```

```python
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
print(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}]))
```

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream=true` as server-sent events), `POST /v1/embeddings`, `GET /v1/models`,
`GET /health` and `GET /v1/internal/stats` (the engine's `EngineStats`).
The `model` field of a request is accepted whatever it names: the server
serves one model and reports its own name back.

The engine is opened in the app's lifespan, so it belongs to the server's
event loop. A client that disconnects cancels its request: the engine frees
the lane before its next step. `serve()` aborts in-flight generations as
soon as shutdown begins (their streams end with an error event and
`[DONE]`), so the process exits promptly on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hmac
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import msgspec

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route
    from starlette.types import ASGIApp, Receive, Scope, Send
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(f"aiobasert.server needs {exc.name}: pip install 'aiobasert[server]'") from exc

from .engine import Engine
from .errors import (
    AioBaseRTError,
    ContextLengthExceededError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
)
from .streams import TokenStream
from .types import ChatMessage, FinishReason, SamplingParams, Token, Usage

__all__ = [
    "APIError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "CompletionRequest",
    "CompletionResponse",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EngineFactory",
    "ErrorResponse",
    "ModelList",
    "create_app",
    "serve",
]

logger = logging.getLogger("aiobasert.server")

T = TypeVar("T")

EngineFactory = Callable[[], AbstractAsyncContextManager[Engine]]
"""A zero-argument callable returning `async with`-able that yields an open Engine,
e.g. `functools.partial(Engine.open, "model.base", max_batch_size=4)`."""

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_EMBEDDING_INPUTS = 2048


# ---- request bodies ---------------------------------------------------------------------
# Unknown fields are ignored (OpenAI clients send fields this server does not use);
# nullable fields accept an explicit `null`, as some clients send for "default".


class StreamOptions(msgspec.Struct, kw_only=True):
    """`stream_options`: `include_usage` adds a last chunk with the usage."""

    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """`response_format.json_schema`: the output always conforms to `schema`, so
    `strict` changes nothing; `name` and `description` are not used."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`response_format`: `text`, `json_object` (any JSON value) or `json_schema`
    (JSON matching `json_schema.schema`), enforced by constrained decoding."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """Extension: keep the k most likely tokens (0 = off)."""
    min_p: float | None = None
    """Extension: drop tokens below min_p * p(most likely)."""
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    """`POST /v1/completions` (the legacy text completion API)."""

    prompt: str | list[int]
    logprobs: int | None = None
    """Report each token's log-probability and this many most likely alternatives."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served."""

    type: str
    text: str | None = None


class RequestMessage(msgspec.Struct, kw_only=True):
    """One chat turn as a client sends it."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[RequestMessage]
    max_completion_tokens: int | None = None
    """The newer name of max_tokens; wins when both are given."""
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[msgspec.Raw] | None = None
    tool_choice: msgspec.Raw | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/embeddings`: mean-pooled final hidden states, one per input."""

    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


# ---- response bodies --------------------------------------------------------------------


class ErrorDetail(msgspec.Struct, kw_only=True):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """The body of every error response, and of a mid-stream error event."""

    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    """Prompt tokens served from the engine's prefix cache."""


class UsageInfo(msgspec.Struct, kw_only=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, usage: Usage) -> UsageInfo:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
        )


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A text completion, or one chunk of a streamed one (then `usage` is absent)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprobEntry(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprobEntry]


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A whole chat completion."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(msgspec.Struct, kw_only=True):
    """`GET /v1/models`: the one model this server serves."""

    object: str
    data: list[ModelCard]


class Embedding(msgspec.Struct, kw_only=True):
    object: str
    index: int
    embedding: list[float] | str
    """Floats, or with encoding_format "base64" the little-endian float32 bytes in base64."""


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class HealthStatus(msgspec.Struct, kw_only=True):
    status: str


# ---- errors -----------------------------------------------------------------------------


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
        return _json(self.body, status=self.status, headers=self.headers)


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


def _api_error(exc: BaseException, *, log: bool = True) -> APIError:
    """The HTTP form of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):  # includes InvalidSamplingParamsError
        return APIError(400, str(exc))
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="server_error", code="engine_overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineClosedError):
        return APIError(503, "the server is shutting down", type="server_error", code="engine_closed")
    if isinstance(exc, AioBaseRTError):
        return APIError(500, f"the engine failed: {exc}", type="server_error", code="engine_error")
    if log:
        logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def _aborted() -> APIError:
    return APIError(503, "the server is shutting down: the generation was aborted", type="server_error", code="aborted")


def _json(body: msgspec.Struct, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")


def _sse(body: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


async def _read_json(request: Request, body_type: type[T]) -> T:
    """Decode a request body into `body_type`, or raise a 400."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}", param=_error_param(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None


def _error_param(message: str) -> str | None:
    """The top-level field a msgspec validation message points at (`... - at `$.field[0]``)."""
    _, sep, path = message.rpartition("at `$.")
    if not sep:
        return None
    name = path.rstrip("`")
    for i, ch in enumerate(name):
        if ch in ".[":
            return name[:i]
    return name


# ---- client disconnects -----------------------------------------------------------------


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel `scope` when the client goes away (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work`, cancelling it (and so its engine request) if the client disconnects."""
    results: list[T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
        try:
            results.append(await work())
        except Exception as exc:  # re-raised below, outside the task group (no ExceptionGroup)
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    if not results:
        raise _ClientGone
    return results[0]


async def _gather(calls: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Run `calls` concurrently; re-raise the first failure as itself (not in an ExceptionGroup)."""
    errors: list[Exception] = []

    async def guarded(call: Callable[[], Awaitable[None]]) -> None:
        try:
            await call()
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(guarded, call)
    if errors:
        raise errors[0]


class _EventStream(Response):
    """A server-sent-event response that commits to 200 only once its first event is ready.

    The events generator raises before its first yield when the request fails
    (a too-long prompt, a full queue): that becomes an ordinary JSON error
    response. The client's disconnect is watched from the start, also while the
    request waits for a lane, and cancels the generator, which closes its
    `TokenStream` and so frees the lane.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self._events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            try:
                await self._send_events(scope, receive, send)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._events.aclose()
                tg.cancel_scope.cancel()

    async def _send_events(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await self._events.__anext__()
        except Exception as exc:
            await _api_error(exc).response()(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_event(exc: BaseException) -> bytes:
    err = _api_error(exc)
    return _sse(err.body)


# ---- request -> engine ------------------------------------------------------------------


def _sampling_params(
    req: _SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    json_schema: dict[str, Any] | bool | None = None,
) -> SamplingParams:
    """SamplingParams from the OpenAI fields (OpenAI's defaults: temperature 1, top_p 1)."""
    if req.n is not None and req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    bias: dict[int, float] | None = None
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or None)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        stop=stop,
        seed=req.seed,
        logit_bias=bias,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        json_schema=json_schema,
    )


def _json_schema(fmt: ResponseFormat | None) -> dict[str, Any] | bool | None:
    """`SamplingParams.json_schema` for a `response_format` (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return True
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        return fmt.json_schema.schema
    raise APIError(400, f"unknown response_format type {fmt.type!r}", param="response_format")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _chat_messages(messages: Sequence[RequestMessage]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages[{i}]: role {m.role!r} is not supported", param="messages")
        if m.content is None:
            if role != "assistant":
                raise APIError(400, f"messages[{i}] has no content", param="messages")
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            texts: list[str] = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400, f"messages[{i}]: content parts of type {part.type!r} are not supported", param="messages"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        out.append(ChatMessage(role=role, content=content))
    return out


def _finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's finish_reason for a generation that ended normally; an aborted one raises."""
    if reason == "aborted":
        raise _aborted()
    if reason not in ("stop", "length"):
        raise APIError(500, f"the generation ended with {reason!r}", type="server_error")
    return reason


async def _first_token(stream: TokenStream) -> Token | None:
    """The stream's first token; request errors (context length, overload) surface here."""
    tok = await anext(stream, None)
    if tok is None:
        _finish_reason(stream.finish_reason)  # an empty stream ends only by abort
    return tok


class _TokenTexts:
    """Token id -> the token's own text, decoded on first need (logprobs only)."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    async def lookup(self, engine: Engine, tokens: Iterable[Token]) -> dict[int, str]:
        missing: set[int] = set()
        for tok in tokens:
            for top in tok.top_logprobs or ():
                self._texts.setdefault(top.id, top.text)
            if tok.id not in self._texts:
                missing.add(tok.id)
        if missing:

            async def fill(token_id: int) -> None:
                self._texts[token_id] = await engine.decode([token_id])

            await _gather(functools.partial(fill, token_id) for token_id in missing)
        return self._texts


def _completion_logprobs(tokens: Sequence[Token], texts: dict[int, str], offset: int) -> CompletionLogprobs:
    token_texts = [texts[t.id] for t in tokens]
    offsets: list[int] = []
    for text in token_texts:
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float]] = []
    for tok, text in zip(tokens, token_texts, strict=True):
        entry = {top.text: top.logprob for top in tok.top_logprobs or ()}
        if tok.logprob is not None:
            entry.setdefault(text, tok.logprob)  # OpenAI: the sampled token is always listed
        tops.append(entry)
    return CompletionLogprobs(
        tokens=token_texts,
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=tops,
        text_offset=offsets,
    )


def _chat_logprobs(tokens: Sequence[Token], texts: dict[int, str]) -> ChoiceLogprobs:
    def utf8(text: str) -> list[int]:
        return list(text.encode("utf-8", "replace"))

    content = []
    for tok in tokens:
        text = texts[tok.id]
        content.append(
            TokenLogprobEntry(
                token=text,
                logprob=tok.logprob if tok.logprob is not None else 0.0,
                bytes=utf8(text),
                top_logprobs=[
                    TopLogprobEntry(token=top.text, logprob=top.logprob, bytes=utf8(top.text))
                    for top in tok.top_logprobs or ()
                ],
            )
        )
    return ChoiceLogprobs(content=content)


# ---- the service ------------------------------------------------------------------------


class _Service:
    """The engine's holder and the endpoints; one per app."""

    def __init__(self, factory: EngineFactory, *, api_key: str | None, model_name: str | None) -> None:
        self._factory = factory
        self.api_key = api_key
        self._model_name = model_name
        self._engine: Engine | None = None
        self._texts = _TokenTexts()
        self.created = int(time.time())

    # ---- lifecycle ----

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with self._factory() as engine:
            self._engine = engine
            if self._model_name is None:
                self._model_name = Path(engine.info.path).stem
            logger.info("serving %s as %r", engine.info.path, self._model_name)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await engine.aclose(abort=True)

    async def abort(self) -> None:
        """End every in-flight generation now and refuse new ones (shutdown has begun)."""
        if self._engine is not None:
            await self._engine.aclose(abort=True)

    @property
    def engine(self) -> Engine:
        engine = self._engine
        if engine is None or engine.closed:
            raise EngineClosedError("the engine is not running")
        return engine

    @property
    def model_name(self) -> str:
        return self._model_name or "aiobasert"

    # ---- endpoints ----

    async def health(self, request: Request) -> Response:
        if self._engine is None or self._engine.closed:
            return _json(HealthStatus(status="unavailable"), status=503)
        return _json(HealthStatus(status="ok"))

    async def stats(self, request: Request) -> Response:
        return Response(msgspec.json.encode(await self.engine.stats()), media_type="application/json")

    async def models(self, request: Request) -> Response:
        return _json(ModelList(object="list", data=[self._model_card()]))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return _json(self._model_card())

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, object="model", created=self.created, owned_by="aiobasert")

    async def completions(self, request: Request) -> Response:
        req = await _read_json(request, CompletionRequest)
        for name, unsupported in (("echo", req.echo), ("suffix", req.suffix is not None)):
            if unsupported:
                raise APIError(400, f"{name} is not supported", param=name)
        if req.best_of is not None and req.best_of != 1:
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        top = req.logprobs
        if top is not None and not 0 <= top <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {top}", param="logprobs")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
        params = _sampling_params(req, max_tokens=max_tokens, logprobs=top is not None, top_logprobs=top or 0)
        engine = self.engine
        stream = engine.stream(req.prompt, params)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _EventStream(self._completion_events(engine, stream, usage=usage, logprobs=top is not None))
        tokens = await _unless_disconnected(request.receive, functools.partial(self._collect, stream))
        finish = _finish_reason(stream.finish_reason)
        logprobs = None
        if top is not None:
            logprobs = _completion_logprobs(tokens, await self._texts.lookup(engine, tokens), 0)
        final = stream.final
        assert final is not None
        return _json(
            CompletionResponse(
                id=f"cmpl-{stream.request_id}",
                object="text_completion",
                created=int(time.time()),
                model=self.model_name,
                choices=[
                    CompletionChoice(
                        index=0, text="".join(t.text for t in tokens), logprobs=logprobs, finish_reason=finish
                    )
                ],
                usage=UsageInfo.of(final.usage),
            )
        )

    async def chat_completions(self, request: Request) -> Response:
        req = await _read_json(request, ChatCompletionRequest)
        json_schema = _json_schema(req.response_format)
        if req.tools:
            raise APIError(400, "tool calling is not supported", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        top = req.top_logprobs or 0
        if not 0 <= top <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        want_logprobs = bool(req.logprobs)
        params = _sampling_params(
            req, max_tokens=max_tokens, logprobs=want_logprobs, top_logprobs=top, json_schema=json_schema
        )
        engine = self.engine
        stream = engine.chat(_chat_messages(req.messages), params)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _EventStream(self._chat_events(engine, stream, usage=usage, logprobs=want_logprobs))
        tokens = await _unless_disconnected(request.receive, functools.partial(self._collect, stream))
        finish = _finish_reason(stream.finish_reason)
        logprobs = _chat_logprobs(tokens, await self._texts.lookup(engine, tokens)) if want_logprobs else None
        final = stream.final
        assert final is not None
        return _json(
            ChatCompletion(
                id=f"chatcmpl-{stream.request_id}",
                object="chat.completion",
                created=int(time.time()),
                model=self.model_name,
                choices=[
                    ChatChoice(
                        index=0,
                        message=AssistantMessage(role="assistant", content="".join(t.text for t in tokens)),
                        logprobs=logprobs,
                        finish_reason=finish,
                    )
                ],
                usage=UsageInfo.of(final.usage),
            )
        )

    async def embeddings(self, request: Request) -> Response:
        req = await _read_json(request, EmbeddingRequest)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        if not inputs:
            raise APIError(400, "input must not be empty", param="input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs per request", param="input")
        engine = self.engine
        if req.dimensions is not None and req.dimensions != engine.info.dim:
            raise APIError(400, f"this model's embeddings have {engine.info.dim} dimensions", param="dimensions")
        as_base64 = req.encoding_format == "base64"
        data: list[Embedding | None] = [None] * len(inputs)
        counts = [0] * len(inputs)

        async def one(i: int, text: str) -> None:
            vector = await engine.embed(text)
            counts[i] = len(await engine.encode(text))
            value: list[float] | str = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if as_base64 else vector.tolist()
            )
            data[i] = Embedding(object="embedding", index=i, embedding=value)

        # Submitted together, so the engine thread runs them back to back between steps.
        await _unless_disconnected(
            request.receive, lambda: _gather(functools.partial(one, i, text) for i, text in enumerate(inputs))
        )
        total = sum(counts)
        return _json(
            EmbeddingResponse(
                object="list",
                data=[d for d in data if d is not None],
                model=self.model_name,
                usage=EmbeddingUsage(prompt_tokens=total, total_tokens=total),
            )
        )

    # ---- generation helpers ----

    @staticmethod
    async def _collect(stream: TokenStream) -> list[Token]:
        try:
            return [tok async for tok in stream]
        finally:
            await stream.aclose()

    async def _completion_events(
        self, engine: Engine, stream: TokenStream, *, usage: bool, logprobs: bool
    ) -> AsyncGenerator[bytes, None]:
        try:
            tok = await _first_token(stream)  # raising here becomes an HTTP error response
            rid, created, offset = f"cmpl-{stream.request_id}", int(time.time()), 0

            def chunk(text: str, lp: CompletionLogprobs | None, finish: str | None) -> bytes:
                choice = CompletionChoice(index=0, text=text, logprobs=lp, finish_reason=finish)
                return _sse(
                    CompletionResponse(
                        id=rid, object="text_completion", created=created, model=self.model_name, choices=[choice]
                    )
                )

            try:
                while tok is not None:
                    lp = None
                    if logprobs:
                        lp = _completion_logprobs([tok], await self._texts.lookup(engine, [tok]), offset)
                        offset += len(lp.tokens[0])
                    if tok.finish_reason is not None:
                        yield chunk(tok.text, lp, _finish_reason(tok.finish_reason))
                    elif tok.text or lp is not None:
                        yield chunk(tok.text, lp, None)
                    tok = await anext(stream, None)
                _finish_reason(stream.finish_reason)  # raises if the lane was aborted
                if usage and stream.final is not None:
                    yield _sse(
                        CompletionResponse(
                            id=rid,
                            object="text_completion",
                            created=created,
                            model=self.model_name,
                            choices=[],
                            usage=UsageInfo.of(stream.final.usage),
                        )
                    )
            except Exception as exc:  # the response has started: report in-band
                yield _error_event(exc)
            yield _SSE_DONE
        finally:
            await stream.aclose()

    async def _chat_events(
        self, engine: Engine, stream: TokenStream, *, usage: bool, logprobs: bool
    ) -> AsyncGenerator[bytes, None]:
        try:
            tok = await _first_token(stream)  # raising here becomes an HTTP error response
            rid, created = f"chatcmpl-{stream.request_id}", int(time.time())

            def chunk(delta: ChatDelta, lp: ChoiceLogprobs | None = None, finish: str | None = None) -> bytes:
                choice = ChatChunkChoice(index=0, delta=delta, logprobs=lp, finish_reason=finish)
                return _sse(
                    ChatCompletionChunk(
                        id=rid, object="chat.completion.chunk", created=created, model=self.model_name, choices=[choice]
                    )
                )

            yield chunk(ChatDelta(role="assistant", content=""))
            try:
                while tok is not None:
                    lp = _chat_logprobs([tok], await self._texts.lookup(engine, [tok])) if logprobs else None
                    if tok.text or lp is not None:
                        yield chunk(ChatDelta(content=tok.text), lp)
                    tok = await anext(stream, None)
                yield chunk(ChatDelta(), finish=_finish_reason(stream.finish_reason))
                if usage and stream.final is not None:
                    yield _sse(
                        ChatCompletionChunk(
                            id=rid,
                            object="chat.completion.chunk",
                            created=created,
                            model=self.model_name,
                            choices=[],
                            usage=UsageInfo.of(stream.final.usage),
                        )
                    )
            except Exception as exc:  # the response has started: report in-band
                yield _error_event(exc)
            yield _SSE_DONE
        finally:
            await stream.aclose()


# ---- auth and error handlers --------------------------------------------------------------


class _BearerAuth:
    """Require `Authorization: Bearer <api_key>` on every path but /health."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                err = APIError(
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    # Unexpected exceptions are logged by Starlette's error middleware, which re-raises them.
    return _api_error(exc, log=False).response()


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    headers = dict(exc.headers) if exc.headers else None
    return APIError(exc.status_code, str(exc.detail), code=code, headers=headers).response()


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody is listening; uvicorn drops it


def _build(
    model: str | os.PathLike[str] | EngineFactory | None,
    *,
    api_key: str | None,
    model_name: str | None,
    max_batch_size: int,
    max_context: int,
) -> tuple[Starlette, _Service]:
    if callable(model):
        factory: EngineFactory = model
    else:
        factory = functools.partial(Engine.open, model, max_batch_size=max_batch_size, max_context=max_context)
    service = _Service(factory, api_key=api_key, model_name=model_name)
    routes = [
        Route("/health", service.health, methods=["GET"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", service.embeddings, methods=["POST"]),
        Route("/v1/internal/stats", service.stats, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_BearerAuth, api_key=api_key)] if api_key is not None else [],
        lifespan=service.lifespan,
        exception_handlers={
            HTTPException: _on_http_exception,
            _ClientGone: _on_client_gone,
            AioBaseRTError: _on_api_error,
            APIError: _on_api_error,
            Exception: _on_api_error,
        },
    )
    return app, service


def create_app(
    model: str | os.PathLike[str] | EngineFactory | None = None,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    max_batch_size: int = 8,
    max_context: int = 2048,
) -> Starlette:
    """The OpenAI-compatible ASGI app (run it with any ASGI server, e.g. uvicorn).

    model: a `.base` path (None = the default model, or $AIOBASERT_MODEL), or an
        `EngineFactory` for full control over `Engine.open`'s arguments; the
        engine is opened when the app starts and aborted when it stops.
    api_key: when set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
    model_name: the id reported by /v1/models and in responses (default: the file's stem).
    max_batch_size, max_context: passed to `Engine.open` when `model` is a path.

    Under a server of your own, in-flight streams keep the shutdown waiting
    until they finish (uvicorn runs the lifespan shutdown last); use `serve()`
    or a graceful-shutdown timeout to bound that.
    """
    return _build(
        model, api_key=api_key, model_name=model_name, max_batch_size=max_batch_size, max_context=max_context
    )[0]


def serve(
    model: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch_size: int = 8,
    max_context: int = 2048,
    *,
    model_name: str | None = None,
    log_level: str = "info",
) -> None:
    """Run the server with uvicorn until SIGTERM or Ctrl-C.

    On shutdown, in-flight generations are aborted at once (streams get an
    error event and `[DONE]`, waiting non-streamed requests a 503); a client
    that does not read its response is cut off after one second.
    """
    try:
        import uvicorn
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError("aiobasert serve needs uvicorn: pip install 'aiobasert[server]'") from exc

    app, service = _build(
        model, api_key=api_key, model_name=model_name, max_batch_size=max_batch_size, max_context=max_context
    )

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await service.abort()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=1, lifespan="on")
    _Server(config).run()

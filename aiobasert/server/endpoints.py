"""The endpoints: each decodes its request, resolves the model, runs the engine
and answers with OpenAI's shapes (whole, or streamed through `events.drive`)."""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..engine import Engine, QueueReservation
from ..errors import InvalidRequestError
from ..fanout import MAX_N, prefill_once, sample_params
from ..streams import TokenStream
from ..tools import ChatDelta as ChatDeltaSDK
from ..tools import ChatStream, ChatTurn, TextDelta, ToolCall, ToolCallDelta
from ..types import SamplingParams, Timing, Token, Usage
from .compat import check_refused
from .errors import APIError
from .events import ChunkFormat, OpenAIChunks, collect, drive
from .http import json_response, read_json
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import Metrics, RequestObserver
from .params import (
    chat_messages,
    chat_refusal,
    check_chat_size,
    finish_reason,
    json_schema_of,
    precount_chat,
    refuse_schema_with_tools,
    request_tools,
    sampling_params,
)
from .protocol import (
    MAX_EMBEDDING_INPUTS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    FunctionCall,
    FunctionCallDelta,
    HealthStatus,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDeltaOut,
    ToolCallOut,
    UsageInfo,
    VersionInfo,
)
from .provider import EngineProvider, ServedModel
from .responses import DEFAULT_STORE_BYTES, ResponsesAPI, ResponseStore
from .streaming import (
    DEFAULT_SSE_KEEPALIVE_S,
    DEFAULT_WRITE_TIMEOUT_S,
    SSE_DONE,
    BacklogLimit,
    EventStream,
    gather,
    sse,
    unless_disconnected,
)
from .workers import Workers, is_large

_Choice = TypeVar("_Choice", CompletionChoice, ChatChunkChoice)


class _ChoiceChunks(OpenAIChunks, Generic[_Choice]):
    """The chunks of one streamed choice (`index`; `last` False when it is one of several
    merged into one response): each endpoint's `_chunk` wraps its choices in its envelope."""

    def __init__(self, served: ServedModel, *, logprobs: bool, index: int = 0, last: bool = True) -> None:
        self._served = served
        self._index = index
        self.last = last
        self._logprobs = logprobs
        self._id = ""
        self._created = 0

    def _chunk(self, choices: list[_Choice], usage: UsageInfo | None = None) -> bytes:
        raise NotImplementedError

    def usage(self, usage: Usage, timing: Timing | None = None) -> bytes:
        return self._chunk([], UsageInfo.of(usage, [timing] if timing is not None else []))

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        """The usage chunk of a whole multi-choice request."""
        return self._chunk([], usage)


class _CompletionChunks(_ChoiceChunks[CompletionChoice]):
    """Streamed text completions: the finish reason rides on the last token's chunk."""

    def __init__(self, served: ServedModel, *, logprobs: bool, index: int = 0, last: bool = True) -> None:
        super().__init__(served, logprobs=logprobs, index=index, last=last)
        self._offset = 0

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        return sse(
            CompletionResponse(
                id=self._id,
                object="text_completion",
                created=self._created,
                model=self._served.name,
                choices=choices,
                usage=usage,
            )
        )

    def opening(self, request_id: str) -> bytes | None:
        self._id, self._created = f"cmpl-{request_id}", int(time.time())
        return None

    async def token(self, tok: Token) -> bytes | None:
        lp = None
        if self._logprobs:
            lp = completion_logprobs([tok], await self._served.texts.lookup(self._served.engine, [tok]), self._offset)
            self._offset += len(lp.tokens[0])
        if tok.finish_reason is not None:
            finish = finish_reason(tok.finish_reason)
            return self._chunk([CompletionChoice(index=self._index, text=tok.text, logprobs=lp, finish_reason=finish)])
        if tok.text or lp is not None:
            return self._chunk([CompletionChoice(index=self._index, text=tok.text, logprobs=lp, finish_reason=None)])
        return None

    def closing(self, finish: str, usage: Usage | None) -> bytes | None:
        return None


def _tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _chat_delta(deltas: Sequence[ChatDeltaSDK]) -> ChatDelta:
    """One wire delta from the SDK deltas of one token: its text and call pieces,
    one entry per call index (a call's head and its first argument fragment, released
    by the same token, are merged: clients such as llama-index keep only one entry per
    index and chunk)."""
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    calls: dict[int, ToolCallDeltaOut] = {}
    for d in deltas:
        if not isinstance(d, ToolCallDelta):
            continue
        seen = calls.get(d.index)
        if seen is None:
            calls[d.index] = ToolCallDeltaOut(
                index=d.index,
                id=d.id,
                type="function" if d.id is not None else None,
                function=FunctionCallDelta(name=d.name, arguments=d.arguments),
            )
        else:
            seen.function.arguments = (seen.function.arguments or "") + d.arguments
    out = list(calls.values())
    return ChatDelta(content=text if text or not out else None, tool_calls=out or None)


class _ChatChunks(_ChoiceChunks[ChatChunkChoice]):
    """Streamed chat completions: a role delta first, text and tool-call deltas as
    the parser releases them, a finish delta last."""

    def __init__(
        self, served: ServedModel, chat: ChatStream, *, logprobs: bool, index: int = 0, last: bool = True
    ) -> None:
        super().__init__(served, logprobs=logprobs, index=index, last=last)
        self._chat = chat

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=self._id,
                object="chat.completion.chunk",
                created=self._created,
                model=self._served.name,
                choices=choices,
                usage=usage,
            )
        )

    def _delta(self, delta: ChatDelta, lp: ChoiceLogprobs | None = None, finish: str | None = None) -> bytes:
        return self._chunk([ChatChunkChoice(index=self._index, delta=delta, logprobs=lp, finish_reason=finish)])

    def opening(self, request_id: str) -> bytes | None:
        self._id, self._created = f"chatcmpl-{request_id}", int(time.time())
        return self._delta(ChatDelta(role="assistant", content=""))

    async def token(self, tok: Token) -> bytes | None:
        lp = None
        if self._logprobs:
            lp = chat_logprobs([tok], await self._served.texts.lookup(self._served.engine, [tok]))
        deltas = self._chat.feed(tok)
        if deltas or lp is not None:
            return self._delta(_chat_delta(deltas) if deltas else ChatDelta(content=""), lp)
        return None

    def closing(self, finish: str, usage: Usage | None) -> bytes | None:
        rest = self._chat.close_parser()
        head = self._delta(_chat_delta(rest)) if rest else b""
        return head + self._delta(ChatDelta(), finish=_with_tools(finish, self._chat.tool_calls))


def _with_tools(finish: str, calls: Sequence[ToolCall]) -> str:
    return "tool_calls" if calls and finish == "stop" else finish


def _batch(value: str | list[int | str | list[int]], param: str) -> list[str | list[int]]:
    """One input (text or token ids) or a batch of texts / token-id lists, as a list of inputs."""
    if isinstance(value, str):
        return [value]
    if all(isinstance(t, int) for t in value):
        return [[t for t in value if isinstance(t, int)]] if value else []
    if all(isinstance(t, str) for t in value) or all(isinstance(t, list) for t in value):
        return [t for t in value if not isinstance(t, int)]
    raise APIError(400, f"{param} mixes token ids, texts and token-id lists", param=param)


def _n(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    return n


def _queue_limit(engine: Engine) -> int:
    """Requests the engine can hold at once: its lanes and its wait queue."""
    return engine.info.max_batch_size + engine.config.max_queue


async def _admit_fanout(engine: Engine, count: int, param: str, *, prompts: int = 1) -> QueueReservation | None:
    """Refuse a request that would fan out into `count` engine requests before
    any of them starts: 400 naming `param` when the engine can never hold that
    many at once, 503 (retry later) when its queue has no room for all of them
    now. Either way nothing ran. The room is taken in one atomic reservation on
    the engine thread (requests being prepared and other reservations count), so
    two fan-outs cannot both pass on one free room and the second fail after
    queuing half its choices: the places returned are the request's own, released
    by `with`. A prefill before the samples (`prefill_once`, one per prompt) takes
    a place of its own. None for a single request (its one Submit is atomic)."""
    limit = _queue_limit(engine)
    if count > limit:
        raise APIError(
            400,
            f"this request fans out into {count} generations; the server holds at most {limit} "
            f"(lanes + queue): send at most {limit} per request",
            param=param,
        )
    if count == 1:
        return None
    warms = prompts if count > prompts and engine.info.prefix_cache else 0
    return await engine.reserve(min(count + warms, limit))


def _submit(places: QueueReservation | None, streams: Sequence[TokenStream]) -> None:
    """Queue `streams` (one after the other in the FIFO: queued, and admitted, together)."""
    if places is not None:
        places.submit(streams)
    else:
        for stream in streams:
            stream.submit()


def _include_usage(req: SamplingRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


@dataclass(frozen=True)
class _ChatPlan:
    """What a chat request asks the engine for, checked before anything is paid for it."""

    params: SamplingParams
    n: int
    logprobs: bool


def _top_logprobs(req: ChatCompletionRequest) -> int:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    top = req.top_logprobs or 0
    if not 0 <= top <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
    return top


def _max_completion_tokens(req: ChatCompletionRequest) -> int | None:
    """max_completion_tokens, the newer name of max_tokens, wins when both are given."""
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise APIError(400, "max_completion_tokens must be >= 1", param="max_completion_tokens")
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def _chat_plan(req: ChatCompletionRequest) -> _ChatPlan:
    """The request's sampling, choices and tools, each bad field a 400 naming it (in this order)."""
    json_schema = json_schema_of(req.response_format)
    top = _top_logprobs(req)
    n = _n(req.n)
    max_tokens = _max_completion_tokens(req)
    want_logprobs = bool(req.logprobs)
    params = sampling_params(
        req, max_tokens=max_tokens, logprobs=want_logprobs, top_logprobs=top, json_schema=json_schema
    )
    refuse_schema_with_tools(bool(req.tools), json_schema, field="response_format", param="response_format")
    return _ChatPlan(params=params, n=n, logprobs=want_logprobs)


class _ChatStarts:
    """Starts a prepared chat turn's streams and remembers each stream's `ChatStream`
    (its parser: the streamed deltas and the whole message are read from it)."""

    def __init__(self, engine: Engine, turn: ChatTurn) -> None:
        self._engine = engine
        self._turn = turn
        self._chats: dict[int, ChatStream] = {}

    def start(self, params: SamplingParams) -> TokenStream:
        try:
            chat = self._engine.stream_turn(self._turn, params)
        except InvalidRequestError as exc:
            raise chat_refusal(exc, "messages") from None
        self._chats[id(chat.tokens)] = chat
        return chat.tokens

    def chat(self, stream: TokenStream) -> ChatStream:
        return self._chats[id(stream)]


async def _chat_choice(
    served: ServedModel, index: int, stream: TokenStream, tokens: list[Token], chat: ChatStream, logprobs: bool
) -> ChatChoice:
    """One choice of a whole (unstreamed) chat completion: its tokens fed through the chat's parser."""
    finish = finish_reason(stream.finish_reason)
    for tok in tokens:
        chat.feed(tok)
    chat.close_parser()
    calls = chat.tool_calls
    lp = chat_logprobs(tokens, await served.texts.lookup(served.engine, tokens)) if logprobs else None
    content = chat.content
    return ChatChoice(
        index=index,
        message=AssistantMessage(
            role="assistant",
            content=content if content or not calls else None,
            tool_calls=[_tool_call_out(c) for c in calls] or None,
        ),
        logprobs=lp,
        finish_reason=_with_tools(finish, calls),
    )


logger = logging.getLogger("aiobasert.server")


class Service:
    """The endpoints of one app, over its `EngineProvider`."""

    def __init__(
        self,
        provider: EngineProvider,
        *,
        write_timeout: float | None = DEFAULT_WRITE_TIMEOUT_S,
        response_store_bytes: int = DEFAULT_STORE_BYTES,
        sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE_S,
    ) -> None:
        self.provider = provider
        self.backlog = BacklogLimit()
        """The bound on every streamed response's backlog (a slow client's unsent events)."""
        self.created = int(time.time())
        self.metrics = Metrics()
        self.workers = Workers()
        self.write_timeout = write_timeout if write_timeout is not None and write_timeout > 0 else None  # 0: never
        self.sse_keepalive = sse_keepalive or None  # 0: never
        self.responses = ResponsesAPI(
            self.resolve,
            self.metrics,
            ResponseStore(max_bytes=response_store_bytes),
            write_timeout=self.write_timeout,
            workers=self.workers,
            backlog=self.backlog,
            sse_keepalive=self.sse_keepalive,
        )

    def _observer(self, served: ServedModel) -> RequestObserver:
        return self.metrics.observer(served.name, served.engine)

    async def metrics_text(self, request: Request) -> Response:
        """`GET /metrics` (Prometheus text)."""
        return await self.metrics.render([(m.name, m.engine) for m in self.provider.served()])

    def resolve(self, model: str | None) -> ServedModel:
        """The one place a request's `model` field is resolved."""
        return self.provider.resolve(model)

    # ---- introspection ----

    async def version(self, request: Request) -> Response:
        from .. import __version__

        return json_response(VersionInfo(version=__version__))

    async def tokenize(self, request: Request) -> Response:
        req = await read_json(request, TokenizeRequest)
        served = self.resolve(req.model)
        ids = await served.engine.encode(req.prompt)
        info = served.engine.info
        return json_response(TokenizeResponse(tokens=ids, count=len(ids), max_model_len=info.max_context))

    async def detokenize(self, request: Request) -> Response:
        req = await read_json(request, DetokenizeRequest)
        served = self.resolve(req.model)
        vocab = served.engine.info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is not in the vocabulary of {vocab}", param="tokens")
        return json_response(DetokenizeResponse(prompt=await served.engine.decode(req.tokens)))

    async def health(self, request: Request) -> Response:
        if not self.provider.ready:
            return json_response(HealthStatus(status="unavailable"), status=503)
        return json_response(HealthStatus(status="ok"))

    async def stats(self, request: Request) -> Response:
        served = self.resolve(request.query_params.get("model"))
        return Response(msgspec.json.encode(await served.engine.stats()), media_type="application/json")

    async def models(self, request: Request) -> Response:
        return json_response(ModelList(object="list", data=[self._card(m) for m in self.provider.served()]))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        for served in self.provider.served():
            if served.name == name:
                return json_response(self._card(served))
        raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")

    def _card(self, served: ServedModel) -> ModelCard:
        return ModelCard(id=served.name, object="model", created=self.created, owned_by="aiobasert")

    # ---- generation ----

    async def _samples(
        self,
        request: Request,
        served: ServedModel,
        starts: Sequence[Callable[[SamplingParams], TokenStream]],
        params: SamplingParams,
        n: int,
        places: QueueReservation | None,
    ) -> tuple[list[tuple[TokenStream, list[Token]]], int]:
        """Run n samples of each prompt (`starts`), each prompt prefilled once;
        returns (stream, tokens) per choice, prompt-major, and the prompt tokens
        the prefill requests found cached."""
        cached = 0

        async def run() -> list[tuple[TokenStream, list[Token]]]:
            nonlocal cached
            streams, cached = await self._start_samples(served, starts, params, n, places)

            def one(stream: TokenStream) -> Callable[[], Awaitable[tuple[TokenStream, list[Token]]]]:
                async def go() -> tuple[TokenStream, list[Token]]:
                    return stream, await collect(stream, self._observer(served))

                return go

            return await gather([one(st) for st in streams])

        return await unless_disconnected(request.receive, run), cached

    async def _start_samples(
        self,
        served: ServedModel,
        starts: Sequence[Callable[[SamplingParams], TokenStream]],
        params: SamplingParams,
        n: int,
        places: QueueReservation | None,
    ) -> tuple[list[TokenStream], int]:
        """The streams of a streamed multi-choice request, all submitted at once
        (after each prompt's one prefill: one after the other in the FIFO, so they
        are queued, and admitted, together), and the prefill's cached tokens."""
        cached = 0
        streams: list[TokenStream] = []
        with places or contextlib.nullcontext():  # places not used (a failed prefill) go back
            for start in starts:
                if n > 1:
                    cached += await prefill_once(served.engine, start, params, places)
                streams += [start(sample_params(params, i)) for i in range(n)]
            _submit(places, streams)
        return streams, cached

    def _merged(
        self,
        served: ServedModel,
        streams: Sequence[TokenStream],
        fmts: Sequence[_CompletionChunks | _ChatChunks],
        n: int,
        cached: int,
        include_usage: bool,
    ) -> EventStream:
        """One SSE response over several choices: their events as they come, then usage and [DONE]."""

        def tail() -> bytes:
            usage = fmts[0].usage_chunk(self._usage(streams, n, cached)) if include_usage else b""
            return usage + SSE_DONE

        observer = self._observer
        return EventStream(
            [drive(st, f, include_usage=False, observer=observer(served)) for st, f in zip(streams, fmts, strict=True)],
            tail,
            write_timeout=self.write_timeout,
            streams=streams,
            backlog=self.backlog,
            keepalive=self.sse_keepalive,
        )

    @staticmethod
    def _usage(streams: Sequence[TokenStream], n: int, prefill_cached: int) -> UsageInfo:
        """OpenAI's usage of a multi-choice request: each prompt counted once."""
        finals = [st.final for st in streams]
        prompt = sum(f.usage.prompt_tokens for f in finals[::n] if f is not None)
        completion = sum(f.usage.completion_tokens for f in finals if f is not None)
        cached = prefill_cached if n > 1 else sum(f.usage.cached_prompt_tokens for f in finals if f is not None)
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached)
        return UsageInfo.of(usage, [f.timing for f in finals if f is not None])

    def _log_user(self, rid: str, user: str | None) -> None:
        if user is not None:
            logger.info("request %s for user %r", rid, user)

    async def completions(self, request: Request) -> Response:
        req = await read_json(request, CompletionRequest)
        check_refused("/v1/completions", req)
        top = req.logprobs
        if top is not None and not 0 <= top <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {top}", param="logprobs")
        prompts = _batch(req.prompt, "prompt")
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        n = _n(req.n)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
        params = sampling_params(req, max_tokens=max_tokens, logprobs=top is not None, top_logprobs=top or 0)
        served = self.resolve(req.model)
        engine = served.engine
        places = await _admit_fanout(
            engine, n * len(prompts), "prompt" if len(prompts) > 1 else "n", prompts=len(prompts)
        )
        starts = [functools.partial(engine.stream, p) for p in prompts]
        include_usage = _include_usage(req)
        if req.stream and n * len(prompts) == 1:
            stream = engine.stream(prompts[0], params)
            return self._one_stream(
                served, stream, _CompletionChunks(served, logprobs=top is not None), include_usage, req.user
            )
        if req.stream:
            streams, cached = await self._start_samples(served, starts, params, n, places)
            self._log_user(streams[0].request_id, req.user)
            fmts = [
                _CompletionChunks(served, logprobs=top is not None, index=i, last=False) for i in range(len(streams))
            ]
            return self._merged(served, streams, fmts, n, cached, include_usage)
        results, cached = await self._samples(request, served, starts, params, n, places)
        return await self._whole_completion(served, results, n, cached, top is not None, req.user)

    async def _whole_completion(
        self,
        served: ServedModel,
        results: Sequence[tuple[TokenStream, list[Token]]],
        n: int,
        cached: int,
        logprobs: bool,
        user: str | None,
    ) -> Response:
        """The JSON response of an unstreamed text completion: every choice's text, whole."""
        self._log_user(results[0][0].request_id, user)
        choices = []
        for index, (stream, tokens) in enumerate(results):
            lp = None
            if logprobs:
                lp = completion_logprobs(tokens, await served.texts.lookup(served.engine, tokens), 0)
            text = "".join(t.text for t in tokens)
            finish = finish_reason(stream.finish_reason)
            choices.append(CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish))
        return json_response(
            CompletionResponse(
                id=f"cmpl-{results[0][0].request_id}",
                object="text_completion",
                created=int(time.time()),
                model=served.name,
                choices=choices,
                usage=self._usage([st for st, _ in results], n, cached),
            )
        )

    def _one_stream(
        self, served: ServedModel, stream: TokenStream, fmt: ChunkFormat, include_usage: bool, user: str | None
    ) -> EventStream:
        """The SSE response of a streamed request with one choice."""
        self._log_user(stream.request_id, user)
        return EventStream(
            drive(stream, fmt, include_usage=include_usage, observer=self._observer(served)),
            write_timeout=self.write_timeout,
            streams=[stream],
            backlog=self.backlog,
            keepalive=self.sse_keepalive,
        )

    async def chat_completions(self, request: Request) -> Response:
        req = await read_json(request, ChatCompletionRequest, precount=precount_chat)
        check_chat_size(len(req.messages), len(req.tools or ()), "messages")  # before anything is paid for them
        check_refused("/v1/chat/completions", req)
        plan = _chat_plan(req)
        served = self.resolve(req.model)
        places = await _admit_fanout(served.engine, plan.n, "n")
        starts = _ChatStarts(served.engine, await self._chat_turn(served, req, plan, places))
        if req.stream and plan.n == 1:
            stream = starts.start(plan.params)
            fmt = _ChatChunks(served, starts.chat(stream), logprobs=plan.logprobs)
            return self._one_stream(served, stream, fmt, _include_usage(req), req.user)
        if req.stream:
            streams, cached = await self._start_samples(served, [starts.start], plan.params, plan.n, places)
            self._log_user(streams[0].request_id, req.user)
            fmts = [
                _ChatChunks(served, starts.chat(st), logprobs=plan.logprobs, index=i, last=False)
                for i, st in enumerate(streams)
            ]
            return self._merged(served, streams, fmts, plan.n, cached, _include_usage(req))
        results, cached = await self._samples(request, served, [starts.start], plan.params, plan.n, places)
        return await self._whole_chat(served, results, starts, plan, cached, req.user)

    async def _chat_turn(
        self, served: ServedModel, req: ChatCompletionRequest, plan: _ChatPlan, places: QueueReservation | None
    ) -> ChatTurn:
        """The request's rendered prompt and tool setup; its reserved places go back when that fails."""
        engine = served.engine
        parallel = req.parallel_tool_calls is not False

        def prepare() -> ChatTurn:
            # request-sized (every message and tool): in a worker, never on the event loop
            tools, choice = request_tools(req.tools, req.tool_choice)
            return engine.prepare_chat(
                chat_messages(req.messages), tools=tools, tool_choice=choice, parallel_tool_calls=parallel
            )

        try:
            return await self.workers.run(prepare, large=is_large(len(req.messages), len(req.tools or ())))
        except BaseException as exc:
            if places is not None:
                places.release()
            if isinstance(exc, InvalidRequestError):
                raise chat_refusal(exc, "messages") from None
            raise

    async def _whole_chat(
        self,
        served: ServedModel,
        results: Sequence[tuple[TokenStream, list[Token]]],
        starts: _ChatStarts,
        plan: _ChatPlan,
        cached: int,
        user: str | None,
    ) -> Response:
        """The JSON response of an unstreamed chat request: every choice's message, whole."""
        self._log_user(results[0][0].request_id, user)
        choices = [
            await _chat_choice(served, index, stream, tokens, starts.chat(stream), plan.logprobs)
            for index, (stream, tokens) in enumerate(results)
        ]
        return json_response(
            ChatCompletion(
                id=f"chatcmpl-{results[0][0].request_id}",
                object="chat.completion",
                created=int(time.time()),
                model=served.name,
                choices=choices,
                usage=self._usage([st for st, _ in results], plan.n, cached),
            )
        )

    async def embeddings(self, request: Request) -> Response:
        req = await read_json(request, EmbeddingRequest)
        inputs = _batch(req.input, "input")
        if not inputs or any(not x for x in inputs):
            raise APIError(400, "input must not be empty", param="input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs per request", param="input")
        served = self.resolve(req.model)
        engine = served.engine
        if req.dimensions is not None and req.dimensions != engine.info.dim:
            raise APIError(400, f"this model's embeddings have {engine.info.dim} dimensions", param="dimensions")
        places = await _admit_fanout(engine, len(inputs), "input")
        self._log_user(request.state.request_id, req.user)
        as_base64 = req.encoding_format == "base64"
        data: list[Embedding | None] = [None] * len(inputs)
        counts = [0] * len(inputs)

        async def one(i: int, text: str | list[int]) -> None:
            if places is not None:
                places.take(1)  # its place goes back just as `embed` posts it (before it first waits)
            vector = await engine.embed(text)
            counts[i] = len(await engine.encode(text)) if isinstance(text, str) else len(text)
            value: list[float] | str = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if as_base64 else vector.tolist()
            )
            data[i] = Embedding(object="embedding", index=i, embedding=value)

        # Submitted together, so the engine thread runs them back to back between steps.
        with places or contextlib.nullcontext():
            await unless_disconnected(
                request.receive, lambda: gather(functools.partial(one, i, text) for i, text in enumerate(inputs))
            )
        total = sum(counts)
        return json_response(
            EmbeddingResponse(
                object="list",
                data=[d for d in data if d is not None],
                model=served.name,
                usage=EmbeddingUsage(prompt_tokens=total, total_tokens=total),
            )
        )

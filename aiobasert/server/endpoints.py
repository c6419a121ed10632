"""The endpoints: each decodes its request, resolves the model, runs the engine
and answers with OpenAI's shapes (whole, or streamed through `events.drive`)."""

from __future__ import annotations

import base64
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..choices import MAX_N, Choices
from ..engine import Engine
from ..errors import InvalidRequestError
from ..reasoning import ReasoningDelta
from ..tools import ChatDelta as ChatDeltaSDK
from ..tools import ChatReply, TextDelta, ToolCall, ToolCallDelta
from ..types import SamplingParams, Token
from .anthropic import MessagesAPI
from .compat import check_refused
from .errors import APIError
from .http import json_response, read_json
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import Metrics, RequestObserver
from .params import (
    chat_messages,
    chat_refusal,
    check_chat_size,
    effort_for,
    finish_reason,
    json_schema_of,
    output_constraint,
    precount_chat,
    reasoning_budget,
    refuse_schema_with_tools,
    request_thinking,
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
    error_event,
    gather,
    sse,
    unless_disconnected,
)
from .workers import Workers, is_large

_Choice = TypeVar("_Choice", CompletionChoice, ChatChunkChoice)
R = TypeVar("R")


class _ChoiceChunks(Generic[_Choice]):
    """The chunks of one streamed choice (`index`) of a response (`response_id`, `created`: the
    same for all its choices): each endpoint's `_chunk` wraps its choices in its envelope."""

    def __init__(self, served: ServedModel, *, logprobs: bool, index: int, response_id: str, created: int) -> None:
        self._served = served
        self._index = index
        self._logprobs = logprobs
        self._id = response_id
        self._created = created
        self.opened = False

    def _chunk(self, choices: list[_Choice], usage: UsageInfo | None = None) -> bytes:
        raise NotImplementedError

    def opening(self) -> bytes | None:
        """The choice's first chunk, if the format has one (chat: the role delta)."""
        return None

    async def token(self, tok: Token, deltas: Sequence[ChatDeltaSDK]) -> bytes | None:
        """The chunk of one token (`deltas`: a chat reply's deltas it completed); None: nothing to send."""
        raise NotImplementedError

    def closing(self, finish: str, deltas: Sequence[ChatDeltaSDK]) -> bytes | None:
        """The chunks after the choice's last token, given OpenAI's finish reason."""
        return None

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        """The usage chunk of the whole request."""
        return self._chunk([], usage)


class _CompletionChunks(_ChoiceChunks[CompletionChoice]):
    """Streamed text completions: the finish reason rides on the last token's chunk."""

    def __init__(self, served: ServedModel, *, logprobs: bool, index: int, response_id: str, created: int) -> None:
        super().__init__(served, logprobs=logprobs, index=index, response_id=response_id, created=created)
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

    async def token(self, tok: Token, deltas: Sequence[ChatDeltaSDK]) -> bytes | None:
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
    thought = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = text if text or not (out or thought) else None
    return ChatDelta(content=content, reasoning_content=thought or None, tool_calls=out or None)


class _ChatChunks(_ChoiceChunks[ChatChunkChoice]):
    """Streamed chat completions: a role delta first, text and tool-call deltas as
    the parser releases them, a finish delta last."""

    def __init__(self, served: ServedModel, *, logprobs: bool, index: int, response_id: str, created: int) -> None:
        super().__init__(served, logprobs=logprobs, index=index, response_id=response_id, created=created)
        self._called = False  # a tool call was streamed: a normal end finishes with "tool_calls"

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

    def opening(self) -> bytes | None:
        return self._delta(ChatDelta(role="assistant", content=""))

    async def token(self, tok: Token, deltas: Sequence[ChatDeltaSDK]) -> bytes | None:
        lp = None
        if self._logprobs:
            lp = chat_logprobs([tok], await self._served.texts.lookup(self._served.engine, [tok]))
        self._called = self._called or any(isinstance(d, ToolCallDelta) for d in deltas)
        if deltas or lp is not None:
            return self._delta(_chat_delta(deltas) if deltas else ChatDelta(content=""), lp)
        return None

    def closing(self, finish: str, deltas: Sequence[ChatDeltaSDK]) -> bytes | None:
        self._called = self._called or any(isinstance(d, ToolCallDelta) for d in deltas)
        head = self._delta(_chat_delta(deltas)) if deltas else b""
        return head + self._delta(ChatDelta(), finish="tool_calls" if self._called and finish == "stop" else finish)


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


def _continuation(req: ChatCompletionRequest) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat completion, as vLLM and llama-server
    take them: booleans, and a continued final message only with add_generation_prompt false."""
    for name in ("add_generation_prompt", "continue_final_message"):
        value = getattr(req, name)
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"{name} must be a boolean, not {type(value).__name__}", param=name)
    add_prompt = req.add_generation_prompt is not False
    continue_final = req.continue_final_message is True
    if continue_final and add_prompt:
        raise APIError(400, "continue_final_message: set add_generation_prompt to false with it (as vLLM)",
                       param="continue_final_message")  # fmt: skip
    return add_prompt, continue_final


def _check_fanout(engine: Engine, count: int, param: str) -> None:
    """Refuse a request that fans out into more engine requests (`count`: prompts x n) than the
    engine can ever hold at once (its lanes and its wait queue), before any of them starts: a 400
    naming `param`. One with no room for all of them now is refused by `Choices.start` (503,
    nothing queued: the room is taken in one atomic reservation on the engine thread)."""
    limit = engine.info.max_batch_size + engine.config.max_queue
    if count > limit:
        raise APIError(
            400,
            f"this request fans out into {count} generations; the server holds at most {limit} "
            f"(lanes + queue): send at most {limit} per request",
            param=param,
        )


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
    constraint, source = output_constraint(req)
    if source is not None and json_schema is not None:
        raise APIError(400, f"{source} cannot be combined with a JSON response_format", param=source)
    top = _top_logprobs(req)
    n = _n(req.n)
    max_tokens = _max_completion_tokens(req)
    want_logprobs = bool(req.logprobs)
    params = sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=want_logprobs,
        top_logprobs=top,
        json_schema=json_schema,
        constraint=constraint,
    )
    refuse_schema_with_tools(bool(req.tools), json_schema, field="response_format", param="response_format")
    if source is not None:
        refuse_schema_with_tools(bool(req.tools), source, field=source, param=source)
    return _ChatPlan(params=params, n=n, logprobs=want_logprobs)


def _chat_choice(index: int, reply: ChatReply, finish: str, lp: ChoiceLogprobs | None) -> ChatChoice:
    """One choice of a whole (unstreamed) chat completion (`finish`: OpenAI's, before the tools rule)."""
    calls = reply.tool_calls
    return ChatChoice(
        index=index,
        message=AssistantMessage(
            role="assistant",
            content=reply.content if reply.content or not calls else None,
            tool_calls=[_tool_call_out(c) for c in calls] or None,
            reasoning_content=reply.reasoning,
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
        reasoning_budget: int = -1,
    ) -> None:
        self.provider = provider
        self.reasoning_budget = reasoning_budget
        """The server's `--reasoning-budget` (params.request_thinking): what a request that says nothing of
        its thought gets (-1: no bound, 0: thinking off, N: N tokens)."""
        self.backlog = BacklogLimit()
        """The bound on every streamed response's backlog (a slow client's unsent events)."""
        self.created = int(time.time())
        self.metrics = Metrics()
        self.workers = Workers()
        self.write_timeout = write_timeout if write_timeout is not None and write_timeout > 0 else None  # 0: never
        self.sse_keepalive = sse_keepalive or None  # 0: never
        self.messages = MessagesAPI(
            self.resolve,
            self.metrics,
            write_timeout=self.write_timeout,
            workers=self.workers,
            backlog=self.backlog,
            sse_keepalive=self.sse_keepalive,
            reasoning_budget=reasoning_budget,
        )
        self.responses = ResponsesAPI(
            self.resolve,
            self.metrics,
            ResponseStore(max_bytes=response_store_bytes),
            write_timeout=self.write_timeout,
            workers=self.workers,
            backlog=self.backlog,
            sse_keepalive=self.sse_keepalive,
            reasoning_budget=reasoning_budget,
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

    async def _choices_events(
        self,
        served: ServedModel,
        choices: Choices[Any],
        fmt: Callable[[int, str], _CompletionChunks | _ChatChunks],
        include_usage: bool,
        user: str | None,
    ) -> EventStream:
        """The SSE response of a streamed request: every choice's chunks as they come (`fmt(index,
        response_id)`), then usage and [DONE]. An error before the first chunk is an HTTP error
        response; after it, the first failure of any choice (which has cancelled the others, see
        `aiobasert.choices`) is one in-band error event, then [DONE]."""
        observers = [self._observer(served) for _ in range(len(choices))]
        # Started here (places reserved, prompts prefilled, choices queued: a full queue is a 503),
        # so the response knows its streams and bounds their unsent backlog.
        await choices.start()

        async def events() -> AsyncGenerator[bytes, None]:
            fmts: list[_CompletionChunks | _ChatChunks] = []
            sent = False
            try:
                try:
                    async for ev in choices:
                        if not fmts:  # started: the response's id is its first choice's request id
                            self._log_user(choices.streams[0].request_id, user)
                            fmts = [fmt(i, choices.streams[0].request_id) for i in range(len(choices))]
                        chunks, stream = fmts[ev.index], choices.streams[ev.index]
                        out = b""
                        if not chunks.opened:
                            chunks.opened = True
                            out += chunks.opening() or b""
                        if ev.token is not None:
                            observers[ev.index].token()
                            out += await chunks.token(ev.token, ev.deltas) or b""
                        else:
                            out += chunks.closing(finish_reason(stream.finish_reason), ev.deltas) or b""
                            observers[ev.index].finished(stream.final)
                        if out:
                            sent = True
                            yield out
                except Exception as exc:
                    if not sent:
                        raise  # becomes an HTTP error response
                    yield error_event(exc)
                    yield SSE_DONE
                    return
                if include_usage:
                    yield fmts[0].usage_chunk(self._usage(choices))
                yield SSE_DONE
            except (GeneratorExit, anyio.get_cancelled_exc_class()):  # the client went away
                await self._aborted(choices, observers)
                raise
            finally:
                await choices.aclose()

        return EventStream(
            events(),
            write_timeout=self.write_timeout,
            streams=choices.streams,
            backlog=self.backlog,
            keepalive=self.sse_keepalive,
        )

    async def _aborted(self, choices: Choices[Any], observers: Sequence[RequestObserver]) -> None:
        """After a disconnect: cancel every choice and let the metrics see the aborts."""
        since = time.perf_counter()
        with anyio.CancelScope(shield=True):
            await choices.aclose()
            for observer in observers:
                await observer.aborted(since)

    async def _whole(
        self, request: Request, served: ServedModel, choices: Choices[R]
    ) -> tuple[list[R], list[list[Token]]]:
        """Every choice of an unstreamed request run to its end (cancelled if the client goes
        away): each one's result and tokens."""
        observers = [self._observer(served) for _ in range(len(choices))]
        tokens: list[list[Token]] = [[] for _ in range(len(choices))]

        async def run() -> list[R]:
            try:
                async for ev in choices:
                    if ev.token is not None:
                        observers[ev.index].token()
                        tokens[ev.index].append(ev.token)
                    else:
                        observers[ev.index].finished(choices.streams[ev.index].final)
            except anyio.get_cancelled_exc_class():
                await self._aborted(choices, observers)
                raise
            return await choices

        return await unless_disconnected(request.receive, run), tokens

    @staticmethod
    def _usage(choices: Choices[Any]) -> UsageInfo:
        """OpenAI's usage of a request: each prompt counted once."""
        return UsageInfo.of(choices.usage, [s.final.timing for s in choices.streams if s.final is not None])

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
        constraint, _ = output_constraint(req)
        params = sampling_params(
            req, max_tokens=max_tokens, logprobs=top is not None, top_logprobs=top or 0, constraint=constraint
        )
        served = self.resolve(req.model)
        _check_fanout(served.engine, n * len(prompts), "prompt" if len(prompts) > 1 else "n")
        choices = served.engine.stream_n(prompts, params, n=n)
        if req.stream:
            created = int(time.time())

            def fmt(index: int, rid: str) -> _CompletionChunks:
                return _CompletionChunks(
                    served, logprobs=top is not None, index=index, response_id=f"cmpl-{rid}", created=created
                )

            return await self._choices_events(served, choices, fmt, _include_usage(req), req.user)
        results, tokens = await self._whole(request, served, choices)
        self._log_user(results[0].request_id, req.user)
        out = []
        for index, (done, toks) in enumerate(zip(results, tokens, strict=True)):
            lp = None
            if top is not None:
                lp = completion_logprobs(toks, await served.texts.lookup(served.engine, toks), 0)
            finish = finish_reason(done.finish_reason)
            out.append(CompletionChoice(index=index, text=done.text, logprobs=lp, finish_reason=finish))
        return json_response(
            CompletionResponse(
                id=f"cmpl-{results[0].request_id}",
                object="text_completion",
                created=int(time.time()),
                model=served.name,
                choices=out,
                usage=self._usage(choices),
            )
        )

    async def chat_completions(self, request: Request) -> Response:
        req = await read_json(request, ChatCompletionRequest, precount=precount_chat)
        check_chat_size(len(req.messages), len(req.tools or ()), "messages")  # before anything is paid for them
        check_refused("/v1/chat/completions", req)
        plan = _chat_plan(req)
        served = self.resolve(req.model)
        _check_fanout(served.engine, plan.n, "n")
        choices = await self._chat_choices(served, req, plan)
        if req.stream:
            created = int(time.time())

            def fmt(index: int, rid: str) -> _ChatChunks:
                return _ChatChunks(
                    served, logprobs=plan.logprobs, index=index, response_id=f"chatcmpl-{rid}", created=created
                )

            return await self._choices_events(served, choices, fmt, _include_usage(req), req.user)
        replies, tokens = await self._whole(request, served, choices)
        self._log_user(replies[0].request_id, req.user)
        out = []
        for index, (reply, toks) in enumerate(zip(replies, tokens, strict=True)):
            lp = chat_logprobs(toks, await served.texts.lookup(served.engine, toks)) if plan.logprobs else None
            finish = finish_reason(choices.streams[index].finish_reason)
            out.append(_chat_choice(index, reply, finish, lp))
        return json_response(
            ChatCompletion(
                id=f"chatcmpl-{replies[0].request_id}",
                object="chat.completion",
                created=int(time.time()),
                model=served.name,
                choices=out,
                usage=self._usage(choices),
            )
        )

    async def _chat_choices(
        self, served: ServedModel, req: ChatCompletionRequest, plan: _ChatPlan
    ) -> Choices[ChatReply]:
        """The request's choices, its prompt rendered and tools set up once (request-sized: every
        message and tool, so in a worker, never on the event loop)."""
        engine = served.engine
        parallel = req.parallel_tool_calls is not False

        budget = reasoning_budget(
            {"reasoning_budget_tokens": req.reasoning_budget_tokens, "thinking_token_budget": req.thinking_token_budget}
        )
        effort, template_kwargs = effort_for(req.reasoning_effort, engine, req.chat_template_kwargs)
        thinking = request_thinking(effort, budget, self.reasoning_budget, engine, template_kwargs)
        named = budget[0] if budget is not None and budget[1] is not None else "reasoning_effort"
        add_prompt, continue_final = _continuation(req)

        def prepare() -> Choices[ChatReply]:
            tools, choice = request_tools(req.tools, req.tool_choice)
            return engine.stream_chat_n(
                chat_messages(req.messages),
                plan.params,
                n=plan.n,
                add_generation_prompt=add_prompt,
                continue_final_message=continue_final,
                tools=tools,
                tool_choice=choice,
                parallel_tool_calls=parallel,
                thinking=thinking,
                chat_template_kwargs=template_kwargs,
            )

        try:
            return await self.workers.run(prepare, large=is_large(len(req.messages), len(req.tools or ())))
        except InvalidRequestError as exc:
            raise chat_refusal(exc, "messages", thinking=named) from None

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
        _check_fanout(engine, len(inputs), "input")
        self._log_user(request.state.request_id, req.user)
        as_base64 = req.encoding_format == "base64"
        # One request to the engine: room for every input taken at once, the first failure cancels the rest
        vectors = await unless_disconnected(request.receive, lambda: engine.embed_batch(inputs))

        async def count(text: str | list[int]) -> int:
            return len(await engine.encode(text)) if isinstance(text, str) else len(text)

        counts = await gather(functools.partial(count, text) for text in inputs)
        data = [
            Embedding(
                object="embedding",
                index=i,
                embedding=base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if as_base64 else v.tolist(),
            )
            for i, v in enumerate(vectors)
        ]
        total = sum(counts)
        return json_response(
            EmbeddingResponse(
                object="list",
                data=data,
                model=served.name,
                usage=EmbeddingUsage(prompt_tokens=total, total_tokens=total),
            )
        )

"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API (what Claude
Code and Anthropic-SDK agents point `ANTHROPIC_BASE_URL` at), over the SDK's chat and tools path.

A conversation's blocks become the SDK's chat messages: `system` a system turn, `tool_use` blocks
an assistant turn's tool calls, `tool_result` blocks tool turns, text blocks text; `thinking` blocks
of past turns are dropped (no model here reasons yet). Images are refused naming the block. Errors
have Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, see `anthropic_error`),
the field named in the message.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidRequestError
from ..reasoning import MAX_REASONING_BUDGET, ReasoningDelta, Thinking
from ..tools import ChatStream, TextDelta, ToolCall, ToolCallDelta
from ..types import SamplingParams, Timing, Token, Usage
from .compat import check_refused
from .errors import APIError, anthropic_error, in_band_error
from .events import collect, drive
from .http import json_response, read_json
from .metrics import Metrics
from .params import chat_refusal, check_chat_size, finish_reason, refuse_schema_with_tools, request_thinking
from .protocol import SchemaFields
from .provider import ServedModel
from .streaming import (
    DEFAULT_SSE_KEEPALIVE_S,
    DEFAULT_WRITE_TIMEOUT_S,
    BacklogLimit,
    EventStream,
    unless_disconnected,
)
from .workers import Workers, is_large

if TYPE_CHECKING:
    from ..engine import Engine

logger = logging.getLogger("aiobasert.server")

# ---- request ---------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="text", tag_field="type"):
    """A text block. `cache_control` is a caching hint (the prefix cache here is automatic) and
    `citations` annotate a past answer: neither changes what is rendered."""

    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ImageBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="image", tag_field="type"):
    """An image: refused by name (the models here read text only)."""

    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="tool_use", tag_field="type"):
    """A tool call the model made in an earlier turn."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="tool_result", tag_field="type"):
    """A tool's result: text, or text blocks (joined with newlines; images refused). `is_error`
    marks a failed call: its text is rendered after "Error: "."""

    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="thinking", tag_field="type"):
    """An earlier turn's thought: dropped from the prompt."""

    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="redacted_thinking", tag_field="type"
):
    data: str


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class MessageParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A client tool (`type` absent or "custom"); Anthropic's server tools (bash, web search, ...)
    are refused by name."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="none", tag_field="type"):
    pass


ToolChoiceParam = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`thinking`: {"type": "enabled", "budget_tokens": N} is `aiobasert.Thinking(enabled=True,
    budget=N)` (the engine closes the thought after N tokens), {"type": "disabled"} is
    `Thinking(enabled=False)` on a reasoning model and nothing on another (docs/reasoning.md)."""

    type: str
    budget_tokens: int | None = None


class OutputFormatParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfigParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`output_config`: `format` (Anthropic's structured outputs) is grammar-enforced; `effort` asks a
    reasoning model for more or less thought: refused until reasoning is served (issue 35 item 1)."""

    format: OutputFormatParam | None = None
    effort: str | None = None


class MetadataParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    user_id: str | None = None
    """Logged with the request id."""


class _Conversation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `/v1/messages` and `/v1/messages/count_tokens` share."""

    schema_fields: ClassVar[SchemaFields] = SchemaFields("output_config.format.schema", "tools[{}].input_schema")

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    # Known Anthropic fields this server does not serve: accepted when they ask for nothing
    # (null, [], the default), else a 400 naming them (compat.py).
    mcp_servers: Any = None
    context_management: Any = None
    container: Any = None


class MessagesRequest(_Conversation, kw_only=True):
    """`POST /v1/messages`. Fields not listed here are refused (400 naming them)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: MetadataParam | None = None
    output_config: OutputConfigParam | None = None
    cache_control: dict[str, Any] | None = None
    """Automatic prompt caching: the engine's prefix cache always is, so this asks for nothing."""
    service_tier: Any = None


class CountTokensRequest(_Conversation, kw_only=True):
    """`POST /v1/messages/count_tokens`."""


# ---- response --------------------------------------------------------------------------------


class TextOut(msgspec.Struct, kw_only=True):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(msgspec.Struct, kw_only=True):
    """The model's thought. `signature` is empty: nothing here is signed, and a thinking block a
    client sends back is rendered (or dropped) as the chat template does, never verified."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(msgspec.Struct, kw_only=True):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(msgspec.Struct, kw_only=True):
    """Anthropic's usage: `input_tokens` are those prefilled, `cache_read_input_tokens` those the
    engine's prefix cache served (together the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, usage: Usage | None) -> MessageUsage:
        if usage is None:
            return cls(input_tokens=0, output_tokens=0)
        cached = usage.cached_prompt_tokens
        return cls(
            input_tokens=usage.prompt_tokens - cached,
            output_tokens=usage.completion_tokens,
            cache_read_input_tokens=cached,
        )


class MessageObject(msgspec.Struct, kw_only=True):
    """The Message object (`type: "message"`)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int


def _new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


# ---- request -> engine -----------------------------------------------------------------------


def _texts(blocks: str | Sequence[TextBlock | ImageBlock], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    out: list[str] = []
    for j, b in enumerate(blocks):
        if isinstance(b, ImageBlock):
            raise _image(f"{where}[{j}]")
        out.append(b.text)
    return "\n".join(out)


def _image(where: str) -> APIError:
    return APIError(400, f"{where}: image blocks are not supported: this server's models read text only", param=where)


def is_prefill(req: _Conversation) -> bool:
    """Whether the conversation ends in an assistant turn the model is to continue: one with text or a
    tool call (refused). An empty final assistant turn, which Anthropic takes ("non-empty content except
    for the optional final assistant message"), continues nothing: it is left out (`chat_messages`)."""
    if not req.messages or req.messages[-1].role != "assistant":
        return False
    content = req.messages[-1].content
    if isinstance(content, str):
        return bool(content)
    return not all((isinstance(b, TextBlock) and not b.text) or isinstance(b, (ThinkingBlock, RedactedThinkingBlock))
                   for b in content)  # fmt: skip


def chat_messages(req: _Conversation) -> list[dict[str, Any]]:
    """The SDK's chat messages (`Engine.stream_chat`) of an Anthropic conversation."""
    if not req.messages:
        raise APIError(400, "messages: at least one message is required", param="messages")
    if is_prefill(req):
        # Anthropic continues a final assistant turn (a prefill), and refuses one that ends in
        # whitespace or holds a tool call; the reply is what follows it
        last, where = req.messages[-1], f"messages[{len(req.messages) - 1}]"
        if not isinstance(last.content, str) and any(isinstance(b, ToolUseBlock) for b in last.content):
            raise APIError(400, f"{where}: a final assistant turn with a tool_use block cannot be continued",
                           param=where)  # fmt: skip
        text = last.content if isinstance(last.content, str) else "".join(
            b.text for b in last.content if isinstance(b, TextBlock)
        )  # fmt: skip
        if text != text.rstrip():
            raise APIError(400, f"{where}: final assistant content cannot end with trailing whitespace", param=where)
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _texts(req.system, "system")})
    messages = req.messages
    if messages[-1].role == "assistant" and not is_prefill(req):
        messages = messages[:-1]  # an empty final assistant turn: nothing to continue
    for i, m in enumerate(messages):
        blocks: Sequence[Block] = [TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        calls: list[ToolCall] = []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ImageBlock):
                raise _image(where)
            elif isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
                if m.role != "assistant":
                    raise APIError(400, f"{where}: thinking blocks belong to assistant turns", param=where)
            elif isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise APIError(400, f"{where}: tool_use blocks belong to assistant turns", param=where)
                calls.append(ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input)))
            else:  # a tool result: a tool turn of its own, in order
                if m.role != "user":
                    raise APIError(400, f"{where}: tool_result blocks belong to user turns", param=where)
                text = _texts(b.content or "", f"{where}.content")
                out.append(
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": f"Error: {text}" if b.is_error else text}
                )
        if m.role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_tools(req: _Conversation) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """The request's tools and tool_choice as the OpenAI dicts the SDK reads, and whether
    parallel calls are allowed (`disable_parallel_tool_use`)."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise APIError(
                    400,
                    f"tools[{i}]: server tools (type {t.type!r}) are not supported: only client tools",
                    param="tools",
                )
            function: dict[str, Any] = {"name": t.name, "parameters": t.input_schema or {"type": "object"}}
            if t.description is not None:
                function["description"] = t.description
            tools.append({"type": "function", "function": function})
    choice: Any = None
    parallel = True
    tc = req.tool_choice
    if tc is not None:
        if isinstance(tc, ToolChoiceTool):
            choice = {"type": "function", "function": {"name": tc.name}}
        else:
            choice = {ToolChoiceAuto: "auto", ToolChoiceAny: "required", ToolChoiceNone: "none"}[type(tc)]
        parallel = not getattr(tc, "disable_parallel_tool_use", False)
    return tools, choice, parallel


def _thinking(req: _Conversation, engine: Engine) -> Thinking | None:
    """The SDK's `Thinking` for a request's `thinking` on `engine`'s model. "disabled" on a model that does
    not reason is what it does anyway: nothing to ask. On a model that thinks without being asked (no
    `enable_thinking` in its template: gpt-oss, DeepSeek-R1's distills) "enabled" is its budget only, and
    "disabled" a thought closed at once (a budget of 0, as the server's `--reasoning-budget 0` there)."""
    t = req.thinking
    if t is None:
        return None
    fmt = engine.reasoning_format
    knob = fmt is not None and fmt.has_knob(engine.chat_template)
    if t.type == "disabled":
        if t.budget_tokens is not None:
            raise APIError(400, "thinking.budget_tokens: only with type 'enabled'", param="thinking.budget_tokens")
        if fmt is None:
            return None
        return Thinking(budget=0) if not knob and fmt.tags_are_tokens else Thinking(enabled=False)
    if t.type != "enabled":
        raise APIError(400, f"thinking.type: {t.type!r} is not one of 'enabled', 'disabled'", param="thinking.type")
    if t.budget_tokens is None or not 1 <= t.budget_tokens <= MAX_REASONING_BUDGET:
        raise APIError(
            400, "thinking.budget_tokens: an integer from 1 to 2**30 is required", param="thinking.budget_tokens"
        )
    if fmt is None:
        raise APIError(400, "thinking: this model does not reason (it has no reasoning format)", param="thinking")
    if is_prefill(req):  # as Anthropic: a continued answer has no thought before it
        raise APIError(400, "thinking: a final assistant turn (a prefill) cannot be continued with thinking enabled",
                       param="thinking")  # fmt: skip
    return Thinking(enabled=True if knob else None, budget=t.budget_tokens)


def _sampling(req: MessagesRequest) -> SamplingParams:
    if req.max_tokens < 1:
        raise APIError(400, "max_tokens: must be >= 1", param="max_tokens")
    config = req.output_config
    if config is not None and config.effort is not None:
        raise APIError(
            400, "output_config.effort is not supported by this server yet (no reasoning models are served)",
            param="output_config",
        )  # fmt: skip
    schema = config.format.schema if config is not None and config.format is not None else None
    refuse_schema_with_tools(bool(req.tools), schema, field="output_config.format", param="output_config")
    return SamplingParams(
        json_schema=schema,
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # Anthropic's default
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        stop=req.stop_sequences or None,
    )


async def _stop_sequence(served: ServedModel, stops: Sequence[str] | None, tokens: Sequence[Token]) -> str | None:
    """Which stop sequence ended a generation that stopped, or None (an end token did). The stream
    drops the stop string from its text; its tokens still spell it: decoded whole, the text
    continues past the output with the stop string that matched first."""
    if not stops:
        return None
    shown = "".join(t.text for t in tokens)
    full = await served.engine.decode([t.id for t in tokens])
    tail = full[max(0, len(shown) - 16) :]  # slack for a detokenizer's leading-space handling
    found = [(tail.find(s), i) for i, s in enumerate(stops) if s in tail]
    return stops[min(found)[1]] if found else None


def _stop_reason(finish: str, calls: bool, stop_sequence: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as `input`: the grammar made them a JSON object, unless max_tokens cut
    the call short (`stop_reason: max_tokens`): then what there is cannot be read, {}."""
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


_SDK_FIELDS = {"stop": "stop_sequences"}
"""SamplingParams fields whose Anthropic request field has another name."""


def _refusal(exc: InvalidRequestError) -> APIError:
    err = chat_refusal(exc, "messages")
    field = _SDK_FIELDS.get(err.body.error.param or "")
    return err if field is None else APIError(400, f"{field}: {err.body.error.message}", param=field)


class _Reply:
    """One message in the making: its blocks as they stream, and the final Message."""

    def __init__(self, req: MessagesRequest, served: ServedModel, chat: ChatStream, request_id: str) -> None:
        self.req = req
        self.served = served
        self.chat = chat
        self.id = f"msg_{request_id}"
        self.tokens: list[Token] = []
        self.stop_sequence: str | None = None
        self._block = -1  # the open block's index (-1: none yet)
        self._open: Literal["thinking", "text", "tool_use"] | None = None
        self._called = False

    def message(self, finish: str | None, usage: Usage | None) -> MessageObject:
        content: list[ThinkingOut | TextOut | ToolUseOut] = []
        if finish is not None and self.chat.reasoning:
            content.append(ThinkingOut(thinking=self.chat.reasoning))
        calls = self.chat.tool_calls if finish is not None else []
        if finish is not None and (self.chat.content or not calls):
            content.append(TextOut(text=self.chat.content))
        content += [ToolUseOut(id=c.id, name=c.name, input=_input(c)) for c in calls]
        reason = _stop_reason(finish, bool(calls), self.stop_sequence) if finish is not None else None
        return MessageObject(
            id=self.id,
            model=self.served.name,
            content=content,
            stop_reason=reason,
            stop_sequence=self.stop_sequence if reason == "stop_sequence" else None,
            usage=MessageUsage.of(usage),
        )

    # ---- streaming events ----

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **fields}) + b"\n\n"

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":  # as Anthropic: the block's signature last (empty: nothing is signed)
            out = self.event(
                "content_block_delta", index=self._block, delta={"type": "signature_delta", "signature": ""}
            )
        self._open = None
        return out + self.event("content_block_stop", index=self._block)

    def _start(self, kind: Literal["thinking", "text", "tool_use"], block: ThinkingOut | TextOut | ToolUseOut) -> bytes:
        out = self._close()
        self._block += 1
        self._open = kind
        return out + self.event("content_block_start", index=self._block, content_block=block)

    def delta(self, d: TextDelta | ToolCallDelta | ReasoningDelta) -> bytes:
        out = b""
        if isinstance(d, ReasoningDelta):
            if not d.text:
                return b""
            if self._open != "thinking":
                out += self._start("thinking", ThinkingOut(thinking=""))
            delta = {"type": "thinking_delta", "thinking": d.text}
            return out + self.event("content_block_delta", index=self._block, delta=delta)
        if isinstance(d, TextDelta):
            if not d.text:
                return b""
            if self._open != "text":
                out += self._start("text", TextOut(text=""))
            return out + self.event(
                "content_block_delta", index=self._block, delta={"type": "text_delta", "text": d.text}
            )
        if d.id is not None:  # a new call: its own block
            self._called = True
            out += self._start("tool_use", ToolUseOut(id=d.id, name=d.name or "", input={}))
        if d.arguments:
            delta = {"type": "input_json_delta", "partial_json": d.arguments}
            out += self.event("content_block_delta", index=self._block, delta=delta)
        return out


class _MessageEvents:
    """The Messages API's streamed events, as a `ChunkFormat` for `events.drive`."""

    def __init__(self, reply: _Reply) -> None:
        self.r = reply

    def opening(self, request_id: str) -> bytes | None:
        start = msgspec.structs.replace(self.r.message(None, None), content=[])
        return self.r.event("message_start", message=start) + self.r.event("ping")

    async def token(self, tok: Token) -> bytes | None:
        r = self.r
        r.tokens.append(tok)
        if tok.finish_reason == "stop":  # the last token: which stop sequence, if any, ended it
            r.stop_sequence = await _stop_sequence(r.served, r.req.stop_sequences, r.tokens)
        out = b"".join(r.delta(d) for d in r.chat.feed(tok))
        return out or None

    def closing(self, finish: str, usage: Usage | None) -> bytes | None:
        r = self.r
        out = b"".join(r.delta(d) for d in r.chat.close_parser()) + r._close()
        final = r.message(finish, usage)
        delta = {"stop_reason": final.stop_reason, "stop_sequence": final.stop_sequence}
        out += r.event("message_delta", delta=delta, usage=final.usage)
        return out + r.event("message_stop")

    def usage(self, usage: Usage, timing: Timing | None = None) -> bytes:
        return b""

    def error(self, exc: BaseException) -> bytes:
        body = anthropic_error(in_band_error(exc))
        return b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"

    def done(self) -> bytes:
        return b""


# ---- the endpoints ---------------------------------------------------------------------------


class MessagesAPI:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens` over a model resolver and the app's metrics."""

    def __init__(
        self,
        resolve: Any,
        metrics: Metrics,
        *,
        write_timeout: float | None = DEFAULT_WRITE_TIMEOUT_S,
        workers: Workers | None = None,
        backlog: BacklogLimit | None = None,
        sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE_S,
        reasoning_budget: int = -1,
    ) -> None:
        self._resolve = resolve
        self._metrics = metrics
        self._reasoning_budget = reasoning_budget
        """The server's `--reasoning-budget` (params.request_thinking), for a request without `thinking`."""
        self._write_timeout = write_timeout
        self._workers = workers if workers is not None else Workers()
        self._backlog = backlog if backlog is not None else BacklogLimit()
        self._sse_keepalive = sse_keepalive

    async def create(self, request: Request) -> Response:
        req = await read_json(request, MessagesRequest)
        check_chat_size(len(req.messages), len(req.tools or ()), "messages")
        check_refused("/v1/messages", req)
        params = _sampling(req)
        served: ServedModel = self._resolve(req.model)
        engine = served.engine
        thinking = request_thinking(_thinking(req, engine), None, self._reasoning_budget, engine)

        def start() -> ChatStream:
            # request-sized (every message and tool): in a worker, never on the event loop
            messages = chat_messages(req)
            tools, choice, parallel = chat_tools(req)
            return engine.stream_chat(
                messages, params, tools=tools, tool_choice=choice, parallel_tool_calls=parallel, thinking=thinking,
                continue_final_message=is_prefill(req),
            )  # fmt: skip

        try:
            chat = await self._workers.run(start, large=is_large(len(req.messages), len(req.tools or ())))
        except InvalidRequestError as exc:
            raise _refusal(exc) from None
        reply = _Reply(req, served, chat, chat.tokens.request_id)
        if req.metadata is not None and req.metadata.user_id is not None:
            logger.info("request %s for user %r", reply.id, req.metadata.user_id)
        observer = self._metrics.observer(served.name, engine)
        if req.stream:
            return EventStream(
                drive(chat.tokens, _MessageEvents(reply), include_usage=False, observer=observer),
                write_timeout=self._write_timeout,
                streams=[chat.tokens],
                backlog=self._backlog,
                keepalive=self._sse_keepalive,
            )
        tokens = await unless_disconnected(request.receive, functools.partial(collect, chat.tokens, observer))
        finish = finish_reason(chat.tokens.finish_reason)
        reply.tokens = tokens
        if finish == "stop":
            reply.stop_sequence = await _stop_sequence(served, req.stop_sequences, tokens)
        for tok in tokens:
            chat.feed(tok)
        chat.close_parser()
        final = chat.tokens.final
        return json_response(reply.message(finish, final.usage if final is not None else None))

    async def count_tokens(self, request: Request) -> Response:
        req = await read_json(request, CountTokensRequest)
        check_chat_size(len(req.messages), len(req.tools or ()), "messages")
        check_refused("/v1/messages/count_tokens", req)
        served: ServedModel = self._resolve(req.model)
        _thinking(req, served.engine)  # refused as /v1/messages would
        messages = chat_messages(req)
        tools, choice, parallel = chat_tools(req)
        try:
            count = await served.engine.count_chat_tokens(
                messages, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                continue_final_message=is_prefill(req),
            )  # fmt: skip
        except InvalidRequestError as exc:
            raise chat_refusal(exc, "messages") from None
        return json_response(TokenCount(input_tokens=count))

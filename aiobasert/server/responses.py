"""`POST /v1/responses`: OpenAI's Responses API (text and function tools,
stream and not) and the store behind `previous_response_id`.

A stored response keeps its conversation (input and output turns, not its
`instructions`, as OpenAI does). The next turn re-renders that conversation
plus the new input; the engine published the previous turn's KV (prompt and
output) to its prefix cache when it finished, so the shared prefix is not
prefilled again: `usage.input_tokens_details.cached_tokens` reports how much
was reused. The store is bounded in bytes (`max_bytes`, oldest dropped first)
and entries expire after `ttl_s`; the KV itself lives in the engine's prefix cache
and is evicted by it under memory pressure (the turn then prefills again).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidRequestError
from ..reasoning import ReasoningDelta, Thinking
from ..tools import ChatDelta, ChatStream, TextDelta, ToolCall, template_supports_tools
from ..types import SamplingParams, Timing, Token, Usage
from .compat import check_refused
from .errors import APIError, in_band_error
from .events import collect, drive
from .http import json_response, read_json
from .metrics import Metrics
from .params import (
    chat_refusal,
    check_chat_size,
    effort_for,
    finish_reason,
    logit_bias,
    precount_responses,
    reasoning_effort,
    refuse_schema_with_tools,
    request_thinking,
    request_tools,
)
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

# ---- request ---------------------------------------------------------------------------------


class InputText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A text part of an input message (`input_text`, or `output_text` in a replayed assistant turn)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class OutputTextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An `input_text` part of a `function_call_output`'s `output` list."""

    type: Literal["input_text"]
    text: str


class InputMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`{"role": ..., "content": ...}` (type "message" optional)."""

    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class InputFunctionCall(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="function_call", tag_field="type"
):
    """A function call the model made earlier (replayed by the client)."""

    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class InputFunctionOutput(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="function_call_output", tag_field="type"
):
    """The result of a function call: text, or a list of content parts of which
    only `input_text` is served (the texts are joined with newlines, as a message's)."""

    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class InputReasoningText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A `reasoning_text` part of a replayed reasoning item: the thought itself."""

    type: Literal["reasoning_text"]
    text: str


class InputReasoning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="reasoning", tag_field="type"):
    """A reasoning item the model wrote earlier (replayed by the client): its `content` texts are the
    thought of the assistant turn that follows, given to the template as the chat completions
    `reasoning` field is (rendered or dropped as the template does). A `summary` is not the thought
    and never reaches the prompt; `encrypted_content` is not served (nothing here is encrypted)."""

    id: str | None = None
    summary: list[dict[str, Any]] = msgspec.field(default_factory=list)
    content: list[InputReasoningText] | None = None
    encrypted_content: None = None
    status: str | None = None


class ResponsesReasoning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`reasoning`: `effort` "none" turns a reasoning model's thinking off (the template's
    `enable_thinking`), any other effort on; `summary` is accepted but no summary is generated
    (a reasoning item's `summary` is always empty: its `content` carries the whole thought)."""

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """Deprecated alias of `summary`."""


class ResponsesFunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A function tool (the only kind served): its arguments always validate
    against `parameters` (the output grammar enforces it), so `strict` changes nothing."""

    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponsesNamedTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`text.format`: "text", "json_object" or "json_schema" (with `schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponsesText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/responses`. Fields not listed here are refused (400 naming them)."""

    schema_fields: ClassVar[SchemaFields] = SchemaFields("text.format.schema", "tools[{}].parameters", "input")

    model: str | None = None
    input: str | list[dict[str, Any]]
    """Text, or items: messages, `function_call`s and `function_call_output`s."""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logit_bias: dict[str, float] | None = None
    """An extension (OpenAI's Responses API has none): token id -> bias, as chat completions'."""
    stream: bool = False
    store: bool | None = None
    """False: the response is not stored (it cannot be continued)."""
    metadata: dict[str, str] | None = None
    """Echoed back on the response."""
    user: str | None = None
    """Echoed back on the response."""
    text: ResponsesText | None = None
    truncation: Literal["disabled"] | None = None
    """Only "disabled" (the default): a conversation longer than the context is refused."""
    reasoning: ResponsesReasoning | None = None
    """A reasoning model's thinking on or off (docs/reasoning.md); refused by a model that does not reason."""
    # Known OpenAI fields this server does not serve: accepted when they ask for
    # nothing (null, [], false, the default), else a 400 naming them (compat.py).
    include: list[str] | None = None
    """Extra output data; the Agents SDK sends `[]` on every call."""
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None


# ---- response --------------------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str
    content: list[OutputText]


class ReasoningText(msgspec.Struct, kw_only=True):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(msgspec.Struct, kw_only=True):
    """A reasoning model's thought, before the message or calls it led to. `summary` is always
    empty (no summary is generated); `content` holds the thought, its tags left out."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText]
    status: str


class OutputFunctionCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    """Input tokens served from the engine's prefix cache (e.g. a previous turn's KV)."""
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_prompt_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The Response object (`object: "response"`)."""

    id: str
    object: Literal["response"] = "response"
    created_at: float
    model: str
    status: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[Any]
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    instructions: str | None
    metadata: dict[str, str] | None
    user: str | None
    store: bool
    text: Any
    reasoning: Any = None
    truncation: str = "disabled"
    error: Any = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None


# ---- the store -------------------------------------------------------------------------------


DEFAULT_STORE_BYTES = 64 * 2**20
"""The Responses store's default budget: the memory every stored conversation holds (`ResponseStore.nbytes`)."""


class ResponseStore:
    """Recent responses' conversations for `previous_response_id`, each for
    `ttl_s` seconds after it was stored, within `max_bytes` in all (oldest
    dropped first; a conversation larger than the whole budget is not stored).

    A conversation is kept as compact JSON (decoded on use), counted at the
    memory it holds (its bytes object, its id, its entry), and only with the
    fields a prompt renders: role, content, calls' names and arguments, and
    call ids only for a template that renders them
    (`keep_ids`); a replayed item's other fields never reach the prompt.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_STORE_BYTES, ttl_s: float = 3600.0) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.nbytes = 0
        """The memory the stored conversations hold, in bytes: each one's JSON and id as Python
        objects, and its entry (at least what tracemalloc measures)."""
        self._entries: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict[str, Any]], model: str, *, keep_ids: bool = True) -> None:
        # an exact-size copy: msgspec's own result keeps its over-allocated buffer (~1.5x the JSON)
        blob = memoryview(msgspec.json.encode([_rendered(m, keep_ids) for m in conversation])).tobytes()
        cost = _cost(response_id, blob)
        if cost > self.max_bytes:
            return
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.nbytes -= _cost(response_id, old[1])
        self._entries[response_id] = (time.monotonic() + self.ttl_s, blob, model)
        self.nbytes += cost
        while self.nbytes > self.max_bytes:
            key, (_, dropped, _) = self._entries.popitem(last=False)
            self.nbytes -= _cost(key, dropped)

    def get(self, response_id: str) -> tuple[list[dict[str, Any]], str] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        expires, blob, model = entry
        if time.monotonic() > expires:
            del self._entries[response_id]
            self.nbytes -= _cost(response_id, blob)
            return None
        conversation: list[dict[str, Any]] = msgspec.json.decode(blob)
        for m in conversation:  # calls as the request side builds them (an id "" when not stored)
            if "tool_calls" in m:
                m["tool_calls"] = [
                    ToolCall(id=c.get("id", ""), name=c["name"], arguments=c["arguments"]) for c in m["tool_calls"]
                ]
        return conversation, model

    def __len__(self) -> int:
        return len(self._entries)


_ENTRY_BYTES = 256
"""What one entry costs besides its JSON and id: its tuple, expiry float and ordered-dict slot
(about 190 bytes measured on CPython 3.12, counted high)."""


def _cost(response_id: str, blob: bytes) -> int:
    """The memory one stored conversation holds: the objects themselves, not just the JSON's length
    (counting the JSON alone, a budget of small entries held 5-10x its size)."""
    return sys.getsizeof(blob) + sys.getsizeof(response_id) + _ENTRY_BYTES


def _rendered(message: dict[str, Any], keep_ids: bool) -> dict[str, Any]:
    """The fields of one conversation message a chat prompt renders."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    calls: Sequence[ToolCall] = message.get("tool_calls") or ()
    if calls:
        out["tool_calls"] = [
            {"name": c.name, "arguments": c.arguments, **({"id": c.id} if keep_ids else {})} for c in calls
        ]
    if keep_ids and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("reasoning_content") is not None:  # the template renders or drops it
        out["reasoning_content"] = message["reasoning_content"]
    return out


def _renders_ids(template: str) -> bool:
    """Whether a chat template renders call ids (most do not: then they are not stored)."""
    return template_supports_tools(template) and re.search(r"tool_call_id|\bid\b", template) is not None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def tag_of(response_id: str) -> str | None:
    """The replica tag a response id carries (`ResponsesAPI.id_tag`), if any."""
    parts = response_id.split("_")
    return parts[1] if len(parts) == 3 and parts[0] == "resp" else None


# ---- request -> engine -----------------------------------------------------------------------


InputItem = InputMessage | InputFunctionCall | InputFunctionOutput | InputReasoning
_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": InputMessage,
    "function_call": InputFunctionCall,
    "function_call_output": InputFunctionOutput,
    "reasoning": InputReasoning,
}


def _input_item(raw: dict[str, Any], i: int) -> InputItem:
    kind = raw.get("type", "message")
    item_type = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if item_type is None:
        raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported", param="input")
    try:
        return msgspec.convert(raw, item_type)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"input[{i}]: {exc}", param="input") from None


def _input_messages(raw_items: str | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(raw_items, str):
        return [{"role": "user", "content": raw_items}]
    out: list[dict[str, Any]] = []
    # A reasoning item's thought belongs to the assistant turn after it (OpenAI's order: reasoning,
    # then the message or calls it led to); one with nothing after it is a turn of its own.
    thought: list[str] | None = None
    for i, raw in enumerate(raw_items):
        item = _input_item(raw, i)
        if isinstance(item, InputReasoning):
            if thought is None:
                thought = []
            thought += [part.text for part in item.content or ()]
            continue
        owns_thought = isinstance(item, InputFunctionCall) or (
            isinstance(item, InputMessage) and item.role == "assistant"
        )
        if thought is not None and not owns_thought:
            out.append({"role": "assistant", "content": "", "reasoning_content": "\n".join(thought)})
            thought = None
        if isinstance(item, InputMessage):
            text = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
            if thought is not None:  # an assistant message: the thought was its own
                out[-1]["reasoning_content"] = "\n".join(thought)
                thought = None
        elif isinstance(item, InputFunctionCall):
            try:  # arguments the model could never have written: the input's fault, on every template
                json.loads(item.arguments)
            except ValueError:
                raise APIError(400, f"input[{i}].arguments is not JSON", param="input") from None
            call = ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
            if thought is None and out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # consecutive calls are one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought is not None:
                    out[-1]["reasoning_content"] = "\n".join(thought)
                    thought = None
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _output_text(item.output, i)})
    if thought is not None:
        out.append({"role": "assistant", "content": "", "reasoning_content": "\n".join(thought)})
    return out


def _output_text(output: str | list[dict[str, Any]], i: int) -> str:
    """A function call's output as the text a prompt renders: a list's `input_text`
    parts joined (the other part types, images and files, are refused by name)."""
    if isinstance(output, str):
        return output
    texts: list[str] = []
    for j, part in enumerate(output):
        field = f"input[{i}].output[{j}]"
        kind = part.get("type")
        if kind != "input_text":
            raise APIError(
                400,
                f"{field}.type: parts of type {kind!r} are not supported (only 'input_text')",
                param=f"{field}.type",
            )
        try:
            texts.append(msgspec.convert(part, OutputTextPart).text)
        except msgspec.ValidationError as exc:
            raise APIError(400, f"{field}: {exc}", param=field) from None
    return "\n".join(texts)


def _json_schema(text: ResponsesText | None) -> dict[str, Any] | bool | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.schema is None:
        raise APIError(400, "text.format json_schema needs a schema", param="text")
    return fmt.schema


def _thinking(reasoning: ResponsesReasoning | None, reasons: bool) -> Thinking | None:
    """The SDK's `thinking` for a request's `reasoning` (`reasons`: the model has a reasoning format).
    On a model that does not reason, a `reasoning` that asks for anything is refused by name."""
    if reasoning is None:
        return None
    thinking = reasoning_effort(reasoning.effort, "reasoning.effort")  # a bad effort is named first
    if not reasons and (thinking is not None or reasoning.summary or reasoning.generate_summary):
        param = "reasoning.effort" if thinking is not None else "reasoning"
        raise APIError(400, f"{param}: this model does not reason (it has no reasoning format)", param=param)
    return thinking


class _Turn:
    """One response in the making: its ids, the model's items as they stream,
    and the final Response object."""

    def __init__(
        self,
        req: ResponsesRequest,
        served: ServedModel,
        chat: ChatStream,
        conversation: list[dict[str, Any]],
        store: ResponseStore,
        response_id: str,
    ) -> None:
        self.req = req
        self.served = served
        self.chat = chat
        self.conversation = conversation
        self.store = store
        self.id = response_id
        self.created = time.time()
        self.msg_id = _new_id("msg")
        self.rs_id = _new_id("rs")
        self.items: list[OutputItem] = []
        self._thought: list[str] | None = None  # the streamed thought ([] once its item closed)
        self._seq = 0
        self._text_open = False
        self._calls: dict[int, int] = {}  # call index -> output index, while the call streams
        self._call_ids: dict[int, str] = {}
        self._order: dict[str, int] = {}  # item id -> output index, as announced in the stream

    def announce(self, item_id: str) -> int:
        """The output index of a streamed item: each its own, in the order they appear
        (the openai SDK's `responses.stream()` refuses a repeated one)."""
        self._order[item_id] = index = len(self._order)
        return index

    def usage(self, usage: Usage | None) -> Usage | None:
        """The turn's usage with its thought counted (the token stream's own does not split it)."""
        if usage is None:
            return None
        return msgspec.structs.replace(usage, reasoning_tokens=self.chat.reasoning_tokens)

    def response(self, status: str, usage: Usage | None, finish: str | None) -> ResponseObject:
        req = self.req
        incomplete = IncompleteDetails(reason="max_output_tokens") if finish == "length" else None
        tool_choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            model=self.served.name,
            status=status,
            output=list(self.items),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=msgspec.to_builtins(tool_choice),
            tools=msgspec.to_builtins(req.tools or []),
            temperature=req.temperature,
            top_p=req.top_p,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            instructions=req.instructions,
            metadata=req.metadata,
            user=req.user,
            store=req.store is not False,
            text=msgspec.to_builtins(req.text) if req.text is not None else {"format": {"type": "text"}},
            reasoning=msgspec.to_builtins(req.reasoning) if req.reasoning is not None else None,
            incomplete_details=incomplete,
            usage=ResponseUsage.of(usage) if usage is not None else None,
        )

    def finish(self, usage: Usage | None, finish: str) -> ResponseObject:
        """The final items and Response; stores the conversation for the next turn."""
        content, calls, thought = self.chat.content, self.chat.tool_calls, self.chat.reasoning
        status = "incomplete" if finish == "length" else "completed"
        items: list[OutputItem] = []
        if thought:  # a turn cut inside its thought is that thought alone (as OpenAI answers it)
            thought_status = "incomplete" if finish == "length" and not (content or calls) else "completed"
            items.append(OutputReasoning(id=self.rs_id, content=[ReasoningText(text=thought)], status=thought_status))
        if content or not (calls or thought):
            items.append(OutputMessage(id=self.msg_id, status=status, content=[OutputText(text=content)]))
        for i, call in enumerate(calls):
            item_id = self._call_ids.get(i) or _new_id("fc")
            items.append(
                OutputFunctionCall(id=item_id, call_id=call.id, name=call.name, arguments=call.arguments, status=status)
            )
        items.sort(key=lambda item: self._order.get(item.id, len(self._order)))  # as streamed
        self.items = items
        if self.req.store is not False:
            turn: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                turn["tool_calls"] = calls
            if thought:
                turn["reasoning_content"] = thought
            keep_ids = _renders_ids(self.served.engine.chat_template)
            self.store.put(self.id, [*self.conversation, turn], self.served.name, keep_ids=keep_ids)
        return self.response(status, self.usage(usage), finish)

    # ---- streaming events ----

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


class _ResponseEvents:
    """The Responses API's streamed events, as a `ChunkFormat` for `events.drive`."""

    def __init__(self, turn: _Turn) -> None:
        self.t = turn

    def opening(self, request_id: str) -> bytes | None:
        r = self.t.response("in_progress", None, None)
        return self.t.event("response.created", response=r) + self.t.event("response.in_progress", response=r)

    async def token(self, tok: Token) -> bytes | None:
        out = b"".join(self._delta(d) for d in self.t.chat.feed(tok))
        return out or None

    def _delta(self, d: ChatDelta) -> bytes:
        t = self.t
        if isinstance(d, ReasoningDelta):
            return self._thought(d.text)
        out = self._close_thought()  # the thought ends where the answer or a call starts
        if isinstance(d, TextDelta):
            if not t._text_open:
                t._text_open = True
                index = t.announce(t.msg_id)
                item = OutputMessage(id=t.msg_id, status="in_progress", content=[])
                out += t.event("response.output_item.added", output_index=index, item=item)
                out += t.event(
                    "response.content_part.added",
                    item_id=t.msg_id,
                    output_index=index,
                    content_index=0,
                    part=OutputText(text=""),
                )
            return out + t.event(
                "response.output_text.delta",
                item_id=t.msg_id,
                output_index=t._order[t.msg_id],
                content_index=0,
                delta=d.text,
                logprobs=[],
            )
        if d.id is not None:  # a new call: close the previous one
            out += self._close_call(d.index - 1)
            t._call_ids[d.index] = _new_id("fc")
            index = t._calls[d.index] = t.announce(t._call_ids[d.index])
            call = OutputFunctionCall(
                id=t._call_ids[d.index], call_id=d.id, name=d.name or "", arguments="", status="in_progress"
            )
            return out + t.event("response.output_item.added", output_index=index, item=call)
        return out + t.event(
            "response.function_call_arguments.delta",
            item_id=t._call_ids[d.index],
            output_index=t._calls[d.index],
            delta=d.arguments,
        )

    def _thought(self, text: str) -> bytes:
        """A delta of the thought: its reasoning item and content part opened first."""
        t = self.t
        out = b""
        if t._thought is None:
            t._thought = []
            index = t.announce(t.rs_id)
            item = OutputReasoning(id=t.rs_id, content=[], status="in_progress")
            out += t.event("response.output_item.added", output_index=index, item=item)
            out += t.event(
                "response.content_part.added",
                item_id=t.rs_id,
                output_index=index,
                content_index=0,
                part=ReasoningText(text=""),
            )
        t._thought.append(text)
        return out + t.event(
            "response.reasoning_text.delta",
            item_id=t.rs_id,
            output_index=t._order[t.rs_id],
            content_index=0,
            delta=text,
        )

    def _close_thought(self, status: str = "completed") -> bytes:
        """The thought's closing events, once, when it has one open."""
        t = self.t
        if not t._thought:
            return b""
        text = "".join(t._thought)
        t._thought = []  # closed: the splitter gives one thought a turn, before the answer
        index = t._order[t.rs_id]
        part = ReasoningText(text=text)
        item = OutputReasoning(id=t.rs_id, content=[part], status=status)
        return (
            t.event("response.reasoning_text.done", item_id=t.rs_id, output_index=index, content_index=0, text=text)
            + t.event("response.content_part.done", item_id=t.rs_id, output_index=index, content_index=0, part=part)
            + t.event("response.output_item.done", output_index=index, item=item)
        )

    def _close_call(self, index: int) -> bytes:
        t = self.t
        if index not in t._calls or index >= len(t.chat.tool_calls):
            return b""
        call = t.chat.tool_calls[index]
        out_index, item_id = t._calls.pop(index), t._call_ids[index]
        item = OutputFunctionCall(
            id=item_id, call_id=call.id, name=call.name, arguments=call.arguments, status="completed"
        )
        return t.event(
            "response.function_call_arguments.done", item_id=item_id, output_index=out_index, arguments=call.arguments
        ) + t.event("response.output_item.done", output_index=out_index, item=item)

    def closing(self, finish: str, usage: Usage | None) -> bytes | None:
        t = self.t
        out = b"".join(self._delta(d) for d in t.chat.close_parser())
        # cut inside the thought (max_output_tokens): the thought is the turn's only item
        only = finish == "length" and not t._text_open and not t._calls
        out += self._close_thought("incomplete" if only else "completed")
        for index in sorted(t._calls):
            out += self._close_call(index)
        final = t.finish(usage, finish)
        if t._text_open:
            index = t._order[t.msg_id]
            msg = final.output[index]
            assert isinstance(msg, OutputMessage)
            part = msg.content[0]
            out += t.event(
                "response.output_text.done",
                item_id=t.msg_id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[],
            )
            out += t.event(
                "response.content_part.done", item_id=t.msg_id, output_index=index, content_index=0, part=part
            )
            out += t.event("response.output_item.done", output_index=index, item=msg)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        return out + t.event(kind, response=final)

    def usage(self, usage: Usage, timing: Timing | None = None) -> bytes:
        return b""

    def error(self, exc: BaseException) -> bytes:
        # OpenAI's shape for a response that ended without completing (an abort, an
        # engine error): the `error` event, then `response.failed` with the Response.
        err = in_band_error(exc).body.error
        failed = msgspec.structs.replace(
            self.t.response("failed", None, None), error={"code": err.code or "server_error", "message": err.message}
        )
        return self.t.event("error", code=err.code, message=err.message, param=err.param) + self.t.event(
            "response.failed", response=failed
        )

    def done(self) -> bytes:
        return b""


# ---- the endpoint ----------------------------------------------------------------------------


class ResponsesAPI:
    """`POST /v1/responses` over a model resolver and the app's metrics."""

    def __init__(
        self,
        resolve: Any,
        metrics: Metrics,
        store: ResponseStore | None = None,
        *,
        write_timeout: float | None = DEFAULT_WRITE_TIMEOUT_S,
        workers: Workers | None = None,
        backlog: BacklogLimit | None = None,
        sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE_S,
        reasoning_budget: int = -1,
    ) -> None:
        self._resolve = resolve
        self._sse_keepalive = sse_keepalive
        self._reasoning_budget = reasoning_budget
        """The server's `--reasoning-budget` (params.request_thinking)."""
        self._backlog = backlog if backlog is not None else BacklogLimit()
        self._workers = workers if workers is not None else Workers()
        self._metrics = metrics
        self.store = store if store is not None else ResponseStore()  # an empty store is falsy (len 0)
        self._write_timeout = write_timeout
        self.id_tag: str | None = None
        """Set by a server with several replicas (Ray Serve): response ids carry it, so a
        `previous_response_id` can be routed to the replica that stores it (`tag_of`)."""

    def new_id(self) -> str:
        return _new_id("resp") if self.id_tag is None else f"resp_{self.id_tag}_{os.urandom(12).hex()}"

    async def create(self, request: Request) -> Response:
        req = await read_json(request, ResponsesRequest, precount=precount_responses)
        # counts first, before any item is read: the stored conversation is counted again below
        check_chat_size(0 if isinstance(req.input, str) else len(req.input), len(req.tools or ()), "input")
        check_refused("/v1/responses", req)
        conversation: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            found = self.store.get(req.previous_response_id)
            if found is None:
                raise APIError(
                    404,
                    f"no stored response {req.previous_response_id!r} (unknown, expired, or evicted; "
                    "responses are kept in a bounded store, on the replica that made them)",
                    param="previous_response_id",
                    code="response_not_found",
                )
            conversation = list(found[0])
        conversation += _input_messages(req.input)
        if not conversation:
            raise APIError(400, "input must not be empty", param="input")
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise APIError(400, "max_output_tokens must be >= 1", param="max_output_tokens")
        schema = _json_schema(req.text)
        refuse_schema_with_tools(bool(req.tools), schema, field="text.format", param="text")
        params = SamplingParams(
            max_tokens=req.max_output_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            logit_bias=logit_bias(req.logit_bias),
            json_schema=schema,
        )
        served: ServedModel = self._resolve(req.model)
        check_chat_size(len(messages), len(req.tools or ()), "input")  # the stored conversation counts too
        engine = served.engine
        parallel = req.parallel_tool_calls is not False
        thinking = _thinking(req.reasoning, engine.reasoning_format is not None)
        template_kwargs = None
        if req.reasoning is not None and req.reasoning.effort is not None:  # gpt-oss's template takes it itself
            thinking, template_kwargs = effort_for(req.reasoning.effort, engine, None, "reasoning.effort")
        thinking = request_thinking(thinking, None, self._reasoning_budget, engine)

        def start() -> ChatStream:
            # request-sized (every message and tool): in a worker, never on the event loop
            tools, choice = request_tools(req.tools, req.tool_choice)
            return engine.stream_chat(
                messages,
                params,
                tools=tools,
                tool_choice=choice,
                parallel_tool_calls=parallel,
                thinking=thinking,
                chat_template_kwargs=template_kwargs,
            )

        try:
            chat = await self._workers.run(start, large=is_large(len(messages), len(req.tools or ())))
        except InvalidRequestError as exc:
            raise chat_refusal(exc, "input", thinking="reasoning.effort") from None
        turn = _Turn(req, served, chat, conversation, self.store, self.new_id())
        observer = self._metrics.observer(served.name, served.engine)
        if req.stream:
            return EventStream(
                drive(chat.tokens, _ResponseEvents(turn), include_usage=False, observer=observer),
                write_timeout=self._write_timeout,
                streams=[chat.tokens],
                backlog=self._backlog,
                keepalive=self._sse_keepalive,
            )
        tokens = await unless_disconnected(request.receive, functools.partial(collect, chat.tokens, observer))
        finish = finish_reason(chat.tokens.finish_reason)
        for tok in tokens:
            chat.feed(tok)
        chat.close_parser()
        final = chat.tokens.final
        return json_response(turn.finish(final.usage if final is not None else None, finish))

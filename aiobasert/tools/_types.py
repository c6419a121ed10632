"""The values of a tool-aware chat turn: tools, calls, deltas, the reply.

No `from __future__ import annotations` here: these Structs are re-exported as
names of `aiobasert.tools` (their `__module__`), and msgspec resolves string annotations in
that module, which does not hold every name they use; real annotations need no lookup. (The
methods' return annotations stay strings, so their signatures read as they did.)"""

from typing import Any, Literal

import msgspec

from .._core.schema import closed_objects
from ..errors import InvalidRequestError
from ..reasoning import ReasoningDelta
from ..types import FinishReason, Timing, Usage


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call. `parameters` is the JSON Schema of its
    arguments (an object schema; None = no arguments)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def as_openai(self) -> "dict[str, Any]":
        """`{"type": "function", "function": {...}}`, as chat templates and clients expect."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}

    def arguments_schema(self) -> "dict[str, Any]":
        """The schema the arguments are generated under (an object, compact JSON):
        `parameters` with its objects closed (`closed_objects`)."""
        default: dict[str, Any] = {"type": "object", "properties": {}}
        schema = dict(self.parameters) if self.parameters is not None else default
        if schema.get("type") is None:
            schema["type"] = "object"
        if schema.get("type") != "object":
            raise InvalidRequestError(f"tool {self.name!r}: parameters must be an object schema")
        schema = dict(closed_objects(schema))
        guidance = dict(schema.get("x-guidance") or {})
        guidance.setdefault("whitespace_flexible", False)
        schema["x-guidance"] = guidance
        return schema


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One call the model made. `arguments` is the JSON text exactly as generated
    (it validates against the tool's schema); `json.loads` it for a dict."""

    id: str
    name: str
    arguments: str
    type: Literal["function"] = "function"


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a streamed call: the first delta of call `index` carries its
    `id` and `name` (and `arguments=""`), the next ones argument fragments.
    The fragments of one call concatenate to its `ToolCall.arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class TextDelta(msgspec.Struct, frozen=True):
    """Assistant text."""

    text: str


ChatDelta = TextDelta | ToolCallDelta | ReasoningDelta

ToolChoice = Literal["auto", "none", "required"] | str
"""`"auto"`, `"none"`, `"required"`, or the name of the function that must be called."""


class ChatReply(msgspec.Struct, frozen=True, kw_only=True):
    """A whole assistant turn: text and/or tool calls (`await engine.stream_chat(...)`).

    `finish_reason` is "tool_calls" when the turn ended after calls, else the
    engine's ("stop", "length", ...)."""

    request_id: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason | Literal["tool_calls"]
    usage: Usage
    timing: Timing
    reasoning: str | None = None
    """A reasoning model's thought (its tags and edge whitespace left out); None when the turn
    had none (a model that does not reason, or thinking off). `usage.reasoning_tokens` counts it."""

    @property
    def text(self) -> str:
        """The turn's text (`content`), under `Completion`'s name: `(await engine.chat(...)).text`
        reads the same with and without `tools`."""
        return self.content

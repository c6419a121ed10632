"""Tool calling: typed tools and calls, prompt rendering, the call grammar, and
an incremental parser that turns generated text into text and tool-call deltas.

```python
weather = Tool(name="get_weather", parameters={"type": "object",
               "properties": {"city": {"type": "string"}}, "required": ["city"]})
reply = await engine.chat(messages, tools=[weather], tool_choice="required")
for call in reply.tool_calls:            # ToolCall(id, name, arguments: JSON text)
    print(call.name, json.loads(call.arguments))
async for delta in engine.stream_chat(messages, tools=[weather]):
    ...                                   # TextDelta | ToolCallDelta
```

Each model calls tools in its family's format, chosen once from its chat template
(`aiobasert.tool_formats`: `engine.tool_format`): Llama 3.x's templates ask for
bare JSON, ``{"name": "get_weather", "parameters": {"city":"Paris"}}`` as the
whole reply (its grammar and parser live in tool_formats); every other model
uses the Hermes / Qwen format, whose grammar and parser are this module's::

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

(several calls are separated by one newline). Tools are rendered into the
prompt by the model's own chat template when it knows about tools (it mentions
`tools`), otherwise by the default below: a system-prompt tool list
(`DEFAULT_TOOL_PROMPT`), assistant calls in the model's format (Hermes, which
that prompt asks for), and tool results as user turns wrapped in
`<tool_response>` tags.

The output is constrained by a grammar, never filtered afterwards. For Hermes, the engine's
own grammar backend is tried first with an xgrammar STRUCTURAL TAG
(`tool_structural_tag`: free text, and after the trigger `<tool_call>` one of
the allowed calls, its arguments under the tool's schema); where the engine
cannot build it (no `baseRT_grammar_create_from_structural_tag`, or a schema it
cannot enforce) llguidance runs the Lark grammar of `tool_grammar` (`%json` for
each tool's arguments) on the host. Both enforce:

- `tool_choice="auto"`: text, and any call the model starts is well-formed
  (the structural tag lets text surround calls; the Lark grammar is stricter:
  either text without `<tool_call>`, or calls from the first character on);
- `"required"` / a named function: only well-formed calls (of that function),
  at least one;
- `"none"`: text without `<tool_call>`;
- `parallel_tool_calls=False`: at most one call (the structural tag's
  `stop_after_first`: only an end token may follow it).

Arguments always validate against the tool's JSON Schema, and hold only the properties
it declares (`closed_objects`: an absent `additionalProperties` is read as false). The grammar masks
the lane's logits row each step, so tool lanes keep batching with free lanes.
"""

from __future__ import annotations

import contextlib
import json
import re
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from .._core.schema import closed_objects
from ..chat import _as_message, check_message_count, encodable_content, render_with_sentinels, sentinel
from ..errors import InvalidRequestError, StreamBusyError, WrongEventLoopError
from ..types import ChatMessage, FinishReason, Timing, Token, Usage
from ._syntax import (
    ARGS_OPEN,
    CALL_CLOSE,
    CALL_END,
    CALL_OPEN,
    CALL_SEP,
    NAME_OPEN,
    JsonExtent,
    new_call_id,
    turn_grammar,
)

if TYPE_CHECKING:
    from ..streams import TokenStream

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "DEFAULT_TOOL_PROMPT",
    "MAX_TOOLS",
    "CallParser",
    "ChatReply",
    "ChatStream",
    "TextDelta",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolChoice",
    "ToolFormat",
    "parse_tool_choice",
    "parse_tools",
    "render_tool_chat",
    "tool_grammar",
    "tool_structural_tag",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

MAX_TOOLS = 128
"""The most tools one request may define (OpenAI's own limit). Each is measured, listed in
the prompt and compiled into the call grammar: checked first, before any of that is paid."""

DEFAULT_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""The system-prompt tool list used when the model's chat template has no tool support."""


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call. `parameters` is the JSON Schema of its
    arguments (an object schema; None = no arguments)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def as_openai(self) -> dict[str, Any]:
        """`{"type": "function", "function": {...}}`, as chat templates and clients expect."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}

    def arguments_schema(self) -> dict[str, Any]:
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


ChatDelta = TextDelta | ToolCallDelta

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

    @property
    def text(self) -> str:
        """The turn's text (`content`), under `Completion`'s name: `(await engine.chat(...)).text`
        reads the same with and without `tools`."""
        return self.content


# ---- a tool-call format: what a turn is rendered, constrained and parsed through -------------


class CallParser(Protocol):
    """What a ChatStream feeds its generated text through (ToolCallParser, Llama3JsonParser)."""

    calls: list[ToolCall]

    def feed(self, text: str) -> list[ChatDelta]: ...

    def close(self) -> list[ChatDelta]: ...

    @property
    def content(self) -> str: ...


class ToolFormat(ABC):
    """One family's tool-call format. Declared here, where turns are rendered and parsed
    through it; the formats themselves (Hermes, Llama 3's bare JSON) and the choice of one
    per chat template live in aiobasert.tool_formats."""

    name: str
    trigger: str
    """What starts a call in the generated text."""

    @abstractmethod
    def grammar(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> str | None:
        """The Lark grammar (llguidance) of an assistant turn under `choice`; None without tools."""

    @abstractmethod
    def structural_tag(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> dict[str, Any] | None:
        """The same contract as an xgrammar structural tag for the engine's grammar backend,
        or None where a structural tag cannot say it (the Lark grammar then runs on the host)."""

    @abstractmethod
    def parser(self, *, forced: bool = False) -> CallParser:
        """A fresh incremental parser of one turn (`forced`: only calls were allowed)."""

    @abstractmethod
    def call_text(self, calls: Sequence[ToolCall]) -> str:
        """A past assistant turn's calls as the model writes them, for a template that
        does not render `tool_calls` itself."""

    def shape_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the model's own template expects it, when it renders tools
        itself (default: unchanged)."""
        return messages

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"


# ---- input normalisation -------------------------------------------------------------------


def parse_tools(tools: Sequence[Tool | Mapping[str, Any]] | None) -> list[Tool]:
    """`Tool`s from Tool objects or OpenAI dicts (`{"type": "function", "function": {...}}`
    or the flat `{"name", "description", "parameters"}`); names must be unique; at most
    `MAX_TOOLS`."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: {len(tools)} tools; at most {MAX_TOOLS} per request")
    out: list[Tool] = []
    names: set[str] = set()
    for i, t in enumerate(tools or ()):
        if isinstance(t, Tool):
            tool = t
        elif isinstance(t, Mapping):
            fn = t.get("function") if t.get("type", "function") == "function" and "function" in t else t
            if t.get("type", "function") != "function":
                raise InvalidRequestError(f"tools[{i}]: only function tools are supported, not {t.get('type')!r}")
            if not isinstance(fn, Mapping):
                raise InvalidRequestError(f"tools[{i}]: function must be an object")
            try:
                tool = msgspec.convert(
                    {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}, Tool
                )
            except msgspec.ValidationError as exc:
                raise InvalidRequestError(f"tools[{i}]: {exc}") from None
        else:
            raise InvalidRequestError(f"tools[{i}] must be a Tool or a mapping, not {type(t).__name__}")
        if not _NAME_RE.match(tool.name):
            raise InvalidRequestError(f"tools[{i}]: name {tool.name!r} must match [A-Za-z0-9_-]{{1,64}}")
        if tool.name in names:
            raise InvalidRequestError(f"tools[{i}]: duplicate tool name {tool.name!r}")
        tool.arguments_schema()  # an object schema, or InvalidRequestError
        out.append(tool)
        names.add(tool.name)
    return out


def parse_tool_choice(choice: ToolChoice | Mapping[str, Any] | None, tools: Sequence[Tool]) -> str:
    """Normalise `tool_choice` ("auto" default; OpenAI's `{"type": "function",
    "function": {"name": ...}}` form accepted) to "auto" / "none" / "required" /
    a tool name, checked against `tools`."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError('tool_choice must be "auto", "none", "required" or {"type": "function", ...}')
        choice = name
        named = True
    else:
        named = choice not in ("auto", "none", "required")
    if not isinstance(choice, str):
        raise InvalidRequestError("tool_choice must be a string or an object")
    if named:
        if not any(t.name == choice for t in tools):
            raise InvalidRequestError(f"tool_choice names {choice!r}, which is not among the tools")
        return choice
    if choice in ("auto", "required") and not tools:
        raise InvalidRequestError(f'tool_choice "{choice}" needs tools')
    return choice


def check_schema_and_tools(has_tools: bool, json_schema: object, *, field: str = "json_schema") -> None:
    """The one rule for a JSON schema beside tools, which the SDK (`Engine.stream_chat`,
    `Engine.stream_turn`) and the server's chat completions and Responses all apply: refused,
    whatever `tool_choice` says. A stream follows one grammar, and a turn with tools has one
    even under "none" (text that spells no call). `field` names the caller's own schema field
    (`json_schema`, `response_format`, `text.format`); cheap, so checked before anything is paid."""
    if has_tools and json_schema is not None:
        raise InvalidRequestError(f"{field} cannot be combined with tools")


# ---- the grammar ---------------------------------------------------------------------------


def tool_grammar(tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> str | None:
    """The Lark grammar (llguidance dialect) of an assistant turn under `choice`;
    None when nothing needs constraining (no tools)."""
    return turn_grammar(
        tools,
        choice,
        parallel=parallel,
        text=r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/",
        head=lambda name: CALL_OPEN + NAME_OPEN + name + ARGS_OPEN,
        tail=CALL_END,
        separator=CALL_SEP,
    )


def tool_structural_tag(tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> dict[str, Any] | None:
    """The xgrammar structural tag of an assistant turn under `choice`, for the
    engine's own grammar backend; None without tools.

    Each allowed tool is a tag: its call head (forced up to the arguments), the
    arguments under the tool's schema, the call's end. "auto": `triggered_tags`
    (free text; `<tool_call>` starts a call); "required" / a named function:
    `tags_with_separator` (calls only, at least one, separated by a newline, as
    the Lark grammar); `parallel=False`: `stop_after_first` (only an end token
    after the call); "none": `any_text` that excludes `<tool_call>`."""
    if not tools:
        return None
    trigger = CALL_OPEN.rstrip("\n")
    if choice == "none":
        return {"type": "structural_tag", "format": {"type": "any_text", "excludes": [trigger]}}
    allowed = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    tags = []
    for tool in allowed:
        schema = tool.arguments_schema()
        guidance = schema.pop("x-guidance", None)
        if guidance and guidance != {"whitespace_flexible": False}:
            # options only the host honours stay: an engine that cannot, refuses the tag
            schema["x-guidance"] = guidance
        tags.append(
            {
                "type": "tag",
                "begin": CALL_OPEN + NAME_OPEN + tool.name + ARGS_OPEN,
                "content": {"type": "json_schema", "json_schema": schema},
                "end": CALL_END,
            }
        )
    fmt: dict[str, Any]
    if choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": CALL_SEP, "at_least_one": True}
    fmt["stop_after_first"] = not parallel
    return {"type": "structural_tag", "format": fmt}


# ---- prompt rendering ----------------------------------------------------------------------


def _message_fields(m: Any, i: int) -> dict[str, Any]:
    """A message as a dict: role, content, and the tool fields (tool_calls, tool_call_id, name)."""
    if isinstance(m, ChatMessage):
        return {"role": m.role, "content": m.content}
    if not isinstance(m, Mapping):
        raise InvalidRequestError(f"message {i} must be a ChatMessage or a mapping, not {type(m).__name__}")
    out: dict[str, Any] = {"role": m.get("role"), "content": m.get("content")}
    if out["content"] is None:
        out["content"] = ""
    calls = m.get("tool_calls")
    if calls:
        parsed: list[ToolCall] = []
        for j, c in enumerate(calls):
            if isinstance(c, ToolCall):
                parsed.append(c)
                continue
            fn = c.get("function", c) if isinstance(c, Mapping) else None
            args = fn.get("arguments", "{}") if isinstance(fn, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(f"message {i}: tool_calls[{j}] needs a function name")
            if not isinstance(args, str):
                args = json.dumps(args)
            parsed.append(ToolCall(id=str(c.get("id") or f"call_{i}_{j}"), name=fn["name"], arguments=args))
        out["tool_calls"] = parsed
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = str(m[key])
    if out["role"] == "assistant" and isinstance(out["content"], str):  # the model's words fed back
        out["content"] = encodable_content("assistant", out["content"], i)
        if "tool_calls" in out:
            out["tool_calls"] = [
                msgspec.structs.replace(c, arguments=encodable_content("assistant", c.arguments, i))
                for c in out["tool_calls"]
            ]
    return out


def template_supports_tools(template: str) -> bool:
    """True when a chat template renders a `tools` variable itself."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def render_tool_chat(
    template: str,
    messages: Sequence[Any],
    tools: Sequence[Tool],
    *,
    tool_format: ToolFormat,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> list[tuple[str, bool]]:
    """Render a conversation with tools (and tool turns) into encodable pieces,
    with the model's template when it supports tools, else the default format.
    `tool_format`: how the model writes calls (the template's is
    `aiobasert.tool_formats.tool_format_for(template)`, `Engine.tool_format`)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} messages")
    check_message_count(messages)
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: {len(tools)} tools; at most {MAX_TOOLS} per request")
    msgs = [_message_fields(m, i) for i, m in enumerate(messages)]
    for i, m in enumerate(msgs):
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise InvalidRequestError(f"message {i} needs a string 'role' and 'content'")
        _as_message(m, i)  # a known role (it is framing), no NUL in the content
        if any("\x00" in m.get(key, "") for key in ("name", "tool_call_id")) or any(
            "\x00" in c.id for c in m.get("tool_calls", ())
        ):
            raise InvalidRequestError(f"message {i} contains a NUL character")
    fmt = tool_format
    if template_supports_tools(template):
        msgs = fmt.shape_messages(msgs)
        return _render_with_template(template, msgs, tools, add_generation_prompt, bos_token, eos_token)
    plain: list[dict[str, Any]] = []
    if tools:
        listing = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t.as_openai()) for t in tools))
        if msgs[0]["role"] in ("system", "developer"):
            plain.append({**msgs[0], "role": "system", "content": msgs[0]["content"] + "\n\n" + listing})
            msgs = msgs[1:]
        else:
            plain.append({"role": "system", "content": listing})
    for m in msgs:
        if m["role"] == "tool":
            plain.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            parts.append(fmt.call_text(m["tool_calls"]))
            plain.append({"role": m["role"], "content": CALL_SEP.join(parts), **_name_of(m)})
        else:
            plain.append({"role": m["role"], "content": m["content"], **_name_of(m)})
    # the template sees each turn's text and `name` (as client text), as with a tool-aware one
    return _render_with_template(template, plain, [], add_generation_prompt, bos_token, eos_token)


def _name_of(m: dict[str, Any]) -> dict[str, Any]:
    return {"name": m["name"]} if "name" in m else {}


_FORGERY = re.compile(r"<\||\|>|<tool_call>|</tool_call>")


def _render_with_template(
    template: str,
    msgs: list[dict[str, Any]],
    tools: Sequence[Tool],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
) -> list[tuple[str, bool]]:
    # Client text becomes content pieces (never parsed for markers), as in
    # chat.render_chat: message contents, and the free-form strings a template
    # may print next to them (`name`, `tool_call_id`, `tool_calls[].id`), so
    # none of them can forge a turn. Tool definitions and call arguments are
    # structured values a template re-serialises (tojson), which a placeholder
    # would not survive: they must not carry marker-like text instead.
    contents: list[str] = []

    def protected(text: str) -> str:
        contents.append(text)
        return sentinel(len(contents) - 1, text)

    ctx: list[dict[str, Any]] = []
    for m in msgs:
        entry: dict[str, Any] = {"role": m["role"], "content": protected(m["content"])}
        if m.get("tool_calls"):
            entry["tool_calls"] = []
            for c in m["tool_calls"]:
                if _FORGERY.search(c.name + c.arguments):
                    raise InvalidRequestError("tool call arguments must not contain chat markers")
                try:
                    args = json.loads(c.arguments)
                except ValueError:
                    raise InvalidRequestError(f"tool call {c.id}: arguments are not JSON") from None
                entry["tool_calls"].append(
                    {"id": protected(c.id), "type": "function", "function": {"name": c.name, "arguments": args}}
                )
        for key in ("tool_call_id", "name"):
            if key in m:
                entry[key] = protected(m[key])
        ctx.append(entry)
    tool_dicts = [t.as_openai() for t in tools]
    if _FORGERY.search(json.dumps(tool_dicts)):
        raise InvalidRequestError("tool definitions must not contain chat markers")
    return render_with_sentinels(
        template,
        ctx,
        contents,
        tools=tool_dicts or None,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )


# ---- output parsing -------------------------------------------------------------------------


class ToolCallParser:
    """Incremental: `feed(text)` returns the deltas the new text completes, `close()`
    the rest. Text that may still become `<tool_call>` is held back until it
    cannot. Argument fragments are released as soon as they are generated; a
    small JSON scanner finds where the arguments end. Assumes the grammar's exact
    call format; anything else is passed through as text.

    forced: the grammar admits only calls (`tool_choice` "required" or a named
    function), so text held back as a possible call opener is a call's framing cut
    off by `max_tokens`: it is dropped at `close()`, never reported as text."""

    def __init__(self, *, forced: bool = False) -> None:
        self._forced = forced
        self._closed = False
        self._buf = ""
        self._mode: Literal["start", "text", "head", "args", "tail", "between"] = "start"
        self._index = -1
        self._json = JsonExtent()
        self.calls: list[ToolCall] = []
        self._name = ""
        self._id = ""
        self._args: list[str] = []
        self.text: list[str] = []

    def feed(self, text: str) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        self._buf += text
        while self._buf:
            before = (self._mode, len(self._buf))
            self._step(out)
            if (self._mode, len(self._buf)) == before:
                break  # needs more text
        return out

    def close(self) -> list[ChatDelta]:
        """The end of the output: flush held text (an unfinished call keeps its fragments).
        Idempotent: a second close reports nothing (and adds no call)."""
        out: list[ChatDelta] = []
        if self._closed:
            return out
        self._closed = True
        if self._mode == "args":
            self._finish_call()
        elif self._buf and self._mode in ("start", "text") and not self._forced:
            self._emit_text(self._buf, out)
        # "head" / "between" / "tail": a call's framing cut off (max_tokens): nothing to report
        self._buf = ""
        return out

    @property
    def content(self) -> str:
        """The text parsed so far (outside calls)."""
        return "".join(self.text)

    def _emit_text(self, text: str, out: list[ChatDelta]) -> None:
        if text:
            self.text.append(text)
            out.append(TextDelta(text))

    def _step(self, out: list[ChatDelta]) -> None:
        buf, opener = self._buf, CALL_OPEN + NAME_OPEN
        if self._mode in ("start", "between"):
            if self._mode == "between" and buf.startswith(CALL_SEP + opener[:1]):
                buf = self._buf = buf[len(CALL_SEP) :]
            if buf.startswith(opener):
                self._buf = buf[len(opener) :]
                self._mode = "head"
            elif opener.startswith(buf) or (self._mode == "between" and (CALL_SEP + opener).startswith(buf)):
                return  # may still become a call
            else:
                self._mode = "text"
        elif self._mode == "text":
            # a call may follow text (the structural tag allows it): text up to an
            # opener is released, a tail that may still become one is held back
            at = buf.find(opener)
            if at >= 0:
                self._emit_text(buf[:at], out)
                self._buf = buf[at + len(opener) :]
                self._mode = "head"
                return
            keep = next((k for k in range(min(len(buf), len(opener) - 1), 0, -1) if buf.endswith(opener[:k])), 0)
            self._emit_text(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep :]
        elif self._mode == "head":
            end = buf.find(ARGS_OPEN)
            if end < 0:
                return
            self._name, self._buf = buf[:end], buf[end + len(ARGS_OPEN) :]
            self._index += 1
            self._id = new_call_id()
            self._args = []
            self._json = JsonExtent()
            out.append(ToolCallDelta(index=self._index, id=self._id, name=self._name, arguments=""))
            self._mode = "args"
        elif self._mode == "args":
            n = self._scan(buf)
            if n:
                self._args.append(buf[:n])
                out.append(ToolCallDelta(index=self._index, arguments=buf[:n]))
                self._buf = buf[n:]
            if self._json.depth == 0 and self._args:
                self._finish_call()
                self._mode = "tail"
        elif self._mode == "tail":
            if buf.startswith(CALL_END):
                self._buf = buf[len(CALL_END) :]
                self._mode = "between"
            elif not CALL_END.startswith(buf):
                self._mode = "text"  # not the grammar's format: keep it as text

    def _scan(self, buf: str) -> int:
        """How many chars of `buf` belong to the arguments (stops after the closing bracket)."""
        end = self._json.end(buf)
        return len(buf) if end is None else end

    def _finish_call(self) -> None:
        self.calls.append(ToolCall(id=self._id, name=self._name, arguments="".join(self._args)))
        self._args = []


class ChatTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A chat turn rendered and constrained once (`Engine.prepare_chat`), to be streamed
    any number of times (`Engine.stream_turn`: one per choice of an n > 1 request).

    Preparing is the request-sized part (rendering every message and tool, the call
    grammar's text); it reads only the model's immutable template, tokens and call format,
    so a server runs it in a worker thread, where it delays only its own request."""

    pieces: list[tuple[str, bool]]
    """The rendered prompt: (text, is_content) pieces, as `baseRT_encode_pieces` takes them."""
    lark: str | None
    """The turn's Lark grammar (llguidance); None without tools."""
    structural_tag: str | None
    """The same contract as an xgrammar structural tag (JSON text), where one can say it."""
    parse_calls: bool
    """Whether the output may hold calls (tools, and `tool_choice` not "none")."""
    forced: bool
    """Only calls may be generated ("required" or a named function)."""
    tool_format: ToolFormat


def check_tools(tools: Sequence[Tool | Mapping[str, Any]] | None) -> None:
    """Refuse tools whose preparation would cost more than a request may make the server pay,
    before any of it is paid: more than `MAX_TOOLS`, or a schema past `json_schema`'s caps
    (measured iteratively: a schema reaches recursive JSON encoders and the grammar compilers)."""
    from ..types import schema_problem

    if tools is None:
        return
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"tools must be a list of tools, not {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: {len(tools)} tools; at most {MAX_TOOLS} per request")
    for i, tool in enumerate(tools):
        data = tool if isinstance(tool, Mapping) else getattr(tool, "as_openai", None)
        if callable(data):
            data = data()
        problem = schema_problem(data) if isinstance(data, Mapping) else None
        if problem is not None:
            raise InvalidRequestError(f"tools[{i}] {problem}")


def prepare_chat_turn(
    template: str,
    messages: Sequence[Any],
    *,
    tool_format: ToolFormat,
    tools: Sequence[Tool | Mapping[str, Any]] | None,
    tool_choice: ToolChoice | Mapping[str, Any] | None,
    parallel: bool,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> ChatTurn:
    """Render and constrain one tool-aware chat turn with the model's chat `template`, in its
    tool-call format (`Engine.tool_format`); `bos_token` / `eos_token` are the model's
    (`ModelInfo`), as the template may print them. Bounded before it is paid: more than
    `MAX_CHAT_MESSAGES` messages or `MAX_TOOLS` tools are refused before anything is
    rendered. Safe to run in a worker thread (it touches no engine and no event loop)."""
    check_message_count(messages)
    check_tools(tools)
    fmt = tool_format
    parsed = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, parsed)
    forced = choice != "none" and choice != "auto"
    if forced and choice != "required":
        parallel = False  # a named function is called exactly once (as OpenAI and vLLM do)
    lark = fmt.grammar(parsed, choice, parallel=parallel)
    tag = fmt.structural_tag(parsed, choice, parallel=parallel)
    pieces = render_tool_chat(
        template,
        messages,
        parsed,  # listed under "none" too: the model knows them, the grammar forbids calls
        tool_format=fmt,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    return ChatTurn(
        pieces=pieces,
        lark=lark,
        structural_tag=json.dumps(tag) if tag is not None else None,
        parse_calls=choice != "none" and bool(parsed),
        forced=forced,
        tool_format=fmt,
    )


def finish_reason_with_tools(reason: FinishReason | None, calls: Sequence[ToolCall]) -> Any:
    """OpenAI's rule: a turn that ended normally after calls finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


class _ChatIteration:
    """What `async for delta in chat` iterates (as `streams._Iteration` for tokens):
    a `break` or an exception out of the loop drops it at once, and its `__del__`
    frees the lane then, not when an async generator would finally be closed."""

    __slots__ = ("__weakref__", "_chat", "_done", "_pending")

    def __init__(self, chat: ChatStream) -> None:
        self._chat = chat
        self._pending: deque[ChatDelta] = deque()
        self._done = False

    def __aiter__(self) -> _ChatIteration:
        return self

    async def __anext__(self) -> ChatDelta:
        chat = self._chat
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                tok = await chat.tokens._next()
            except StopAsyncIteration:
                self._done = True
                self._pending.extend(chat.close_parser())
                continue
            except BaseException as exc:
                # as streams._Iteration: a misuse (a second reader, a foreign loop) must not
                # end the stream for its rightful reader; a cancellation already freed the lane
                if isinstance(exc, (StreamBusyError, WrongEventLoopError)) or chat.tokens._ended:
                    self._done = True
                raise
            self._pending.extend(chat.feed(tok))
        return self._pending.popleft()

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # a finalizer must not raise
                self._chat.tokens._abandon()


class ChatStream:
    """`async for delta in stream` yields `TextDelta` / `ToolCallDelta`;
    `await stream` gives the `ChatReply`. Wraps the turn's `TokenStream`
    (`stream.tokens`); closing one closes the other. Leaving the loop early
    (`break`, an exception) frees the lane at once, as for a `TokenStream`.
    `tool_format`: the model's call format the text is parsed in (default Hermes;
    `engine.stream_chat` passes `engine.tool_format`)."""

    def __init__(
        self, tokens: TokenStream, *, parse_calls: bool, forced: bool = False, tool_format: ToolFormat | None = None
    ) -> None:
        self.tokens = tokens
        self._parser: CallParser | None = None
        if parse_calls:  # in the model's call format (default Hermes)
            self._parser = tool_format.parser(forced=forced) if tool_format else ToolCallParser(forced=forced)
        self._text: list[str] = []
        self._reply: ChatReply | None = None

    def __aiter__(self) -> _ChatIteration:
        return _ChatIteration(self)

    def feed(self, tok: Token) -> list[ChatDelta]:
        """The deltas one token completes (for callers that walk the tokens themselves)."""
        if self._parser is None:
            self._text.append(tok.text)
            return [TextDelta(tok.text)] if tok.text else []
        return self._parser.feed(tok.text)

    def close_parser(self) -> list[ChatDelta]:
        """The deltas held back until the end (call after the last `feed`; idempotent)."""
        return self._parser.close() if self._parser is not None else []

    @property
    def content(self) -> str:
        """The assistant text so far (without tool calls)."""
        return self._parser.content if self._parser is not None else "".join(self._text)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return list(self._parser.calls) if self._parser is not None else []

    async def aclose(self) -> None:
        """Stop the turn (its lane is freed before the engine's next step)."""
        await self.tokens.aclose()

    def reply(self) -> ChatReply:
        """The turn so far as a `ChatReply` (call once the stream has ended)."""
        final = self.tokens.final
        if final is None:
            raise InvalidRequestError("the chat stream has not finished")
        return ChatReply(
            request_id=self.tokens.request_id,
            content=self.content,
            tool_calls=self.tool_calls,
            finish_reason=finish_reason_with_tools(final.finish_reason, self.tool_calls),
            usage=final.usage,
            timing=final.timing,
        )

    async def collect(self) -> ChatReply:
        """Run the turn to its end: the `ChatReply` (`await stream` does the same).
        Awaiting again returns the same reply; a stream closed before its request
        finished raises `StreamClosedError`, a failed one its error (as `TokenStream`)."""
        if self._reply is not None:
            return self._reply
        async for _ in self:
            pass
        await self.tokens.collect()  # raises the stream's error, or StreamClosedError
        self._reply = self.reply()
        return self._reply

    def __await__(self) -> Generator[Any, None, ChatReply]:
        return self.collect().__await__()

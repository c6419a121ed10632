"""gpt-oss's tool calls in OpenAI's Harmony framing (`HARMONY_TOOLS`, "harmony").

A call is a message of its own on the commentary channel, addressed to the function, its body the
arguments as JSON, ended by `<|call|>` (which ends the turn: one call a turn):

    <|channel|>analysis<|message|>THOUGHT<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(one line: the break is this page's).

The recipient may also stand in the role's header (`<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>`: how gpt-oss's template renders past calls); both are read. A message to another recipient
(`to=python`, `to=container.exec`: gpt-oss's built-in tools) is neither a call nor text. The answer is the
final channel's body (and a commentary preamble's), as `aiobasert.reasoning.harmony` splits it; llama.cpp's
tests/test-chat.cpp gpt-oss cases are the parser's oracle (tests/sdk/test_tools_harmony.py).

gpt-oss's template renders the tools (its `functions` namespace in the developer message) and past calls and
their results itself. The grammar starts after the thought (the thought gate writes `<|end|><|start|>assistant`
after it: `after_thought`), so it is the one message that follows: the final answer or a call, its arguments
under the tool's schema. Its markers are special tokens, which only the host's Lark grammar (llguidance) names:
there is no structural tag. The parser reads the text with its framing (`reads_framing`), not the answer alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from ..reasoning.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE, START, HarmonySplitter
from ._format import CallParser, ToolFormat, register_tool_format, template_supports_tools
from ._syntax import lark_str, new_call_id
from ._types import ChatDelta, TextDelta, Tool, ToolCall, ToolCallDelta

__all__ = ["HARMONY_TOOLS", "HarmonyCallParser", "HarmonyToolFormat"]

_FUNCTIONS: Final = "functions."


def _call_head(name: str) -> str:
    """What the model writes between `<|channel|>` and `<|constrain|>` to call `name`."""
    return f"commentary to={_FUNCTIONS}{name} "


def _recipient_function(header: str) -> str | None:
    """The function a message's header addresses (`to=functions.NAME`), or None (no recipient, another one)."""
    words = header.replace(CHANNEL, " ").replace(CONSTRAIN, " ").split()
    to = next((w[3:] for w in words if w.startswith("to=") and w != "to=assistant"), None)
    return to[len(_FUNCTIONS) :] if to is not None and to.startswith(_FUNCTIONS) and len(to) > len(_FUNCTIONS) else None


class _FramedSplitter(HarmonySplitter):
    """The channel splitter that also reports call messages: ("open", function or ""), ("call", text), ("end", "")."""

    def _emit(self, out: list[Any], text: str) -> None:
        if self._kind == "call":
            if text:
                out.append(("call", text))
        else:
            super()._emit(out, text)

    def _opened(self, out: list[Any]) -> None:
        if self._kind == "call":
            out.append(("open", _recipient_function(self.header) or ""))

    def _ended(self, out: list[Any]) -> None:
        if self._kind == "call":
            out.append(("end", ""))


class HarmonyCallParser:
    """Incremental parser of a gpt-oss turn (a `CallParser`): the answer as `TextDelta`s, each call to a
    function as `ToolCallDelta`s while it streams (its id and name once its header is read, then its
    arguments as they come, as the Hermes parser does), the thought left to the chat stream's splitter.

    The arguments are kept as written (the grammar held them to the tool's schema); a call cut off by
    `max_tokens` keeps the arguments written so far (finish_reason "length" says so). Without a grammar
    (a model that ignored it cannot happen; a parser fed by hand can) arguments that are not JSON are
    reported all the same: the client sees what the model wrote."""

    def __init__(self, *, forced: bool = False, open_at_start: bool = False) -> None:
        self._forced = forced
        self._splitter = _FramedSplitter(open_at_start=open_at_start)
        self._name: str | None = None  # the call being read: its function ("" for another recipient)
        self._id = ""
        self._args: list[str] = []
        self._closed = False
        self.calls: list[ToolCall] = []
        self.text: list[str] = []

    @property
    def content(self) -> str:
        """The answer parsed so far (outside calls)."""
        return "".join(self.text)

    def feed(self, text: str) -> list[ChatDelta]:
        if self._closed:
            return []
        return self._events(self._splitter.feed(text))

    def close(self) -> list[ChatDelta]:
        """The end of the output (idempotent)."""
        if self._closed:
            return []
        self._closed = True
        return self._events(self._splitter.close())

    def _events(self, events: Sequence[tuple[str, str]]) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        for kind, text in events:
            if kind == "content":
                self.text.append(text)
                out.append(TextDelta(text))
            elif kind == "open":
                self._name, self._args = text, []
                if text:
                    self._id = new_call_id()
                    out.append(ToolCallDelta(index=len(self.calls), id=self._id, name=text, arguments=""))
            elif kind == "call" and self._name:
                self._args.append(text)
                out.append(ToolCallDelta(index=len(self.calls), arguments=text))
            elif kind == "end":
                if self._name:
                    self.calls.append(ToolCall(id=self._id, name=self._name, arguments="".join(self._args)))
                self._name = None
            # "reasoning": the chat stream's own splitter reports the thought
        return out


class HarmonyToolFormat(ToolFormat):
    """Harmony's calls: a commentary message `to=functions.NAME`, JSON arguments, `<|call|>`.

    The grammar (after the thought) is one message after `<|channel|>`: "auto", the final answer or a
    call; "required" / a named function, a call (of that function); "none", the final answer. One call
    a turn (`<|call|>` ends it), so `parallel` changes nothing."""

    name = "harmony"
    trigger = CHANNEL + _call_head("").rstrip()
    reads_framing = True
    after_thought = START + "assistant"

    def detect(self, template: str) -> bool:
        # gpt-oss's template: it renders tools, and calls as commentary messages to the functions namespace
        return template_supports_tools(template) and CHANNEL + "commentary" in template and _FUNCTIONS in template

    def grammar(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> str | None:
        if not tools:
            return None
        final = f'"final" {MESSAGE} TEXT'
        lines = [f"start: {CHANNEL} answer", "TEXT: /(?s:.*)/"]
        if choice == "none":
            return "\n".join([*lines, f"answer: {final}"]) + "\n"
        allowed = [(i, t) for i, t in enumerate(tools) if choice in ("auto", "required") or t.name == choice]
        calls = " | ".join(f"call_{i}" for i, _ in allowed)
        lines.append(f"answer: {final} | {calls}" if choice == "auto" else f"answer: {calls}")
        for i, tool in allowed:
            lines.append(f'call_{i}: {lark_str(_call_head(tool.name))} {CONSTRAIN} "json" {MESSAGE} args_{i} {CALL}')
            lines.append(f"args_{i}: %json {json.dumps(tool.arguments_schema())}")
        return "\n".join(lines) + "\n"

    def structural_tag(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> dict[str, Any] | None:
        return None  # its markers are special tokens, which only the Lark grammar names

    def parser(self, *, forced: bool = False) -> CallParser:
        return HarmonyCallParser(forced=forced)

    def turn_parser(self, *, forced: bool = False, open_at_start: bool = False) -> CallParser:
        return HarmonyCallParser(forced=forced, open_at_start=open_at_start)

    def shape_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # gpt-oss's template writes each tool's description as a comment (`"// " + tool.description`):
        # a tool without one gets an empty one rather than a template error
        return [{**t, "function": {"description": "", **t["function"]}} for t in tools]

    def shape_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # gpt-oss's template renders only an assistant turn's first call (one call a turn, as the model
        # writes them): one turn per call, in order, the text and the thought with the first
        out: list[dict[str, Any]] = []
        for m in messages:
            calls = m.get("tool_calls") or []
            if len(calls) <= 1:
                out.append(m)
                continue
            first = {**m, "tool_calls": [calls[0]]}
            rest = {k: v for k, v in m.items() if k not in ("reasoning_content", "tool_calls")}
            out += [first, *({**rest, "content": "", "tool_calls": [c]} for c in calls[1:])]
        return out

    def call_text(self, calls: Sequence[ToolCall]) -> str:
        return "".join(
            f"{START}assistant{CHANNEL}{_call_head(c.name)}{CONSTRAIN}json{MESSAGE}{c.arguments}{CALL}" for c in calls
        )


HARMONY_TOOLS: Final = register_tool_format(HarmonyToolFormat())
"""The registered Harmony tool format."""

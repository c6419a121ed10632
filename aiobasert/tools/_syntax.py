"""What every tool-call format (aiobasert.tools' format modules) is built from: the Lark grammar
of a turn of calls and its xgrammar structural tag (each format gives its call's head, tail and
separator), the incremental JSON extent scanner, and call ids. It imports nothing of the package.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol


def lark_str(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


class CallableTool(Protocol):
    """What a grammar needs of a tool (aiobasert.tools.Tool)."""

    @property
    def name(self) -> str: ...

    def arguments_schema(self) -> dict[str, Any]: ...


def turn_grammar(
    tools: Sequence[CallableTool],
    choice: str,
    *,
    parallel: bool,
    text: str,
    head: Callable[[str], str],
    tail: str,
    separator: str,
) -> str | None:
    """The Lark grammar (llguidance dialect) of an assistant turn under `choice`, in a format
    whose call is `head(name)`, the arguments under the tool's schema, then `tail`, several
    separated by `separator`; `text` is the rule TEXT (what may stand where no call does).
    "auto": TEXT or calls; "required" / a tool's name: calls (of that tool); "none": TEXT;
    `parallel=False`: one call. None without tools (nothing to constrain)."""
    if not tools:
        return None
    if choice == "none":
        return f"start: TEXT\n{text}\n"
    # rules are numbered by the tool's place in `tools`, so a schema error's rule names it
    allowed = [(i, t) for i, t in enumerate(tools) if choice in ("auto", "required") or t.name == choice]
    lines = [f"start: TEXT | calls\n{text}" if choice == "auto" else "start: calls"]
    lines.append("calls: call" + (f" ({lark_str(separator)} call)*" if parallel else ""))
    lines.append("call: " + " | ".join(f"call_{i}" for i, _ in allowed))
    for i, tool in allowed:
        lines.append(f"call_{i}: {lark_str(head(tool.name))} args_{i} {lark_str(tail)}")
        lines.append(f"args_{i}: %json {json.dumps(tool.arguments_schema())}")
    return "\n".join(lines) + "\n"


def turn_structural_tag(
    tools: Sequence[CallableTool],
    choice: str,
    *,
    parallel: bool,
    head: Callable[[str], str],
    tail: str,
    separator: str,
    trigger: str,
) -> dict[str, Any] | None:
    """The xgrammar structural tag of an assistant turn under `choice`, for the engine's own
    grammar backend, in a format whose call is `head(name)`, the arguments, `tail`; None
    without tools.

    Each allowed tool is a tag: its call head (forced up to the arguments), the
    arguments under the tool's schema, the call's end. "auto": `triggered_tags`
    (free text; `trigger` starts a call); "required" / a named function:
    `tags_with_separator` (calls only, at least one, separated by `separator`, as
    the Lark grammar); `parallel=False`: `stop_after_first` (only an end token
    after the call); "none": `any_text` that excludes `trigger`."""
    if not tools:
        return None
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
                "begin": head(tool.name),
                "content": {"type": "json_schema", "json_schema": schema},
                "end": tail,
            }
        )
    fmt: dict[str, Any]
    if choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True}
    fmt["stop_after_first"] = not parallel
    return {"type": "structural_tag", "format": fmt}


_call_ids = itertools.count(1)
_call_prefix = os.urandom(4).hex()


def new_call_id() -> str:
    """A fresh `ToolCall.id`: unique in this process, and unlikely to repeat across processes."""
    return f"call_{_call_prefix}{next(_call_ids):06d}"


class JsonExtent:
    """Incremental: where a JSON object or array fed in pieces ends (its closing bracket), aware of
    strings and escapes; `depth` is the nesting still open."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_str = False
        self._escape = False

    def end(self, text: str, start: int = 0) -> int | None:
        """Scan text[start:] (the part not scanned before): just past the bracket that closes the
        value, or None if it is still open."""
        for j in range(start, len(text)):
            ch = text[j]
            if self._in_str:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return j + 1
        return None

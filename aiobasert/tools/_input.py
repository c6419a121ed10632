"""Input normalisation: tools and `tool_choice` as the SDK and the server accept them, bounded."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ..errors import InvalidRequestError
from ._types import Tool, ToolChoice

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

MAX_TOOLS = 128
"""The most tools one request may define (OpenAI's own limit). Each is measured, listed in
the prompt and compiled into the call grammar: checked first, before any of that is paid."""


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
    (`json_schema`, `response_format`, `text.format`, or another output constraint: `regex`, `choice`,
    `grammar`, `structured_outputs`); cheap, so checked before anything is paid."""
    if has_tools and json_schema is not None:
        raise InvalidRequestError(f"{field} cannot be combined with tools")


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

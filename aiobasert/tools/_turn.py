"""A chat turn rendered and constrained once (`prepare_chat_turn`).

No `from __future__ import annotations`: ChatTurn is re-exported as `aiobasert.tools.ChatTurn`
(see _types)."""

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ..chat import check_message_count
from ._format import ToolFormat
from ._input import check_tools, parse_tool_choice, parse_tools
from ._render import render_tool_chat
from ._types import Tool, ToolChoice


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

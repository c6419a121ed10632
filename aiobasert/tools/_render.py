"""Prompt rendering of a conversation with tools and tool turns."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from ..chat import _as_message, check_message_count, encodable_content, render_with_sentinels, sentinel
from ..errors import InvalidRequestError
from ..types import ChatMessage
from ._format import ToolFormat, template_supports_tools
from ._input import MAX_TOOLS
from ._types import Tool, ToolCall

DEFAULT_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""The system-prompt tool list used when the model's chat template has no tool support."""


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
    # a reasoning model's thought, sent back with its turn (`reasoning_content`, as vLLM and DeepSeek
    # name it, or `reasoning`): given to the template, which renders it or drops it
    thought = m.get("reasoning_content", m.get("reasoning"))
    if thought is not None and out["role"] == "assistant":
        if not isinstance(thought, str):
            raise InvalidRequestError(f"message {i}: reasoning_content must be a string")
        out["reasoning_content"] = encodable_content("assistant", thought, i)
    if out["role"] == "assistant" and isinstance(out["content"], str):  # the model's words fed back
        out["content"] = encodable_content("assistant", out["content"], i)
        if "tool_calls" in out:
            out["tool_calls"] = [
                msgspec.structs.replace(c, arguments=encodable_content("assistant", c.arguments, i))
                for c in out["tool_calls"]
            ]
    return out


def render_tool_chat(
    template: str,
    messages: Sequence[Any],
    tools: Sequence[Tool],
    *,
    tool_format: ToolFormat,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[tuple[str, bool]]:
    """Render a conversation with tools (and tool turns) into encodable pieces,
    with the model's template when it supports tools, else the default format.
    `tool_format`: how the model writes calls (the template's is
    `tool_format_for(template)`, `Engine.tool_format`); `template_kwargs`: more variables for
    the template (`chat.check_template_kwargs`, e.g. `enable_thinking`); `continue_final_message`:
    the final assistant turn is continued (`chat.render_with_sentinels`)."""
    extra = dict(template_kwargs or {})
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
    if continue_final_message and msgs[-1].get("tool_calls"):
        # its calls follow its text (or are it): a prompt cut after the text would drop them in silence
        raise InvalidRequestError(
            "continue_final_message: the final assistant turn has tool calls, which follow its text: "
            "only a turn of text can be continued"
        )
    fmt = tool_format
    if template_supports_tools(template):
        msgs = fmt.shape_messages(msgs)
        return _render_with_template(
            template, msgs, tools, add_generation_prompt, bos_token, eos_token, extra, continue_final_message,
            shape_tools=fmt.shape_tools,
        )  # fmt: skip
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
            plain.append({"role": m["role"], "content": "\n".join(parts), **_name_of(m), **_thought_of(m)})
        else:
            plain.append({"role": m["role"], "content": m["content"], **_name_of(m), **_thought_of(m)})
    # the template sees each turn's text and `name` (as client text), as with a tool-aware one
    return _render_with_template(
        template, plain, [], add_generation_prompt, bos_token, eos_token, extra, continue_final_message
    )


def _name_of(m: dict[str, Any]) -> dict[str, Any]:
    return {"name": m["name"]} if "name" in m else {}


def _thought_of(m: dict[str, Any]) -> dict[str, Any]:
    return {"reasoning_content": m["reasoning_content"]} if "reasoning_content" in m else {}


_FORGERY = re.compile(r"<\||\|>|<tool_call>|</tool_call>")


def _render_with_template(
    template: str,
    msgs: list[dict[str, Any]],
    tools: Sequence[Tool],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    template_kwargs: dict[str, Any],
    continue_final_message: bool = False,
    shape_tools: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
) -> list[tuple[str, bool]]:
    # Client text becomes content pieces (never parsed for markers), as in
    # chat.render_chat: message contents, and the free-form strings a template
    # may print next to them (`name`, `tool_call_id`, `tool_calls[].id`), so
    # none of them can forge a turn. Tool definitions and call arguments are
    # structured values a template re-serialises (tojson), which a placeholder
    # would not survive: they must not carry marker-like text instead.
    contents: list[str] = []

    def protected(text: str, *, marked: bool = False) -> str:
        if not text and not marked:  # nothing to forge; a template's `if message.content` must see it empty (gpt-oss's)
            return ""
        contents.append(text)
        return sentinel(len(contents) - 1, text)

    ctx: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        # a continued final turn's text is marked even when empty: the prompt is cut right after it
        marked = continue_final_message and i == len(msgs) - 1
        entry: dict[str, Any] = {"role": m["role"], "content": protected(m["content"], marked=marked)}
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
        for key in ("tool_call_id", "name", "reasoning_content"):
            if key in m:
                entry[key] = protected(m[key])
        if "reasoning_content" in m:
            entry["thinking"] = entry["reasoning_content"]  # gpt-oss's template (Harmony) reads it by this name
        ctx.append(entry)
    tool_dicts = [t.as_openai() for t in tools]
    if shape_tools is not None:
        tool_dicts = shape_tools(tool_dicts)
    if _FORGERY.search(json.dumps(tool_dicts)):
        raise InvalidRequestError("tool definitions must not contain chat markers")
    # no tools: `tools` left undefined, as llama.cpp renders it (Hermes' templates test
    # `tools is defined` and would iterate a None)
    tool_context = {"tools": tool_dicts} if tool_dicts else {}
    return render_with_sentinels(
        template,
        ctx,
        contents,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        continue_final_message=continue_final_message,
        **tool_context,
        **template_kwargs,
    )

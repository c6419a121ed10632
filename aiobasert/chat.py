"""Chat prompts: render the model's Jinja chat template into encodable pieces.

The template is rendered with every message content replaced by a sentinel;
the rendered text is then split at the sentinels into framing pieces (the
template's own text: role headers, turn markers) and content pieces (the
client's text). `baseRT_encode_pieces` parses markers only in framing, so a
message that quotes `<|im_end|>` stays text and cannot forge a turn, while
the pieces still tokenize as one text.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidRequestError
from .types import ChatMessage

# ChatML, for bundles without a template of their own (Qwen, SmolLM2: <|im_start|> ... <|im_end|>).
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 3's turn format, for a Llama 3 vocabulary without a template: header, blank line, <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Gemma's turn format, for a Gemma vocabulary without a template (Gemma 3 270M's GGUF has none): the
# system prompt opens the first user turn, the assistant is "model", turns end with <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Each family's template, and the turn marker its vocabulary is known by.
_FAMILY_TEMPLATES = (("<start_of_turn>", GEMMA_TEMPLATE), ("<|start_header_id|>", LLAMA3_TEMPLATE))


def default_template(special_tokens: Iterable[str]) -> str:
    """The template of the model's family, known by its vocabulary's special tokens, for a
    model whose GGUF carries none: Gemma, Llama 3, else ChatML."""
    specials = set(special_tokens)
    return next((template for marker, template in _FAMILY_TEMPLATES if marker in specials), DEFAULT_TEMPLATE)


ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""The roles a chat message may have. The template writes the role into the
turn header as framing (where markers ARE parsed), so a free-form role could
forge turn markers; only these known words are accepted."""

MAX_CHAT_MESSAGES = 10_000
"""The most messages one chat may have. Rendering costs per message (a content is a
sentinel while the template runs, so its length costs nothing there): this bounds
what a chat can make its renderer pay, checked before anything is rendered."""


def check_message_count(messages: object) -> None:
    """InvalidRequestError naming `messages` past `MAX_CHAT_MESSAGES` (a cheap check, made first)."""
    if isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequestError(f"messages: {len(messages)} messages; at most {MAX_CHAT_MESSAGES} per chat")


TEMPLATE_GLOBALS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
)
"""The names a chat template is given by the renderer itself: `chat_template_kwargs` may not set them."""


def check_template_kwargs(
    template: str, kwargs: Mapping[str, Any] | None, special_tokens: Iterable[str] = ()
) -> dict[str, Any]:
    """`chat_template_kwargs` as the template may be given them, or `InvalidRequestError` naming the
    key: each must be a variable the template reads (a knob it does not have is refused, never
    silently ignored), not one the renderer sets itself, and its value JSON (a string in it may
    not hold a special token's text: the template prints it as framing, where markers are parsed)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(f"chat_template_kwargs must be an object, not {type(kwargs).__name__}")
    specials = [t for t in special_tokens if t]
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key):
            raise InvalidRequestError(f"chat_template_kwargs: {str(key)[:40]!r} is not a template variable name")
        if key in TEMPLATE_GLOBALS:
            raise InvalidRequestError(f"chat_template_kwargs.{key}: set by the server itself, not by a request")
        if re.search(rf"\b{key}\b", template or DEFAULT_TEMPLATE) is None:
            raise InvalidRequestError(f"chat_template_kwargs.{key}: the model's chat template has no such variable")
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"chat_template_kwargs.{key}: the value must be JSON") from None
        if len(text) > 65_536:
            raise InvalidRequestError(f"chat_template_kwargs.{key}: the value is longer than 65,536 characters")
        if any(t in text for t in specials) or "\\u0000" in text:
            raise InvalidRequestError(f"chat_template_kwargs.{key}: the value holds a special token's text")
        out[key] = value
    return out


_SENTINEL = "\x00\x01{}\x01\x00"
# the sentinel as tojson writes it inside a JSON string, and what it becomes: content i, JSON-escaped
_ESCAPED_SENTINEL_RE = re.compile(r"\\u0000\\u0001(\d+)\\u0001\\u0000")
_JSON_SENTINEL = "\x00\x02{}:{}\x02\x00"
_SENTINEL_RE = re.compile("\x00(?:\x01(\\d+)\x01|\x02(\\d+):([01])\x02)\x00")


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template refused the conversation: {message}")


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    # HF transformers' (and llama.cpp's) tojson: plain JSON, not Jinja's HTML-escaped one
    # ("<" stays "<" in a tool description), with the indent Llama 3.1's template asks for.
    text = json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    # A message content inside the value (Llama 3.1's template writes a tool result as
    # `content | tojson`) comes out as an escaped sentinel: marked so that the content is
    # put back as a content piece, JSON-escaped as the template asked.
    return _ESCAPED_SENTINEL_RE.sub(lambda m: _JSON_SENTINEL.format(m.group(1), int(ensure_ascii)), text)


def _strftime_now(fmt: str) -> str:
    # HF transformers' global: Llama 3.2's template writes today's date into its system turn.
    return time.strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: HF transformers marks the assistant's tokens with it
    (for training masks); rendering, it is its body. Templates that use it (LFM2, GLM, Kimi ...)
    render as they do in transformers and llama.cpp."""

    tags = {"generation"}  # noqa: RUF012  (jinja2's own class attribute)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    # As HF transformers compiles a chat template: trimmed blocks, `{% break %}` / `{% continue %}`,
    # the generation tag, its tojson, raise_exception and strftime_now.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def _as_message(m: ChatMessage | Mapping[str, str], i: int) -> ChatMessage:
    if isinstance(m, ChatMessage):
        role, content = m.role, m.content
    elif isinstance(m, Mapping):
        role, content = m.get("role"), m.get("content")  # type: ignore[assignment]
    else:
        raise InvalidRequestError(f"message {i} must be a ChatMessage or a mapping, not {type(m).__name__}")
    if not isinstance(role, str) or not role:
        raise InvalidRequestError(f"message {i} needs a non-empty string 'role'")
    if role not in ROLES:
        raise InvalidRequestError(f"message {i} has role {role[:40]!r}; a role is one of {', '.join(sorted(ROLES))}")
    if not isinstance(content, str):
        raise InvalidRequestError(f"message {i} needs a string 'content'")
    if "\x00" in role:
        raise InvalidRequestError(f"message {i} contains a NUL character")
    return ChatMessage(role=role, content=encodable_content(role, content, i))


def encodable_content(role: str, content: str, i: int) -> str:
    """A message's text as the engine can encode it. The encode ABI takes C strings, which cannot
    carry NUL: a NUL a client wrote is refused by name, but the model's own output may hold one it
    sampled (a byte token), and every chat loop, like the Responses store, feeds that output back as
    an assistant turn. There it is rendered as U+FFFD, so a conversation never fails on the
    server's own words."""
    if "\x00" not in content:
        return content
    if role == "assistant":
        return content.replace("\x00", "\ufffd")
    raise InvalidRequestError(f"message {i} contains a NUL character")


def render_chat(
    template: str,
    messages: Sequence[ChatMessage | Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    continue_final_message: bool = False,
) -> list[tuple[str, bool]]:
    """Render `messages` into (text, is_content) pieces for `baseRT_encode_pieces`;
    `continue_final_message`: see `render_with_sentinels`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} messages")
    check_message_count(messages)
    msgs = [_as_message(m, i) for i, m in enumerate(messages)]
    return render_with_sentinels(
        template,
        [{"role": m.role, "content": sentinel(i, m.content)} for i, m in enumerate(msgs)],
        [m.content for m in msgs],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        continue_final_message=continue_final_message,
    )


def _split_space(content: str) -> tuple[str, str, str]:
    """(leading whitespace, the rest, trailing whitespace), whitespace as Jinja's `trim` strips it."""
    rest = content.lstrip()
    lead = content[: len(content) - len(rest)]
    core = rest.rstrip()
    return lead, core, rest[len(core) :]


def sentinel(i: int, content: str = "") -> str:
    """The placeholder a template sees for message content `i` (see render_with_sentinels): the
    content's own leading and trailing whitespace around a marker, so a template that trims the
    content (Llama 3's and Gemma's `message['content'] | trim`) drops exactly that whitespace."""
    lead, _, trail = _split_space(content)
    return lead + _SENTINEL.format(i) + trail


# StepFun's template (its tool preamble names it): llama.cpp trims every message's text before
# rendering, as leftover whitespace drives the model into reasoning loops (llama.cpp #24181).
_TRIMMED_TEMPLATE_MARK = "You have access to the following functions in JSONSchema format"
_SYSTEM_PROBE = "\x00system-probe\x00"


@lru_cache(maxsize=32)
def supports_system_role(template: str) -> bool:
    """Whether the template prints a system message's text (llama.cpp's capability check: a system
    and a user message rendered, the system text looked for). Gemma 2's raises instead."""
    probe = [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "u"}]
    try:
        rendered = _compile(template).render(messages=probe, add_generation_prompt=True, bos_token="", eos_token="")
    except InvalidRequestError:  # the template's own raise_exception: it refuses a system message
        return False
    except Exception:  # it needs variables only a real request sets: no verdict,
        return True  # and the real render says what it lacks
    return _SYSTEM_PROBE in rendered


def _as_llama_cpp_renders(template: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as llama.cpp hands it to a template (common/chat.cpp's workarounds), so a
    prompt renders byte for byte as its `/apply-template` does: a template without a system role
    gets the system text in front of the next message (joined by a newline; alone, it is dropped)
    instead of refusing the request, and StepFun's gets every text trimmed."""
    if _TRIMMED_TEMPLATE_MARK in template:
        messages = [{**m, "content": m["content"].strip()} if isinstance(m.get("content"), str) else m
                    for m in messages]  # fmt: skip
    if messages and messages[0].get("role") == "system" and not supports_system_role(template):
        first, rest = messages[0], messages[1:]
        if rest and isinstance(rest[0].get("content"), str) and isinstance(first.get("content"), str):
            rest = [{**rest[0], "content": first["content"] + "\n" + rest[0]["content"]}, *rest[1:]]
        messages = rest
    return messages


def _final_sentinel(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """(the marker, the whitespace after it) of the final message's content, which must be an
    assistant turn's text for a turn to be continued."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    if last.get("role") != "assistant" or not isinstance(content, str):
        raise InvalidRequestError("continue_final_message: the last message must be an assistant turn with text")
    match = _SENTINEL_RE.search(content)
    if match is None:
        raise InvalidRequestError("continue_final_message: the last message must be an assistant turn with text")
    return match.group(0), content[match.end() :]


def _cut_after(rendered: str, marker: str, trail: str) -> str:
    """The rendered prompt up to the final message's text (its own trailing whitespace kept where
    the template printed it): the turn's end marker and anything after it dropped."""
    at = rendered.rfind(marker)
    if at < 0:
        raise InvalidRequestError(
            "continue_final_message: the chat template does not print the final assistant turn's text"
        )
    cut = at + len(marker)
    return rendered[: cut + len(trail)] if rendered.startswith(trail, cut) else rendered[:cut]


def render_with_sentinels(
    template: str,
    messages: list[dict[str, Any]],
    contents: Sequence[str],
    *,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    continue_final_message: bool = False,
    **context: Any,
) -> list[tuple[str, bool]]:
    """Render `messages` (whose contents are `sentinel(i, contents[i])` placeholders)
    and split the result into (text, is_content) pieces: the template's own text is
    framing (parsed for markers), each content a piece that never is (its outer
    whitespace, outside the marker, is framing: plain whitespace either way). `context`
    goes to the template too (e.g. `tools`).

    `continue_final_message`: the last message is an assistant turn the model goes on writing (a
    prefill: Anthropic's final assistant turn, vLLM's `continue_final_message`): rendered without a
    generation prompt and cut right after its text, as llama.cpp continues one."""
    if not isinstance(continue_final_message, bool):
        raise InvalidRequestError(f"continue_final_message must be a bool, not {type(continue_final_message).__name__}")
    final = _final_sentinel(messages) if continue_final_message else None
    messages = _as_llama_cpp_renders(template or DEFAULT_TEMPLATE, messages)
    try:
        rendered = _compile(template or DEFAULT_TEMPLATE).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt and final is None,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except InvalidRequestError:
        raise  # the template's own raise_exception
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
        # a template's own fault on this conversation (iterating a missing field, a bad index ...)
        # is the request's error, named, never a server fault
        raise InvalidRequestError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    if final is not None:
        rendered = _cut_after(rendered, *final)
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for match in _SENTINEL_RE.finditer(rendered):
        if match.start() > pos:
            pieces.append((rendered[pos : match.start()], False))
        idx = int(match.group(1) or match.group(2))
        if idx >= len(contents):
            raise InvalidRequestError("chat template produced an unknown message reference")
        core = _split_space(contents[idx])[1]  # the whitespace around it was rendered with the sentinel
        if match.group(2) is not None:  # inside a tojson string: escaped as json.dumps escapes it
            core = json.dumps(core, ensure_ascii=match.group(3) == "1")[1:-1]
        if core:
            pieces.append((core, True))
        pos = match.end()
    if pos < len(rendered):
        pieces.append((rendered[pos:], False))
    if not pieces:
        raise InvalidRequestError("chat template rendered nothing")
    return pieces

"""Chat prompts: render the model's Jinja chat template into encodable pieces.

The template is rendered with every message content replaced by a sentinel;
the rendered text is then split at the sentinels into framing pieces (the
template's own text: role headers, turn markers) and content pieces (the
client's text). `baseRT_encode_pieces` parses markers only in framing, so a
message that quotes `<|im_end|>` stays text and cannot forge a turn, while
the pieces still tokenize as one text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidRequestError
from .types import ChatMessage

# ChatML, for bundles without a template of their own.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""The roles a chat message may have. The template writes the role into the
turn header as framing (where markers ARE parsed), so a free-form role could
forge turn markers; only these known words are accepted."""

_SENTINEL = "\x00\x01{}\x01\x00"
_SENTINEL_RE = re.compile("\x00\x01(\\d+)\x01\x00")


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template refused the conversation: {message}")


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
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
    if "\x00" in content or "\x00" in role:
        raise InvalidRequestError(f"message {i} contains a NUL character")
    return ChatMessage(role=role, content=content)


def render_chat(
    template: str,
    messages: Sequence[ChatMessage | Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> list[tuple[str, bool]]:
    """Render `messages` into (text, is_content) pieces for `baseRT_encode_pieces`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} messages")
    msgs = [_as_message(m, i) for i, m in enumerate(messages)]
    return render_with_sentinels(
        template,
        [{"role": m.role, "content": sentinel(i)} for i, m in enumerate(msgs)],
        [m.content for m in msgs],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )


def sentinel(i: int) -> str:
    """The placeholder a template sees for message content `i` (see render_with_sentinels)."""
    return _SENTINEL.format(i)


def render_with_sentinels(
    template: str,
    messages: list[dict[str, Any]],
    contents: Sequence[str],
    *,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    **context: Any,
) -> list[tuple[str, bool]]:
    """Render `messages` (whose contents are `sentinel(i)` placeholders for
    `contents[i]`) and split the result into (text, is_content) pieces: the
    template's own text is framing (parsed for markers), each content a piece
    that never is. `context` goes to the template too (e.g. `tools`)."""
    try:
        rendered = _compile(template or DEFAULT_TEMPLATE).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except TemplateError as exc:
        raise InvalidRequestError(f"chat template failed: {exc}") from None
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for match in _SENTINEL_RE.finditer(rendered):
        if match.start() > pos:
            pieces.append((rendered[pos : match.start()], False))
        idx = int(match.group(1))
        if idx >= len(contents):
            raise InvalidRequestError("chat template produced an unknown message reference")
        if contents[idx]:
            pieces.append((contents[idx], True))
        pos = match.end()
    if pos < len(rendered):
        pieces.append((rendered[pos:], False))
    if not pieces:
        raise InvalidRequestError("chat template rendered nothing")
    return pieces

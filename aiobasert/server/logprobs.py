"""Log-probabilities in OpenAI's two shapes (legacy completions, chat)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

from ..engine import Engine
from ..types import Token
from .protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprobEntry, TopLogprobEntry
from .streaming import gather


class TokenTexts:
    """Token id -> the token's own text, decoded on first need (logprobs only)."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    async def lookup(self, engine: Engine, tokens: Iterable[Token]) -> dict[int, str]:
        missing: set[int] = set()
        for tok in tokens:
            for top in tok.top_logprobs or ():
                self._texts.setdefault(top.id, top.text)
            if tok.id not in self._texts:
                missing.add(tok.id)
        if missing:

            async def fill(token_id: int) -> None:
                self._texts[token_id] = await engine.decode([token_id])

            await gather(functools.partial(fill, token_id) for token_id in missing)
        return self._texts


def completion_logprobs(tokens: Sequence[Token], texts: dict[int, str], offset: int) -> CompletionLogprobs:
    token_texts = [texts[t.id] for t in tokens]
    offsets: list[int] = []
    for text in token_texts:
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float]] = []
    for tok, text in zip(tokens, token_texts, strict=True):
        entry = {top.text: top.logprob for top in tok.top_logprobs or ()}
        if tok.logprob is not None:
            entry.setdefault(text, tok.logprob)  # OpenAI: the sampled token is always listed
        tops.append(entry)
    return CompletionLogprobs(
        tokens=token_texts,
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=tops,
        text_offset=offsets,
    )


def chat_logprobs(tokens: Sequence[Token], texts: dict[int, str]) -> ChoiceLogprobs:
    def utf8(text: str) -> list[int]:
        return list(text.encode("utf-8", "replace"))

    content = []
    for tok in tokens:
        text = texts[tok.id]
        content.append(
            TokenLogprobEntry(
                token=text,
                logprob=tok.logprob if tok.logprob is not None else 0.0,
                bytes=utf8(text),
                top_logprobs=[
                    TopLogprobEntry(token=top.text, logprob=top.logprob, bytes=utf8(top.text))
                    for top in tok.top_logprobs or ()
                ],
            )
        )
    return ChoiceLogprobs(content=content)

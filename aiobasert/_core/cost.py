"""What a request's preparation may cost, measured before any of it is paid.

Preparing a request (tokenizing its prompt, compiling its grammar, decoding ids) costs
what the request decides: a 15 MB prompt, a 0.7 MB schema. The rules
(docs/fairness.md, "The engine thread only steps"):

* bounded before it is paid: a text that cannot fit the context window is refused
  without tokenizing it (`check_fits`: no token covers more than the vocabulary's
  longest token, so `chars / longest` tokens at least), ids are counted before they
  are read;
* paid where only that request waits: on an intake worker, in a lane for its cost
  (`lane_of`), so a cheap job never waits behind a costly one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ContextLengthExceededError

QUICK_COST = 64 * 1024
"""Characters (prompt text plus grammar source) up to which a job is cheap: a few ms of
tokenizing or a small grammar. Cheap jobs have workers of their own (aiobasert._core.intake)."""

COMPILE_BUDGET_S = 5.0
"""Seconds one grammar compile may take. A compile cannot be interrupted (llguidance, the engine's C
compiler): one past its budget is refused when it returns (InvalidRequestError naming the field) and
the refusal is cached, so the same source is refused at once after that, never compiled again."""

MAX_DECODE_IDS = 1 << 20
"""Token ids one `Engine.decode` (`POST /detokenize`) takes: more are refused before any is read
(InvalidRequestError). A stream's ids are at most the context window."""

MAX_ENCODE_IDS = MAX_DECODE_IDS
"""Token ids one `Engine.encode` (`POST /tokenize`) returns: a text with more is refused
(InvalidRequestError) once counted by the C call, before a list of that many Python ints
(~36 bytes each) is built."""

Lane = Literal["quick", "cheap", "costly"]
"""quick: a cheap text-only job (the tokenizer worker, FIFO); cheap: a cheap grammar job;
costly: anything above QUICK_COST (a worker of its own; cheap grammar jobs never wait for it)."""


def lane_of(cost: int, *, grammar: bool) -> Lane:
    if cost > QUICK_COST:
        return "costly"
    return "cheap" if grammar else "quick"


def prompt_chars(prompt: Any) -> int:
    """Characters of text a prompt has to tokenize (0 for token ids). Any thread; O(pieces)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], tuple):
        return sum(len(text) for text, _ in prompt)
    return 0


def _schema_json(schema: Any) -> bytes | None:
    """A json_schema's JSON text, by msgspec's C encoder (~1 GB/s); None for a value msgspec
    cannot encode (the compile refuses it later, which costs nothing here)."""
    if schema is None:
        return None
    try:
        import msgspec

        return msgspec.json.encode(schema)
    except Exception:
        return None


@dataclass(frozen=True)
class Measure:
    """What preparing a request may cost, measured on the caller's thread before any work."""

    text: int
    """Characters of prompt text to tokenize."""
    grammar: int
    """Characters of grammar source to compile (json_schema's JSON, tool grammars)."""
    grammar_key: bytes | None
    """The digest its compiled grammar is cached under (aiobasert._core.grammar_cache.GrammarCache)."""


NO_COST = Measure(0, 0, None)


def constraint_source(params: Any) -> tuple[str, str] | None:
    """A request's grammar constraint other than a json_schema: its SamplingParams field and its
    source text (`choice` as JSON), or None. Cheap (O(source)), any thread."""
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        import json

        return "choice", json.dumps(params.choice)
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


def measure(prompt: Any, params: Any, lark: str | None, structural_tag: str | None) -> Measure:
    """`params`: the request's SamplingParams (its json_schema, regex, choice or grammar)."""
    text = prompt_chars(prompt)
    if lark is not None or structural_tag is not None:
        tag, host = (structural_tag or "").encode("utf-8", "replace"), (lark or "").encode("utf-8", "replace")
        source = b"tools\0" + tag + b"\0" + host
        return Measure(text, len(tag) + len(host), hashlib.blake2b(source, digest_size=16).digest())
    other = constraint_source(params)
    if other is not None:
        field, code = other[0].encode(), other[1].encode("utf-8", "replace")
        return Measure(text, len(code), hashlib.blake2b(field + b"\0" + code, digest_size=16).digest())
    schema = _schema_json(params.json_schema)
    if schema is None:
        return Measure(text, 0, None)
    return Measure(text, len(schema), hashlib.blake2b(b"schema\0" + schema, digest_size=16).digest())


# The longest token of each vocabulary, by bundle (path, size, mtime): asked of the engine
# once per process, by the first worker that needs it (~0.2-1.5 s for a 50k-130k vocabulary:
# one call per token), on the costly lane where only costly jobs wait.
_longest: dict[tuple[str, int, int], int] = {}
_longest_lock = threading.Lock()


def _bundle_key(path: str) -> tuple[str, int, int]:
    try:
        st = os.stat(path)
        return (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        return (path, 0, 0)


def longest_token_bytes(lib: Any, handle: int, model_path: str) -> int:
    """The most bytes one token of this vocabulary stands for (its special tokens' texts
    included, and at least 4: an unknown character may take a token of its own)."""
    key = _bundle_key(model_path)
    with _longest_lock:
        known = _longest.get(key)
        if known is not None:
            return known
        longest = 4
        buf = ctypes.create_string_buffer(1024)
        i = 0
        while True:
            n = int(lib.baseRT_decode_token_raw(handle, i, buf, len(buf)))
            if n < 0:  # past the vocabulary
                break
            longest = max(longest, n)
            i += 1
        for text in lib.special_tokens(handle):
            longest = max(longest, len(text))
        _longest[key] = longest
        return longest


def check_fits(chars: int, limit: int, lib: Any, handle: int, model_path: str) -> None:
    """ContextLengthExceededError when `chars` characters of text cannot encode to `limit`
    tokens or fewer, decided without tokenizing them: every token stands for at most the
    vocabulary's longest token's bytes, and a character is at least one byte. (The one
    exception is whitespace an added "rstrip" token swallows: a prompt of mostly such
    whitespace is refused too.)"""
    if chars <= limit:  # a token stands for at least one character: it may fit
        return
    longest = longest_token_bytes(lib, handle, model_path)
    least = -(-chars // longest)
    if least > limit:
        err = ContextLengthExceededError(least, 1, limit)
        err.args = (
            f"the prompt of {chars} characters is at least {least} tokens (this vocabulary's longest token "
            f"is {longest} bytes), which alone exceeds the context window of {limit} tokens",
        )
        raise err

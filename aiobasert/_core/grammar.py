"""Structured output: JSON Schema constrained decoding with llguidance.

`GrammarBackend` turns a bundle's tokenizer into an llguidance tokenizer (once
per engine) and compiles each request's JSON Schema into a `JsonSchemaConstraint`,
the `Constraint` the engine thread steps: before every sampled token it writes
the allowed-token bitmask (the lane's logits row is then masked with it), after
it the token is consumed. Compiles run on an intake worker (aiobasert._core.intake:
a large stack, off the engine thread); stepping runs on the engine thread.

Generated JSON is compact by default (no free whitespace between tokens): a
schema's ``"x-guidance": {"whitespace_flexible": true}`` turns free whitespace
back on. Small models otherwise tend to wander off into endless whitespace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequestError
from ..models._hf_tokenizer import hf_tokenizer_json

try:
    import llguidance

    _HAVE_LLGUIDANCE = True
except ImportError:  # pragma: no cover - a dependency; without it structured requests fail one by one
    _HAVE_LLGUIDANCE = False

if TYPE_CHECKING:  # numpy arrays are what the engine thread passes in; a text-only process never imports it
    import numpy as np

__all__ = ["GRAMMAR_LIMITS", "EngineGrammarConstraint", "GrammarBackend", "JsonSchemaConstraint"]

GRAMMAR_LIMITS: dict[str, Any] = {
    # Bound a compile's work while it runs (llguidance's ParserLimits; it stops with its reason, an
    # InvalidRequestError): the time budget (cost.COMPILE_BUDGET_S) can only judge a compile
    # after it returns. Measured on SmolLM2's vocabulary (docs/fairness.md): the lexer's build is what
    # grows fastest (8,000 integer properties with distinct minimums: 6 s here, ~1M fuel); at 200,000
    # fuel it is refused after 0.1-0.5 s, while 128 tools of 40 properties (the most tools allowed)
    # need less and compile in 0.3 s.
    "initial_lexer_fuel": 200_000,
    # llguidance fails a grammar of 65,525 symbols or more (a u16 symbol index) only after building it
    # whole (2.7 s for 14,000 integer properties): refused as it grows past this instead.
    "max_grammar_size": 64_000,
}


def engine_end_ids(lib: Any, model: int, n_tokens: int) -> list[int]:
    """The ids that end generation, asked of the engine (baseRT_is_eos_token): its loader
    knows each model family's end markers, the grammar offers exactly those."""
    return [i for i in range(n_tokens) if lib.baseRT_is_eos_token(model, i)]


class JsonSchemaConstraint:
    """One request's grammar: an llguidance matcher behind the engine's `Constraint`
    protocol (aiobasert._core.protocol).

    Stepping never raises for what the model samples (an exception there would
    stop the engine thread): a rejected token or an internal llguidance error
    puts the matcher in its error state, `accept` returns False and `error`
    says why.
    """

    __slots__ = ("_mask_bytes", "_matcher")

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int) -> None:
        self._matcher = matcher
        self._mask_bytes = mask_words * 4

    def fill_bitmask(self, out: np.ndarray[Any, Any]) -> bool:
        """Write the allowed tokens of the next step into `out` (int32 words, bit
        set = allowed, ceil(vocab/32) words). Once the grammar is complete (or
        broken) only the end tokens remain allowed. Always True: a JSON grammar
        never allows every token. A mis-sized `out` is a caller bug: ValueError."""
        if out.dtype.name != "int32" or out.nbytes != self._mask_bytes or not out.flags.c_contiguous:
            raise ValueError(f"the token bitmask must be {self._mask_bytes // 4} contiguous int32 words")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, self._mask_bytes)
        return True

    def copy(self) -> JsonSchemaConstraint:
        """A fresh constraint with this one's grammar (llguidance's deep copy: no compile)."""
        return JsonSchemaConstraint(self._matcher.deep_copy(), self._mask_bytes // 4)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it (or failed)."""
        return self._matcher.consume_token(token) and not self._matcher.is_error()

    def is_finished(self) -> bool:
        """True when the output is complete: nothing but an end token could follow,
        or an end token was just consumed."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """llguidance's message once the matcher is in its error state, else None."""
        return self._matcher.get_error() if self._matcher.is_error() else None

    def adopt(self, lib: Any) -> None:
        """A host grammar is stepped in Python: no engine library to take."""

    def close(self) -> None:
        """A host grammar holds no engine handle: dropped with its lane."""


class GrammarBackend:
    """Compiles JSON Schemas into per-request constraints over one model's vocabulary."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int, end_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.end_ids = end_ids
        self._mask_words = (vocab_size + 31) // 32

    @classmethod
    def for_tokenizer(cls, fields: Mapping[str, Any], *, vocab_size: int, end_ids: Sequence[int]) -> GrammarBackend:
        """Build the backend from a bundle's tokenizer fields (the engine's own `ModelFile`, read
        once), with the `end_ids` the engine running the model ends generation on (engine_end_ids)."""
        if not _HAVE_LLGUIDANCE:
            raise InvalidRequestError("structured output needs the llguidance package (pip install llguidance)")
        n_tokens = len(fields.get("tokenizer.ggml.tokens") or [])
        if n_tokens > vocab_size:
            raise InvalidRequestError(
                f"structured output: the tokenizer has {n_tokens} tokens but the model only {vocab_size} logits"
            )
        end_ids = [i for i in end_ids if i < n_tokens]
        if not end_ids:
            raise InvalidRequestError("structured output: the model defines no end-of-sequence token")
        try:
            # llguidance holds the GIL while it builds a tokenizer (every stream pauses): built in two
            # calls, the token trie then its mask slices (an optimization only: the same masks), the
            # GIL goes to the engine thread in between, so the longest pause is about half of one
            # call's (SmolLM2 on a loaded 2-core machine: 0.3-0.4 s instead of 0.8-1.0 s).
            tokenizer = llguidance.LLTokenizer(hf_tokenizer_json(fields), n_vocab=vocab_size, eos_token=end_ids,
                                               slices=[])  # fmt: skip
            time.sleep(0)  # let a waiting thread take the GIL
            tokenizer = tokenizer.with_slices(llguidance.LLTokenizer.general_slices())
        except Exception as exc:  # whatever llguidance objects to; a request error, never an engine-thread crash
            raise InvalidRequestError(f"structured output is not supported for this model's tokenizer: {exc}") from None
        if tokenizer.vocab_size != vocab_size:
            raise InvalidRequestError(
                f"structured output: llguidance sees {tokenizer.vocab_size} tokens, the model {vocab_size}"
            )
        return cls(tokenizer, vocab_size, end_ids)

    def compile(self, schema: Mapping[str, Any] | bool) -> JsonSchemaConstraint:
        """A fresh constraint for one request: `schema` is a JSON Schema object, or
        True for any JSON value. Raises `InvalidRequestError` with llguidance's
        message for a malformed schema or one using unsupported keywords."""
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise InvalidRequestError("json_schema must be a JSON Schema object, or True for any JSON value")
        try:
            text = json.dumps(schema, allow_nan=False)
            # compact JSON unless the schema's "x-guidance" options say otherwise
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"invalid json_schema: {_message(exc)}") from None
        return self._constraint(grammar, "invalid json_schema")

    def compile_lark(self, lark: str) -> JsonSchemaConstraint:
        """A fresh constraint from a Lark grammar (llguidance's dialect, `%json`
        for embedded JSON Schemas), e.g. the tool-call grammar of aiobasert.tools.
        Raises `InvalidRequestError` with llguidance's message when it does not compile."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"invalid grammar: {_message(exc)}") from None
        return self._constraint(grammar, "invalid grammar")

    def compile_constraint(self, field: str, source: str) -> JsonSchemaConstraint:
        """A fresh constraint from a `regex`, a `choice` (its JSON list) or a `grammar` (Lark, or
        llama.cpp's GBNF converted to Lark by llguidance's converter). Raises `InvalidRequestError`
        "invalid sampling parameter FIELD: ..." when it does not convert or compile."""
        what = f"invalid sampling parameter {field}"
        if field == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        elif field == "choice":
            # each choice a Lark string literal (JSON escapes): exactly one of them, whole
            lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(source))
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(_lark_of(source, what))
        return self._constraint(grammar, what)

    def _constraint(self, grammar: str, what: str) -> JsonSchemaConstraint:
        """A matcher over this vocabulary for a compiled llguidance grammar, built once within
        GRAMMAR_LIMITS (with the GIL released); its errors (the grammar's, or a limit it reached)
        become `InvalidRequestError`s starting with `what`. (A separate validation first would
        build the whole grammar twice.)"""
        limits = llguidance.LLParserLimits(**GRAMMAR_LIMITS)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidRequestError(f"{what}: {_message(matcher.get_error())}")
        return JsonSchemaConstraint(matcher, self._mask_words)


def _lark_of(source: str, what: str) -> str:
    """A `grammar` as Lark: itself when it reads as Lark, else llama.cpp's GBNF converted
    (llguidance's converter; what it cannot convert is refused, saying why)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(source)
    except Exception as exc:  # the converter's own errors (GbnfToLarkError, and what its parser trips on)
        raise InvalidRequestError(f"{what}: a GBNF grammar that cannot be converted to Lark: {_message(exc)}") from None


def _message(error: object) -> str:
    """llguidance's message for a client: without the Rust backtrace a panic appends."""
    text = str(error)
    return text.split("\n<backtrace>", 1)[0][:2000]


class EngineGrammarConstraint:
    """A constraint run by the engine's own grammar backend (a JSON Schema through
    `baseRT_grammar_create_from_schema`, a structural tag through
    `baseRT_grammar_create_from_structural_tag`, stepped by token bitmask), for
    engines that have one. `fill_bitmask` is False when every token may follow
    (free text of a structural tag): nothing to apply.

    Same contract as `JsonSchemaConstraint`; the grammar handle is freed by
    `close()` when the lane is released. Engine thread only.
    """

    def __init__(self, lib: Any, grammar: int, words: int, *, resettable: bool) -> None:
        self._lib = lib
        self._grammar: int | None = grammar
        self._words = words
        self._resettable = resettable  # the library has baseRT_grammar_reset (`LoadedModel.grammar_reset`)

    @classmethod
    def create(
        cls, lib: Any, model: int, schema: Mapping[str, Any] | bool, *, resettable: bool
    ) -> EngineGrammarConstraint | None:
        """The engine's grammar for `schema`, or None when the engine cannot step it
        per token (no xgrammar bitmask): the caller then uses the host backend."""
        if schema is True:
            grammar = lib.baseRT_grammar_create_json(model)
        else:
            grammar = lib.baseRT_grammar_create_from_schema(model, json.dumps(schema).encode())
        if not grammar:
            err = lib.last_error("baseRT_grammar_create_from_schema")
            if err.code.name == "UNSUPPORTED":
                return None
            raise InvalidRequestError(f"invalid json_schema: {err.message}")
        return cls._steppable(lib, grammar, resettable)

    @classmethod
    def from_structural_tag(cls, lib: Any, model: int, tag: str, *, resettable: bool) -> EngineGrammarConstraint | None:
        """The engine's grammar for an xgrammar structural tag (JSON text), or None
        when the engine cannot build it (a format or schema it cannot enforce: the
        caller then uses the host backend) or cannot step it per token. Such a
        grammar never reports completed: its lane ends on an end token."""
        grammar = lib.baseRT_grammar_create_from_structural_tag(model, tag.encode())
        if not grammar:
            return None  # baseRT_get_error says why; the host grammar enforces the same contract
        return cls._steppable(lib, grammar, resettable)

    @classmethod
    def _steppable(cls, lib: Any, grammar: int, resettable: bool) -> EngineGrammarConstraint | None:
        """The constraint over a new grammar handle, or None (the handle freed) when the
        engine cannot step it per token: a legacy grammar without a bitmask cannot be batched."""
        words = int(lib.baseRT_grammar_bitmask_size(grammar))
        if words <= 0:
            lib.baseRT_grammar_free(grammar)
            return None
        return cls(lib, grammar, words, resettable=resettable)

    def reset(self) -> bool:
        """Back to the grammar's start, for another request (False: the engine cannot reset it)."""
        if self._grammar is None or not self._resettable:
            return False
        self._lib.baseRT_grammar_reset(self._grammar)
        return True

    def adopt(self, lib: Any) -> None:
        """Step (and free) through `lib` from now on: a grammar is built by an intake
        worker through its own library view, then handed to the engine thread."""
        self._lib = lib

    def fill_bitmask(self, out: np.ndarray[Any, Any]) -> bool:
        if out.shape[0] < self._words:
            raise InvalidRequestError(f"engine grammar bitmask of {self._words} words exceeds the vocabulary")
        out[:] = -1  # words past the engine's stay "allowed"; the engine fills its own
        return int(self._lib.baseRT_grammar_fill_bitmask(self._grammar, out.ctypes.data)) == 1

    def accept(self, token: int) -> bool:
        return int(self._lib.baseRT_grammar_accept_token(self._grammar, token)) == 1

    @property
    def error(self) -> str | None:
        """The engine's grammar says no more than that it rejected a token."""
        return None

    def is_finished(self) -> bool:
        lib = self._lib
        return bool(lib.baseRT_grammar_is_terminated(self._grammar) or lib.baseRT_grammar_is_completed(self._grammar))

    def close(self) -> None:
        if self._grammar is not None:
            self._lib.baseRT_grammar_free(self._grammar)
            self._grammar = None

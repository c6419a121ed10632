"""Preparing a request before it may join the engine's queue: its prompt's ids and its grammar.

The engine thread only steps (docs/fairness.md, "The engine thread only steps"): it hands each
request to a `Preparer`, which tokenizes the prompt and compiles the grammar on the intake workers
(`intake.Intake`: a job in the lane its `cost` says), never on the engine thread, and posts the
result back to the thread's inbox (`protocol.Prepared`). The thread then gives the prepared request
a lane (aiobasert/engine_thread.py, the lanes' one writer).

What runs where:

* on the engine thread: `submit` / `submit_embed` (hand the work over with the request's record,
  `request.Request`; a prompt of ids with no grammar needs none and is checked at once), `returned`
  (its record back: its status says whether it was answered meanwhile), `adopt` /
  `close_constraint` (a grammar's life on the thread);
* on an intake worker: `prepare` (the prompt's ids and the grammar), the grammar from the cache or
  compiled within `cost.COMPILE_BUDGET_S`, the host (llguidance) backend built once per engine from
  the engine's `ModelFile`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _ffi
from .. import _lazy_numpy as lazy_numpy
from ..errors import AioBaseRTError, ContextLengthExceededError, InvalidRequestError
from ..types import MAX_SCHEMA_REFS, Capabilities
from . import cost as _cost
from .grammar_cache import GrammarCache
from .intake import Intake, Reroute, TokenIds, Tokenizer, on_costly_worker, run_job
from .model_file import ModelFile
from .protocol import Constraint, Embed, Message, Prepared, Prompt, RequestSpec, Submit, ThoughtSpec
from .request import Request
from .schema import closed_objects
from .thought import ThoughtGate

if TYPE_CHECKING:  # llguidance (the grammar module): imported on first use only
    from .grammar import GrammarBackend

PromptAndGrammar = tuple[TokenIds | list[int], Constraint | None]
"""A prepared request: its prompt's ids and its grammar (None without one)."""


@dataclass(slots=True)
class Preparing:
    """A request handed to the intake workers and not back yet: its message and its record (a
    record that finished meanwhile was answered: what its preparation returns is dropped)."""

    msg: Submit | Embed
    request: Request


class Preparer:
    """One engine's request preparation (see the module docstring)."""

    def __init__(
        self,
        lib: _ffi.Library,
        model_file: ModelFile,
        *,
        caps: Capabilities,
        grammar_reset: bool,
        vocab_size: int,
        max_context: int,
        intake: Intake | None,
        inline: Tokenizer | None,
        post: Callable[[Message], None],
    ) -> None:
        self.lib = lib  # the engine thread's: grammars adopted for stepping are stepped through it
        self.model_file = model_file
        self.caps = caps  # which grammars the engine builds itself: asked once, at load
        self.grammar_reset = grammar_reset  # an engine grammar can be reset and kept for the next request
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.intake = intake
        self._inline = inline  # an engine without tokenizer-only handles: prepared on the engine thread
        self._post = post
        self.grammars = GrammarCache()  # compiled grammars by their source's digest
        self.backend: GrammarBackend | None = None  # built on first host-grammar use (llguidance import is slow)
        self._lock = threading.Lock()  # the grammar workers build the backend and count
        self._backend_built = threading.local()  # seconds this worker's compile spent building it
        self.grammar_backends: Counter[str] = Counter()  # "engine" / "llguidance" served
        self.grammar_compiles: Counter[str] = Counter()  # those compiled (not cached)
        self.live_grammars = 0
        self._preparing: dict[str, Preparing] = {}  # by request id
        self._end_ids: list[int] | None = None  # asked of the engine once, by the first thought gate

    @property
    def preparing(self) -> int:
        """Requests handed to the intake workers, not back yet (each holds a queue place)."""
        return len(self._preparing)

    def holds(self, rid: str) -> bool:
        """The request's preparation is out (answered meanwhile or not: it holds its queue place
        until its preparation returns)."""
        return rid in self._preparing

    def message(self, rid: str) -> Submit | Embed | None:
        """The message of a request being prepared, to answer it before its preparation returns."""
        entry = self._preparing.get(rid)
        return None if entry is None else entry.msg

    # ---- on the engine thread -------------------------------------------------------------

    def submit(self, msg: Submit, request: Request) -> tuple[list[int] | None, BaseException | None] | None:
        """Hand the request to the intake workers: tokenizing and grammar compiles never run on
        the engine thread (they can take unbounded time and stack). A prompt of ids without a
        grammar needs neither: its checked ids (or its error) are returned at once instead."""
        spec = msg.spec
        grammar = spec.lark is not None or spec.structural_tag is not None or spec.params.constrained
        grammar = grammar or spec.thought is not None  # a thought gate is a (cheap) grammar of its own
        sink = msg.sink

        def prepare(tok: Tokenizer) -> PromptAndGrammar | None:
            return self.prepare(tok, spec) if sink.alive() else None  # None: its reader left, skip the work

        if not grammar and _is_ids(spec.prompt):  # nothing to tokenize or compile: straight into the FIFO
            try:
                return self.checked_ids(spec.prompt), None  # type: ignore[arg-type]
            except AioBaseRTError as exc:
                return None, exc
        cost = spec.cost.text + (0 if spec.cost.grammar_key in self.grammars else spec.cost.grammar)
        self._off_thread(msg, request, prepare, grammar=grammar, cost=cost)
        return None

    def submit_embed(self, msg: Embed, text: str, request: Request) -> None:
        """An embedding's text input is tokenized by the intake workers."""
        limit = self.max_context
        self._off_thread(
            msg, request, lambda tok: tok.encode_text(text, special=False, limit=limit), grammar=False, cost=len(text)
        )

    def _off_thread(
        self, msg: Submit | Embed, request: Request, job: Callable[[Tokenizer], Any], *, grammar: bool, cost: int
    ) -> None:
        self._preparing[request.rid] = Preparing(msg, request)
        if self.intake is not None:
            self.intake.submit(
                job, lambda result, error: self._post(Prepared(msg, result, error)), grammar=grammar, cost=cost
            )
            return
        assert self._inline is not None
        result, error = run_job(job, self._inline)
        self._post(Prepared(msg, result, error))

    def returned(self, rid: str) -> Request:
        """The request's preparation came back (`protocol.Prepared`): its record (finished when it
        was answered meanwhile)."""
        return self._preparing.pop(rid).request

    def adopt(self, constraint: Constraint) -> None:
        """A prepared grammar goes live on the engine thread."""
        self.live_grammars += 1
        constraint.adopt(self.lib)  # an engine grammar: stepped through the engine's library from now on

    def close_constraint(self, constraint: Constraint, key: bytes | None) -> None:
        self.live_grammars -= 1
        if isinstance(constraint, ThoughtGate):  # the request's own grammar is what the cache keeps
            if constraint.inner is None:
                return
            constraint = constraint.inner
        if key is not None and self.grammars.give_back(key, constraint):  # kept for the next request
            return
        with contextlib.suppress(Exception):  # freeing must not stop the teardown
            constraint.close()

    def host_grammar_installed(self) -> bool:
        """llguidance is there to serve the grammars the engine's own compiler does not take."""
        return importlib.util.find_spec("llguidance") is not None

    def build_host_grammar(self, intake: Intake) -> None:
        """At open, before any stream runs (`EngineConfig.grammar_backend_at_open`): llguidance builds
        its tokenizer holding the GIL (~1 s for a 49k vocabulary, several for 262k), which on first
        use would pause every running stream once. Built on a worker (its tokenizer handle asks the
        end ids); a failure is left to the first request that needs it."""
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        intake.submit(lambda tok: self.host_grammar(tok), lambda result, error: built.set_result(None),
                      grammar=True, cost=_cost.QUICK_COST + 1)  # fmt: skip
        built.result()

    # ---- on an intake worker ----------------------------------------------------------------

    def prepare(self, tok: Tokenizer, spec: RequestSpec) -> PromptAndGrammar:
        """The request's grammar, then its prompt's ids. The grammar first: it decides which worker
        prepares the request (a cheap worker that comes to the host backend's first build hands the
        job, whole, to the costly one: `intake.Reroute`), so that is settled before the prompt is
        tokenized, and no prompt is tokenized twice."""
        for text in (spec.lark, spec.structural_tag):
            # tool schemas reach the compilers inside these texts: the same `$ref` cap
            # as a json_schema (a cheap, conservative count of the key itself)
            if text is not None and text.count('"$ref"') > MAX_SCHEMA_REFS:
                raise InvalidRequestError(f"tools: the tool schemas hold more than {MAX_SCHEMA_REFS} $refs")
        constraint: Constraint | None = None
        source = spec.lark is not None or spec.structural_tag is not None or spec.params.constrained
        if source or spec.thought is not None:
            tok.check_fits(_cost.prompt_chars(spec.prompt), self.max_context)  # no grammar for a text that cannot fit
            lazy_numpy.load()  # the engine thread masks a grammar's rows with numpy: imported here, never there
        if source:
            constraint = self.grammar_of(tok, spec)  # may raise Reroute: nothing is tokenized yet
        if spec.thought is not None:
            try:
                constraint = self.thought_gate(tok, spec.thought, constraint)
            except BaseException:
                if constraint is not None:
                    _discard(constraint, tok)
                raise
        try:
            prompt = self.tokenize_prompt(tok, spec)
        except BaseException:
            if constraint is not None:
                _discard(constraint, tok)
            raise
        return prompt, constraint

    def grammar_of(self, tok: Tokenizer, spec: RequestSpec) -> Constraint:
        """The request's grammar, from the cache when its source was compiled (or refused)
        before, else compiled here within `cost.COMPILE_BUDGET_S`."""
        key = spec.cost.grammar_key
        tools = spec.lark is not None or spec.structural_tag is not None
        if key is not None:
            hit: Constraint | None = self.grammars.take(key)  # raises the error a refused source got
            if hit is not None:
                self._count("engine" if hasattr(hit, "reset") else "llguidance")
                return hit
        started = time.monotonic()
        self._backend_built.seconds = 0.0
        other = None if tools else _cost.constraint_source(spec.params)
        try:
            if tools:
                constraint = self.build_tag_constraint(tok, spec.structural_tag, spec.lark)
            elif other is not None:  # regex, choice, grammar: the host backend's (the engine compiles schemas only)
                constraint = self._counted(None, lambda: self.host_grammar(tok).compile_constraint(*other))
            else:
                assert spec.params.json_schema is not None
                constraint = self.build_constraint(tok, spec.params.json_schema)
        except AioBaseRTError as exc:
            if key is not None:  # a compile error is the same the next time: never paid twice
                self.grammars.refuse(key, exc)
            raise
        took = time.monotonic() - started - self._backend_built.seconds  # the compile's, not the backend's
        budget = _cost.COMPILE_BUDGET_S
        if took > budget:
            constraint.close()
            # worded as the compilers' own errors, which the server maps to the request's field
            if tools:
                what = "invalid grammar: the tools' grammar"
            elif other is not None:
                what = f"invalid sampling parameter {other[0]}: its grammar"
            else:
                what = "invalid json_schema: its grammar"
            err = InvalidRequestError(
                f"{what} took {took:.1f} s to compile, over the budget of {budget:g} s (the same grammar is "
                "refused at once from now on)"
            )
            if key is not None:
                self.grammars.refuse(key, err)
            raise err
        if key is not None:
            self.grammars.remember(key, constraint)
        return constraint

    def thought_gate(self, tok: Tokenizer, spec: ThoughtSpec, inner: Constraint | None) -> ThoughtGate:
        """The lane's thought gate around its grammar (`inner`, or none): the tags' ids read
        through the worker's tokenizer (markers as their tokens; the close tag followed by the
        answer's header where the format has one: Harmony's), the end ids asked of the engine
        once per engine (only a gate with a grammar after it forbids them in the thought)."""
        ids = []
        for tag in (spec.open_tag, spec.close_tag + spec.answer_tag):
            encoded = tok.encode_list(tag, special=True)
            if not encoded or (not spec.answer_tag and len(encoded) != 1):
                raise InvalidRequestError(f"thinking: {tag!r} is not one token of this model's vocabulary")
            ids.append(encoded)
        if inner is not None and self._end_ids is None:
            from .grammar import engine_end_ids

            self._end_ids = engine_end_ids(tok.lib, tok.handle, self.vocab_size)
        return ThoughtGate(inner, spec, open_id=ids[0], close_id=ids[1], end_ids=self._end_ids or ())

    def build_constraint(self, tok: Tokenizer, schema: Mapping[str, Any] | bool) -> Constraint:
        """The lane's grammar: the engine's own where it has one, else the host backend.
        Through the worker's own tokenizer handle. Objects are closed
        (`schema.closed_objects`): the engine's grammar reads an absent additionalProperties
        as false, and the host's then reads the schema the same way."""
        from .grammar import EngineGrammarConstraint

        schema = closed_objects(schema)
        lib, model = tok.lib, tok.handle
        native = None
        if self.caps.grammar_compiler:
            native = EngineGrammarConstraint.create(lib, model, schema, resettable=self.grammar_reset)
        return self._counted(native, lambda: self.host_grammar(tok).compile(schema))

    def build_tag_constraint(self, tok: Tokenizer, tag: str | None, lark: str | None) -> Constraint:
        """A tool-call grammar: the engine's structural tag where the library builds
        it (bitmask stepping, like the schema path), else the host's Lark grammar."""
        from .grammar import EngineGrammarConstraint

        lib, model = tok.lib, tok.handle
        native = None
        if tag is not None and self.caps.structural_tag:
            native = EngineGrammarConstraint.from_structural_tag(lib, model, tag, resettable=self.grammar_reset)
        if native is None and lark is None:
            raise InvalidRequestError("the engine cannot build this structural tag and no host grammar was given")
        return self._counted(native, lambda: self.host_grammar(tok).compile_lark(lark or ""))  # lark: set here

    def _counted(self, native: Constraint | None, host: Callable[[], Constraint]) -> Constraint:
        """The engine's grammar when it built one, else the host's; counted by backend."""
        if native is not None:
            self._count("engine", compiled=True)
            return native
        constraint = host()
        self._count("llguidance", compiled=True)
        return constraint

    def _count(self, backend: str, *, compiled: bool = False) -> None:
        with self._lock:
            self.grammar_backends[backend] += 1  # grammars served (the cache's included)
            if compiled:
                self.grammar_compiles[backend] += 1

    def host_grammar(self, tok: Tokenizer) -> GrammarBackend:
        """The host (llguidance) backend, built once per engine by a grammar worker from the engine's
        `ModelFile` and the end ids asked of the engine through the worker's own tokenizer handle: at
        open (`EngineConfig.grammar_backend_at_open`), else on first use (once, holding the GIL:
        docs/fairness.md)."""
        with self._lock:
            if self.backend is None:
                if not on_costly_worker():  # built where only its request waits (a cheap worker moves on)
                    raise Reroute
                from .grammar import GrammarBackend, engine_end_ids

                started = time.monotonic()
                end_ids = engine_end_ids(tok.lib, tok.handle, self.vocab_size)
                try:
                    fields = self.model_file.bundle().tokenizer  # the header only: tensors stay unmapped
                except (OSError, ValueError) as exc:
                    raise InvalidRequestError(f"structured output: cannot read the model's tokenizer: {exc}") from None
                self.backend = GrammarBackend.for_tokenizer(fields, vocab_size=self.vocab_size, end_ids=end_ids)
                self._backend_built.seconds = time.monotonic() - started
            return self.backend

    def tokenize_prompt(self, tok: Tokenizer, spec: RequestSpec) -> TokenIds | list[int]:
        """A C array of ids (a text that cannot fit is refused untokenized)."""
        prompt = spec.prompt
        ids: TokenIds | list[int]
        if isinstance(prompt, str):
            ids = tok.encode_text(prompt, special=spec.parse_special, limit=self.max_context)
        elif prompt and isinstance(prompt[0], tuple):
            ids = tok.encode_pieces(prompt, limit=self.max_context)  # type: ignore[arg-type]
        else:
            ids = self.checked_ids(prompt)  # type: ignore[arg-type]
        if not ids:
            raise InvalidRequestError("the prompt is empty: it encodes to no tokens")
        return ids

    def checked_ids(self, prompt: Sequence[int]) -> list[int]:
        """Any thread: a prompt of ids, each checked against the vocabulary."""
        if len(prompt) > self.max_context:  # refused before the loop below: its cost stays bounded
            raise ContextLengthExceededError(len(prompt), 1, self.max_context)
        ids = list(prompt)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token {i} is {t!r}: not a token id of this model (vocab {self.vocab_size})"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty: it encodes to no tokens")
        return ids


def _discard(constraint: Constraint, tok: Tokenizer) -> None:
    """Free, on the worker, the grammar of a request refused after it was built (its prompt): an
    engine grammar is freed through the worker's own library view (one from the cache was adopted by
    the engine thread's: taken back first), a host grammar is only dropped."""
    constraint.adopt(tok.lib)
    with contextlib.suppress(Exception):  # freeing must not hide why the request was refused
        constraint.close()


def _is_ids(prompt: Prompt) -> bool:
    """A prompt of token ids (not text, not rendered chat pieces)."""
    return not isinstance(prompt, str) and not (len(prompt) > 0 and isinstance(prompt[0], tuple))

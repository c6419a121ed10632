"""The engine thread: the one thread that owns the model handle.

Every libbaseRT call of an engine happens here. The thread drains a
thread-safe inbox (`_protocol` messages: requests, cancellations, calls,
close), asks the batcher for the next step, has the `_step.StepRunner` run ONE
fused batch step over every active lane, passes each lane's token through
`_output.OutputProcessor` (text, stops, finish), and hands the whole step's
output to the event loop in one wake-up. With nothing to do it blocks on the
inbox: no spinning, and a new request wakes it at once. An embedding is a lane
as well (`EmbedLane`): its input is fed chunk by chunk in those same steps and
pooled from hidden-state taps, so it never stalls the running streams.

Teardown order matters: a lane's engine sequence is freed (rolled back first
when it was cancelled) before its bookkeeping is dropped, never after. A
request's trouble (bad input, a grammar that raises, a bug in its sampling)
costs that request only; the thread itself never dies of a request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import importlib.util
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from ctypes import byref, c_float, c_int, sizeof
from typing import TYPE_CHECKING, Any

from ._core import ffi as _ffi
from ._core import preparation
from ._core.grammar_cache import GrammarCache
from ._core.intake import Intake, Reroute, TokenIds, Tokenizer, on_costly_worker, run_job
from ._core.output import Detokenizer, OutputProcessor
from ._core.protocol import (
    Ask,
    Call,
    Cancel,
    Close,
    Constraint,
    Decode,
    Done,
    Embed,
    EngineConfig,
    EvictPrefixCache,
    Final,
    Message,
    Notify,
    Prepared,
    Prompt,
    Query,
    Release,
    RequestSpec,
    Reserve,
    Sink,
    Stats,
    Submit,
    Ticket,
)
from ._core.step import EmbedLane, Lane, Requests, RowResult, Sampled, StepRunner, TapPooler, internal_error
from .batcher import Batcher, LaneState
from .errors import (
    AioBaseRTError,
    ContextLengthExceededError,
    EngineClosedError,
    EngineError,
    EngineOverloadedError,
    ErrorCode,
    InvalidConfigError,
    InvalidRequestError,
)
from .types import MAX_SCHEMA_REFS, EngineStats, FinishReason, ModelInfo, Token

if TYPE_CHECKING:  # llguidance (the grammar module) and numpy (embeddings): imported on first use only
    import numpy as np

    from ._core.grammar import GrammarBackend

__all__ = [  # the contract types are re-exported for code that imported them from here
    "Call",
    "Cancel",
    "Close",
    "Constraint",
    "Embed",
    "EngineConfig",
    "EngineThread",
    "Final",
    "Message",
    "Prompt",
    "RequestSpec",
    "Sink",
    "Submit",
    "Ticket",
]

_EMBED_TAPS_ENV = "AIOBASERT_EMBED_TAPS"
"""Set to 0 to embed with one baseRT_embed call per input (the engine then
stalls for the whole forward): the comparison baseline of bench/embed_stall.py."""
_FAIRNESS_ENV = "AIOBASERT_ADMISSION"
"""Set to fifo for plain FIFO admission without preemption: the baseline of bench/fair_admission.py."""
_TAP_FUNCTIONS = (
    "baseRT_batch_step_fused_logits_rows_taps",
    "baseRT_read_tap_rows",
    "baseRT_tap_rows_capacity",
    "baseRT_model_supports_taps",
)
_UNDECIDED = object()
# Engine.open's kv_cache_dtype -> BaseRTLoadOptions.kv_bits, and baseRT_kv_bits_effective's answer -> a name
# (the reference engine reports its exact f32 pool as 32). "auto" and "f32": see _kv_bits.
_KV_BITS = {"f16": 16, "q8": 8}
_KV_NAMES = {32: "f32", 16: "f16", 8: "q8", 4: "q4", 84: "q8/q4"}


class EngineThread:
    """Owns the model handle; everything below runs on this thread only."""

    def __init__(self, lib: _ffi.Library, cfg: EngineConfig, notify: Notify) -> None:
        self.lib = lib
        self.cfg = cfg
        self._notify = notify  # LoopWaker.call_soon: fire-and-forget onto the loop
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.ready: concurrent.futures.Future[ModelInfo] = concurrent.futures.Future()
        self.stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name="aiobasert-engine", daemon=True)
        self._model: int | None = None
        self.requests = Requests()  # every request with a lane (queued or running), generation or embedding
        self._embed_pooler: Any = _UNDECIDED  # TapPooler, or None for the single-call path
        self._dirty: dict[str, Lane] = {}
        self._closing = False
        self._abort = False
        self._grammar: GrammarBackend | None = None  # built on first host-grammar use (llguidance import is slow)
        self._grammar_lock = threading.Lock()  # the grammar workers build it
        self._backend_built = threading.local()  # seconds this worker's compile spent building it
        self.intake: Intake | None = None
        self._inline_tok: Tokenizer | None = None
        self._preparing = 0  # requests handed to the intake workers, not back yet
        self._reserved = 0  # queue places held for fan-outs about to be submitted (Reserve / Release)
        self._in_prep: dict[str, Submit | Embed] = {}  # those requests, by id
        self._dropped: set[str] = set()  # requests answered (cancelled, aborted) while they were prepared
        self.steps = 0
        self.models_freed = 0
        self.live_sequences = 0
        self.live_grammars = 0
        self.grammar_backends: collections.Counter[str] = collections.Counter()  # "engine" / "llguidance" served
        self.grammar_compiles: collections.Counter[str] = collections.Counter()  # those compiled (not cached)
        self.grammars = GrammarCache()  # compiled grammars by their source's digest
        self.finished = 0
        self.cancelled = 0
        self.failed = 0
        self.thread_id: int | None = None

    # ---- loop-side API (thread-safe) --------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def post(self, msg: Message) -> None:
        self._inbox.put(msg)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- main loop --------------------------------------------------------------------

    def _main(self) -> None:
        self.thread_id = threading.get_ident()
        self.lib.bind_thread()
        try:
            info = self._load()
        except BaseException as exc:
            self.ready.set_exception(exc)
            self.stopped.set_result(None)
            return
        self.ready.set_result(info)
        try:
            self._serve()
        finally:
            try:
                self._shutdown()
            finally:
                self.stopped.set_result(None)

    def _special_tokens(self, handle: int) -> list[str]:
        """The text of every special (control / user-defined) token of the model."""
        lib = self.lib
        if not (lib.has("baseRT_special_token_count") and lib.has("baseRT_special_token")):
            return []
        count = int(lib.baseRT_special_token_count(handle))
        return [(lib.baseRT_special_token(handle, i, None) or b"").decode("utf-8", "replace") for i in range(count)]

    def _load(self) -> ModelInfo:
        lib, cfg = self.lib, self.cfg
        opts = _ffi.BaseRTLoadOptions(
            struct_size=sizeof(_ffi.BaseRTLoadOptions),
            kv_bits=self._kv_bits(cfg.kv_cache_dtype),
            paged_kv=1,
            max_batch_size=cfg.max_batch_size,
            prefix_cache=int(cfg.prefix_cache),
            prefill_chunk=cfg.prefill_chunk,
        )
        path = os.fsencode(cfg.model_path)
        # The intake's tokenizer handles first (tokenization and grammar compiles run there): their
        # loads parse the bundle's header while no weights are resident, and the model's own load then
        # shares their tokenizer, so the process peaks at the weights, not the weights plus a header.
        intake = Intake(lib, cfg.model_path) if lib.has("baseRT_load_tokenizer_only") else None
        try:
            if intake is not None:
                intake.wait_loaded()
            handle = lib.baseRT_load_model_ex(path, None, cfg.max_context, byref(opts))
            if not handle:
                raise lib.last_error("baseRT_load_model_ex", f"cannot load {cfg.model_path}")
            self._model = handle
            try:
                info = self._configure(handle, inline_tokenizer=intake is None)
            except BaseException:
                self._free_model()
                raise
            if intake is not None and self._host_grammar_only():
                self._build_host_grammar(intake)
        except BaseException:
            if intake is not None:
                intake.close()
            raise
        self.intake = intake
        return info

    def _configure(self, handle: int, *, inline_tokenizer: bool) -> ModelInfo:
        """Read the effective limits back from the loaded engine and plan with them."""
        lib, cfg = self.lib, self.cfg
        caps = int(lib.baseRT_capabilities(handle))
        if not caps & _ffi.CAP_SEQUENCES:
            raise AioBaseRTError(
                f"{cfg.model_path}: the engine cannot create sequences for this model "
                "(no continuous batching); aiobasert needs BASERT_CAP_SEQUENCES"
            )
        mc = _ffi.BaseRTModelConfig()
        lib.baseRT_get_config_into(handle, byref(mc), sizeof(mc))
        self.vocab_size = int(mc.vocab_size)
        self.max_context = int(mc.max_seq_len) or cfg.max_context
        self.page_size = int(lib.baseRT_page_size(handle)) or 16
        engine_chunk = int(lib.baseRT_max_prefill_chunk(handle)) or cfg.prefill_chunk
        # The engine may serve fewer lanes than asked (the reference engine caps
        # them at its prefill chunk): its descriptor says how many; plan with that.
        self.max_batch_size = cfg.max_batch_size
        descriptor = self._descriptor(handle)
        engine_batch = descriptor.get("max_batch_size")
        if isinstance(engine_batch, int) and not isinstance(engine_batch, bool) and engine_batch > 0:
            self.max_batch_size = min(cfg.max_batch_size, engine_batch)
        self.prefill_budget = max(1, min(cfg.prefill_chunk, engine_chunk))
        self.has_prefix = bool(caps & _ffi.CAP_PREFIX_CACHE) and lib.has("baseRT_prefix_match")
        stride = int(lib.baseRT_batch_logits_stride(handle))
        if stride < 2 * self.vocab_size:
            raise AioBaseRTError(f"engine reports a logits stride of {stride} bytes for vocab {self.vocab_size}")
        self.detok = Detokenizer(lib, handle)
        self.output = OutputProcessor(lib, handle, self.detok)
        self.runner = StepRunner(
            lib, handle, vocab_size=self.vocab_size, stride=stride, max_rows=self.max_batch_size,
            token_text=self.detok.token_text,
        )
        self.batcher = Batcher(
            max_batch_size=self.max_batch_size,
            max_context=self.max_context,
            prefill_budget=self.prefill_budget,
            max_queue=cfg.max_queue,
            page_size=self.page_size,
            prefix_cache=self.has_prefix,
            fair=os.environ.get(_FAIRNESS_ENV, "fair") != "fifo",
        )
        if all(lib.has(fn) for fn in _TAP_FUNCTIONS):
            cap = int(lib.baseRT_tap_rows_capacity(handle))
            self.batcher.tap_budget = cap if cap > 0 else None
        self.n_layers = int(mc.n_layers)
        self.dim = int(mc.dim)
        self.norm_eps = float(mc.norm_eps)
        template = ""
        if lib.has("baseRT_chat_template_jinja"):
            template = (lib.baseRT_chat_template_jinja(handle) or b"").decode("utf-8", "replace")
        if not template:  # a GGUF without a template (Gemma 3 270M): its family's, by the vocabulary
            from .chat import default_template

            template = default_template(self._special_tokens(handle))
        self.chat_template = template
        self.bos_token = self._static_str("baseRT_bos_token")
        self.eos_token = self._static_str("baseRT_eos_token")
        self.tokenizer = Tokenizer.borrow(lib, handle, cfg.model_path)  # the model handle's own, for this thread only
        if inline_tokenizer:  # an engine without a separate tokenizer handle: prepared here, between steps
            self._inline_tok = self.tokenizer
        return ModelInfo(
            path=cfg.model_path,
            architecture=mc.architecture.decode("utf-8", "replace"),
            vocab_size=self.vocab_size,
            dim=int(mc.dim),
            n_layers=int(mc.n_layers),
            n_heads=int(mc.n_heads),
            n_kv_heads=int(mc.n_kv_heads),
            max_context=self.max_context,
            max_batch_size=self.max_batch_size,
            prefix_cache=self.has_prefix,
            library_path=self.lib.path,
            library_version=self.lib.version,
            capabilities=caps,
            prefill_chunk=self.prefill_budget,
            kv_cache_dtype=self._kv_cache_dtype(handle),
        )

    def _kv_bits(self, dtype: str) -> int:
        """BaseRTLoadOptions.kv_bits for `dtype`. "auto" is f16 on the reference engine (as
        llama.cpp's default: half its exact f32 pool, which is its library default, kv_bits 0)
        and the library's own default elsewhere (BaseRT: Q8_0 where head_dim allows). "f32",
        the exact pool, only the reference engine has."""
        reference = self.lib.has("baseRT_ref_kernels")  # a symbol only the reference engine exports
        if dtype == "auto":
            return 16 if reference else 0
        if dtype == "f32":
            if not reference:
                raise InvalidConfigError(
                    f"kv_cache_dtype='f32' is the reference engine's exact KV pool; {self.lib.path} has none "
                    "(use 'auto', 'f16' or 'q8')"
                )
            return 0
        return _KV_BITS[dtype]

    def _kv_cache_dtype(self, handle: int) -> str:
        """What the engine allocated (it may override the request: a head_dim Q8_0 cannot split)."""
        if not self.lib.has("baseRT_kv_bits_effective"):
            return ""
        return _KV_NAMES.get(int(self.lib.baseRT_kv_bits_effective(handle)), "")

    def _descriptor(self, handle: int) -> dict[str, Any]:
        if not self.lib.has("baseRT_capability_descriptor"):
            return {}
        raw = self.lib.baseRT_capability_descriptor(handle)
        try:
            desc = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return desc if isinstance(desc, dict) else {}

    def _static_str(self, fn: str) -> str:
        if not self.lib.has(fn):
            return ""
        raw = getattr(self.lib, fn)(self._model)
        return (raw or b"").decode("utf-8", "replace")

    def _serve(self) -> None:
        while self._step():
            pass

    # ---- one step -----------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step, as vLLM v1's `EngineCore.step` (schedule -> execute -> update):

        1. drain the inbox: requests, cancels, queries, close (blocks when idle);
        2. plan: the batcher admits waiting requests (`_start` creates their
           sequences) and picks each running lane's row (`batcher.StepPlan`);
        3. run: `StepRunner.run` = prepare -> ONE fused forward -> collect;
        4. apply: each lane's `RowResult` is applied here, the lanes' one writer
           (tokens through `OutputProcessor`, finish, failure, freeing);
        5. deliver: everything the step produced reaches the loop in one wake-up.

        False once the engine is closed (drained, or aborted)."""
        idle = not self.batcher.has_runnable_work()
        busy = bool(self.requests or self._preparing)
        self._drain(block=idle and not (self._closing and not busy))
        # a drain serves the requests still being prepared too; an abort has answered them
        if self._closing and (self._abort or not (self._preparing or self.requests)):
            return False
        if self.batcher.has_runnable_work():
            self.steps += 1
            try:
                plan = self.batcher.plan(self._start, self._preempt)
                if plan.rows:
                    for result in self.runner.run([(self.requests.of(r.lane), r) for r in plan.rows]):
                        self._apply(result)
            except Exception as exc:  # last resort: a bug outside any one lane costs the running lanes
                self._fail_running(internal_error("in the engine step", exc))
        self._deliver()
        return True

    def _apply(self, result: RowResult) -> None:
        """Apply one lane's part of the step (the engine thread is the only writer of a lane)."""
        lane, row = result.lane, result.row
        if not self.requests.holds(lane):  # ended earlier in this step
            return
        if result.error is not None:
            self._end(lane, result.error)
            return
        if row.kind != "decode":
            lane.state.prefilled += row.tokens
        if isinstance(lane, EmbedLane):
            if result.pooled is not None:
                lane.add(result.pooled)
            self._embed_chunk_done(lane)
        elif result.sampled is not None:
            self._apply_token(lane, result.sampled)

    def _apply_token(self, lane: Lane, sampled: Sampled) -> None:
        try:
            out = self.output.process(lane, *sampled)
        except AioBaseRTError as exc:
            self._fail(lane, exc)
            return
        except Exception as exc:  # a bug in one lane's output costs that lane only
            self._fail(lane, internal_error("processing the output", exc))
            return
        if not lane.generated:
            lane.first_token_at = time.monotonic()
            lane.first_token_step = self.steps
        lane.generated.append(out.token.id)
        lane.state.generated += 1
        self._emit(lane, out.token)
        if out.finish is not None:
            self._finish(lane, out.finish)

    def _end(self, req: Lane | EmbedLane, error: BaseException | None) -> None:
        """End a request with its error, or (None) because it was cancelled."""
        if isinstance(req, EmbedLane):
            self._end_embed(req, None, error)
        elif error is None:
            self._cancel(req)
        else:
            self._fail(req, error)

    def _fail_running(self, exc: AioBaseRTError) -> None:
        for state in list(self.batcher.running):
            req = self.requests.get(state.rid)
            if req is not None:
                self._end(req, exc)

    def _drain(self, *, block: bool) -> None:
        try:
            msg = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Message) -> None:
        """One inbox message, by its type."""
        if isinstance(msg, Submit):
            self._intake(msg)
        elif isinstance(msg, Cancel):
            self._on_cancel(msg)
        elif isinstance(msg, Embed):
            self._intake_embed(msg)
        elif isinstance(msg, Prepared):
            self._on_prepared(msg)
        elif isinstance(msg, Ask):
            self._run_for(msg.done, lambda: self._answer(msg.query))
        elif isinstance(msg, Call):
            self._run_for(msg.done, msg.fn)
        elif isinstance(msg, Release):
            self._reserved -= msg.count
        else:
            self._on_close(msg)

    def _run_for(self, done: Done, fn: Callable[[], Any]) -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:
            result, error = None, exc
        self._notify(done, result, error)

    def _answer(self, query: Query) -> Any:
        """A query's answer, read between two steps."""
        if isinstance(query, Stats):
            return self.stats()
        if isinstance(query, EvictPrefixCache):
            return self.evict_prefix_cache()
        if isinstance(query, Decode):
            return self.decode_ids(query.ids)
        if isinstance(query, Reserve):
            return self._reserve(query.count)
        return self.encode_text(query.text, special=query.special)

    def _reserve(self, count: int) -> int:
        """Hold `count` queue places, all or none: the last of them must still fit."""
        if self._closing:
            raise EngineClosedError("the engine is closing")
        try:
            self.batcher.check_room(self._preparing + self._reserved + count - 1)
        except EngineOverloadedError:
            b = self.batcher
            free = max(0, b.max_batch_size - len(b.running))
            room = b.max_queue + free - len(b.waiting) - self._preparing - self._reserved
            raise EngineOverloadedError(
                f"request queue has room for {max(0, room)} of this request's {count} generations; retry later"
            ) from None
        self._reserved += count
        return count

    def _on_cancel(self, msg: Cancel) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:  # an embedding's caller is gone: free the lane, nobody to tell
            self._end(req, None)
        prep = self._in_prep.pop(msg.rid, None)
        if prep is not None:  # cancelled while it is prepared: counted now, dropped on return
            self._dropped.add(msg.rid)
            if isinstance(prep, Submit):
                self.cancelled += 1

    def _on_prepared(self, msg: Prepared) -> None:
        self._preparing -= 1
        if isinstance(msg.msg, Submit):
            self._enqueue(msg.msg, msg.result, msg.error)
        else:
            self._enqueue_embed(msg.msg, msg.result, msg.error)

    def _on_close(self, msg: Close) -> None:
        self._closing = True
        # Lanes nobody can read any more are cancelled; the others run to
        # their own end (bounded by max_tokens / the context: no lane ever
        # waits for its reader).
        for lane in self.requests.lanes():
            if not lane.sink.alive():
                self._cancel(lane)
        if msg.abort:
            self._abort = True
            for lane in self.requests.lanes():
                self._finish(lane, "aborted")
            self._abort_embeds()
            self._abort_in_prep()

    def _abort_in_prep(self) -> None:
        """Answer the requests still being prepared now: an abort waits for no compile."""
        closed = EngineClosedError("the engine was closed before the request started")
        for rid, prep in self._in_prep.items():
            self._dropped.add(rid)
            self.cancelled += 1
            if isinstance(prep, Submit):
                self._notify(prep.sink.deliver, [], None, closed)
            else:
                self._notify(prep.done, None, closed)
        self._in_prep.clear()

    def _cancel(self, lane: Lane) -> None:
        lane.state.cancelled = True
        self.cancelled += 1
        self._release(lane)

    # ---- intake: tokenize and validate, on this thread, before queueing --------------

    def _intake(self, msg: Submit) -> None:
        """Hand the request to the intake workers: tokenizing and grammar compiles
        never run here (they can take unbounded time and stack)."""
        spec = msg.spec
        if self._closing:
            self._notify(msg.sink.deliver, [], None, EngineClosedError("the engine is closing"))
            return
        try:  # refused before any work is spent on it; its queue slot is held while it is prepared
            self.batcher.check_room(self._preparing + self._reserved)
        except EngineOverloadedError as exc:
            self._notify(msg.sink.deliver, [], None, exc)
            return
        grammar = spec.lark is not None or spec.structural_tag is not None or spec.params.json_schema is not None
        sink = msg.sink

        def prepare(tok: Tokenizer) -> tuple[TokenIds | list[int], Constraint | None] | None:
            return self._prepare(tok, spec) if sink.alive() else None  # None: its reader left, skip the work

        if not grammar and _is_ids(spec.prompt):  # nothing to tokenize or compile: straight into the FIFO
            try:
                ids, error = self._checked_ids(spec.prompt), None  # type: ignore[arg-type]
            except AioBaseRTError as exc:
                ids, error = None, exc
            self._enqueue(msg, (ids, None), error)
            return
        self._in_prep[spec.rid] = msg
        cost = spec.cost.text + (0 if spec.cost.grammar_key in self.grammars else spec.cost.grammar)
        self._prepare_off_thread(msg, prepare, grammar=grammar, cost=cost)

    def _prepare_off_thread(
        self, msg: Submit | Embed, job: Callable[[Tokenizer], Any], *, grammar: bool, cost: int
    ) -> None:
        self._preparing += 1
        if self.intake is not None:
            self.intake.submit(
                job, lambda result, error: self.post(Prepared(msg, result, error)), grammar=grammar, cost=cost
            )
            return
        assert self._inline_tok is not None
        result, error = run_job(job, self._inline_tok)
        self.post(Prepared(msg, result, error))

    def _prepare(self, tok: Tokenizer, spec: RequestSpec) -> tuple[TokenIds | list[int], Constraint | None]:
        """On an intake worker: the prompt's ids and the request's grammar."""
        for text in (spec.lark, spec.structural_tag):
            # tool schemas reach the compilers inside these texts: the same `$ref` cap
            # as a json_schema (a cheap, conservative count of the key itself)
            if text is not None and text.count('"$ref"') > MAX_SCHEMA_REFS:
                raise InvalidRequestError(f"tools: the tool schemas hold more than {MAX_SCHEMA_REFS} $refs")
        prompt = self._tokenize_prompt(tok, spec)
        constraint: Constraint | None = None
        if spec.lark is not None or spec.structural_tag is not None or spec.params.json_schema is not None:
            constraint = self._grammar_of(tok, spec)
        return prompt, constraint

    def _grammar_of(self, tok: Tokenizer, spec: RequestSpec) -> Constraint:
        """On an intake worker: the request's grammar, from the cache when its source was compiled
        (or refused) before, else compiled here within `preparation.COMPILE_BUDGET_S`."""
        key = spec.cost.grammar_key
        tools = spec.lark is not None or spec.structural_tag is not None
        if key is not None:
            hit: Constraint | None = self.grammars.take(key)  # raises the error a refused source got
            if hit is not None:
                self._count("engine" if hasattr(hit, "reset") else "llguidance")
                return hit
        started = time.monotonic()
        self._backend_built.seconds = 0.0
        try:
            if tools:
                constraint = self._build_tag_constraint(tok, spec.structural_tag, spec.lark)
            else:
                assert spec.params.json_schema is not None
                constraint = self._build_constraint(tok, spec.params.json_schema)
        except AioBaseRTError as exc:
            if key is not None:  # a compile error is the same the next time: never paid twice
                self.grammars.refuse(key, exc)
            raise
        took = time.monotonic() - started - self._backend_built.seconds  # the compile's, not the backend's
        budget = preparation.COMPILE_BUDGET_S
        if took > budget:
            close = getattr(constraint, "close", None)
            if close is not None:
                close()
            # worded as the compilers' own errors, which the server maps to the request's field
            what = "invalid grammar: the tools' grammar" if tools else "invalid json_schema: its grammar"
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

    def _enqueue(self, msg: Submit, prepared: Any, error: BaseException | None) -> None:
        """A prepared request joins the FIFO queue (or is answered with its error)."""
        spec = msg.spec
        constraint: Constraint | None = None
        self._in_prep.pop(spec.rid, None)
        dropped = spec.rid in self._dropped  # its Cancel came (and was counted) while it was prepared
        self._dropped.discard(spec.rid)
        try:
            if error is not None:
                if dropped:  # nobody to tell
                    return
                raise error
            if prepared is None:  # its reader had left before the work began
                if not dropped:
                    self.cancelled += 1
                return
            prompt, constraint = prepared
            if constraint is not None:
                self.live_grammars += 1
                adopt = getattr(constraint, "adopt", None)
                if adopt is not None:  # an engine grammar: stepped through the engine's library from now on
                    adopt(self.lib)
            if self._closing and self._abort:
                raise EngineClosedError("the engine was closed before the request started")
            if dropped or not msg.sink.alive():  # cancelled while it was prepared: nobody to serve
                if constraint is not None:
                    self._close_constraint(constraint, spec.cost.grammar_key)
                if not dropped:
                    self.cancelled += 1
                return
            max_new = self.batcher.resolve_max_tokens(len(prompt), spec.params.max_tokens)
            lane = Lane(spec, msg.sink, msg.ticket, prompt, max_new, constraint)
            lane.submitted_step = self.steps
            self.batcher.enqueue(lane.state, reserved=True)
        except BaseException as exc:
            if constraint is not None:  # refused after its grammar was built: free it
                self._close_constraint(constraint, spec.cost.grammar_key)
            err = exc if isinstance(exc, AioBaseRTError) else internal_error("at intake", exc)
            self._notify(msg.sink.deliver, [], None, err)
            if not isinstance(exc, Exception):
                raise
            return
        self.requests.add(lane)

    def _build_constraint(self, tok: Tokenizer, schema: Mapping[str, Any] | bool) -> Constraint:
        """The lane's grammar: the engine's own where it has one, else the host backend.
        On an intake worker, through its own tokenizer handle. Objects are closed
        (`tools.closed_objects`): the engine's grammar reads an absent additionalProperties
        as false, and the host's then reads the schema the same way."""
        from ._core.grammar import EngineGrammarConstraint
        from .tools import closed_objects

        schema = closed_objects(schema)
        lib, model = tok.lib, tok.handle
        native = None
        if lib.has("baseRT_grammar_create_from_schema") and lib.has("baseRT_grammar_fill_bitmask"):
            native = EngineGrammarConstraint.create(lib, model, schema)
        return self._counted(native, lambda: self._host_grammar(tok).compile(schema))

    def _build_tag_constraint(self, tok: Tokenizer, tag: str | None, lark: str | None) -> Constraint:
        """A tool-call grammar: the engine's structural tag where the library builds
        it (bitmask stepping, like the schema path), else the host's Lark grammar."""
        from ._core.grammar import EngineGrammarConstraint

        lib, model = tok.lib, tok.handle
        native = None
        if (
            tag is not None
            and lib.has("baseRT_grammar_create_from_structural_tag")
            and lib.has("baseRT_grammar_fill_bitmask")
        ):
            native = EngineGrammarConstraint.from_structural_tag(lib, model, tag)
        if native is None and lark is None:
            raise InvalidRequestError("the engine cannot build this structural tag and no host grammar was given")
        return self._counted(native, lambda: self._host_grammar(tok).compile_lark(lark or ""))  # lark: set here

    def _counted(self, native: Constraint | None, host: Callable[[], Constraint]) -> Constraint:
        """The engine's grammar when it built one, else the host's; counted by backend."""
        if native is not None:
            self._count("engine", compiled=True)
            return native
        constraint = host()
        self._count("llguidance", compiled=True)
        return constraint

    def _count(self, backend: str, *, compiled: bool = False) -> None:
        with self._grammar_lock:
            self.grammar_backends[backend] += 1  # grammars served (the cache's included)
            if compiled:
                self.grammar_compiles[backend] += 1

    def _host_grammar_only(self) -> bool:
        """The engine has no grammar compiler of its own: llguidance serves every json_schema."""
        lib = self.lib
        native = lib.has("baseRT_grammar_create_from_schema") and lib.has("baseRT_grammar_fill_bitmask")
        return not native and importlib.util.find_spec("llguidance") is not None

    def _build_host_grammar(self, intake: Intake) -> None:
        """At open, before any stream runs: llguidance builds its tokenizer holding the GIL (0.3-1 s
        for a 50k vocabulary), which on first use would pause every running stream once. Built on a
        worker (its tokenizer handle asks the end ids); a failure is left to the first request."""
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        intake.submit(lambda tok: self._host_grammar(tok), lambda result, error: built.set_result(None),
                      grammar=True, cost=preparation.QUICK_COST + 1)  # fmt: skip
        built.result()

    def _host_grammar(self, tok: Tokenizer) -> GrammarBackend:
        """The host (llguidance) backend, built once per engine by a grammar worker, through its own
        tokenizer handle (the end ids are asked of the engine): at open where the engine has no grammar
        compiler of its own, else on first use (once, holding the GIL: docs/fairness.md)."""
        with self._grammar_lock:
            if self._grammar is None:
                if not on_costly_worker():  # built where only its request waits (a cheap worker moves on)
                    raise Reroute
                from ._core.grammar import GrammarBackend, engine_end_ids

                started = time.monotonic()

                end_ids = engine_end_ids(tok.lib, tok.handle, self.vocab_size)
                self._grammar = GrammarBackend.for_bundle(self.cfg.model_path, vocab_size=self.vocab_size,
                                                          end_ids=end_ids)
                self._backend_built.seconds = time.monotonic() - started
            return self._grammar

    def _close_constraint(self, constraint: Constraint, key: bytes | None) -> None:
        self.live_grammars -= 1
        if key is not None and self.grammars.give_back(key, constraint):  # kept for the next request
            return
        close = getattr(constraint, "close", None)
        if close is not None:  # an engine-side grammar handle
            with contextlib.suppress(Exception):  # freeing must not stop the teardown
                close()

    def _tokenize_prompt(self, tok: Tokenizer, spec: RequestSpec) -> TokenIds | list[int]:
        """On an intake worker: a C array of ids (a text that cannot fit is refused untokenized)."""
        prompt = spec.prompt
        ids: TokenIds | list[int]
        if isinstance(prompt, str):
            ids = tok.encode_text(prompt, special=spec.parse_special, limit=self.max_context)
        elif prompt and isinstance(prompt[0], tuple):
            ids = tok.encode_pieces(prompt, limit=self.max_context)  # type: ignore[arg-type]
        else:
            ids = self._checked_ids(prompt)  # type: ignore[arg-type]
        if not ids:
            raise InvalidRequestError("the prompt is empty: it encodes to no tokens")
        return ids

    def _checked_ids(self, prompt: Sequence[int]) -> list[int]:
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

    # ---- embeddings ---------------------------------------------------------------------

    def _intake_embed(self, msg: Embed) -> None:
        """A text input is tokenized by the intake workers first; ids go straight on."""
        try:
            if self._closing:
                raise EngineClosedError("the engine is closing")
            self.batcher.check_room(self._preparing + self._reserved)  # its queue slot is held while it is prepared
        except AioBaseRTError as exc:
            self._notify(msg.done, None, exc)
            return
        if isinstance(msg.source, str):
            text = msg.source
            self._in_prep[msg.rid] = msg
            limit = self.max_context
            self._prepare_off_thread(
                msg, lambda tok: tok.encode_text(text, special=False, limit=limit), grammar=False, cost=len(text)
            )
        else:
            self._enqueue_embed(msg, list(msg.source), None)

    def _enqueue_embed(self, msg: Embed, ids: Sequence[int] | None, error: BaseException | None) -> None:
        """Validate an embedding and queue it as a lane (or, without taps, run it now)."""
        self._in_prep.pop(msg.rid, None)
        if msg.rid in self._dropped:  # cancelled or aborted while it was tokenized: already answered
            self._dropped.discard(msg.rid)
            return
        try:
            if error is not None:
                raise error
            if self._closing and self._abort:
                raise EngineClosedError("the engine was closed before the embedding started")
            assert ids is not None
            if not ids:
                raise InvalidRequestError("cannot embed an empty input")
            if len(ids) > self.max_context:
                raise InvalidRequestError(
                    f"input of {len(ids)} tokens exceeds the context window of {self.max_context} tokens"
                )
            if self._embed_path() is None:  # one atomic forward, between two steps (as before taps)
                self._notify(msg.done, self.embed(ids, self.dim), None)
                return
            lane = EmbedLane(msg.rid, ids, self.dim, msg.done, msg.client)
            self.batcher.enqueue(lane.state, reserved=True)
        except BaseException as exc:
            err = exc if isinstance(exc, AioBaseRTError) else internal_error("at intake", exc)
            self._notify(msg.done, None, err)
            if not isinstance(exc, Exception):
                raise
            return
        self.requests.add(lane)

    def _embed_path(self) -> TapPooler | None:
        """The tapped (chunked) embedding path, or None for one baseRT_embed call.

        Decided once, on the first embedding: the engine must offer taps, the
        bundle must carry the final norm weight that baseRT_embed applies, and a
        probe pooled from taps must match baseRT_embed. Any doubt keeps the
        single call, whose result is the reference. A probe the engine could not
        run right now (no free KV for it) decides nothing: this input takes the
        single call and the next one probes again."""
        if self._embed_pooler is _UNDECIDED:
            pooler = None
            if os.environ.get(_EMBED_TAPS_ENV, "1") != "0":
                try:
                    pooler = self._probe_taps()
                except EngineError:  # the engine refused the probe's steps for now
                    return None
                except Exception:
                    pooler = None
            self._embed_pooler = pooler
            self.runner.pooler = pooler
        return self._embed_pooler  # type: ignore[no-any-return]

    def _probe_taps(self) -> TapPooler | None:
        lib, model = self.lib, self._model
        cap = self.batcher.tap_budget
        if cap is None or not all(lib.has(fn) for fn in _TAP_FUNCTIONS):
            return None
        if lib.baseRT_model_supports_taps(model) != 1:
            return None
        import numpy as np

        from .models.bundle import read_bundle

        with read_bundle(self.cfg.model_path) as bundle:
            weight = np.asarray(bundle.tensor("final_norm.weight"), dtype=np.float32).reshape(-1)
        if weight.shape != (self.dim,):
            return None
        pooler = TapPooler(weight, self.norm_eps, self.n_layers, cap)
        probe = [(7 * i + 3) % self.vocab_size for i in range(min(12, cap, self.max_context))]
        want = self.embed(probe, self.dim).astype(np.float64)
        got = self._tapped_once(probe, pooler)
        if got is None or not np.isfinite(got).all():
            return None
        # A wrong norm or tap is off by O(1); f16 rounding by ~1e-4.
        if np.linalg.norm(got - want) > 1e-2 * max(float(np.linalg.norm(want)), 1e-30):
            return None
        return pooler

    def _tapped_once(self, ids: list[int], pooler: TapPooler) -> np.ndarray | None:
        """Pool `ids` through one tapped step on a scratch sequence (the probe)."""
        lib, model = self.lib, self._model
        seq = lib.baseRT_sequence_create(model)
        if not seq:
            raise lib.last_error("baseRT_sequence_create")
        try:
            n = len(ids)
            one = (c_int * 1)
            rc = lib.baseRT_batch_step_fused_logits_rows_taps(
                model, (ctypes.c_void_p * 1)(seq), 1, _ffi.u32_array(ids), one(n), one(1),
                one(pooler.hidden_index), 1, one(n),
            )
            if rc == ErrorCode.OUT_OF_MEMORY:
                raise lib.last_error("baseRT_batch_step_fused_logits_rows_taps")
            if rc != 0 or lib.baseRT_read_tap_rows(model, 0, n, pooler.rows.ctypes.data) != self.dim:
                return None
            return pooler.pooled_sum(pooler.rows[:n]) / n
        finally:
            lib.baseRT_sequence_rollback(seq, 0)
            lib.baseRT_sequence_free(seq)

    def _admit_embed(self, lane: EmbedLane) -> None:
        seq = self.lib.baseRT_sequence_create(self._model)
        if not seq:
            self._end_embed(lane, None, self.lib.last_error("baseRT_sequence_create"))
            return
        lane.seq = seq
        self.live_sequences += 1

    def _embed_chunk_done(self, lane: EmbedLane) -> None:
        if lane.state.prefilling:
            return
        if lane.finite:
            self._end_embed(lane, lane.result(), None)
            return
        # The tapped hidden state overflowed f16: this input needs the f32 path.
        self._free_embed(lane)
        try:
            result, error = self.embed(lane.ids, self.dim), None
        except AioBaseRTError as exc:
            result, error = None, exc
        self._notify(lane.done, result, error)

    def _end_embed(self, lane: EmbedLane, result: np.ndarray | None, error: BaseException | None) -> None:
        """Free the embedding's lane, then hand its result or error to the caller (none when cancelled)."""
        self._free_embed(lane)
        if result is not None or error is not None:
            self._notify(lane.done, result, error)

    def _free_embed(self, lane: EmbedLane) -> None:
        if lane.seq is not None:
            self.lib.baseRT_sequence_rollback(lane.seq, 0)
            self.lib.baseRT_sequence_free(lane.seq)
            lane.seq = None
            self.live_sequences -= 1
        st = lane.state
        if st.admitted or st in self.batcher.waiting:
            self.batcher.remove(st)
        self.requests.pop(lane.rid)

    def _abort_embeds(self) -> None:
        for lane in self.requests.embeds():
            self._end_embed(lane, None, EngineClosedError("the engine was closed before the embedding finished"))

    # ---- tokenizer helpers (engine thread) ---------------------------------------------

    def encode_text(self, text: str, *, special: bool) -> list[int]:
        return self.tokenizer.encode_text(text, special=special)[:]

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        return self.tokenizer.encode_pieces(pieces)[:]

    def token_bytes(self, tok: int) -> bytes:
        return self.detok.token_bytes(tok)

    def decode_ids(self, ids: Sequence[int]) -> str:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"{t!r} is not a token id of this model (vocab {self.vocab_size})")
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")

    def embed(self, ids: Sequence[int], dim: int) -> np.ndarray:
        import numpy as np

        arr = _ffi.u32_array(ids)
        out = np.zeros(dim, dtype=np.float32)
        n = self.lib.baseRT_embed(self._model, arr, len(ids), out.ctypes.data_as(ctypes.POINTER(c_float)), dim)
        if n <= 0:
            raise self.lib.last_error("baseRT_embed")
        return out[:n]

    def stats(self) -> EngineStats:
        ms = _ffi.BaseRTMemoryStats()
        if not self.lib.baseRT_model_memory_stats(self._model, byref(ms)):
            raise self.lib.last_error("baseRT_model_memory_stats")
        cached = c_int(0)
        if self.has_prefix and self.lib.has("baseRT_prefix_cache_stats"):
            self.lib.baseRT_prefix_cache_stats(self._model, None, None, None, byref(cached))
        return EngineStats(
            steps=self.steps,
            active_lanes=len(self.batcher.running),
            waiting_requests=len(self.batcher.waiting),
            live_sequences=self.live_sequences,
            live_grammars=self.live_grammars,
            kv_blocks_total=int(ms.kv_cache_blocks_total),
            kv_blocks_used=int(ms.kv_cache_blocks_used),
            prefix_blocks_cached=int(cached.value),
            requests_finished=self.finished,
            requests_cancelled=self.cancelled,
            requests_failed=self.failed,
            kv_cache_bytes=int(ms.kv_cache_capacity_bytes),
            engine_bytes=int(ms.runtime_allocated_bytes),
            requests_preempted=self.batcher.preemptions,
        )

    def evict_prefix_cache(self) -> int:
        if not self.has_prefix or not self.lib.has("baseRT_prefix_evict"):
            return 0
        return int(self.lib.baseRT_prefix_evict(self._model, 1 << 30))

    # ---- lane lifecycle ---------------------------------------------------------------

    def _start(self, state: LaneState) -> None:
        """A lane was admitted (`Batcher.plan`): its engine sequence, before its first row."""
        req = self.requests.of(state)
        if isinstance(req, EmbedLane):
            self._admit_embed(req)
        else:
            self._admit(req)

    def _admit(self, lane: Lane) -> None:
        lib, model = self.lib, self._model
        st = lane.state
        resumed = lane.admitted_step >= 0  # a preempted lane: its first admission's timing and usage stay
        if not resumed:
            lane.admitted_step = self.steps
            lane.admitted_at = time.monotonic()
        match = None
        if self.batcher.should_match_prefix(st):
            match = lib.baseRT_prefix_match(model, lane.fed_array(), st.kv_target)
            if not match.handle:
                match = None
        seq = lib.baseRT_sequence_create(model)
        if not seq:
            err = lib.last_error("baseRT_sequence_create")
            if match is not None:
                lib.baseRT_prefix_release(model, match.handle)
            self._fail(lane, err)
            return
        lane.seq = seq
        self.live_sequences += 1
        if match is not None:
            rc = lib.baseRT_sequence_seed_prefix(seq, match.blocks, match.n_blocks, match.matched_tokens)
            if rc == 0:
                lane.prefix_handle = int(match.handle)
                st.prefilled = int(match.matched_tokens)
                if not resumed:
                    lane.cached = st.prefilled
            else:
                lib.baseRT_prefix_release(model, match.handle)

    def _preempt(self, state: LaneState) -> None:
        """The batcher takes a lane back for another client (docs/fairness.md): its
        KV goes to the prefix cache (so its resume re-prefills little), its sequence
        is freed; the request keeps its output, stream and grammar state, and waits
        to resume from prompt + output."""
        lane = self.requests.of(state)
        assert isinstance(lane, Lane)  # the batcher never preempts an embedding
        self._free_sequence(lane, keep_kv=True)

    def _free_sequence(self, lane: Lane, *, keep_kv: bool) -> None:
        """Free a lane's engine sequence and its prefix-cache lock. `keep_kv`: its KV goes to the
        prefix cache where the batcher publishes it (else it is rolled back first)."""
        lib, model = self.lib, self._model
        if lane.seq is not None:
            kv = lane.kv_tokens() if keep_kv else None  # a C array: no request-sized Python list here
            if kv is not None and self.batcher.should_publish_prefix(lane.state, len(kv)):
                lib.baseRT_prefix_insert(model, kv, len(kv), lane.seq)  # best effort
            else:
                lib.baseRT_sequence_rollback(lane.seq, 0)
            lib.baseRT_sequence_free(lane.seq)
            lane.seq = None
            self.live_sequences -= 1
        if lane.prefix_handle:
            lib.baseRT_prefix_unlock(model, lane.prefix_handle)
            lane.prefix_handle = 0

    def _emit(self, lane: Lane, token: Token) -> None:
        lane.pending.append(token)
        lane.ticket.delivered += 1
        self._dirty[lane.rid] = lane

    def _finish(self, lane: Lane, reason: FinishReason) -> None:
        lane.final = self.output.final(lane, reason, self.steps)
        if reason == "aborted":
            self.cancelled += 1
        else:
            self.finished += 1
        self._dirty[lane.rid] = lane
        self._release(lane)

    def _fail(self, lane: Lane, exc: BaseException) -> None:
        self.failed += 1
        lane.error = exc
        self._dirty[lane.rid] = lane
        self._release(lane)

    def _release(self, lane: Lane) -> None:
        """Return everything a lane holds in the engine, then forget the lane."""
        st = lane.state
        # a cancelled, aborted or failed lane's KV is dropped; a finished one's may serve a later prompt
        self._free_sequence(lane, keep_kv=lane.final is not None and lane.final.finish_reason in ("stop", "length"))
        if lane.constraint is not None:
            constraint, lane.constraint = lane.constraint, None
            self._close_constraint(constraint, lane.spec.cost.grammar_key)
        if st.admitted or st in self.batcher.waiting:
            self.batcher.remove(st)
        self.requests.pop(lane.rid)

    def _deliver(self) -> None:
        """One wake-up of the loop for everything this step produced."""
        if not self._dirty:
            return
        batch = [(lane.sink, lane.pending, lane.final, lane.error) for lane in self._dirty.values()]
        for lane in self._dirty.values():
            lane.pending = []
        self._dirty = {}
        self._notify(_deliver_batch, batch)

    def _shutdown(self) -> None:
        for lane in self.requests.lanes():
            self._finish(lane, "aborted")
        self._abort_embeds()
        self._deliver()
        self.grammars.close()  # the kept engine grammars, before the workers free the handles they came from
        if self.intake is not None:
            # The workers end after their current job (each frees its own tokenizer
            # handle, independent of the model): an abort waits for no compile.
            self.intake.close()
        self._free_model()

    def _free_model(self) -> None:
        if self._model is not None:
            self.lib.baseRT_free_model(self._model)
            self._model = None
            self.models_freed += 1


def _is_ids(prompt: Prompt) -> bool:
    """A prompt of token ids (not text, not rendered chat pieces)."""
    return not isinstance(prompt, str) and not (len(prompt) > 0 and isinstance(prompt[0], tuple))


def _deliver_batch(batch: list[tuple[Sink, list[Token], Final | None, BaseException | None]]) -> None:
    """Runs on the event loop: hand each stream its part of one step."""
    for sink, tokens, final, error in batch:
        sink.deliver(tokens, final, error)

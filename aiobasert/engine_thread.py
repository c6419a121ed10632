"""The engine thread: the one thread that owns the model handle.

Every libbaseRT call of the model handle happens here. The thread loads and
configures the model, drains a thread-safe inbox (`_core.protocol` messages:
requests, cancellations, queries, calls, close), asks the batcher for the next
step, has the `_core.step.StepRunner` run ONE fused batch step over every
active lane, passes each lane's token through `_core.output.OutputProcessor`
(text, stops, finish), and hands the whole step's output to the event loop in
one wake-up. With nothing to do it blocks on the inbox: no spinning, and a new
request wakes it at once.

A request is prepared first (`_core.prepare.Preparer`: its prompt tokenized and
its grammar compiled on the intake workers, never here) and becomes a lane when
it comes back. An embedding is a lane as well (`EmbedLane`): its input is fed
chunk by chunk in those same steps and pooled from hidden-state taps
(`_core.embed.Embedder` decides that path), so it never stalls the running
streams. This module is the lanes' one writer: their admission, tokens, end
and freeing.

Teardown order matters: a lane's engine sequence is freed (rolled back first
when it was cancelled) before its bookkeeping is dropped, never after. A
request's trouble (bad input, a grammar that raises, a bug in its sampling)
costs that request only; the thread itself never dies of a request.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from ctypes import byref, c_int, sizeof
from typing import TYPE_CHECKING, Any

from ._core import ffi as _ffi
from ._core.embed import TAP_FUNCTIONS, Embedder
from ._core.intake import Intake, Tokenizer
from ._core.memory import available_memory
from ._core.model_file import ModelFile
from ._core.output import Detokenizer, OutputProcessor
from ._core.plan import LaneState
from ._core.prepare import Preparer, RequestStatus
from ._core.protocol import (
    Ask,
    Call,
    Cancel,
    Close,
    Constraint,
    Decode,
    Done,
    Embed,
    EvictPrefixCache,
    Final,
    Message,
    Notify,
    Prepared,
    Query,
    Release,
    Reserve,
    Sink,
    Stats,
    Submit,
)
from ._core.step import EmbedLane, Lane, Requests, RowResult, Sampled, StepRunner, TapPooler, internal_error
from .batcher import Batcher
from .config import EngineConfig
from .errors import (
    AioBaseRTError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidConfigError,
    InvalidRequestError,
)
from .types import EngineStats, FinishReason, ModelInfo, Token

if TYPE_CHECKING:  # numpy (embeddings): imported on first use only
    import numpy as np

_FAIRNESS_ENV = "AIOBASERT_ADMISSION"
"""Set to fifo for plain FIFO admission without preemption: the baseline of bench/fair_admission.py."""
# Engine.open's kv_cache_dtype -> BaseRTLoadOptions.kv_bits, and baseRT_kv_bits_effective's answer -> a name
# (the reference engine reports its exact f32 pool as 32). "auto" and "f32": see _kv_bits.
_KV_BITS = {"f16": 16, "q8": 8}
_KV_NAMES = {32: "f32", 16: "f16", 8: "q8", 4: "q4", 84: "q8/q4"}


class EngineThread:
    """Owns the model handle; everything below runs on this thread only."""

    def __init__(self, lib: _ffi.Library, model_path: str, cfg: EngineConfig, notify: Notify) -> None:
        self.lib = lib
        self.model_path = model_path  # the resolved `.base` bundle
        self.cfg = cfg
        self._notify = notify  # LoopWaker.call_soon: fire-and-forget onto the loop
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.ready: concurrent.futures.Future[ModelInfo] = concurrent.futures.Future()
        self.stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name="aiobasert-engine", daemon=True)
        self._model: int | None = None
        self.requests = Requests()  # every request with a lane (queued or running), generation or embedding
        self._dirty: dict[str, Lane] = {}
        self._closing = False
        self._abort = False
        self._load_cancelled = threading.Event()  # set by a cancelled Engine.open: the load stops at its next phase
        self.intake: Intake | None = None
        self._reserved = 0  # queue places held for fan-outs about to be submitted (Reserve / Release)
        self.steps = 0
        self.models_freed = 0
        self.live_sequences = 0
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

    def cancel_load(self) -> None:
        """Nobody will hold this engine (its open was cancelled): the load ends at its next phase."""
        self._load_cancelled.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- main loop: load and configure, then serve ----------------------------------------

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
        path = os.fsencode(self.model_path)
        available = available_memory()  # before the load: what the weights and the pool may take
        # The intake's tokenizer handles first (tokenization and grammar compiles run there): their
        # loads parse the bundle's header while no weights are resident, and the model's own load then
        # shares their tokenizer, so the process peaks at the weights, not the weights plus a header.
        intake = Intake(lib, self.model_path) if lib.has("baseRT_load_tokenizer_only") else None
        try:
            if intake is not None:
                intake.wait_loaded()
            self._check_cancelled("the tokenizer")
            handle = lib.baseRT_load_model_ex(path, None, cfg.max_context, byref(opts))
            if not handle:
                raise lib.last_error("baseRT_load_model_ex", f"cannot load {self.model_path}")
            self._model = handle
            try:
                self._check_memory(handle, available)
                self._check_cancelled("the weights and the KV pool")
                info = self._configure(handle, intake)
                if intake is not None and cfg.grammar_backend_at_open and self.prep.host_grammar_installed():
                    self._check_cancelled("the engine's configuration")
                    self.prep.build_host_grammar(intake)
                self._check_cancelled("the load")
            except BaseException:
                self._free_model()
                raise
        except BaseException:
            if intake is not None:
                intake.close()
            raise
        self.intake = intake
        return info

    def _configure(self, handle: int, intake: Intake | None) -> ModelInfo:
        """Read the effective limits back from the loaded engine and plan with them. The model's
        file is opened for the host here, once (`ModelFile`), and handed to what reads it."""
        lib, cfg = self.lib, self.cfg
        caps = int(lib.baseRT_capabilities(handle))
        if not caps & _ffi.CAP_SEQUENCES:
            raise AioBaseRTError(
                f"{self.model_path}: the engine cannot create sequences for this model "
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
        self.prefix_bound = self._prefix_bound(handle)
        stride = int(lib.baseRT_batch_logits_stride(handle))
        if stride < 2 * self.vocab_size:
            raise AioBaseRTError(f"engine reports a logits stride of {stride} bytes for vocab {self.vocab_size}")
        self.detok = Detokenizer(lib, handle)
        self.output = OutputProcessor(lib, handle, self.detok)
        self.runner = StepRunner(
            lib,
            handle,
            vocab_size=self.vocab_size,
            stride=stride,
            max_rows=self.max_batch_size,
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
        if all(lib.has(fn) for fn in TAP_FUNCTIONS):
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
        self.tokenizer = Tokenizer.borrow(lib, handle, self.model_path)  # the model handle's own, for this thread only
        model_file = ModelFile(self.model_path)
        self.prep = Preparer(
            lib,
            model_file,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            intake=intake,
            # an engine without a separate tokenizer handle: prepared here, between steps
            inline=self.tokenizer if intake is None else None,
            post=self.post,
        )
        self.embedder = Embedder(
            lib,
            handle,
            model_file,
            dim=self.dim,
            n_layers=self.n_layers,
            norm_eps=self.norm_eps,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            tap_budget=self.batcher.tap_budget,
        )
        return ModelInfo(
            path=self.model_path,
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
            bos_token=self._static_str("baseRT_bos_token"),
            eos_token=self._static_str("baseRT_eos_token"),
            engine_threads=self._engine_threads(),
        )

    def _prefix_bound(self, handle: int) -> int | None:
        """The most blocks the prefix cache keeps (`EngineConfig.prefix_cache_mb`, in the engine's block
        size), or None where it cannot be held to one (no cache, or an engine without the calls)."""
        lib = self.lib
        if not (self.has_prefix and lib.has("baseRT_prefix_evict") and lib.has("baseRT_prefix_cache_stats")):
            return None
        ms = _ffi.BaseRTMemoryStats()
        if not lib.baseRT_model_memory_stats(handle, byref(ms)) or ms.kv_cache_blocks_total <= 0:
            return None
        total = int(ms.kv_cache_blocks_total)
        if self.cfg.prefix_cache_mb is None:
            return total // 4
        block_bytes = max(1, int(ms.kv_cache_capacity_bytes) // total)
        return min(total, self.cfg.prefix_cache_mb * 2**20 // block_bytes)

    def _bound_prefix_cache(self) -> None:
        """Evict the least recently used cached prefixes past the bound (after a lane's blocks went to
        the cache or back to the pool; blocks a running lane shares stay until it ends)."""
        if self.prefix_bound is None:
            return
        cached = c_int(0)
        self.lib.baseRT_prefix_cache_stats(self._model, None, None, None, byref(cached))
        if cached.value > self.prefix_bound:
            self.lib.baseRT_prefix_evict(self._model, cached.value - self.prefix_bound)

    def _check_cancelled(self, phase: str) -> None:
        """Between two phases of the load: stop here when its open was cancelled (the phase that ran is
        not undone by raising; the callers free what it built)."""
        if self._load_cancelled.is_set():
            raise EngineClosedError(f"the open was cancelled (after {phase})")

    def _check_memory(self, handle: int, available: tuple[int, str] | None) -> None:
        """Refuse a KV pool that, with the weights, is more than the memory available before the load.

        The engine says what it reserved (`kv_cache_capacity_bytes`: the reference engine sizes its
        pool as max_batch_size + 1 full-context sequences of blocks; another engine sizes its own).
        Until its blocks are written the reservation costs nothing (untouched pages), so it would
        open and then be killed for memory later, under load; refused here instead."""
        if available is None:
            return
        ms = _ffi.BaseRTMemoryStats()
        if not self.lib.baseRT_model_memory_stats(handle, byref(ms)):
            return
        pool = int(ms.kv_cache_capacity_bytes)
        need = max(int(ms.runtime_allocated_bytes), pool)  # the weights, the pool and the engine's scratch
        free, source = available
        if need <= free:
            return
        cfg = self.cfg
        raise InvalidConfigError(
            f"the KV pool for max_batch_size={cfg.max_batch_size} x max_context={cfg.max_context} "
            f"({_gib(pool)}) plus the weights and scratch ({_gib(need - pool)}) needs {_gib(need)}, more than the "
            f"{_gib(free)} available ({source}); lower max_batch_size or max_context (or kv_cache_dtype)"
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

    def _engine_threads(self) -> int:
        """The reference engine's compute threads (its shared pool, sized at load, the calling thread
        included); 0 for a library that does not say."""
        if not self.lib.has("baseRT_ref_counter"):
            return 0
        return max(0, int(self.lib.baseRT_ref_counter(b"pool_threads")))

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
           sequences) and picks each running lane's row (`plan.StepPlan`);
        3. run: `StepRunner.run` = prepare -> ONE fused forward -> collect;
        4. apply: each lane's `RowResult` is applied here, the lanes' one writer
           (tokens through `OutputProcessor`, finish, failure, freeing);
        5. deliver: everything the step produced reaches the loop in one wake-up.

        False once the engine is closed (drained, or aborted)."""
        idle = not self.batcher.has_runnable_work()
        busy = bool(self.requests or self.prep.preparing)
        self._drain(block=idle and not (self._closing and not busy))
        # a drain serves the requests still being prepared too; an abort has answered them
        if self._closing and (self._abort or not (self.prep.preparing or self.requests)):
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

    # ---- the inbox: each message by its type -------------------------------------------------

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
            self._on_submit(msg)
        elif isinstance(msg, Cancel):
            self._on_cancel(msg)
        elif isinstance(msg, Embed):
            self._on_embed(msg)
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
            self.batcher.check_room(self.prep.preparing + self._reserved + count - 1)
        except EngineOverloadedError:
            b = self.batcher
            free = max(0, b.max_batch_size - len(b.running))
            room = b.max_queue + free - len(b.waiting) - self.prep.preparing - self._reserved
            raise EngineOverloadedError(
                f"request queue has room for {max(0, room)} of this request's {count} generations; retry later"
            ) from None
        self._reserved += count
        return count

    def _on_cancel(self, msg: Cancel) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:  # an embedding's caller is gone: free the lane, nobody to tell
            self._end(req, None)
        prep = self.prep.cancel(msg.rid)
        if isinstance(prep, Submit):  # cancelled while it is prepared: counted now, dropped on return
            self.cancelled += 1

    def _on_prepared(self, msg: Prepared) -> None:
        req = msg.msg
        dropped = self.prep.returned(req.spec.rid if isinstance(req, Submit) else req.rid) is RequestStatus.ABANDONED
        if isinstance(req, Submit):
            self._enqueue(req, msg.result, msg.error, dropped=dropped)
        else:
            self._enqueue_embed(req, msg.result, msg.error, dropped=dropped)

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
            self._abort_preparing()

    def _abort_preparing(self) -> None:
        """Answer the requests still being prepared now: an abort waits for no compile."""
        closed = EngineClosedError("the engine was closed before the request started")
        for prep in self.prep.abandon_all():
            self.cancelled += 1
            if isinstance(prep, Submit):
                self._notify(prep.sink.deliver, [], None, closed)
            else:
                self._notify(prep.done, None, closed)

    def _cancel(self, lane: Lane) -> None:
        lane.state.cancelled = True
        self.cancelled += 1
        self._release(lane)

    # ---- requests in, through their preparation (`_core.prepare`), out as lanes ---------------

    def _on_submit(self, msg: Submit) -> None:
        """A request goes to its preparation, refused first when the engine closes or its queue is full."""
        if self._closing:
            self._notify(msg.sink.deliver, [], None, EngineClosedError("the engine is closing"))
            return
        try:  # refused before any work is spent on it; its queue slot is held while it is prepared
            self.batcher.check_room(self.prep.preparing + self._reserved)
        except EngineOverloadedError as exc:
            self._notify(msg.sink.deliver, [], None, exc)
            return
        checked = self.prep.submit(msg)
        if checked is not None:  # a prompt of ids, nothing to prepare: straight into the FIFO
            ids, error = checked
            self._enqueue(msg, (ids, None), error, dropped=False)

    def _enqueue(self, msg: Submit, prepared: Any, error: BaseException | None, *, dropped: bool) -> None:
        """A prepared request joins the FIFO queue (or is answered with its error). `dropped`: it was
        answered (its Cancel came and was counted, or an abort) while it was prepared."""
        spec = msg.spec
        constraint: Constraint | None = None
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
                self.prep.adopt(constraint)
            if self._closing and self._abort:
                raise EngineClosedError("the engine was closed before the request started")
            if dropped or not msg.sink.alive():  # cancelled while it was prepared: nobody to serve
                if constraint is not None:
                    self.prep.close_constraint(constraint, spec.cost.grammar_key)
                if not dropped:
                    self.cancelled += 1
                return
            max_new = self.batcher.resolve_max_tokens(len(prompt), spec.params.max_tokens)
            lane = Lane(spec, msg.sink, msg.ticket, prompt, max_new, constraint)
            lane.submitted_step = self.steps
            self.batcher.enqueue(lane.state, reserved=True)
        except BaseException as exc:
            if constraint is not None:  # refused after its grammar was built: free it
                self.prep.close_constraint(constraint, spec.cost.grammar_key)
            err = exc if isinstance(exc, AioBaseRTError) else internal_error("at intake", exc)
            self._notify(msg.sink.deliver, [], None, err)
            if not isinstance(exc, Exception):
                raise
            return
        self.requests.add(lane)

    # ---- embeddings in, as lanes (`_core.embed`: their paths) -------------------------------

    def _on_embed(self, msg: Embed) -> None:
        """A text input is tokenized by the intake workers first; ids go straight on."""
        try:
            if self._closing:
                raise EngineClosedError("the engine is closing")
            self.batcher.check_room(self.prep.preparing + self._reserved)  # its queue slot is held while it is prepared
        except AioBaseRTError as exc:
            self._notify(msg.done, None, exc)
            return
        if isinstance(msg.source, str):
            self.prep.submit_embed(msg, msg.source)
        else:
            self._enqueue_embed(msg, list(msg.source), None, dropped=False)

    def _enqueue_embed(
        self, msg: Embed, ids: Sequence[int] | None, error: BaseException | None, *, dropped: bool
    ) -> None:
        """Validate an embedding and queue it as a lane (or, without taps, run it now)."""
        if dropped:  # cancelled or aborted while it was tokenized: already answered
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
                self._notify(msg.done, self.embedder.embed(ids), None)
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
        """The tapped (chunked) embedding path the step runner pools with, or None for one baseRT_embed call."""
        pooler = self.embedder.path()
        self.runner.pooler = pooler
        return pooler

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
            result, error = self.embedder.embed(lane.ids), None
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

    # ---- queries answered between steps (engine thread) ----------------------------------

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
            live_grammars=self.prep.live_grammars,
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
        # bounded when a request ends, not when one is preempted: a preempted lane's KV waits in the cache
        # for its resume (the batcher counts on it), and is bounded with the rest once it has ended
        self._bound_prefix_cache()
        if lane.constraint is not None:
            constraint, lane.constraint = lane.constraint, None
            self.prep.close_constraint(constraint, lane.spec.cost.grammar_key)
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
        self.prep.grammars.close()  # the kept engine grammars, before the workers free the handles they came from
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _deliver_batch(batch: list[tuple[Sink, list[Token], Final | None, BaseException | None]]) -> None:
    """Runs on the event loop: hand each stream its part of one step."""
    for sink, tokens, final, error in batch:
        sink.deliver(tokens, final, error)

"""The engine thread: the one thread that owns the model handle.

Every libbaseRT call of an engine happens here. The thread drains a
thread-safe inbox (requests, cancellations, calls, close), asks the batcher for
the next step, runs ONE fused batch step over every active lane (prefill
chunks and decode rows mixed), samples (in the engine where the lane's
parameters allow, on host logits rows otherwise), turns each lane's token into
text through the lane's own decode stream, and hands the whole step's output
to the event loop in one wake-up. With nothing to do it blocks on the inbox:
no spinning, and a new request wakes it at once.

Teardown order matters: a lane's engine sequence is freed (rolled back first
when it was cancelled) before its bookkeeping is dropped, never after.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from ctypes import byref, c_char_p, c_float, c_int, c_int32, c_uint32, c_void_p, sizeof
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import _ffi
from .batcher import Batcher, LaneState
from .errors import (
    AioBaseRTError,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
)
from .stopping import StopStringMatcher
from .types import EngineStats, FinishReason, ModelInfo, SamplingParams, Timing, Token, TopLogprob, Usage

# ---- what crosses between the loop and the engine thread ----------------------------


@dataclass
class EngineConfig:
    """Load options and serving limits (see `Engine.open`)."""

    model_path: str
    max_batch_size: int = 8
    max_context: int = 2048
    prefill_chunk: int = 256
    prefix_cache: bool = True
    max_queue: int = 1024
    max_buffered_tokens: int = 256


Prompt = str | Sequence[int] | Sequence[tuple[str, bool]]
"""Text, token ids, or (text, is_content) pieces of a rendered chat."""


class Constraint(Protocol):
    """A per-request token grammar (structured output), stepped on the engine thread."""

    def fill_bitmask(self, out: np.ndarray) -> bool:
        """Write the allowed-token bitmask (int32 words, bit set = allowed) for
        the next token; False when every token is allowed (nothing to apply)."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it."""
        ...

    def is_finished(self) -> bool:
        """The output is complete: the lane stops."""
        ...


@dataclass
class RequestSpec:
    rid: str
    prompt: Prompt
    params: SamplingParams
    parse_special: bool = True
    """Text prompts: marker strings become control ids (baseRT_encode)."""
    submitted_at: float = field(default_factory=time.monotonic)
    constraint: Callable[[], Constraint] | None = None
    """Builds the lane's grammar at intake (on the engine thread)."""


class Ticket:
    """Flow-control counters shared by a stream and its lane.

    The engine thread writes `delivered` and `paused`; the consumer writes
    `consumed`. Each int is written by one side only, so no lock is needed.
    """

    __slots__ = ("consumed", "delivered", "paused")

    def __init__(self) -> None:
        self.delivered = 0
        self.consumed = 0
        self.paused = False


@dataclass(frozen=True)
class Final:
    """How a request ended; delivered with (or after) its last token."""

    finish_reason: FinishReason
    usage: Usage
    timing: Timing


class Sink(Protocol):
    """The consumer side of one request; called on the event loop only."""

    def deliver(self, tokens: list[Token], final: Final | None, error: BaseException | None) -> None: ...


@dataclass
class Submit:
    spec: RequestSpec
    sink: Sink
    ticket: Ticket


@dataclass
class Cancel:
    rid: str


@dataclass
class Resume:
    """A paused lane's consumer caught up: re-plan."""


@dataclass
class Call:
    """Run fn on the engine thread between steps; report through done (on the loop)."""

    fn: Callable[[], Any]
    done: Callable[[Any, BaseException | None], None]


@dataclass
class Close:
    abort: bool


Message = Submit | Cancel | Resume | Call | Close

# ---- the lane ---------------------------------------------------------------------


def _mix32(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter) folded to a non-zero u32 (0 means 'random')."""
    z = (seed * 0x9E3779B97F4A7C15 + counter + 0x632BE59BD9B4E5F5) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z & 0xFFFFFFFF) or 1


class _Lane:
    """Engine-thread bookkeeping of one request."""

    def __init__(
        self,
        spec: RequestSpec,
        sink: Sink,
        ticket: Ticket,
        prompt: list[int],
        max_new: int,
        constraint: Constraint | None = None,
    ) -> None:
        self.spec = spec
        self.constraint = constraint
        self.sink = sink
        self.ticket = ticket
        self.prompt = prompt
        self.prompt_arr = _ffi.u32_array(prompt)
        self.state = LaneState(rid=spec.rid, prompt_len=len(prompt), max_new_tokens=max_new)
        p = spec.params
        self.seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.penalized = p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        # Which sampler a lane uses depends on its own parameters only, never on
        # what else shares the step, so a seed reproduces the same tokens. The
        # engine's row sampler (BaseRTRowSampling) serves greedy and sampled
        # lanes; logit_bias, and penalties on a greedy lane, need the CPU
        # pipeline of baseRT_sample_logits_row.
        self.cpu_sampler = bool(p.logit_bias) or (self.penalized and p.temperature == 0) or constraint is not None
        self.host = p.needs_host_logits or self.cpu_sampler
        self.stop_ids = frozenset(p.stop_token_ids or ())
        self.stopper = StopStringMatcher(p.stop or ())
        self.seq: int | None = None
        self.dstream: int | None = None
        self.prefix_handle = 0
        self.cached = 0
        self.generated: list[int] = []
        self.pending: list[Token] = []
        self.final: Final | None = None
        self.error: BaseException | None = None
        self.submitted_step = 0
        self.admitted_step = -1
        self.admitted_at = 0.0
        self.first_token_at = 0.0
        self.sampling_cfg: _ffi.BaseRTSamplingConfig | None = None
        self._keep: list[Any] = []  # ctypes arrays the sampling config points into
        if self.cpu_sampler:
            cfg = _cpu_sampling_config(p, _mix32(self.seed, 0))
            if p.logit_bias:
                toks = (c_int32 * len(p.logit_bias))(*p.logit_bias.keys())
                vals = (c_float * len(p.logit_bias))(*p.logit_bias.values())
                cfg.n_logit_bias = len(p.logit_bias)
                cfg.logit_bias_tokens = ctypes.cast(toks, ctypes.POINTER(c_int32))
                cfg.logit_bias_values = ctypes.cast(vals, ctypes.POINTER(c_float))
                self._keep += [toks, vals]
            self.sampling_cfg = cfg

    @property
    def rid(self) -> str:
        return self.spec.rid

    def history(self) -> list[int]:
        """Recent tokens the penalties look at: prompt tail + output."""
        window = self.spec.params.penalty_window
        if window <= 0:
            return []
        tail = self.generated[-window:]
        if len(tail) < window:
            tail = self.prompt[-(window - len(tail)) :] + tail
        return tail

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV the sequence holds (the last sampled one is not fed yet)."""
        return self.prompt[: self.state.prefilled] + self.generated[:-1]


_Sampled = tuple[int, float | None, list[TopLogprob] | None] | AioBaseRTError
"""A lane's (token, logprob, top logprobs) from one step, or why its sampling failed."""


def _cpu_sampling_config(p: SamplingParams, seed32: int) -> _ffi.BaseRTSamplingConfig:
    """The BaseRTSamplingConfig of baseRT_sample_logits_row (logit bias attached by the caller)."""
    return _ffi.BaseRTSamplingConfig(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repeat_penalty=p.repeat_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=seed32,
    )


def _row_sampling(lane: _Lane, history: list[Any]) -> _ffi.BaseRTRowSampling:
    p = lane.spec.params
    rs = _ffi.BaseRTRowSampling(
        temperature=p.temperature,
        top_p=p.top_p,
        min_p=p.min_p,
        top_k=p.top_k,
        seed=_mix32(lane.seed, len(lane.generated)),
        repeat_penalty=p.repeat_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if lane.penalized and p.temperature > 0:
        hist = _ffi.u32_array(lane.history())
        history.append(hist)
        rs.history = ctypes.cast(hist, ctypes.POINTER(c_uint32))
        rs.history_count = len(hist)
    return rs


# ---- the thread -------------------------------------------------------------------


class EngineThread:
    """Owns the model handle; everything below runs on this thread only."""

    def __init__(self, lib: _ffi.Library, cfg: EngineConfig, notify: Callable[..., None]) -> None:
        self.lib = lib
        self.cfg = cfg
        self._notify = notify  # LoopWaker.call_soon: fire-and-forget onto the loop
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.ready: concurrent.futures.Future[ModelInfo] = concurrent.futures.Future()
        self.stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name="aiobasert-engine", daemon=True)
        self._model: int | None = None
        self._lanes: dict[str, _Lane] = {}
        self._dirty: dict[str, _Lane] = {}
        self._closing = False
        self._abort = False
        self.steps = 0
        self.models_freed = 0
        self.live_sequences = 0
        self.live_streams = 0
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

    def _load(self) -> ModelInfo:
        lib, cfg = self.lib, self.cfg
        opts = _ffi.BaseRTLoadOptions(
            struct_size=sizeof(_ffi.BaseRTLoadOptions),
            paged_kv=1,
            max_batch_size=cfg.max_batch_size,
            prefix_cache=int(cfg.prefix_cache),
            prefill_chunk=cfg.prefill_chunk,
        )
        path = os.fsencode(cfg.model_path)
        handle = lib.baseRT_load_model_ex(path, None, cfg.max_context, byref(opts))
        if not handle:
            raise lib.last_error("baseRT_load_model_ex", f"cannot load {cfg.model_path}")
        self._model = handle
        caps = int(lib.baseRT_capabilities(handle))
        if not caps & _ffi.CAP_SEQUENCES:
            self._free_model()
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
        self.has_prefix = bool(caps & _ffi.CAP_PREFIX_CACHE) and lib.has("baseRT_prefix_match")
        self.has_fused_sample = lib.has("baseRT_batch_step_fused_sample")
        self.stride = int(lib.baseRT_batch_logits_stride(handle))
        if self.stride < 2 * self.vocab_size:
            self._free_model()
            raise AioBaseRTError(f"engine reports a logits stride of {self.stride} bytes for vocab {self.vocab_size}")
        self._logits = np.zeros((cfg.max_batch_size, self.stride // 2), dtype=np.float16)
        self._logits_ptr = self._logits.ctypes.data
        self._mask: np.ndarray | None = None
        self.batcher = Batcher(
            max_batch_size=cfg.max_batch_size,
            max_context=self.max_context,
            prefill_budget=max(1, min(cfg.prefill_chunk, engine_chunk)),
            max_queue=cfg.max_queue,
            max_buffered_tokens=cfg.max_buffered_tokens,
            page_size=self.page_size,
            prefix_cache=self.has_prefix,
        )
        template = ""
        if lib.has("baseRT_chat_template_jinja"):
            template = (lib.baseRT_chat_template_jinja(handle) or b"").decode("utf-8", "replace")
        self.chat_template = template
        self.bos_token = self._static_str("baseRT_bos_token")
        self.eos_token = self._static_str("baseRT_eos_token")
        return ModelInfo(
            path=cfg.model_path,
            architecture=mc.architecture.decode("utf-8", "replace"),
            vocab_size=self.vocab_size,
            dim=int(mc.dim),
            n_layers=int(mc.n_layers),
            n_heads=int(mc.n_heads),
            n_kv_heads=int(mc.n_kv_heads),
            max_context=self.max_context,
            max_batch_size=cfg.max_batch_size,
            prefix_cache=self.has_prefix,
            library_path=lib.path,
            library_version=lib.version,
            capabilities=caps,
        )

    def _static_str(self, fn: str) -> str:
        if not self.lib.has(fn):
            return ""
        raw = getattr(self.lib, fn)(self._model)
        return (raw or b"").decode("utf-8", "replace")

    def _serve(self) -> None:
        while True:
            self._refresh_flow()
            idle = not self.batcher.has_runnable_work()
            self._drain(block=idle and not (self._closing and not self._lanes))
            if self._closing and (self._abort or not self._lanes):
                return
            self._refresh_flow()
            if self.batcher.has_runnable_work():
                try:
                    self._step()
                except Exception as exc:  # a bug must cost its lanes, never the engine thread
                    self._fail_running(AioBaseRTError(f"internal error in the engine step: {exc!r}"))
            self._flush()

    def _fail_running(self, exc: AioBaseRTError) -> None:
        for state in list(self.batcher.running):
            lane = self._lanes.get(state.rid)
            if lane is not None:
                self._fail(lane, exc)

    def _refresh_flow(self) -> None:
        """Flow control: see what each consumer has read; pause lanes that are too far ahead.

        A paused lane's ticket says so; its consumer posts `Resume` on its next
        read. `paused` is set before the counter is re-read, so a read racing
        with the pause is never missed.
        """
        for state in self.batcher.running:
            t = self._lanes[state.rid].ticket
            state.unread = t.delivered - t.consumed
            if self.batcher.is_paused(state) and not t.paused:
                t.paused = True
                state.unread = t.delivered - t.consumed
                if not self.batcher.is_paused(state):
                    t.paused = False

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
        if isinstance(msg, Submit):
            self._intake(msg)
        elif isinstance(msg, Cancel):
            lane = self._lanes.get(msg.rid)
            if lane is not None:
                lane.state.cancelled = True
                self.cancelled += 1
                self._release(lane)
        elif isinstance(msg, Call):
            try:
                result, error = msg.fn(), None
            except BaseException as exc:
                result, error = None, exc
            self._notify(msg.done, result, error)
        elif isinstance(msg, Close):
            self._closing = True
            if msg.abort:
                self._abort = True
                for lane in list(self._lanes.values()):
                    self._finish(lane, "aborted")
        # Resume needs no action: waking up re-plans.

    # ---- intake: tokenize and validate, on this thread, before queueing --------------

    def _intake(self, msg: Submit) -> None:
        spec = msg.spec
        if self._closing:
            self._notify(msg.sink.deliver, [], None, EngineClosedError("the engine is closing"))
            return
        try:
            prompt = self._tokenize_prompt(spec)
            max_new = self.batcher.resolve_max_tokens(len(prompt), spec.params.max_tokens)
            constraint = spec.constraint() if spec.constraint is not None else None
            lane = _Lane(spec, msg.sink, msg.ticket, prompt, max_new, constraint)
            lane.submitted_step = self.steps
            self.batcher.enqueue(lane.state)
        except AioBaseRTError as exc:
            self._notify(msg.sink.deliver, [], None, exc)
            return
        except Exception as exc:  # never let one request's bug stop the engine thread
            self._notify(msg.sink.deliver, [], None, AioBaseRTError(f"internal error at intake: {exc!r}"))
            return
        self._lanes[spec.rid] = lane

    def _tokenize_prompt(self, spec: RequestSpec) -> list[int]:
        prompt = spec.prompt
        if isinstance(prompt, str):
            ids = self.encode_text(prompt, special=spec.parse_special)
        elif prompt and isinstance(prompt[0], tuple):
            ids = self.encode_pieces(prompt)  # type: ignore[arg-type]
        else:
            ids = list(prompt)  # type: ignore[arg-type]
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise InvalidRequestError(
                        f"prompt token {i} is {t!r}: not a token id of this model (vocab {self.vocab_size})"
                    )
        if not ids:
            raise InvalidRequestError("the prompt is empty: it encodes to no tokens")
        return ids

    # ---- tokenizer helpers (engine thread) ---------------------------------------------

    def encode_text(self, text: str, *, special: bool) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be str or a list of token ids, not {type(text).__name__}")
        try:
            data = _ffi.c_str(text)
        except ValueError as exc:
            raise InvalidRequestError(f"prompt cannot be encoded: {exc}") from None
        cap = len(data) + 8  # byte-level BPE: at most one token per byte, plus BOS
        out = (c_uint32 * cap)()
        fn = "baseRT_encode" if special else "baseRT_encode_plain"
        n = getattr(self.lib, fn)(self._model, data, out, cap)
        if n < 0:
            raise self.lib.last_error(fn)
        return list(out[:n])

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        try:
            datas = [_ffi.c_str(t) for t, _ in pieces]
        except ValueError as exc:
            raise InvalidRequestError(f"message cannot be encoded: {exc}") from None
        texts = (c_char_p * len(datas))(*datas)
        plain = (c_int * len(datas))(*(1 if content else 0 for _, content in pieces))
        cap = sum(len(d) for d in datas) + 8
        out = (c_uint32 * cap)()
        n = self.lib.baseRT_encode_pieces(self._model, texts, plain, len(datas), out, cap)
        if n < 0:
            raise self.lib.last_error("baseRT_encode_pieces")
        return list(out[:n])

    def token_bytes(self, tok: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self.lib.baseRT_decode_token_raw(self._model, tok, buf, 64)
        if n > 64:
            buf = ctypes.create_string_buffer(n)
            n = self.lib.baseRT_decode_token_raw(self._model, tok, buf, n)
        if n < 0:
            raise self.lib.last_error("baseRT_decode_token_raw")
        return buf.raw[:n]

    def decode_ids(self, ids: Sequence[int]) -> str:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"{t!r} is not a token id of this model (vocab {self.vocab_size})")
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")

    def embed(self, ids: Sequence[int], dim: int) -> np.ndarray:
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
            live_decode_streams=self.live_streams,
            kv_blocks_total=int(ms.kv_cache_blocks_total),
            kv_blocks_used=int(ms.kv_cache_blocks_used),
            prefix_blocks_cached=int(cached.value),
            requests_finished=self.finished,
            requests_cancelled=self.cancelled,
            requests_failed=self.failed,
        )

    def evict_prefix_cache(self) -> int:
        if not self.has_prefix or not self.lib.has("baseRT_prefix_evict"):
            return 0
        return int(self.lib.baseRT_prefix_evict(self._model, 1 << 30))

    # ---- one step -----------------------------------------------------------------------

    def _step(self) -> None:
        self.steps += 1
        for state in self.batcher.admit():
            self._admit(self._lanes[state.rid])
        rows = self.batcher.schedule()
        if not rows:
            return
        lanes = [self._lanes[st.rid] for st, _ in rows]
        n = len(rows)
        feed: list[int] = []
        counts = (c_int * n)()
        sampling: list[int] = []  # row indices that yield a token this step
        for i, (st, k) in enumerate(rows):
            lane = lanes[i]
            if st.prefilling:
                feed.extend(lane.prompt[st.prefilled : st.prefilled + k])
                if st.prefilled + k == st.prompt_len:
                    sampling.append(i)
            else:
                feed.append(lane.generated[-1])
                sampling.append(i)
            counts[i] = k
        seqs = (c_void_p * n)(*(lane.seq for lane in lanes))
        toks = _ffi.u32_array(feed)
        host = not self.has_fused_sample or any(lanes[i].host for i in sampling)
        try:
            run = self._run_logits_step if host else self._run_sample_step
            results = run(lanes, seqs, toks, counts, sampling)
        except EngineError as exc:
            # The step failed as a whole: fail its lanes, keep serving the rest.
            for lane in lanes:
                self._fail(lane, exc)
            return
        for st, k in rows:
            if st.prefilling:
                st.prefilled += k
        for i in sampling:
            result = results[i]
            if isinstance(result, AioBaseRTError):
                self._fail(lanes[i], result)
            else:
                self._accept(lanes[i], *result)

    def _run_sample_step(
        self,
        lanes: list[_Lane],
        seqs: ctypes.Array[c_void_p],
        toks: ctypes.Array[c_uint32],
        counts: ctypes.Array[c_int],
        sampling: list[int],
    ) -> dict[int, _Sampled]:
        n = len(lanes)
        rows = (_ffi.BaseRTRowSampling * n)()
        keep: list[Any] = []
        for i in sampling:
            rows[i] = _row_sampling(lanes[i], keep)
        out = (c_uint32 * n)()
        rc = self.lib.baseRT_batch_step_fused_sample(self._model, seqs, n, toks, counts, rows, out)
        self.lib.check(rc, "baseRT_batch_step_fused_sample")
        return {i: (int(out[i]), None, None) for i in sampling}

    def _run_logits_step(
        self,
        lanes: list[_Lane],
        seqs: ctypes.Array[c_void_p],
        toks: ctypes.Array[c_uint32],
        counts: ctypes.Array[c_int],
        sampling: list[int],
    ) -> dict[int, _Sampled]:
        lib, model = self.lib, self._model
        n = len(lanes)
        rc = lib.baseRT_batch_step_fused_logits(model, seqs, n, toks, counts)
        lib.check(rc, "baseRT_batch_step_fused_logits")
        if lib.baseRT_read_batch_logits(model, n, self._logits_ptr) < 0:
            raise lib.last_error("baseRT_read_batch_logits")
        results: dict[int, _Sampled] = {}
        for i in sampling:
            try:
                results[i] = self._sample_host_row(lanes[i], i)
            except AioBaseRTError as exc:  # this lane's sampling failed: only this lane ends
                results[i] = exc
        return results

    def _sample_host_row(self, lane: _Lane, i: int) -> tuple[int, float | None, list[TopLogprob] | None]:
        """Pick lane's token from row i of the host logits (and its logprobs)."""
        lib, model = self.lib, self._model
        p = lane.spec.params
        row = self._logits_ptr + i * self.stride
        if lane.constraint is not None:
            self._apply_constraint(lane, i)
        if lane.sampling_cfg is not None:  # logit_bias / greedy penalties: the CPU pipeline
            hist = _ffi.u32_array(lane.history()) if lane.penalized else None
            tok = lib.baseRT_sample_logits_row(
                model, row, byref(lane.sampling_cfg), hist, len(hist) if hist else 0, 0, len(lane.generated)
            )
            if tok == 0 and lib.baseRT_get_error_code() != 0:
                raise lib.last_error("baseRT_sample_logits_row")
        elif p.temperature > 0 and lib.has("baseRT_sample_logits_rows"):
            # the engine's row sampler, as baseRT_batch_step_fused_sample would run it
            keep: list[Any] = []
            rs = _row_sampling(lane, keep)
            out = c_uint32(0)
            rc = lib.baseRT_sample_logits_rows(model, i, 1, byref(rs), byref(out))
            lib.check(rc, "baseRT_sample_logits_rows")
            tok = int(out.value)
        elif p.temperature > 0:  # an engine without the row-sampling pass: CPU pipeline
            cfg = _cpu_sampling_config(p, _mix32(lane.seed, 0))
            tok = lib.baseRT_sample_logits_row(model, row, byref(cfg), None, 0, 0, len(lane.generated))
        else:
            tok = lib.baseRT_argmax_logits_row(model, row)
        tok = int(tok)
        lp: float | None = None
        tops: list[TopLogprob] | None = None
        if p.logprobs or p.top_logprobs:
            k = p.top_logprobs
            chosen = c_float(0.0)
            ids = (c_uint32 * max(k, 1))()
            vals = (c_float * max(k, 1))()
            got = lib.baseRT_logits_row_logprobs(model, row, tok, k, byref(chosen), ids, vals)
            if got < 0:
                raise lib.last_error("baseRT_logits_row_logprobs")
            lp = float(chosen.value)
            if k:
                tops = [
                    TopLogprob(
                        id=int(ids[j]),
                        logprob=float(vals[j]),
                        text=self.token_bytes(int(ids[j])).decode("utf-8", "replace"),
                    )
                    for j in range(got)
                ]
        return tok, lp, tops

    def _apply_constraint(self, lane: _Lane, i: int) -> None:
        """Mask row i of the host logits with the lane's grammar (disallowed -> -inf)."""
        assert lane.constraint is not None
        words = (self.vocab_size + 31) // 32
        if self._mask is None or self._mask.shape[0] != words:
            self._mask = np.zeros(words, dtype=np.int32)
        if not lane.constraint.fill_bitmask(self._mask):
            return
        if not self._mask.any():
            raise InvalidRequestError("the output grammar admits no further token")
        if self.lib.has("baseRT_mask_logits_row"):
            row = self._logits_ptr + i * self.stride
            mask_ptr = self._mask.ctypes.data_as(ctypes.POINTER(c_int32))
            self.lib.check(self.lib.baseRT_mask_logits_row(self._model, row, mask_ptr), "baseRT_mask_logits_row")
        else:  # an engine without the row op: the same on the f16 view
            allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
            self._logits[i, : self.vocab_size][~allowed] = -np.inf

    # ---- lane lifecycle ---------------------------------------------------------------

    def _admit(self, lane: _Lane) -> None:
        lib, model = self.lib, self._model
        st = lane.state
        lane.admitted_step = self.steps
        lane.admitted_at = time.monotonic()
        match = None
        if self.batcher.should_match_prefix(st):
            match = lib.baseRT_prefix_match(model, lane.prompt_arr, st.prompt_len)
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
                st.prefilled = lane.cached = int(match.matched_tokens)
            else:
                lib.baseRT_prefix_release(model, match.handle)
        stream = lib.baseRT_decode_stream_create(model)
        if not stream:
            self._fail(lane, lib.last_error("baseRT_decode_stream_create"))
            return
        lane.dstream = stream
        self.live_streams += 1
        lib.baseRT_decode_stream_reset_for_prompt(stream, lane.prompt_arr, st.prompt_len)

    def _accept(self, lane: _Lane, tok: int, logprob: float | None, tops: list[TopLogprob] | None) -> None:
        """Turn a sampled token into output; end the lane on a stop condition."""
        lib, p, st = self.lib, lane.spec.params, lane.state
        if not lane.generated:
            lane.first_token_at = time.monotonic()
        lane.generated.append(tok)
        st.generated += 1
        raw = lib.baseRT_decode_stream_token(lane.dstream, tok)
        if raw is None:
            self._fail(lane, lib.last_error("baseRT_decode_stream_token"))
            return
        piece = raw.decode("utf-8", "replace")
        finish: FinishReason | None = None
        if lane.constraint is not None and not lane.constraint.accept(tok):
            why = getattr(lane.constraint, "error", None) or "rejected"
            self._fail(lane, InvalidRequestError(f"token {tok} was sampled outside the output grammar: {why}"))
            return
        if tok in lane.stop_ids or (not p.ignore_eos and lib.baseRT_is_eos_token(self._model, tok)):
            text, finish = lane.stopper.flush(), "stop"
        else:
            text, hit = lane.stopper.feed(piece)
            if hit or (lane.constraint is not None and lane.constraint.is_finished()):
                text += lane.stopper.flush() if not hit else ""
                finish = "stop"
        if finish is None and st.generated >= st.max_new_tokens:
            text += lane.stopper.flush()
            finish = "length"
        self._emit(lane, Token(id=tok, text=text, index=st.generated - 1, logprob=logprob,
                               top_logprobs=tops, finish_reason=finish))
        if finish is not None:
            self._finish(lane, finish)

    def _emit(self, lane: _Lane, token: Token) -> None:
        lane.pending.append(token)
        lane.ticket.delivered += 1
        self._dirty[lane.rid] = lane

    def _finish(self, lane: _Lane, reason: FinishReason) -> None:
        now = time.monotonic()
        submitted = lane.spec.submitted_at
        admitted = lane.admitted_at or now
        lane.final = Final(
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=lane.state.prompt_len,
                completion_tokens=len(lane.generated),
                cached_prompt_tokens=lane.cached,
            ),
            timing=Timing(
                queued_s=admitted - submitted,
                time_to_first_token_s=(lane.first_token_at or now) - submitted,
                total_s=now - submitted,
                submitted_step=lane.submitted_step,
                admitted_step=lane.admitted_step,
                finished_step=self.steps,
            ),
        )
        if reason == "aborted":
            self.cancelled += 1
        else:
            self.finished += 1
        self._dirty[lane.rid] = lane
        self._release(lane)

    def _fail(self, lane: _Lane, exc: BaseException) -> None:
        self.failed += 1
        lane.error = exc
        self._dirty[lane.rid] = lane
        self._release(lane)

    def _release(self, lane: _Lane) -> None:
        """Return everything a lane holds in the engine, then forget the lane."""
        lib, model, st = self.lib, self._model, lane.state
        if lane.seq is not None:
            if lane.final is not None and lane.final.finish_reason in ("stop", "length"):
                kv = lane.kv_tokens()
                if self.batcher.should_publish_prefix(st, len(kv)):
                    arr = _ffi.u32_array(kv)
                    lib.baseRT_prefix_insert(model, arr, len(kv), lane.seq)  # best effort
            else:  # cancelled, aborted or failed: drop its KV before freeing
                lib.baseRT_sequence_rollback(lane.seq, 0)
            lib.baseRT_sequence_free(lane.seq)
            lane.seq = None
            self.live_sequences -= 1
        if lane.prefix_handle:
            lib.baseRT_prefix_unlock(model, lane.prefix_handle)
            lane.prefix_handle = 0
        close = getattr(lane.constraint, "close", None)
        if close is not None:  # an engine-side grammar handle
            close()
            lane.constraint = None
        if lane.dstream is not None:
            lib.baseRT_decode_stream_free(lane.dstream)
            lane.dstream = None
            self.live_streams -= 1
        if st.admitted or st in self.batcher.waiting:
            self.batcher.remove(st)
        self._lanes.pop(lane.rid, None)

    def _flush(self) -> None:
        """One wake-up of the loop for everything this step produced."""
        if not self._dirty:
            return
        batch = [(lane.sink, lane.pending, lane.final, lane.error) for lane in self._dirty.values()]
        for lane in self._dirty.values():
            lane.pending = []
        self._dirty = {}
        self._notify(_deliver_batch, batch)

    def _shutdown(self) -> None:
        for lane in list(self._lanes.values()):
            self._finish(lane, "aborted")
        self._flush()
        self._free_model()

    def _free_model(self) -> None:
        if self._model is not None:
            self.lib.baseRT_free_model(self._model)
            self._model = None
            self.models_freed += 1


def _deliver_batch(batch: list[tuple[Sink, list[Token], Final | None, BaseException | None]]) -> None:
    """Runs on the event loop: hand each stream its part of one step."""
    for sink, tokens, final, error in batch:
        sink.deliver(tokens, final, error)

"""One fused batch step and its sampling (engine thread only).

`Lane` is what the engine thread keeps to run one generation (its `request.Request` says where
it stands); `StepRunner.run` feeds
every planned row (`plan.StepPlan`) through ONE fused forward and samples
each lane's next token, in three parts: `prepare` (the FFI arrays), `forward`
(the one fused call; `Batch.path` picks which) and `collect` (a `RowResult`
per lane, which the engine thread applies: nothing here writes a lane). It
samples in the engine (`baseRT_batch_step_fused_sample`) when every sampling
lane's parameters allow, else from host logits rows (grammar masks, logit
bias, logprobs, penalties on greedy lanes). A step that verifies drafts
samples the lanes that need no host rows in the engine too (`sample_rows`),
and reads rows back only for the others; where every lane of it is greedy with
no host needs, the engine argmaxes its rows itself
(`baseRT_batch_step_fused_rows_argmax`: no rows sampled or read back).

An embedding is an `EmbedLane`: a step that carries one of its chunks runs as
`baseRT_batch_step_fused_logits_rows_taps`, tapping the final pre-norm hidden
state of the chunk's rows, which `TapPooler` normalises and sums; every
sampling lane of that step samples from host logits rows (the engine's row
sampler on the same rows: the same tokens as the fused-sample path).

numpy is imported where an embedding or a host-side grammar mask first needs it, not
here: a server that only generates text never pays its ~15 MiB of resident memory.

Fault isolation: whatever goes wrong while preparing or sampling ONE lane (a
bad value, a grammar that raises, a bug) becomes that lane's outcome and
nobody else's. Only a failure of the shared forward itself fails the lanes
that were in it.
"""

from __future__ import annotations

import codecs
import ctypes
import mmap
import os
from collections.abc import Sequence
from ctypes import byref, c_float, c_int, c_int32, c_uint32, c_void_p
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from .. import _ffi
from ..errors import AioBaseRTError, EngineError, ErrorCode, InternalError, InvalidRequestError
from ..types import Capabilities, TopLogprob
from .plan import PlannedRow
from .protocol import Constraint, Done, EmbedOutput, Final, RequestSpec, Sink, StreamOutput, Ticket
from .request import Request
from .speculate import LaneSpec
from .stopping import StopStringMatcher

if TYPE_CHECKING:
    import numpy as np


def mix32(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter) folded to a non-zero u32 (0 means 'random')."""
    z = (seed * 0x9E3779B97F4A7C15 + counter + 0x632BE59BD9B4E5F5) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z & 0xFFFFFFFF) or 1


def internal_error(where: str, exc: BaseException) -> InternalError:
    """A bug surfaced as a typed error for the one request it hit."""
    return InternalError(where, exc)


class Lane:
    """Engine-thread bookkeeping of one generation: its sampling, output and sequence. Its record
    (`state`, the `request.Request` made when it reached the engine thread) says where it stands."""

    def __init__(
        self,
        spec: RequestSpec,
        sink: Sink,
        ticket: Ticket,
        prompt: Sequence[int],
        max_new: int,
        constraint: Constraint | None = None,
        state: Request | None = None,
    ) -> None:
        self.spec = spec
        self.constraint = constraint
        self.grammar_key = spec.cost.grammar_key
        self.sink = sink
        self.ticket = ticket
        # tokenized prompts come as C arrays (intake.TokenIds) and are fed as they are
        arr: ctypes.Array[c_uint32] = prompt if isinstance(prompt, ctypes.Array) else _ffi.u32_array(prompt)
        self.prompt_arr = arr
        self.prompt: Sequence[int] = arr  # type: ignore[assignment]  # a uint32 array reads as ints
        self.state = state if state is not None else Request(rid=spec.rid, prompt_len=0, max_new_tokens=0)
        self.state.prompt_len, self.state.max_new_tokens, self.state.client = len(prompt), max_new, spec.client
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
        # Text is assembled here from each token's exact bytes, so the stream's
        # text is the decode of its ids (NUL bytes included; bytes still pending
        # at the end become U+FFFD, as Engine.decode does).
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.seq: int | None = None
        self.prefix_handle = 0
        self.cached = 0
        self.generated: list[int] = []
        self.speculation: LaneSpec | None = None
        """Its speculation state (`speculate`); None: this lane does not speculate."""
        self.drafts: list[int] = []
        """Draft tokens planned for its next step (fed after its pending token)."""
        self.pending: list[Any] = []  # Tokens produced this step, not yet handed to the loop
        self.final: Final | None = None
        self.error: BaseException | None = None
        self.submitted_step = 0
        self.admitted_step = -1
        self.admitted_at = 0.0
        self.first_token_at = 0.0
        self.first_token_step = -1
        self.sampling_cfg: _ffi.BaseRTSamplingConfig | None = None
        self._keep: list[Any] = []  # ctypes arrays the sampling config points into
        if self.cpu_sampler:
            cfg = cpu_sampling_config(p, mix32(self.seed, 0))
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

    def history(self, drafts: Sequence[int] = ()) -> list[int]:
        """Recent tokens the penalties look at: prompt tail + output (+ `drafts`, counted as
        generated: a verify row's history)."""
        window = self.spec.params.penalty_window
        if window <= 0:
            return []
        tail = (self.generated + list(drafts))[-window:] if drafts else self.generated[-window:]
        if len(tail) < window:
            tail = list(self.prompt[-(window - len(tail)) :]) + tail
        return tail

    def next_input(self, k: int) -> list[int]:
        """The k tokens this lane feeds next: a prompt chunk, or its last sampled token (and
        then k - 1 of its drafts)."""
        st = self.state
        if st.prefilling:
            return self._fed(st.prefilled, st.prefilled + k)
        return self.generated[-1:] + self.drafts[: k - 1]

    def _fed(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of what it prefills: the prompt, then a recomputed request's
        output so far (`Request.replay`), without concatenating the whole prompt."""
        n = len(self.prompt)
        head = list(self.prompt[start : min(end, n)]) if start < n else []
        if end > n:
            head += self.generated[max(start, n) - n : min(end - n, self.state.replay)]
        return head

    def kv_tokens(self) -> ctypes.Array[ctypes.c_uint32]:
        """The tokens whose KV the sequence holds (the last sampled one is not fed yet), as a C
        array copied from the prompt's (no request-sized Python list)."""
        st, n = self.state, len(self.prompt)
        held = st.prefilled if st.prefilling else n + max(len(self.generated) - 1, 0)
        p = min(held, n)
        return self._prompt_then(p, self.generated[: held - p])

    def fed_array(self) -> ctypes.Array[ctypes.c_uint32]:
        """All it prefills, as a C array: the prompt, then a recomputed request's output."""
        if not self.state.replay:
            return self.prompt_arr
        return self._prompt_then(len(self.prompt), self.generated[: self.state.replay])

    def _prompt_then(self, p: int, out: list[int]) -> ctypes.Array[ctypes.c_uint32]:
        arr = (ctypes.c_uint32 * (p + len(out)))()
        ctypes.memmove(arr, self.prompt_arr, p * ctypes.sizeof(ctypes.c_uint32))
        arr[p:] = out  # type: ignore[assignment]  # ctypes takes ints for c_uint32 slots
        return arr

    def output(self) -> StreamOutput:
        """What this step produced for its stream (the tokens since the last delivery, and how it
        ended when it did), handed to the loop with the rest of the step (the tokens taken)."""
        out = StreamOutput(self.sink, self.pending, self.final, self.error)
        self.pending = []
        return out


class TapPooler:
    """What `baseRT_embed` pools, rebuilt from hidden-state taps.

    `baseRT_embed` averages the FINAL-NORMED hidden state (rmsnorm with the
    model's final norm weight) of every input row; a tap gives the final
    PRE-norm hidden, rounded to f16. So each tapped row goes through the same
    rmsnorm here (sum of squares in float64, scale rounded to float32, product
    in float32, as the engine computes it) and is summed in float64. The only
    difference from the single-call result is the f16 rounding of the tapped
    hidden state (relative error ~1e-4 on real models); the engine thread
    checks that on a probe before it trusts this path (`embed.Embedder.path`).
    """

    def __init__(self, weight: np.ndarray, eps: float, hidden_index: int, capacity: int) -> None:
        import numpy as np

        self.weight = np.ascontiguousarray(weight, dtype=np.float32)
        self.dim = int(self.weight.shape[0])
        self.eps = float(eps)
        self.hidden_index = hidden_index
        """The hidden_states index of the final pre-norm hidden (= n_layers)."""
        self.rows = np.zeros((max(capacity, 1), self.dim), dtype=np.float16)
        """The tap read-back buffer: up to `capacity` rows a step."""

    def pooled_sum(self, rows: np.ndarray) -> np.ndarray:
        """Sum over `rows` ([n, dim] f16 pre-norm hidden) of their final-normed values, float64."""
        import numpy as np

        x = rows.astype(np.float32)
        x64 = x.astype(np.float64)
        ss = np.einsum("ij,ij->i", x64, x64)
        scale = (1.0 / np.sqrt(ss / self.dim + self.eps)).astype(np.float32)
        normed = (x * scale[:, None]) * self.weight
        total: np.ndarray = normed.sum(axis=0, dtype=np.float64)
        return total


class EmbedLane:
    """Engine-thread bookkeeping of one chunked embedding: the same record (`state`, of the
    pooling kind) and sequence as a generation's `Lane`, its input pooled instead of sampled."""

    host = False  # it samples nothing, so it never needs a host logits row
    constraint = None  # nor any grammar
    grammar_key = None
    speculation = None
    cached = 0  # nor a cached prefix: every row's hidden state is pooled
    prefix_handle = 0

    def __init__(
        self,
        rid: str,
        ids: Sequence[int],
        dim: int,
        done: Done,
        client: str | None = None,
        state: Request | None = None,
    ) -> None:
        import numpy as np

        self.rid = rid
        self.ids = ids
        self.done = done  # (result, error) callback, run on the loop
        self.state = state if state is not None else Request(rid=rid, prompt_len=0, max_new_tokens=0, embed=True)
        self.state.prompt_len, self.state.max_new_tokens, self.state.client = len(ids), 0, client
        self.seq: int | None = None
        self.admitted_step = -1
        self.admitted_at = 0.0
        self.total = np.zeros(dim, dtype=np.float64)
        self.finite = True
        self.result: np.ndarray | None = None
        """The embedding, once it ended pooled."""
        self.error: BaseException | None = None
        """Why it failed (or what its caller is told when the engine aborted it)."""

    def next_input(self, k: int) -> list[int]:
        """The next chunk of the input to pool."""
        return list(self.ids[self.state.prefilled : self.state.prefilled + k])

    def add(self, part: np.ndarray) -> None:
        """Pool one chunk's rows (engine thread). An f16 tap overflows where the
        hidden state exceeds 65504: the engine thread then recomputes that input
        with baseRT_embed."""
        import numpy as np

        self.finite = self.finite and bool(np.isfinite(part).all())
        self.total += part

    def mean(self) -> np.ndarray:
        """The mean over all rows, as baseRT_embed rounds it: float64 sum / n, then float32."""
        out: np.ndarray = (self.total / len(self.ids)).astype("float32")
        return out

    def kv_tokens(self) -> ctypes.Array[ctypes.c_uint32]:
        """The input fed so far (an embedding's KV is never published: `Batcher.should_publish_prefix`)."""
        return _ffi.u32_array(self.ids[: self.state.prefilled])

    def fed_array(self) -> ctypes.Array[ctypes.c_uint32]:
        """All it feeds: its input (an embedding never matches a cached prefix: it pools every row)."""
        return _ffi.u32_array(self.ids)

    def output(self) -> EmbedOutput:
        """Its result or error, handed to the loop with the rest of the step."""
        return EmbedOutput(self.done, self.result, self.error)


class Sampled(NamedTuple):
    """A lane's next token from one step."""

    token: int
    logprob: float | None = None
    """Its log-probability, when the request asked for logprobs."""
    top_logprobs: list[TopLogprob] | None = None
    """The most likely alternatives, when the request asked for top_logprobs."""


@dataclass(frozen=True, slots=True)
class RowResult:
    """What one step produced for one lane; the engine thread applies it (the lanes' one writer)."""

    lane: Lane | EmbedLane
    row: PlannedRow
    sampled: Sampled | None = None
    """The lane's next token (a decode row, or the chunk that ended its prompt). A verify row's
    first token: the engine thread picks the tokens of its later rows (`StepRunner.verify_row`)
    one by one, after applying the ones before (they are chosen with those counted)."""
    first_row: int = 0
    """The index of the lane's first logits row in the step (a verify row has 1 + drafts)."""
    verified: tuple[int, ...] | None = None
    """A verify row sampled in the engine: the tokens of its later rows, each chosen with the
    drafts before it counted as generated (used while they are accepted); None: from host rows."""
    pooled: np.ndarray | None = None
    """An embedding chunk: the float64 sum of its rows' final-normed hidden states."""
    error: BaseException | None = None
    """Why this lane failed in this step (it alone, or the whole forward)."""


ForwardPath = Literal["sample", "logits", "taps", "rows", "argmax"]


@dataclass(eq=False)
class Batch:
    """The inputs of one fused call, in row order (built by `StepRunner.prepare`)."""

    fusable: bool
    """The engine can sample in the fused call (`baseRT_batch_step_fused_sample`)."""
    rows: list[tuple[Lane | EmbedLane, PlannedRow]] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)
    samplers: list[_ffi.BaseRTRowSampling | None] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # ctypes arrays the samplers point into
    host: bool = False
    """Some lane samples from host logits rows (grammar, logit bias, logprobs, ...)."""
    tapped: int = 0
    sampling: bool = False
    drafts: int = 0
    """Draft tokens verified in this step: the step leaves 1 + drafts logits rows for each such lane."""
    argmax: bool = False
    """The engine can argmax a verify step's rows (`baseRT_batch_step_fused_rows_argmax`, not refused)."""
    greedy: bool = True
    """Every lane that samples is greedy with no host needs: its rows' argmax is its tokens."""
    argmaxed: ctypes.Array[c_uint32] | None = None
    """The rows_argmax tokens, once the forward ran it (sum(out_rows), lanes in order)."""

    def add(
        self, lane: Lane | EmbedLane, row: PlannedRow, chunk: list[int], sampler: _ffi.BaseRTRowSampling | None
    ) -> None:
        self.rows.append((lane, row))
        self.feed.extend(chunk)
        self.samplers.append(sampler)
        self.sampling = self.sampling or row.samples
        self.host = self.host or (row.samples and lane.host)
        if row.samples and not (isinstance(lane, Lane) and not lane.host and lane.spec.params.temperature == 0):
            self.greedy = False
        self.drafts += row.drafts
        if row.kind == "embed":
            self.tapped += row.tokens

    def path(self) -> ForwardPath:
        """Which fused call runs the step: the only place that chooses."""
        if self.tapped:
            return "taps"  # embedding chunks need the hidden-state taps; samplers use host rows
        if self.drafts:
            if self.argmax and self.greedy:
                return "argmax"  # greedy verify rows: the engine argmaxes them, nothing read back
            return "rows"  # verify rows: several logits rows a lane (`StepRunner.sample_rows`)
        if self.host or not self.fusable:
            return "logits"
        return "sample"


def cpu_sampling_config(p: Any, seed32: int) -> _ffi.BaseRTSamplingConfig:
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


def row_sampling(lane: Lane, keep: list[Any], drafts: Sequence[int] = ()) -> _ffi.BaseRTRowSampling:
    """The engine row sampler's parameters for lane's next token (after `drafts`, were they
    accepted: a verify row's later row)."""
    p = lane.spec.params
    rs = _ffi.BaseRTRowSampling(
        temperature=p.temperature,
        top_p=p.top_p,
        min_p=p.min_p,
        top_k=p.top_k,
        seed=mix32(lane.seed, len(lane.generated) + len(drafts)),
        repeat_penalty=p.repeat_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if lane.penalized and p.temperature > 0:
        hist = _ffi.u32_array(lane.history(drafts))
        keep.append(hist)
        rs.history = ctypes.cast(hist, ctypes.POINTER(c_uint32))
        rs.history_count = len(hist)
    return rs


class StepRunner:
    """Runs fused steps for one model handle; owns the host logits buffer."""

    def __init__(
        self,
        lib: _ffi.Library,
        model: int,
        caps: Capabilities,
        *,
        vocab_size: int,
        stride: int,
        max_rows: int,
        token_text: Any,
    ) -> None:
        self.lib = lib
        self.model = model
        self.caps = caps  # which fused call and which sampler: asked once, at load
        self.vocab_size = vocab_size
        self.stride = stride
        self.max_rows = max(max_rows, 1)
        # Anonymous pages: zero, and resident only once the engine writes a row into them.
        self._logits = mmap.mmap(-1, self.max_rows * stride)
        self._logits_ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._logits))
        self._mask: np.ndarray | None = None
        self._token_text = token_text  # id -> str, for top_logprobs
        self.pooler: TapPooler | None = None  # set once the engine thread trusts the tapped embed path
        self.argmax_refused = False
        """The engine refused rows_argmax (UNSUPPORTED) once: greedy verify steps read rows from then on."""
        self.argmax_steps = 0
        """Verify steps the engine argmaxed (`baseRT_batch_step_fused_rows_argmax`)."""

    def run(self, rows: Sequence[tuple[Lane | EmbedLane, PlannedRow]]) -> list[RowResult]:
        """One step over `rows`: prepare -> forward (ONE fused call) -> collect.

        Every lane gets a result: its sampled token, its embedding chunk's
        pooled rows, nothing yet (a prefill chunk), or its error. No lane is
        written here: the engine thread applies the results."""
        batch, failed = self.prepare(rows)
        if not batch.rows:
            return failed
        try:
            fused = self.forward(batch)
        except EngineError as exc:  # the step failed as a whole: its lanes end with it
            return failed + [RowResult(lane, row, error=exc) for lane, row in batch.rows]
        except Exception as exc:
            err = internal_error("in the engine step", exc)
            return failed + [RowResult(lane, row, error=err) for lane, row in batch.rows]
        return failed + self.collect(batch, fused)

    def prepare(self, rows: Sequence[tuple[Lane | EmbedLane, PlannedRow]]) -> tuple[Batch, list[RowResult]]:
        """The fused call's inputs; the lanes that cannot be marshalled fail alone, before the forward."""
        batch = Batch(fusable=self.caps.fused_sample, argmax=self.caps.rows_argmax and not self.argmax_refused)
        failed: list[RowResult] = []
        for lane, row in rows:
            try:
                chunk = lane.next_input(row.tokens)
                if lane.seq is None or len(chunk) != row.tokens or (row.kind == "embed" and self.pooler is None):
                    raise RuntimeError(f"request {lane.rid} is not ready to step")
                sampler = None
                if row.samples and isinstance(lane, Lane) and not lane.host and batch.fusable:
                    sampler = row_sampling(lane, batch.keep)
            except Exception as exc:
                failed.append(RowResult(lane, row, error=internal_error("preparing the step", exc)))
                continue
            batch.add(lane, row, chunk, sampler)
        return batch, failed

    def forward(self, batch: Batch) -> ctypes.Array[c_uint32] | None:
        """The one fused call; the sampled ids when the engine sampled, else None
        (the step's logits rows are then in the host buffer)."""
        lib, model, n = self.lib, self.model, len(batch.rows)
        seqs = (c_void_p * n)(*(lane.seq for lane, _ in batch.rows))
        counts = (c_int * n)(*(row.tokens for _, row in batch.rows))
        toks = _ffi.u32_array(batch.feed)
        path = batch.path()
        out_rows = (c_int * n)(*(row.out_rows for _, row in batch.rows))
        n_out = n + batch.drafts
        if path == "argmax":
            ids = (c_uint32 * n_out)()
            rc = lib.baseRT_batch_step_fused_rows_argmax(model, seqs, n, toks, counts, out_rows, None, 0, None, ids)
            if rc == 0:
                self.argmax_steps += 1
                batch.argmaxed = ids
                return None
            if rc != ErrorCode.UNSUPPORTED:
                raise lib.last_error("baseRT_batch_step_fused_rows_argmax", f"returned {rc}")
            # this model verifies through host logits (a bundle the engine cannot argmax): remembered,
            # and this step runs on the logits rows (a refused step changed no sequence)
            self.argmax_refused = True
            path = "rows"
        if path == "sample":
            rows_c = (_ffi.BaseRTRowSampling * n)()
            for i, r in enumerate(batch.samplers):
                if r is not None:
                    rows_c[i] = r
            fused = (c_uint32 * n)()
            lib.check(
                lib.baseRT_batch_step_fused_sample(model, seqs, n, toks, counts, rows_c, fused),
                "baseRT_batch_step_fused_sample",
            )
            return fused
        if path == "taps":
            # One row of logits per lane as in the other paths (the header wants
            # out_rows >= 1; an embedding lane's row is ignored), taps of the
            # embedding lanes' chunks. Samplers then use host rows.
            assert self.pooler is not None
            layer = (c_int * 1)(self.pooler.hidden_index)
            trows = (c_int * n)(*(row.tokens if row.kind == "embed" else 0 for _, row in batch.rows))
            lib.check(
                lib.baseRT_batch_step_fused_logits_rows_taps(model, seqs, n, toks, counts, out_rows, layer, 1, trows),
                "baseRT_batch_step_fused_logits_rows_taps",
            )
            read = batch.sampling
        elif path == "rows":
            lib.check(
                lib.baseRT_batch_step_fused_logits_rows(model, seqs, n, toks, counts, out_rows),
                "baseRT_batch_step_fused_logits_rows",
            )
            # lanes without host needs are sampled in the engine (`sample_rows`): no readback
            # unless some lane samples from host rows
            read = batch.host or not self.caps.row_sampler
        else:
            lib.check(
                lib.baseRT_batch_step_fused_logits(model, seqs, n, toks, counts), "baseRT_batch_step_fused_logits"
            )
            read = True
        if read and lib.baseRT_read_batch_logits(model, n_out, self._logits_ptr) < 0:
            raise lib.last_error("baseRT_read_batch_logits")
        return None

    def collect(self, batch: Batch, fused: ctypes.Array[c_uint32] | None) -> list[RowResult]:
        """Each lane's result of the forward: sampled ids, pooled tap rows, or its own error."""
        results: list[RowResult] = []
        taps_error = self._read_taps(batch.tapped) if batch.tapped else None
        ids = batch.argmaxed
        engine_rows = self.sample_rows(batch) if batch.drafts and self.caps.row_sampler and ids is None else {}
        taps_at = 0
        at = 0  # the lane's first logits row
        for i, (lane, row) in enumerate(batch.rows):
            if row.kind == "embed":
                results.append(RowResult(lane, row, error=taps_error) if taps_error else self._pool(lane, row, taps_at))
                taps_at += row.tokens
            elif not row.samples:
                results.append(RowResult(lane, row))
            elif fused is not None:
                results.append(RowResult(lane, row, sampled=Sampled(int(fused[i]))))
            elif ids is not None:  # greedy: row j's argmax is the token after the lane's drafts[:j]
                toks = tuple(int(t) for t in ids[at : at + row.out_rows])
                results.append(RowResult(lane, row, sampled=Sampled(toks[0]), first_row=at, verified=toks[1:]))
            elif (got := engine_rows.get(i)) is not None:
                results.append(got)
            else:
                results.append(self._sample(lane, row, at))
            at += row.out_rows
        return results

    def sample_rows(self, batch: Batch) -> dict[int, RowResult]:
        """A verifying step's lanes that need no host rows (no grammar, logit bias, logprobs,
        greedy penalties), sampled in the engine as `baseRT_batch_step_fused_sample` would:
        every logits row of each, row j with the lane's drafts before it counted as generated
        (its seed position and penalty history; they are used only while those drafts are
        accepted). One `baseRT_sample_logits_rows` call per run of consecutive such rows;
        the other lanes' rows are left to the host. By batch index; a failed call leaves its
        lanes to the host path (which reports their error)."""
        out: dict[int, RowResult] = {}
        runs: list[tuple[int, list[tuple[int, Lane, PlannedRow]]]] = []  # (first row, lanes)
        at = 0
        for i, (lane, row) in enumerate(batch.rows):
            if row.samples and isinstance(lane, Lane) and not lane.host:
                if runs and runs[-1][0] + sum(r.out_rows for _, _, r in runs[-1][1]) == at:
                    runs[-1][1].append((i, lane, row))
                else:
                    runs.append((at, [(i, lane, row)]))
            at += row.out_rows
        keep: list[Any] = []
        for first, lanes in runs:
            samplers = [
                row_sampling(lane, keep, lane.drafts[:j]) for _, lane, row in lanes for j in range(row.out_rows)
            ]
            n_rows = len(samplers)
            rows_c = (_ffi.BaseRTRowSampling * n_rows)(*samplers)
            toks = (c_uint32 * n_rows)()
            if self.lib.baseRT_sample_logits_rows(self.model, first, n_rows, rows_c, toks) != 0:
                if not batch.host:  # the host path needs the rows the forward did not read back
                    if self.lib.baseRT_read_batch_logits(self.model, at, self._logits_ptr) < 0:
                        raise self.lib.last_error("baseRT_read_batch_logits")
                    batch.host = True
                continue
            j = 0
            for i, lane, row in lanes:
                got = [int(t) for t in toks[j : j + row.out_rows]]
                out[i] = RowResult(lane, row, sampled=Sampled(got[0]), verified=tuple(got[1:]))
                j += row.out_rows
        return out

    def _sample(self, lane: Lane | EmbedLane, row: PlannedRow, i: int) -> RowResult:
        try:
            assert isinstance(lane, Lane)
            return RowResult(lane, row, sampled=self._sample_host_row(lane, i), first_row=i)
        except AioBaseRTError as exc:  # this lane's sampling failed: only this lane ends
            return RowResult(lane, row, error=exc)
        except Exception as exc:
            return RowResult(lane, row, error=internal_error("sampling", exc))

    def verify_row(self, lane: Lane, i: int) -> Sampled:
        """The token of logits row `i` of the last step (a verify row's later row), chosen as a
        plain step would choose it from the lane as it is now: its drafts before this row are
        in `lane.generated` (penalties, seed position, grammar state). Raises the lane's error."""
        try:
            return self._sample_host_row(lane, i)
        except AioBaseRTError:
            raise
        except Exception as exc:
            raise internal_error("sampling", exc) from exc

    def _read_taps(self, n_rows: int) -> AioBaseRTError | None:
        """Copy the step's tapped rows into the pooler's buffer; the error costs the embedding lanes only."""
        assert self.pooler is not None
        try:
            got = self.lib.baseRT_read_tap_rows(self.model, 0, n_rows, self.pooler.rows.ctypes.data)
            if got < 0:
                raise self.lib.last_error("baseRT_read_tap_rows")
            if got != self.pooler.dim:
                raise EngineError(f"baseRT_read_tap_rows: rows of {got} values, expected {self.pooler.dim}")
        except AioBaseRTError as exc:
            return exc
        except Exception as exc:
            return internal_error("reading the hidden-state taps", exc)
        return None

    def _pool(self, lane: Lane | EmbedLane, row: PlannedRow, first: int) -> RowResult:
        assert self.pooler is not None
        try:
            part = self.pooler.pooled_sum(self.pooler.rows[first : first + row.tokens])
        except Exception as exc:
            return RowResult(lane, row, error=internal_error("pooling the embedding", exc))
        return RowResult(lane, row, pooled=part)

    def _sample_host_row(self, lane: Lane, i: int) -> Sampled:
        """Pick lane's token from row i of the host logits (and its logprobs)."""
        lib, model = self.lib, self.model
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
        elif p.temperature > 0 and self.caps.row_sampler:
            # the engine's row sampler, as baseRT_batch_step_fused_sample would run it
            keep: list[Any] = []
            rs = row_sampling(lane, keep)
            out = c_uint32(0)
            rc = lib.baseRT_sample_logits_rows(model, i, 1, byref(rs), byref(out))
            lib.check(rc, "baseRT_sample_logits_rows")
            tok = int(out.value)
        elif p.temperature > 0:  # an engine without the row-sampling pass: CPU pipeline
            cfg = cpu_sampling_config(p, mix32(lane.seed, 0))
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
                    TopLogprob(id=int(ids[j]), logprob=float(vals[j]), text=self._token_text(int(ids[j])))
                    for j in range(got)
                ]
        return Sampled(tok, lp, tops)

    def _apply_constraint(self, lane: Lane, i: int) -> None:
        """Mask row i of the host logits with the lane's grammar (disallowed -> -inf)."""
        assert lane.constraint is not None
        import numpy as np  # the bitmask llguidance fills

        words = (self.vocab_size + 31) // 32
        if self._mask is None or self._mask.shape[0] != words:
            self._mask = np.zeros(words, dtype=np.int32)
        if not lane.constraint.fill_bitmask(self._mask):
            return
        if not self._mask.any():
            raise InvalidRequestError("the output grammar admits no further token")
        if self.caps.mask_row:
            row = self._logits_ptr + i * self.stride
            mask_ptr = self._mask.ctypes.data_as(ctypes.POINTER(c_int32))
            self.lib.check(self.lib.baseRT_mask_logits_row(self.model, row, mask_ptr), "baseRT_mask_logits_row")
        else:  # an engine without the row op: the same on the f16 view
            allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
            logits = np.frombuffer(self._logits, dtype=np.float16).reshape(self.max_rows, self.stride // 2)
            logits[i, : self.vocab_size][~allowed] = -np.inf


class Requests:
    """The engine thread's registry of every request it holds, by id: its record
    (`request.Request`, from its arrival) and, once it is prepared, the lane that runs it (a
    generation's `Lane` or an embedding's `EmbedLane`). One place to look either up."""

    def __init__(self) -> None:
        self._records: dict[str, Request] = {}
        self._lanes: dict[str, Lane | EmbedLane] = {}

    def add(self, req: Request) -> None:
        """A request reaches the engine thread (it is prepared next)."""
        self._records[req.rid] = req

    def attach(self, lane: Lane | EmbedLane) -> None:
        """The lane that runs a prepared request."""
        self._records[lane.rid] = lane.state
        self._lanes[lane.rid] = lane

    def get(self, rid: str) -> Request | None:
        return self._records.get(rid)

    def lane(self, rid: str) -> Lane | EmbedLane | None:
        return self._lanes.get(rid)

    def pop(self, rid: str) -> None:
        self._records.pop(rid, None)
        self._lanes.pop(rid, None)

    def of(self, state: Request) -> Lane | EmbedLane:
        return self._lanes[state.rid]

    def records(self) -> list[Request]:
        """Every request held, in arrival order (a request answered while it is prepared is
        held, finished, until its preparation returns: it holds its queue place)."""
        return list(self._records.values())

    def live(self) -> list[Request]:
        """The requests not finished yet."""
        return [r for r in self._records.values() if not r.status.is_finished]

    def lanes(self) -> list[Lane]:
        """The generations holding a lane (queued or running)."""
        return [r for r in self._lanes.values() if isinstance(r, Lane)]

    def __len__(self) -> int:
        return len(self._records)

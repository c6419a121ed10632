"""One fused batch step and its sampling (engine thread only).

`Lane` is the engine thread's record of one request; `StepRunner.step` feeds
every scheduled lane through ONE fused forward and samples each lane's next
token: in the engine (`baseRT_batch_step_fused_sample`) when every sampling
lane's parameters allow, else from host logits rows (grammar masks, logit
bias, logprobs, penalties on greedy lanes).

An embedding is an `EmbedLane`: a step that carries one of its chunks runs as
`baseRT_batch_step_fused_logits_rows_taps`, tapping the final pre-norm hidden
state of the chunk's rows, which `TapPooler` normalises and sums; every
sampling lane of that step samples from host logits rows (the engine's row
sampler on the same rows: the same tokens as the fused-sample path).

Fault isolation: whatever goes wrong while preparing or sampling ONE lane (a
bad value, a grammar that raises, a bug) becomes that lane's outcome and
nobody else's. Only a failure of the shared forward itself fails the lanes
that were in it.
"""

from __future__ import annotations

import codecs
import ctypes
import os
from ctypes import byref, c_float, c_int, c_int32, c_uint32, c_void_p
from typing import Any

import numpy as np

from . import _ffi
from ._protocol import Constraint, Final, RequestSpec, Sink, Ticket
from .batcher import LaneState
from .errors import AioBaseRTError, EngineError, InvalidRequestError
from .stopping import StopStringMatcher
from .types import TopLogprob


def mix32(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter) folded to a non-zero u32 (0 means 'random')."""
    z = (seed * 0x9E3779B97F4A7C15 + counter + 0x632BE59BD9B4E5F5) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z & 0xFFFFFFFF) or 1


def internal_error(where: str, exc: BaseException) -> AioBaseRTError:
    """A bug surfaced as a typed error for the one request it hit."""
    err = AioBaseRTError(f"internal error {where}: {exc!r}")
    err.__cause__ = exc
    return err


class Lane:
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
        # Text is assembled here from each token's exact bytes, so the stream's
        # text is the decode of its ids (NUL bytes included; bytes still pending
        # at the end become U+FFFD, as Engine.decode does).
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.seq: int | None = None
        self.prefix_handle = 0
        self.cached = 0
        self.generated: list[int] = []
        self.pending: list[Any] = []  # Tokens produced this step, not yet handed to the loop
        self.final: Final | None = None
        self.error: BaseException | None = None
        self.submitted_step = 0
        self.admitted_step = -1
        self.admitted_at = 0.0
        self.first_token_at = 0.0
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


class TapPooler:
    """What `baseRT_embed` pools, rebuilt from hidden-state taps.

    `baseRT_embed` averages the FINAL-NORMED hidden state (rmsnorm with the
    model's final norm weight) of every input row; a tap gives the final
    PRE-norm hidden, rounded to f16. So each tapped row goes through the same
    rmsnorm here (sum of squares in float64, scale rounded to float32, product
    in float32, as the engine computes it) and is summed in float64. The only
    difference from the single-call result is the f16 rounding of the tapped
    hidden state (relative error ~1e-4 on real models); the engine thread
    checks that on a probe before it trusts this path (`EngineThread._embed_path`).
    """

    def __init__(self, weight: np.ndarray, eps: float, hidden_index: int, capacity: int) -> None:
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)
        self.dim = int(self.weight.shape[0])
        self.eps = float(eps)
        self.hidden_index = hidden_index
        """The hidden_states index of the final pre-norm hidden (= n_layers)."""
        self.rows = np.zeros((max(capacity, 1), self.dim), dtype=np.float16)
        """The tap read-back buffer: up to `capacity` rows a step."""

    def pooled_sum(self, rows: np.ndarray) -> np.ndarray:
        """Sum over `rows` ([n, dim] f16 pre-norm hidden) of their final-normed values, float64."""
        x = rows.astype(np.float32)
        x64 = x.astype(np.float64)
        ss = np.einsum("ij,ij->i", x64, x64)
        scale = (1.0 / np.sqrt(ss / self.dim + self.eps)).astype(np.float32)
        normed = (x * scale[:, None]) * self.weight
        total: np.ndarray = normed.sum(axis=0, dtype=np.float64)
        return total


class EmbedLane:
    """Engine-thread bookkeeping of one chunked embedding."""

    def __init__(self, rid: str, ids: list[int], dim: int, done: Any) -> None:
        self.rid = rid
        self.ids = ids
        self.done = done  # (result, error) callback, run on the loop
        self.state = LaneState(rid=rid, prompt_len=len(ids), max_new_tokens=0, embed=True)
        self.seq: int | None = None
        self.total = np.zeros(dim, dtype=np.float64)
        self.finite = True

    def result(self) -> np.ndarray:
        """The mean over all rows, as baseRT_embed rounds it: float64 sum / n, then float32."""
        out: np.ndarray = (self.total / len(self.ids)).astype(np.float32)
        return out


Sampled = tuple[int, float | None, list[TopLogprob] | None]
"""A lane's (token, logprob, top logprobs) from one step."""

Outcome = Sampled | BaseException | None
"""Per lane of a step: its token, why it failed, or None (a prefill chunk, no token yet)."""


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


def row_sampling(lane: Lane, keep: list[Any]) -> _ffi.BaseRTRowSampling:
    """The engine row sampler's parameters for lane's next token."""
    p = lane.spec.params
    rs = _ffi.BaseRTRowSampling(
        temperature=p.temperature,
        top_p=p.top_p,
        min_p=p.min_p,
        top_k=p.top_k,
        seed=mix32(lane.seed, len(lane.generated)),
        repeat_penalty=p.repeat_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if lane.penalized and p.temperature > 0:
        hist = _ffi.u32_array(lane.history())
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
        *,
        vocab_size: int,
        stride: int,
        max_rows: int,
        token_text: Any,
    ) -> None:
        self.lib = lib
        self.model = model
        self.vocab_size = vocab_size
        self.stride = stride
        self.has_fused_sample = lib.has("baseRT_batch_step_fused_sample")
        self._logits = np.zeros((max_rows, stride // 2), dtype=np.float16)
        self._logits_ptr = self._logits.ctypes.data
        self._mask: np.ndarray | None = None
        self._token_text = token_text  # id -> str, for top_logprobs
        self.pooler: TapPooler | None = None  # set once the engine thread trusts the tapped embed path

    def _prepare_embed(self, lane: EmbedLane, k: int) -> list[int]:
        st = lane.state
        chunk = lane.ids[st.prefilled : st.prefilled + k]
        if lane.seq is None or len(chunk) != k or self.pooler is None:
            raise RuntimeError(f"embedding {lane.rid} is not ready to step")
        return chunk

    def step(self, rows: list[tuple[Lane | EmbedLane, int]]) -> list[tuple[Lane | EmbedLane, Outcome]]:
        """Feed `rows` ((lane, tokens fed)) through one forward; every lane's outcome.

        An embedding lane's outcome is None (its chunk pooled) or its error."""
        outcomes: list[tuple[Lane | EmbedLane, Outcome]] = []
        batch: list[tuple[Lane | EmbedLane, int, bool]] = []  # lane, fed, samples this step
        feed: list[int] = []
        srows: list[_ffi.BaseRTRowSampling | None] = []
        keep: list[Any] = []
        fusable = self.has_fused_sample
        host = not fusable
        tapped = 0
        for lane, k in rows:
            st = lane.state
            if isinstance(lane, EmbedLane):
                try:
                    chunk = self._prepare_embed(lane, k)
                except Exception as exc:
                    outcomes.append((lane, internal_error("preparing the step", exc)))
                    continue
                feed.extend(chunk)
                batch.append((lane, k, False))
                srows.append(None)
                tapped += k
                continue
            # Each lane is prepared on its own: a lane whose input or sampling
            # parameters cannot be marshalled fails alone, before the forward.
            try:
                if st.prefilling:
                    chunk = lane.prompt[st.prefilled : st.prefilled + k]
                    samples = st.prefilled + k == st.prompt_len
                else:
                    chunk = [lane.generated[-1]]
                    samples = True
                if lane.seq is None or len(chunk) != k:
                    raise RuntimeError(f"lane {lane.rid} is not ready to step")
                row = row_sampling(lane, keep) if fusable and samples and not lane.host else None
            except Exception as exc:
                outcomes.append((lane, internal_error("preparing the step", exc)))
                continue
            if samples and lane.host:
                host = True
            feed.extend(chunk)
            batch.append((lane, k, samples))
            srows.append(row)
        if not batch:
            return outcomes
        n = len(batch)
        seqs = (c_void_p * n)(*(lane.seq for lane, _, _ in batch))
        counts = (c_int * n)(*(k for _, k, _ in batch))
        toks = _ffi.u32_array(feed)
        fused: ctypes.Array[c_uint32] | None
        try:
            if tapped:
                # One row of logits per lane as in the other paths (the header
                # wants out_rows >= 1; an embedding lane's row is ignored), taps
                # of the embedding lanes' chunks. Samplers then use host rows.
                assert self.pooler is not None
                ones = (c_int * n)(*([1] * n))
                layer = (c_int * 1)(self.pooler.hidden_index)
                trows = (c_int * n)(*(k if isinstance(lane, EmbedLane) else 0 for lane, k, _ in batch))
                rc = self.lib.baseRT_batch_step_fused_logits_rows_taps(
                    self.model, seqs, n, toks, counts, ones, layer, 1, trows
                )
                self.lib.check(rc, "baseRT_batch_step_fused_logits_rows_taps")
                sampling = any(samples for _, _, samples in batch)
                if sampling and self.lib.baseRT_read_batch_logits(self.model, n, self._logits_ptr) < 0:
                    raise self.lib.last_error("baseRT_read_batch_logits")
                fused = None
            elif host:
                rc = self.lib.baseRT_batch_step_fused_logits(self.model, seqs, n, toks, counts)
                self.lib.check(rc, "baseRT_batch_step_fused_logits")
                if self.lib.baseRT_read_batch_logits(self.model, n, self._logits_ptr) < 0:
                    raise self.lib.last_error("baseRT_read_batch_logits")
                fused = None
            else:
                rows_c = (_ffi.BaseRTRowSampling * n)()
                for i, r in enumerate(srows):
                    if r is not None:
                        rows_c[i] = r
                fused = (c_uint32 * n)()
                rc = self.lib.baseRT_batch_step_fused_sample(self.model, seqs, n, toks, counts, rows_c, fused)
                self.lib.check(rc, "baseRT_batch_step_fused_sample")
        except EngineError as exc:  # the step failed as a whole: its lanes end with it
            return outcomes + [(lane, exc) for lane, _, _ in batch]
        except Exception as exc:
            return outcomes + [(lane, internal_error("in the engine step", exc)) for lane, _, _ in batch]
        taps_at = 0
        taps_error = self._read_taps(tapped) if tapped else None
        for i, (lane, k, samples) in enumerate(batch):
            if lane.state.prefilling:
                lane.state.prefilled += k
            if isinstance(lane, EmbedLane):
                outcomes.append((lane, taps_error or self._pool(lane, taps_at, k)))
                taps_at += k
                continue
            if not samples:
                outcomes.append((lane, None))
                continue
            if fused is not None:
                outcomes.append((lane, (int(fused[i]), None, None)))
                continue
            try:
                outcomes.append((lane, self._sample_host_row(lane, i)))
            except AioBaseRTError as exc:  # this lane's sampling failed: only this lane ends
                outcomes.append((lane, exc))
            except Exception as exc:
                outcomes.append((lane, internal_error("sampling", exc)))
        return outcomes

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

    def _pool(self, lane: EmbedLane, first: int, k: int) -> AioBaseRTError | None:
        assert self.pooler is not None
        try:
            part = self.pooler.pooled_sum(self.pooler.rows[first : first + k])
        except Exception as exc:
            return internal_error("pooling the embedding", exc)
        # An f16 tap overflows where the hidden state exceeds 65504: the engine
        # thread then recomputes that input with baseRT_embed.
        lane.finite = lane.finite and bool(np.isfinite(part).all())
        lane.total += part
        return None

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
        elif p.temperature > 0 and lib.has("baseRT_sample_logits_rows"):
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
        return tok, lp, tops

    def _apply_constraint(self, lane: Lane, i: int) -> None:
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
            self.lib.check(self.lib.baseRT_mask_logits_row(self.model, row, mask_ptr), "baseRT_mask_logits_row")
        else:  # an engine without the row op: the same on the f16 view
            allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
            self._logits[i, : self.vocab_size][~allowed] = -np.inf

"""Draft sources that are models: a small model beside the target (method="draft"), and the
refusal of the engine's own speculators where the loaded engine lacks them (engine thread only).

`open_drafter` is called once, at load, on the engine thread: it returns the drafter the
configuration names (`speculate.NgramDrafter` for "ngram"), or raises a typed error naming the
field. A draft model is a second model handle from the same library (`baseRT_load_model_ex`),
owned by the engine thread as the target's is; its vocabulary must be the target's (size, the
end / begin ids, the special tokens and, where both are bundles, every token's text).

`DraftModelDrafter` keeps one draft sequence a lane and proposes greedily: before each step's
plan (`prepare`) it runs the draft model for every lane at once, as fused steps of the draft
handle (`baseRT_batch_step_fused_sample`, greedy): first a catch-up feed per lane (the tokens its
draft sequence lacks: the prompt while the target prefills it, then the tokens the target made),
which gives the first draft, then one row a lane per further draft, k - 1 steps. The plan then
asks `propose` as it asks any drafter, and the verify path is the one of every source.

A draft sequence is rolled back with the target's, lazily: at its next `prepare` its KV is cut to
what still matches the lane's tokens (the accepted drafts stay, so nothing is prefilled twice). It
is freed with the lane's sequence (`release`: finish, cancel, failure, a pause that releases KV,
preemption); a resumed or recomputed lane's draft catches up from its tokens again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from ctypes import byref, c_int, c_uint32, c_void_p, sizeof
from typing import TYPE_CHECKING, Any, Protocol

from .. import _ffi
from ..config import EngineConfig
from ..errors import AioBaseRTError, InvalidConfigError, UnsupportedError
from .loaded import LoadedModel, _static_str, kv_bits, probe
from .speculate import Drafter, LaneSpec, NgramDrafter, SpecPolicy

if TYPE_CHECKING:
    from .request import Request

SPECULATOR_NEEDS = {
    "mtp": ("speculator_head", "an embedded MTP speculator head (baseRT_load_speculator_head, baseRT_mtp_chain)"),
    "eagle3": ("eagle3", "EAGLE-3 drafter heads (baseRT_load_drafter, baseRT_eagle3_chain)"),
    "dflash": ("drafter", "DFlash block drafters (baseRT_load_drafter, baseRT_drafter_step)"),
    "dspark": ("drafter", "DSpark block drafters (baseRT_load_drafter, baseRT_drafter_step)"),
}
"""The engine's own speculators: the `Capabilities` flag each needs, and what that is."""

MARGIN = 0.1
"""Drafting must make this much more per second than not drafting (`best_depth`): its two times
are measured on a shared machine."""
PROBE_EVERY = 16
"""Where drafting does not pay, one lane (in turn) still drafts one token this often: the draft's
acceptance kept current at the cost of its catching up with that lane."""
REFRESH_EVERY = 16
"""Where drafting pays, one step in this many is a plain step (its time kept current)."""


class DraftLane(Protocol):
    """What the draft model reads of a lane (`step.Lane`)."""

    @property
    def prompt(self) -> Sequence[int]: ...

    @property
    def generated(self) -> list[int]: ...

    @property
    def speculation(self) -> LaneSpec | None: ...

    @property
    def state(self) -> Request: ...


def open_drafter(lib: _ffi.Library, target: LoadedModel, cfg: EngineConfig) -> Drafter | None:
    """The drafter `cfg.speculation` names, built for `target` (None: no speculation). Raises
    `UnsupportedError` naming an engine speculator the library lacks, `InvalidConfigError` naming
    `speculation.draft_model` for a draft whose vocabulary is not the target's."""
    spec = cfg.speculation
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft":
        assert spec.draft_model is not None  # SpeculationConfig checks it
        return DraftModelDrafter(load_draft(lib, spec.draft_model, target, cfg))
    flag, what = SPECULATOR_NEEDS[spec.method]
    if not getattr(target.caps, flag):
        raise UnsupportedError(
            f"speculation.method={spec.method!r} needs {what}; {lib.path} does not export them "
            f"(Capabilities.{flag} is false): use method='ngram' or method='draft'"
        )
    raise UnsupportedError(
        f"speculation.method={spec.method!r}: the engine has {what}, but aiobasert does not drive them yet "
        "(docs/speculative.md): use method='ngram' or method='draft'"
    )


class DraftModel:
    """A loaded draft model: the engine thread's second handle."""

    def __init__(
        self, lib: _ffi.Library, handle: int, path: str, *, vocab_size: int, budget: int, lanes: int, context: int
    ) -> None:
        self.lib = lib
        self.handle = handle
        self.path = path
        self.vocab_size = vocab_size
        self.context = context
        """Positions a draft sequence holds: the target's context, or the draft's own window where shorter."""
        self.budget = budget
        """Tokens one draft step feeds at most (the draft's prefill chunk)."""
        self.lanes = lanes
        """Sequences one draft step carries at most."""

    def free(self) -> None:
        if self.handle:
            self.lib.baseRT_free_model(self.handle)
            self.handle = 0


def load_draft(lib: _ffi.Library, source: str, target: LoadedModel, cfg: EngineConfig) -> DraftModel:
    """Load the draft model at `source` beside `target` (on the engine thread) and check that its
    vocabulary is the target's."""
    from ..models.cache import resolve_model  # a GGUF is converted into the cache once

    path = os.fspath(resolve_model(source, progress=False))
    opts = _ffi.BaseRTLoadOptions(
        struct_size=sizeof(_ffi.BaseRTLoadOptions),
        kv_bits=kv_bits(lib, cfg.kv_cache_dtype),
        paged_kv=1,
        max_batch_size=target.max_batch_size,
        prefix_cache=0,  # a draft sequence catches up from the lane's tokens: nothing to share
        prefill_chunk=cfg.prefill_chunk,
    )
    handle = lib.baseRT_load_model_ex(os.fsencode(path), None, target.max_context, byref(opts))
    if not handle:  # the engine's error (its type and code), naming the field it came from
        err = lib.last_error("baseRT_load_model_ex", f"cannot load {path}")
        raise type(err)(f"speculation.draft_model: {err.message}", code=err.raw_code, function=err.function)
    try:
        caps = probe(lib, handle)
        if not (caps.sequences and caps.fused_sample):
            raise InvalidConfigError(f"speculation.draft_model: the engine cannot batch sequences of {path}")
        mc = _ffi.BaseRTModelConfig()
        lib.baseRT_get_config_into(handle, byref(mc), sizeof(mc))
        check_vocabulary(lib, handle, path, int(mc.vocab_size), target)
        chunk = int(lib.baseRT_max_prefill_chunk(handle)) or cfg.prefill_chunk
        return DraftModel(
            lib,
            handle,
            path,
            vocab_size=int(mc.vocab_size),
            budget=max(1, min(cfg.prefill_chunk, chunk)),
            lanes=target.max_batch_size,
            context=int(mc.max_seq_len) or target.max_context,
        )
    except BaseException:
        lib.baseRT_free_model(handle)
        raise


def check_vocabulary(lib: _ffi.Library, handle: int, path: str, vocab_size: int, target: LoadedModel) -> None:
    """Refuse a draft whose token ids do not mean the target's tokens (its drafts would be
    verified against other tokens: correct output, but nothing ever accepted)."""

    def refuse(what: str, draft: Any, want: Any) -> None:
        raise InvalidConfigError(
            f"speculation.draft_model: {path} has another vocabulary than the model "
            f"({what}: {draft!r} in the draft, {want!r} in {target.path})"
        )

    if vocab_size != target.vocab_size:
        refuse("vocab_size", vocab_size, target.vocab_size)
    eos, target_eos = int(lib.baseRT_eos_token_id(handle)), int(target.lib.baseRT_eos_token_id(target.handle))
    if eos != target_eos:
        refuse("eos_token_id", eos, target_eos)
    for fn, want in (("baseRT_bos_token", target.info.bos_token), ("baseRT_eos_token", target.info.eos_token)):
        mine = _static_str(lib, handle, fn)
        if mine != want:
            refuse(fn.removeprefix("baseRT_"), mine, want)
    special = tuple(t.decode("utf-8", "replace") for t in lib.special_tokens(handle))
    if special != target.special_tokens:
        refuse("special tokens", special[:8], target.special_tokens[:8])
    mine_tokens, theirs_tokens = _bundle_tokens(path), _bundle_tokens(target.path)
    if mine_tokens is not None and theirs_tokens is not None and mine_tokens != theirs_tokens:
        at = next((i for i, (a, b) in enumerate(zip(mine_tokens, theirs_tokens, strict=False)) if a != b), 0)
        refuse(f"token {at}", mine_tokens[at], theirs_tokens[at])


def _bundle_tokens(path: str) -> list[Any] | None:
    """Every token's text, from a bundle's tokenizer fields; None where the file has none."""
    from ..models.bundle import read_bundle

    try:
        tokens = read_bundle(path).tokenizer.get("tokenizer.ggml.tokens")
    except (AioBaseRTError, OSError, ValueError):
        return None
    return list(tokens) if isinstance(tokens, list) else None


class DraftSeq:
    """A lane's draft sequence: the draft model's KV of the lane's tokens (and the drafts fed)."""

    __slots__ = ("n", "proposal", "proposal_at", "seq", "tail")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.n = 0
        """Tokens in the draft's KV."""
        self.tail: list[int] = []
        """The drafts among them (the last len(tail)): kept at the next `prepare` while they
        match what the lane then generated."""
        self.proposal: list[int] = []
        self.proposal_at = -1
        """The lane's token count `proposal` follows (a proposal serves that step only)."""


class DraftModelDrafter:
    """Greedy drafts from a draft model, batched across lanes (see the module's docstring)."""

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self.held: dict[int, LaneSpec] = {}
        """The lanes holding a draft sequence, by id (of their `LaneSpec`)."""
        self.steps = 0
        """Fused steps of the draft model run."""
        self.draft_s: float | None = None
        """A drafting step of the draft model (a row or two a lane), seconds (decayed mean)."""
        self.plain_s: float | None = None
        """An engine step without drafts (the target's step, the host around it), seconds."""
        self.row_s: float | None = None
        """What a verified draft row adds to an engine step, seconds."""
        self._ended: float | None = None
        self._last: list[tuple[LaneSpec, int]] = []
        """The lanes that drafted in the last step, and their drafted count before it."""
        self._drafting = 0
        """Steps with lanes that could draft (`REFRESH_EVERY`)."""
        self._idle = 0
        """Steps since the draft model last drafted (`PROBE_EVERY`)."""
        self._probed = 0
        """Probes run (the next probes the next lane)."""
        self._pays = True
        """Drafting paid when last weighed (prompts being prefilled catch up meanwhile)."""

    def propose(self, lane: Any, k: int) -> list[int]:
        st = lane.speculation
        ds = st.draft if st is not None else None
        if not isinstance(ds, DraftSeq) or ds.proposal_at != len(lane.prompt) + len(lane.generated):
            return []
        return ds.proposal[:k]

    def before_plan(self, lanes: Sequence[tuple[DraftLane, int]], policy: SpecPolicy) -> None:
        """This step's drafts, before the plan asks for them: `lanes` are the running lanes and
        how many drafts each may feed (`draft_candidates`). With the adaptive policy, the draft
        length is also cut to what pays for the draft model's own steps and the verify rows
        (`best_depth`, from the times measured here)."""
        self._measure(time.perf_counter())
        wanted = draft_candidates(lanes, policy)
        if policy.adaptive:
            wanted = self._weigh(wanted)
        self.prepare(wanted, [ln.speculation for ln, _ in lanes if ln.speculation])
        self._last = [(st, st.drafted) for ln, w in wanted if w and (st := ln.speculation) is not None]
        self._ended = time.perf_counter()

    def _measure(self, now: float) -> None:
        """The engine's step since the last drafts (the target's step and the host around it; an
        idle wait counts at most 3x the mean): a plain step's time, or what each verified draft
        row added to it."""
        if self._ended is None:
            return
        gap = now - self._ended
        rows = sum(st.drafted - before for st, before in self._last)
        if not self._last:
            self.plain_s = gap if self.plain_s is None else 0.8 * self.plain_s + 0.2 * min(gap, 3 * self.plain_s)
        elif rows > 0 and self.plain_s is not None:
            per_row = max(0.0, gap - self.plain_s) / rows
            self.row_s = per_row if self.row_s is None else 0.8 * self.row_s + 0.2 * min(per_row, 3 * self.row_s + 1e-4)

    def _weigh(self, wanted: list[tuple[DraftLane, int]]) -> list[tuple[DraftLane, int]]:
        """Cut the draft length to what pays (`best_depth`); none before the times are measured
        (one plain step measures the step), and a plain step now and then keeps that current."""
        decode = [(ln, w) for ln, w in wanted if w]
        if not decode:  # prompts catch up ahead of their first drafts only while drafting pays
            return wanted if self._pays else []
        self._drafting += 1
        if self.plain_s is None or self._drafting % REFRESH_EVERY == 0:
            return []
        if self.draft_s is None:  # not measured yet: draft at full length once
            return wanted
        ps = [ln.speculation.p for ln, _ in decode if ln.speculation is not None]
        ratio = (self.draft_s + len(decode) * (self.row_s or 0.0)) / self.plain_s
        k = best_depth(ps, max(w for _, w in decode), ratio)
        self._pays = k > 0
        self._idle = 0 if k else self._idle + 1
        if self._idle >= PROBE_EVERY:  # one lane's draft now and then keeps the acceptance current
            self._idle = 0
            probe = decode[self._probed % len(decode)]
            self._probed += 1
            return [(probe[0], 1)]
        return [(ln, min(w, k)) for ln, w in wanted] if k else []

    @property
    def live(self) -> int:
        """Draft sequences held (`EngineStats.draft_live_sequences`)."""
        return len(self.held)

    def prepare(self, lanes: Sequence[tuple[DraftLane, int]], running: Sequence[LaneSpec] = ()) -> None:
        """Run the draft model for this step: `lanes` are (lane, drafts wanted; 0 = catch up only,
        for a lane still prefilling), in priority order. Each lane's draft sequence first catches
        up to the lane's tokens (within the draft's feed budget; a lane that cannot catch up this
        step proposes nothing), then the lanes that want drafts step together, one row each.
        A held draft sequence whose lane is not `running` (paused) is freed first: the draft's
        pool is sized for the running lanes, and a resumed lane catches up again."""
        if len(self.held) > len(running):
            keep = {id(st) for st in running}
            for key, held in list(self.held.items()):
                if key not in keep:
                    self.release(held)
        m = self.model
        budget = m.budget
        feeds: list[tuple[DraftLane, DraftSeq, list[int], int, int]] = []  # lane, seq, feed, real, want
        for lane, want in lanes:
            if len(feeds) >= m.lanes or budget <= 0:
                break
            st = lane.speculation
            if st is None:
                continue
            prompt, out = lane.prompt, lane.generated
            n_prompt = len(prompt)
            real = lane.state.prefilled if lane.state.prefilling else n_prompt + len(out)
            if real >= m.context:  # past the draft's window (shorter than the target's): it drafts no more
                self.release(st)
                continue
            want = min(want, m.context - real)  # its drafts fed back stay inside the window
            ds = self._seq(st)
            if ds is None:
                break  # no sequence left in the draft's pool: the lanes after this one draft nothing

            def at(i: int, prompt: Sequence[int] = prompt, out: list[int] = out, n: int = n_prompt) -> int:
                return int(prompt[i]) if i < n else out[i - n]

            self._reconcile(ds, real, at)
            if want and ds.n >= real:  # everything is in: feed the last token again for its logits
                self._rollback(ds, real - 1)
            lag = real - ds.n
            if lag <= 0:
                continue
            take = min(lag, budget)
            budget -= take
            feeds.append((lane, ds, [at(i) for i in range(ds.n, ds.n + take)], real, want if take == lag else 0))
        if not feeds:
            return
        tokens = self._step([(ds, feed) for _, ds, feed, _, _ in feeds])
        drafting: list[tuple[DraftSeq, int, int]] = []  # seq, want, real
        for (_, ds, feed, real, want), tok in zip(feeds, tokens or [], strict=False):
            ds.n += len(feed)
            if want:
                ds.proposal, ds.proposal_at = [tok], real
                drafting.append((ds, want, real))
        for r in range(1, max((w for _, w, _ in drafting), default=0)):
            batch = [(ds, [ds.proposal[-1]]) for ds, want, _ in drafting if want > r]
            tokens = self._step(batch)
            if tokens is None:
                break
            for (ds, feed), tok in zip(batch, tokens, strict=True):
                ds.n += 1
                ds.tail.append(feed[0])
                ds.proposal.append(tok)

    def _step(self, batch: Sequence[tuple[DraftSeq, list[int]]]) -> list[int] | None:
        """One fused step of the draft model, greedy: each sequence's next token after its feed.
        None when the engine refused it (the drafts are dropped; the target's output does not
        depend on them)."""
        if not batch:
            return []
        m, lib = self.model, self.model.lib
        n = len(batch)
        seqs = (c_void_p * n)(*(ds.seq for ds, _ in batch))
        counts = (c_int * n)(*(len(feed) for _, feed in batch))
        toks = _ffi.u32_array([t for _, feed in batch for t in feed])
        rows = (_ffi.BaseRTRowSampling * n)()  # temperature 0: argmax
        out = (c_uint32 * n)()
        self.steps += 1
        began = time.perf_counter()
        rc = lib.baseRT_batch_step_fused_sample(m.handle, seqs, n, toks, counts, rows, out)
        took = time.perf_counter() - began
        if len(toks) <= 2 * n:  # a drafting step, not a prompt's catch-up (which `best_depth` does not weigh)
            self.draft_s = took if self.draft_s is None else 0.8 * self.draft_s + 0.2 * took
        if rc != 0:
            lib.last_error("baseRT_batch_step_fused_sample")  # read (and so cleared) on this thread
            for ds, _ in batch:  # what the failed step wrote is unknown: start these over
                self._rollback(ds, 0)
            return None
        return [int(t) for t in out]

    def _reconcile(self, ds: DraftSeq, real: int, at: Any) -> None:
        """Roll the draft back to what still matches the lane's tokens: the drafts the target
        accepted stay, the rest go."""
        if not ds.tail:
            if ds.n > real:
                self._rollback(ds, real)
            return
        base = ds.n - len(ds.tail)
        keep = 0
        for i, tok in enumerate(ds.tail):
            if base + i >= real or at(base + i) != tok:
                break
            keep += 1
        ds.tail = []
        if base + keep < ds.n:
            self._rollback(ds, base + keep)
        else:
            ds.n = base + keep

    def _rollback(self, ds: DraftSeq, length: int) -> None:
        length = max(length, 0)
        if self.model.lib.baseRT_sequence_rollback(ds.seq, length) != 0:
            self.model.lib.last_error("baseRT_sequence_rollback")
            length = 0
            self.model.lib.baseRT_sequence_rollback(ds.seq, 0)
        ds.n = length
        ds.tail = []

    def _seq(self, st: LaneSpec) -> DraftSeq | None:
        if isinstance(st.draft, DraftSeq):
            return st.draft
        seq = self.model.lib.baseRT_sequence_create(self.model.handle)
        if not seq:
            self.model.lib.last_error("baseRT_sequence_create")
            return None
        st.draft = DraftSeq(int(seq))
        self.held[id(st)] = st
        return st.draft

    def release(self, st: LaneSpec) -> None:
        """Free a lane's draft sequence (its target sequence is being freed)."""
        ds = st.draft
        if isinstance(ds, DraftSeq):
            st.draft = None
            del self.held[id(st)]
            lib = self.model.lib
            lib.baseRT_sequence_rollback(ds.seq, 0)
            lib.baseRT_sequence_free(ds.seq)

    def close(self) -> None:
        """Free the draft model (every lane's draft sequence was released with its lane)."""
        self.model.free()


def best_depth(ps: Sequence[float], cap: int, ratio: float) -> int:
    """The draft length (0..cap) that makes the most tokens per second when `ps` are the drafting
    lanes' per-draft acceptance and one more draft (a draft model step for all lanes, a verify row
    a lane) costs `ratio` x a plain engine step: each lane makes 1 + p + p^2 + ... + p^k tokens in
    1 + k x ratio steps' time, against 1 token in 1 without drafts (by `MARGIN` at least)."""
    if not ps or cap <= 0:
        return 0
    best, best_rate = 0, 1.0 + MARGIN
    for k in range(1, cap + 1):
        made = sum(1.0 + sum(p**i for i in range(1, k + 1)) for p in ps) / len(ps)
        rate = made / (1.0 + k * ratio)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def draft_candidates(lanes: Sequence[tuple[DraftLane, int]], policy: SpecPolicy) -> list[tuple[DraftLane, int]]:
    """The lanes a batched drafter prepares this step: decode lanes the policy may ask (their
    cap), then prefilling ones (their prompts catch up meanwhile). `lanes` are the running
    lanes, (lane, cap)."""
    decode: list[tuple[DraftLane, int]] = []
    prefill: list[tuple[DraftLane, int]] = []
    running = sum(1 for lane, _ in lanes if not lane.state.prefilling)
    for lane, cap in lanes:
        st = lane.speculation
        if st is None:
            continue
        if lane.state.prefilling:
            prefill.append((lane, 0))
        elif cap > 0 and policy.may_ask(st, running, running):
            decode.append((lane, cap))
    return decode + prefill

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
preemption); a resumed or recomputed lane's draft catches up from its tokens again, from the
draft's prefix cache where it holds them (below).

The draft handle has a prefix cache of its own where the target has one (`EngineConfig.prefix_cache`,
bounded as the target's by `prefix_cache_mb`, in the draft's blocks): a new draft sequence is
seeded with the longest cached prefix of the lane's tokens (`baseRT_prefix_match`,
`baseRT_sequence_seed_prefix`), and a released one publishes its KV of the lane's tokens
(`baseRT_prefix_insert`) when its lane finished or paused, as the target's does; what the cache
keeps past its bound is evicted after each publish. Drafts only change speed: the target's tokens
are the same with a cached draft prefix or without.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence
from ctypes import byref, c_int, c_uint32, c_void_p, memmove, sizeof
from typing import Any

from .. import _ffi
from ..config import EngineConfig
from ..errors import AioBaseRTError, InvalidConfigError, UnsupportedError
from .loaded import LoadedModel, _prefix_bound, _static_str, kv_bits, prefix_upkeep, probe
from .speculate import Drafter, DraftLane, LaneSpec, NgramDrafter, SpecPolicy, StepCost

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
HORIZON = 128
"""Drafting starts (lanes catch up on the draft model) only where the predicted gain pays for the
catch-up within the tokens the lanes have left to make, counted to this many at most (a request
often ends well before its max_tokens)."""
PROBE_P = 0.95
"""A probe runs only where drafts accepted this often would pay: where the costs alone rule drafting
out, its acceptance is not worth a lane's catch-up to learn."""
PROBE_BUDGET = 0.02
"""Probes take at most this share of the engine's time: what they learn (a lane's acceptance) is
worth less than they cost where drafting would only break even (4 streams of the f16 / q4 pair:
0.88x with probes every 16 steps, drafting never starting)."""
SPENT_DECAY = 0.995
"""The decay a step of the probes' and the engine's time (`PROBE_BUDGET`)."""
REFRESH_EVERY = 16
"""Where drafting pays, one step in this many is a plain step (its time kept current)."""
CATCH_UP = 8
"""A draft step feeding a lane more tokens than this is a catch-up (the draft model's prefill of
a lane's prompt, or of its tokens since it last drafted): a lane's cost once, left out of the
drafting steps' measured rate (`Throughput`), which is that of drafting as it goes on."""
RETRY_EVERY = 64
"""Where drafting was measured to make fewer tokens a second than plain steps, it is tried again
(one drafting step, its rate measured anew) after this many steps; meanwhile the draft model does
nothing (no probe, no catch-up: a lane's catch-up is the draft model's prefill of its tokens)."""


class Throughput:
    """Tokens a lane makes per second over one kind of engine step (decayed)."""

    __slots__ = ("n", "seconds", "tokens")

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.n = 0

    def add(self, tokens: float, seconds: float, decay: float = 0.8) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.n += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class MeasuredGain:
    """Whether drafting is measured to pay: a lane's tokens per second over the drafting steps (the
    target's verify step, the draft model's steps and the host around them) against the plain
    decode steps'. `best_depth` predicts from a model of the costs; this is what the steps then
    made, so a cost the model leaves out (the host, a draft step dearer than measured, a verify
    step dearer than the fit) still stops drafting that does not pay."""

    def __init__(self) -> None:
        self.drafting = Throughput()
        self.plain = Throughput()
        self.vetoed = 0
        """Steps since drafting was last measured to lose (`RETRY_EVERY`); 0: it is not."""

    def loses(self) -> bool:
        """Whether drafting made fewer tokens a second than plain steps (by `MARGIN`), unless a
        retry is due (every `RETRY_EVERY` asks: one drafting step measures it anew; the plain
        steps meanwhile keep the other rate current)."""
        if self.drafting.n < 3 or self.plain.n < 2 or self.drafting.rate >= (1.0 + MARGIN) * self.plain.rate:
            self.vetoed = 0
            return False
        self.vetoed += 1
        if self.vetoed >= RETRY_EVERY:
            self.vetoed = 0
            return False
        return True


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
        self,
        lib: _ffi.Library,
        handle: int,
        path: str,
        *,
        vocab_size: int,
        budget: int,
        lanes: int,
        context: int,
        prefix: bool = False,
        stats: bool = False,
        evict: bool = False,
        bound: int | None = None,
        page_size: int = 16,
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
        self.prefix = prefix
        """The draft handle has a prefix cache (`Capabilities.prefix_cache` of its load)."""
        self.stats, self.evict = stats, evict
        """It can count and evict its cached blocks (`loaded.prefix_upkeep`)."""
        self.bound = bound
        """The most blocks its prefix cache keeps at rest (`EngineConfig.prefix_cache_mb` in the
        draft's blocks; None: no bound can be held, as for the target's)."""
        self.page_size = page_size
        """KV tokens per block: a prefix shorter than one block is never cached."""

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
        prefix_cache=int(cfg.prefix_cache),  # its own: a prompt served again is not prefilled again on it
        prefill_chunk=cfg.prefill_chunk,
    )
    handle = lib.baseRT_load_model_ex(os.fsencode(path), None, target.max_context, byref(opts))
    if not handle:  # the engine's error (its type and code), naming the field it came from
        err = lib.last_error("baseRT_load_model_ex", f"cannot load {path}")
        said = err.message.removeprefix(f"{err.function}: ") if err.function else err.message  # named once
        raise type(err)(f"speculation.draft_model: {said}", code=err.raw_code, function=err.function)
    try:
        caps = probe(lib, handle)
        if not (caps.sequences and caps.fused_sample):
            raise InvalidConfigError(f"speculation.draft_model: the engine cannot batch sequences of {path}")
        mc = _ffi.BaseRTModelConfig()
        lib.baseRT_get_config_into(handle, byref(mc), sizeof(mc))
        check_vocabulary(lib, handle, path, int(mc.vocab_size), target)
        chunk = int(lib.baseRT_max_prefill_chunk(handle)) or cfg.prefill_chunk
        stats, evict = prefix_upkeep(lib, caps)
        return DraftModel(
            lib,
            handle,
            path,
            vocab_size=int(mc.vocab_size),
            budget=max(1, min(cfg.prefill_chunk, chunk)),
            lanes=target.max_batch_size,
            context=int(mc.max_seq_len) or target.max_context,
            prefix=caps.prefix_cache,
            stats=stats,
            evict=evict,
            bound=_prefix_bound(lib, handle, cfg, caps, stats and evict),
            page_size=int(lib.baseRT_page_size(handle)) or 16,
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

    __slots__ = ("lane", "match", "n", "proposal", "proposal_at", "seq", "tail")

    def __init__(self, seq: int, lane: DraftLane | None = None) -> None:
        self.seq = seq
        self.lane = lane
        """The lane it drafts for (its tokens are published to the draft's prefix cache at release)."""
        self.match = 0
        """The draft prefix-cache match it was seeded from (unlocked at release); 0: none."""
        self.n = 0
        """Tokens in the draft's KV."""
        self.tail: list[int] = []
        """The drafts among them (the last len(tail)): kept at the next `prepare` while they
        match what the lane then generated."""
        self.proposal: list[int] = []
        self.proposal_at = -1
        """The lane's token count `proposal` follows (a proposal serves that step only)."""


class DraftModelDrafter(Drafter):
    """Greedy drafts from a draft model, batched across lanes (see the module's docstring)."""

    weighed = True  # `_weigh` cuts the drafts to what pays, its own steps and the verify rows counted

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self.held: dict[int, LaneSpec] = {}
        """The lanes holding a draft sequence, by id (of their `LaneSpec`)."""
        self.steps = 0
        """Fused steps of the draft model run."""
        self.fed = 0
        """Tokens fed to the draft model (catch-up feeds and drafts)."""
        self.refused = 0
        """Draft steps the engine refused (their drafts dropped, their sequences started over)."""
        self.reused = 0
        """Tokens draft sequences took from the draft's prefix cache instead of being fed
        (`EngineStats.draft_cached_tokens`)."""
        self.draft_s: float | None = None
        """A drafting step of the draft model (a row or two a lane), seconds (decayed mean)."""
        self.draft_cost = StepCost()
        """The draft model's steps as a + b x rows (every step, catch-ups included): a drafting
        step of n lanes is priced at its n rows, not at the mean of steps of every width (a
        one-lane probe read 8 ms where a 16-lane step took 20)."""
        self.plain_s: float | None = None
        """An engine step without drafts (the target's step, the host around it), seconds."""
        self._ended: float | None = None
        self._last: list[tuple[LaneSpec, int]] = []
        """The lanes that drafted in the last step, and their drafted count before it."""
        self._accepted_before = 0
        """Their accepted drafts before the last step."""
        self._decoding = 0
        """Lanes decoding in the last step (0: a prompt was being prefilled; not measured)."""
        self._took = 0.0
        """The draft model's time before the last step (its steps and the host around them), less
        its catch-up feeds (`CATCH_UP`)."""
        self._catch_up_s = 0.0
        self.gain = MeasuredGain()
        """Tokens a lane made per second, drafting and not."""
        self._drafting = 0
        """Steps with lanes that could draft (`REFRESH_EVERY`)."""
        self._idle = 0
        """Steps since the draft model last drafted (`PROBE_EVERY`)."""
        self._probing = False
        self._probe_s = 0.0
        self._spent = 0.0
        """The probes' time and the engine's (the target's steps and the draft model's), decayed
        alike (`PROBE_BUDGET`)."""

    def propose(self, lane: Any, k: int) -> list[int]:
        st = lane.speculation
        ds = st.draft if st is not None else None
        if not isinstance(ds, DraftSeq) or ds.proposal_at != len(lane.prompt) + len(lane.generated):
            return []
        return ds.proposal[:k]

    def before_plan(self, running: Callable[[], Sequence[tuple[DraftLane, int]]], policy: SpecPolicy) -> None:
        """This step's drafts, before the plan asks for them: `running()` gives the running lanes
        and how many drafts each may feed (`draft_candidates`). With the adaptive policy, the draft
        length is also cut to what pays for the draft model's own steps and the verify rows
        (`best_depth`, from the times measured here)."""
        began = time.perf_counter()
        lanes = running()
        self._measure(began)
        self._catch_up_s = 0.0
        wanted = draft_candidates(lanes)
        prefilling = any(ln.state.prefilling for ln, _ in lanes)
        if policy.adaptive:
            wanted = self._weigh(wanted, policy, max(len(lanes), 1), prefilling)
        self.prepare(wanted, [ln.speculation for ln, _ in lanes if ln.speculation])
        self._last = [(st, st.drafted) for ln, w in wanted if w and (st := ln.speculation) is not None]
        self._accepted_before = sum(st.accepted for st, _ in self._last)
        self._decoding = 0 if prefilling else len(lanes)
        self._ended = time.perf_counter()
        self._took = self._ended - began - self._catch_up_s
        self._spent = self._spent * SPENT_DECAY + (self._ended - began)
        if self._probing:  # what the probe cost: its lane's catch-up and drafts
            self._probe_s += self._ended - began
            self._probing = False
        self._probe_s *= SPENT_DECAY

    def _measure(self, now: float) -> None:
        """The last step's time (the target's step and the host around it since the last drafts,
        and its drafting steps), if all its lanes were decoding: a plain step's time (`plain_s`),
        and a lane's tokens per second in drafting and plain steps (`Throughput`). A step with a
        prompt's rows, or one that ended in an idle wait, is not measured."""
        if self._ended is None or not self._decoding:
            return
        gap = now - self._ended
        self._spent += gap
        if self.plain_s is not None and gap > 4 * (self.plain_s + self._took):
            return
        if self._last:
            accepted = sum(st.accepted for st, _ in self._last) - self._accepted_before
            self.gain.drafting.add(1.0 + accepted / self._decoding, gap + self._took)
        else:
            self.plain_s = gap if self.plain_s is None else 0.8 * self.plain_s + 0.2 * gap
            self.gain.plain.add(1.0, gap)

    def _weigh(
        self, wanted: list[tuple[DraftLane, int]], policy: SpecPolicy, rows: int, prefilling: bool = False
    ) -> list[tuple[DraftLane, int]]:
        """Cut the draft length to what pays (`best_depth`); none before the times are measured
        (one plain step measures the step), and a plain step now and then keeps that current.
        One more draft costs a draft-model step for the drafting lanes and a verify row each: the
        target's row cost is its steps' fit (b seconds a row, `StepCost`), at one stream nearly
        nothing, on a compute-bound target (an f16 model on CPU) about as much as a token."""
        decode = [(ln, w) for ln, w in wanted if w]
        if not decode:  # no prompt catches up ahead of its first drafts: they may never pay
            return []
        self._drafting += 1
        if self.plain_s is None or self._drafting % REFRESH_EVERY == 0:
            return []
        if self.draft_s is None:  # not measured yet: one lane drafts at full length once, the one
            return [min(decode, key=lambda lw: self._lag(lw[0]))]  # with least to catch up
        ps = [ln.speculation.p for ln, _ in decode if ln.speculation is not None]
        fit = policy.cost.fit()
        # a plain step: the target's fit at this step's rows (the measured step includes the host
        # and whatever else the machine did then); unfitted, the measured one and its lanes' share
        plain, row_s = (fit[0] + fit[1] * rows, fit[1]) if fit is not None else (self.plain_s, self.plain_s / rows)
        plain = max(plain, 1e-6)
        draft_fit = self.draft_cost.fit()
        draft_step = draft_fit[0] + draft_fit[1] * len(decode) if draft_fit is not None else self.draft_s
        ratio = (draft_step + len(decode) * row_s) / plain
        fixed = policy.cost.overhead_rows * row_s / plain  # a verifying step's own cost (rollbacks, rows path)
        cap = max(w for _, w in decode)
        k = best_depth(ps, cap, ratio, fixed)

        def repays(lanes: Sequence[DraftLane], ps: Sequence[float], k: int) -> bool:
            """Whether drafting k pays back the lanes' catch-up first (the draft model's prefill of
            what they lack: a prompt, or the tokens since they last drafted) within what they have
            left to make (at most HORIZON tokens: how long a request runs is not known)."""
            lag = sum(self._lag(ln) for ln in lanes)
            if draft_fit is None or lag <= CATCH_UP * len(lanes):
                return True
            if prefilling:  # a step carrying prompt chunks is long whatever drafts: no catch-up then
                return False
            left = sum(ln.state.max_new_tokens - ln.state.generated for ln in lanes) / len(lanes)
            gain = plain * (1.0 - 1.0 / depth_rate(ps, k, ratio, fixed))  # seconds a step saves
            return draft_fit[0] + draft_fit[1] * lag <= min(left, HORIZON) * gain

        if k and not repays([ln for ln, _ in decode], ps, k):
            k = 0
        vetoed = k > 0 and self.gain.loses()
        k = 0 if vetoed else k
        self._idle = 0 if k else self._idle + 1
        # one lane's draft now and then keeps the acceptance current, where it is what stops drafting
        # (drafts accepted PROBE_P of the time would pay) and the lane's catch-up would be repaid then
        hoped = best_depth([PROBE_P] * len(ps), cap, ratio, fixed) if not k and not vetoed else 0
        if self._idle >= PROBE_EVERY and hoped and draft_fit is not None:
            self._idle = 0
            near = [ln for ln, _ in decode if repays([ln], [PROBE_P], hoped)]
            lane = min(near, key=self._lag) if near else None
            # its cost (the catch-up, then a draft step a draft) within the budget, counted before it runs
            cost = draft_fit[0] + draft_fit[1] * self._lag(lane) + hoped * draft_step if lane is not None else 0.0
            if lane is not None and self._probe_s + cost <= PROBE_BUDGET * self._spent:
                self._probing = True
                return [(lane, hoped)]  # at the hoped depth: k observations for one catch-up
        return [(ln, min(w, k)) for ln, w in wanted] if k else []

    @staticmethod
    def _lag(lane: DraftLane) -> int:
        """The lane's tokens its draft sequence lacks (all of them where it has none yet)."""
        st = lane.speculation
        ds = st.draft if st is not None else None
        have = ds.n if isinstance(ds, DraftSeq) else 0
        return max(len(lane.prompt) + len(lane.generated) - have, 0)

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
        pool is sized for the running lanes; its KV goes to the draft's prefix cache, so a
        resumed lane catches up from there."""
        if len(self.held) > len(running):
            keep = {id(st) for st in running}
            for key, held in list(self.held.items()):
                if key not in keep:
                    self.release(held, publish=True)
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
            ds = self._seq(st, lane)
            if ds is None:
                break  # no sequence left in the draft's pool: the lanes after this one draft nothing

            def at(i: int, prompt: Sequence[int] = prompt, out: list[int] = out, n: int = n_prompt) -> int:
                return int(prompt[i]) if i < n else out[i - n]

            self._reconcile(ds, real, at, n_prompt + len(out))
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
        began = time.perf_counter()
        tokens = self._step([(ds, feed) for _, ds, feed, _, _ in feeds])
        if max(len(feed) for _, _, feed, _, _ in feeds) > CATCH_UP:  # a lane's prefill: not the rate's
            self._catch_up_s += time.perf_counter() - began
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
        self.fed += len(toks)
        began = time.perf_counter()
        rc = lib.baseRT_batch_step_fused_sample(m.handle, seqs, n, toks, counts, rows, out)
        took = time.perf_counter() - began
        self.draft_cost.add(len(toks), took)
        if len(toks) <= 2 * n:  # a drafting step, not a prompt's catch-up (which `best_depth` does not weigh)
            self.draft_s = took if self.draft_s is None else 0.8 * self.draft_s + 0.2 * took
        if rc != 0:
            lib.last_error("baseRT_batch_step_fused_sample")  # read (and so cleared) on this thread
            self.refused += 1
            for ds, _ in batch:  # what the failed step wrote is unknown: start these over
                self._rollback(ds, 0)
            self.evict_cache()  # cached draft blocks never cost a lane its drafts
            return None
        return [int(t) for t in out]

    def _reconcile(self, ds: DraftSeq, real: int, at: Any, known: int) -> None:
        """Roll the draft back to what still matches the lane's tokens: the drafts the target
        accepted stay, the rest go. Without drafts, its KV is of the lane's own tokens: it may be
        ahead of a prompt the target still prefills (a cached prefix), never past the `known` ones."""
        if not ds.tail:
            if ds.n > known:
                self._rollback(ds, known)
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

    def _seq(self, st: LaneSpec, lane: DraftLane) -> DraftSeq | None:
        """The lane's draft sequence; a new one is seeded from the draft's prefix cache."""
        if isinstance(st.draft, DraftSeq):
            return st.draft
        m, lib = self.model, self.model.lib
        seq = lib.baseRT_sequence_create(m.handle)
        if not seq:
            lib.last_error("baseRT_sequence_create")  # read (and so cleared) on this thread
            if self.evict_cache():  # cached blocks never refuse a lane its draft sequence
                seq = lib.baseRT_sequence_create(m.handle)
                if not seq:
                    lib.last_error("baseRT_sequence_create")
        if not seq:
            return None
        ds = st.draft = DraftSeq(int(seq), lane)
        self.held[id(st)] = st
        self._seed(ds, lane)
        return ds

    def _seed(self, ds: DraftSeq, lane: DraftLane) -> None:
        """Seed a new draft sequence with the longest prefix of the lane's tokens the draft's
        prefix cache holds (the protocol of the target's: match, seed, unlock at release)."""
        m, lib = self.model, self.model.lib
        known = len(lane.prompt) + len(lane.generated)
        if not m.prefix or known <= m.page_size:  # a match leaves one token: it needs > one block
            return
        match = lib.baseRT_prefix_match(m.handle, lane_tokens(lane, known), known)
        if not match.handle:
            return
        if lib.baseRT_sequence_seed_prefix(ds.seq, match.blocks, match.n_blocks, match.matched_tokens) != 0:
            lib.last_error("baseRT_sequence_seed_prefix")
            lib.baseRT_prefix_release(m.handle, match.handle)
            return
        ds.match = int(match.handle)
        ds.n = int(match.matched_tokens)
        self.reused += ds.n

    def release(self, st: LaneSpec, *, publish: bool = False) -> None:
        """Free a lane's draft sequence (its target sequence is being freed). `publish`: its KV
        of the lane's tokens goes to the draft's prefix cache first (the lane finished, or paused),
        and the cache is then held to its bound."""
        ds = st.draft
        if not isinstance(ds, DraftSeq):
            return
        st.draft = None
        del self.held[id(st)]
        m, lib = self.model, self.model.lib
        lane, ds.lane = ds.lane, None
        published = False
        if publish and m.prefix and lane is not None and not lane.state.cancelled:
            valid = self._valid(ds, lane)
            if valid > m.page_size:
                if valid < ds.n:  # drafts the target did not take: not the lane's KV
                    lib.baseRT_sequence_rollback(ds.seq, valid)
                lib.baseRT_prefix_insert(m.handle, lane_tokens(lane, valid), valid, ds.seq)  # best effort
                published = True
        lib.baseRT_sequence_rollback(ds.seq, 0)
        lib.baseRT_sequence_free(ds.seq)
        if ds.match:
            lib.baseRT_prefix_unlock(m.handle, ds.match)
            ds.match = 0
        if published:
            self._bound()

    @staticmethod
    def _valid(ds: DraftSeq, lane: DraftLane) -> int:
        """How much of the draft's KV is of the lane's tokens: all but the drafts the lane did
        not make."""
        prompt, out = lane.prompt, lane.generated
        known = len(prompt) + len(out)
        base = min(ds.n - len(ds.tail), known)
        keep = 0
        for i, tok in enumerate(ds.tail):
            at = base + i
            if at >= known or (int(prompt[at]) if at < len(prompt) else out[at - len(prompt)]) != tok:
                break
            keep += 1
        return base + keep

    def _bound(self) -> None:
        """Evict the least recently used cached draft prefixes past the bound (as the target's
        cache, `EngineConfig.prefix_cache_mb`)."""
        m = self.model
        if m.bound is None:
            return
        cached = c_int(0)
        m.lib.baseRT_prefix_cache_stats(m.handle, None, None, None, byref(cached))
        if cached.value > m.bound:
            m.lib.baseRT_prefix_evict(m.handle, cached.value - m.bound)

    def evict_cache(self) -> bool:
        """Empty the draft's prefix cache (what no live draft sequence shares): the draft's pool
        was short, or `Engine.evict_prefix_cache`. True if a block went back to the pool."""
        m = self.model
        if not m.evict:
            return False
        return int(m.lib.baseRT_prefix_evict(m.handle, 1 << 30)) > 0

    def kv_blocks(self) -> tuple[int, int]:
        """The draft pool's blocks in use and those its prefix cache holds (engine thread only;
        at idle the two are equal: no draft sequence holds any)."""
        m = self.model
        ms = _ffi.BaseRTMemoryStats()
        if not m.lib.baseRT_model_memory_stats(m.handle, byref(ms)):
            return -1, -1
        cached = c_int(0)
        if m.stats:
            m.lib.baseRT_prefix_cache_stats(m.handle, None, None, None, byref(cached))
        return int(ms.kv_cache_blocks_used), int(cached.value)

    def close(self) -> None:
        """Free the draft model (every lane's draft sequence was released with its lane)."""
        self.model.free()


def lane_tokens(lane: DraftLane, n: int) -> ctypes.Array[c_uint32]:
    """The lane's first `n` tokens (its prompt, then its output) as a C array; a prompt that is a
    C array is copied, not read token by token."""
    prompt = lane.prompt
    p = min(n, len(prompt))
    arr = (c_uint32 * n)()
    if isinstance(prompt, ctypes.Array):
        memmove(arr, prompt, p * sizeof(c_uint32))
    else:
        arr[:p] = [int(t) for t in prompt[:p]]
    arr[p:] = lane.generated[: n - p]  # type: ignore[assignment]  # ctypes takes ints for c_uint32 slots
    return arr


def best_depth(ps: Sequence[float], cap: int, ratio: float, fixed: float = 0.0) -> int:
    """The draft length (0..cap) that makes the most tokens per second when `ps` are the drafting
    lanes' per-draft acceptance, one more draft (a draft model step for all lanes, a verify row
    a lane) costs `ratio` x a plain engine step and a step that verifies `fixed` x one more: each
    lane makes 1 + p + p^2 + ... + p^k tokens in 1 + fixed + k x ratio steps' time, against 1
    token in 1 without drafts (by `MARGIN` at least)."""
    if not ps or cap <= 0:
        return 0
    best, best_rate = 0, 1.0 + MARGIN
    for k in range(1, cap + 1):
        rate = depth_rate(ps, k, ratio, fixed)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def depth_rate(ps: Sequence[float], k: int, ratio: float, fixed: float = 0.0) -> float:
    """Tokens a lane makes drafting `k` per plain step's time (`best_depth`): 1.0 makes as many as
    not drafting."""
    if not ps:
        return 1.0
    made = sum(1.0 + sum(p**i for i in range(1, k + 1)) for p in ps) / len(ps)
    return made / (1.0 + fixed + k * ratio)


def draft_candidates(lanes: Sequence[tuple[DraftLane, int]]) -> list[tuple[DraftLane, int]]:
    """The lanes a batched drafter may prepare this step: decode lanes (their cap), then
    prefilling ones (0: a prompt's catch-up only). `lanes` are the running lanes, (lane, cap).
    How far each drafts is the drafter's own weighing (`DraftModelDrafter._weigh`)."""
    speculating = [(lane, cap) for lane, cap in lanes if lane.speculation is not None]
    decode = [(lane, cap) for lane, cap in speculating if not lane.state.prefilling and cap > 0]
    return decode + [(lane, 0) for lane, _ in speculating if lane.state.prefilling]

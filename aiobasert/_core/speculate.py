"""Speculative decoding on the engine thread: where drafts come from and how many to verify.

A decode lane may feed its pending token plus k draft tokens in one fused step
(`plan.PlannedRow.drafts`); the step leaves k + 1 logits rows and the engine thread picks
each row's token exactly as a plain step would (`engine_thread._apply`), accepting drafts
while they equal it. The output is therefore the non-speculative output whatever the drafts
are: a draft source and the policy below only decide how fast it comes.

* `Drafter` is the interface of a draft source: `propose(lane, k)` returns up to k ids that
  may follow the lane's tokens. `NgramDrafter` is prompt lookup (vLLM's `ngram`, llama.cpp's
  `ngram-simple`): the lane's last n tokens are looked up in its prompt and output, and what
  followed their latest earlier occurrence is proposed.
* `SpecPolicy` chooses k, down to 0. A draft at depth i is only worth its row when its chance
  of being accepted (p^i, p the lane's measured per-draft acceptance, `LaneSpec`) exceeds what
  the row costs relative to the tokens the step makes anyway (`StepCost`: the step time fitted
  as a + b x rows; at one stream a row is nearly free, in a wide compute-bound step it costs
  as much as a token). Proposals a lane does not verify are still checked against the tokens
  it then generates (`LaneSpec.shadow`), so its acceptance keeps being measured for free.
  A row must pay `margin` times its estimated cost (the fit is noisy on a shared machine, and a
  step that verifies pays for rollbacks and row sampling a plain step does not), and a lane
  whose estimate makes every draft a loss is not even asked for a proposal, except one step in
  `probe_every` (its shadow keeps p current).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .request import Request


class DraftSource(Protocol):
    """What a drafter reads of a lane: its tokens so far."""

    @property
    def prompt(self) -> Sequence[int]: ...

    @property
    def generated(self) -> list[int]: ...

    @property
    def speculation(self) -> LaneSpec | None: ...


class DraftLane(DraftSource, Protocol):
    """What a drafter that steps all lanes at once reads of a lane (`step.Lane`): a drafter's
    view and its record."""

    @property
    def state(self) -> Request: ...


class Drafter:
    """A source of draft tokens (engine thread only): `propose`. The hooks after it are for a
    drafter holding state of its own in the engine (a draft model: its sequences, its prefix
    cache, `draft_model.DraftModelDrafter`); they do nothing here, so the engine thread calls
    them whatever the drafter."""

    reused = 0
    """Tokens its sequences took from its own prefix cache (`EngineStats.draft_cached_tokens`)."""
    weighed = False
    """Its proposals are already as long as pays, verify rows included (a drafter that runs for all
    lanes before the plan and weighs its own steps, `before_plan`): the row policy
    (`SpecPolicy.ask` / `depth`) is not asked again, as it would drop drafts whose cost is spent."""

    def propose(self, lane: DraftSource, k: int) -> list[int]:
        """Up to `k` token ids that may follow the lane's prompt + output (its last output
        token included); [] when it has no guess. Any ids are safe: wrong ones only cost rows."""
        raise NotImplementedError

    def before_plan(self, lanes: Callable[[], Sequence[tuple[DraftLane, int]]], policy: SpecPolicy) -> None:
        """Before each step's plan asks for drafts: `lanes()` gives the running lanes and the drafts
        each may feed (called only by a drafter that drafts for all of them at once)."""

    def release(self, spec: LaneSpec, *, publish: bool = False) -> None:
        """The lane's target sequence is being freed (`publish`: its KV goes to the prefix cache)."""

    def evict_cache(self) -> bool:
        """Empty its own prefix cache (`Engine.evict_prefix_cache`); True if anything was freed."""
        return False

    def close(self) -> None:
        """The engine closes, or will not speculate after all."""

    @property
    def live(self) -> int:
        """Sequences of its own held (`EngineStats.draft_live_sequences`)."""
        return 0


class LaneSpec:
    """One lane's speculation state: its n-gram index and its acceptance history."""

    __slots__ = ("accepted", "draft", "drafted", "hits", "idle", "index", "indexed", "misses", "shadow", "verified")

    def __init__(self, prior_hits: float = 1.0, prior_misses: float = 1.5) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        """n-gram -> the position just after its latest occurrence (`NgramDrafter`)."""
        self.indexed = 0
        """Tokens of prompt + output the index covers."""
        self.hits = prior_hits
        self.misses = prior_misses
        """Decayed counts of drafts accepted / rejected (verified or shadowed): p = hits / (hits + misses)."""
        self.shadow: list[int] = []
        """A proposal not verified: checked against the tokens the lane generates next."""
        self.idle = 0
        """Steps since the drafter was last asked (`SpecPolicy.ask`)."""
        self.drafted = 0
        self.accepted = 0
        self.verified = 0
        """Draft tokens fed, accepted, and verify rows run (usage and stats)."""
        self.draft: object = None
        """Its draft model's sequence (`draft_model.DraftSeq`), for a draft-model drafter."""

    @property
    def p(self) -> float:
        return self.hits / (self.hits + self.misses)

    def observe(self, accepted: int, rejected: bool, decay: float = 0.9) -> None:
        """`accepted` drafts in a row matched, then one did not (`rejected`) or the run ended."""
        for _ in range(accepted):
            self.hits = self.hits * decay + 1.0
            self.misses *= decay
        if rejected:
            self.hits *= decay
            self.misses = self.misses * decay + 1.0

    def on_token(self, token: int) -> None:
        """A token the lane generated: the shadow proposal is scored against it."""
        if not self.shadow:
            return
        if self.shadow[0] == token:
            self.shadow.pop(0)
            self.observe(1, False)
        else:
            self.shadow = []
            self.observe(0, True)


class NgramDrafter(Drafter):
    """Prompt lookup: propose what followed the latest earlier occurrence of the lane's last
    n tokens (n from `n_max` down to `n_min`, the longest match first).

    The index (n-gram -> where it last ended) is built once over the prompt and extended by
    each output token, so a proposal costs O(n_max) dict lookups, not a scan of the context."""

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, lane: DraftSource, k: int) -> list[int]:
        st = lane.speculation
        if st is None or k <= 0:
            return []
        prompt, out = lane.prompt, lane.generated
        n_prompt = len(prompt)
        total = n_prompt + len(out)

        def at(i: int) -> int:
            return int(prompt[i]) if i < n_prompt else out[i - n_prompt]

        # index every n-gram that ends before the last token (the last n tokens are the query:
        # indexing them first would find themselves); from one list of the tokens it needs, by
        # slices (a step adds one token: a few tuples, no per-token calls)
        index, n_min, n_max = st.index, self.n_min, self.n_max
        start = max(st.indexed, 1)
        base = max(start - n_max, 0)
        window = [at(j) for j in range(base, total)]
        for end in range(start, total):
            e = end - base
            for n in range(n_min, min(n_max, end) + 1):
                index[tuple(window[e - n : e])] = end
        st.indexed = max(st.indexed, total)
        e = total - base
        for n in range(min(n_max, total - 1), n_min - 1, -1):
            after = index.get(tuple(window[e - n : e]) if n <= e else tuple(at(j) for j in range(total - n, total)))
            if after is not None:
                # what followed, and where it runs into the end, the same period again (a loop
                # of period `total - after` continues as it went)
                period = total - after
                return [at(after + i % period) for i in range(k)]
        return []


class StepCost:
    """The step's time as a + b x rows, fitted by decayed least squares over the plain steps
    run, and what a step that verifies drafts costs beyond that (`overhead_rows`: its rows are
    sampled one lane at a time and its lanes rolled back; measured, as a number of rows, over
    the verifying steps)."""

    def __init__(self, decay: float = 0.97, overhead_rows: float = 2.0) -> None:
        self.decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self.prior_overhead = self.overhead_rows = overhead_rows
        """A verifying step's own cost, in rows: measured on verifying steps, each counted at
        most 8 rows (the first one also faults in the logits scratch), and drifting back to the
        prior over plain steps (a high estimate would otherwise stop the steps that measure it)."""

    def add(self, rows: int, seconds: float, verified: bool = False) -> None:
        if verified:  # the fit stays that of plain steps; the excess is the verify overhead
            fit = self.fit()
            if fit is not None and fit[1] > 0:
                extra = (seconds - (fit[0] + fit[1] * rows)) / fit[1]
                self.overhead_rows = 0.8 * self.overhead_rows + 0.2 * min(max(extra, 0.0), 8.0)
            return
        self.overhead_rows += 0.02 * (self.prior_overhead - self.overhead_rows)
        d = self.decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until the steps seen vary enough in rows to tell them apart."""
        n = self._n
        if n < 2:
            return None
        var = self._xx / n - (self._x / n) ** 2
        if var < 0.25:
            return None
        b = (self._xy / n - (self._x / n) * (self._y / n)) / var
        a = self._y / n - b * self._x / n
        return max(a, 0.0), max(b, 0.0)

    def row_cost(self, rows: int, lanes: int) -> float:
        """What one more row costs, in tokens the step makes anyway (`lanes`): b x lanes /
        (a + b x rows). Before the fit can tell, a guess: cheap in a narrow step, dearer as
        it widens."""
        fit = self.fit()
        if fit is None:
            return lanes / (8.0 + rows)
        a, b = fit
        total = a + b * rows
        return b * lanes / total if total > 0 else 1.0


class SpecPolicy:
    """How many of a proposal's drafts a lane verifies this step (0 = none)."""

    def __init__(self, adaptive: bool = True, margin: float = 1.5, probe_every: int = 4) -> None:
        self.adaptive = adaptive
        self.cost = StepCost()
        self.margin = margin
        """A draft row is verified only when its expected yield is `margin` x its estimated cost."""
        self.probe_every = probe_every
        """A lane no draft pays for is asked for a proposal (scored as a shadow) this often."""
        self.pooled = LaneSpec()
        """Every lane's verified drafts, decayed more slowly than a lane's: a new lane's prior.
        How often drafts are accepted is as much the drafter's and the traffic's as a lane's (a
        draft model of the target's own weights agrees with it on any prompt): a lane that
        started from a fixed prior lower than that did not draft before it had ended."""

    def new_lane(self) -> LaneSpec:
        """A new lane's state, its p the pooled acceptance (as 2.5 drafts' worth of evidence,
        kept within 0.05..0.95 so that either way a lane's own drafts soon outweigh it)."""
        p = min(max(self.pooled.p, 0.05), 0.95)
        return LaneSpec(prior_hits=2.5 * p, prior_misses=2.5 * (1.0 - p))

    def observe(self, accepted: int, rejected: bool) -> None:
        """A lane's verified run (`LaneSpec.observe`), into the pooled estimate."""
        self.pooled.observe(accepted, rejected, decay=0.98)

    def ask(self, st: LaneSpec, rows: int, lanes: int) -> bool:
        """Whether to run the drafter for a lane this step: when even its first draft could pay,
        and otherwise one step in `probe_every` (a proposal then is a shadow, which keeps p
        current) and never while a shadow is still being scored. Proposing costs host time
        every step a lane is asked; at 16 lanes of free text almost none pays."""
        if not self.adaptive:
            return True
        if st.p > self.margin * self.cost.row_cost(rows, max(lanes, 1)):
            st.idle = 0
            return True
        st.idle += 1
        if st.shadow or st.idle < self.probe_every:
            return False
        st.idle = 0
        return True

    def depth(self, st: LaneSpec, proposed: int, rows: int, lanes: int, first: bool = False) -> int:
        """The largest i <= `proposed` with p^i above `margin` x the row's cost c (each deeper draft
        is accepted only if every one before it was). The `first` lane to draft in a step also pays
        the step's verify overhead: its expected accepted drafts (p + p^2 + ... + p^i) less the
        rows' cost (i x c) must exceed overhead_rows x c, else it drafts nothing."""
        if not self.adaptive or proposed <= 0:
            return proposed
        c = self.cost.row_cost(rows, max(lanes, 1))
        bar = self.margin * c
        p = st.p
        if p <= bar or p <= 0.0:
            return 0
        k = proposed if p >= 1.0 or bar <= 0.0 else max(0, min(proposed, int(math.log(bar) / math.log(p))))
        if first and k and sum(p**i for i in range(1, k + 1)) - k * c <= self.cost.overhead_rows * c:
            return 0
        return k

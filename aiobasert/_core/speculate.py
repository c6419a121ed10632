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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol


class DraftSource(Protocol):
    """What a drafter reads of a lane: its tokens so far."""

    @property
    def prompt(self) -> Sequence[int]: ...

    @property
    def generated(self) -> list[int]: ...

    @property
    def speculation(self) -> LaneSpec | None: ...


class Drafter(Protocol):
    """A source of draft tokens (engine thread only)."""

    def propose(self, lane: DraftSource, k: int) -> list[int]:
        """Up to `k` token ids that may follow the lane's prompt + output (its last output
        token included); [] when it has no guess. Any ids are safe: wrong ones only cost rows."""
        ...


class LaneSpec:
    """One lane's speculation state: its n-gram index and its acceptance history."""

    __slots__ = ("accepted", "drafted", "hits", "index", "indexed", "misses", "shadow", "verified")

    def __init__(self, prior_hits: float = 1.5, prior_misses: float = 1.0) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        """n-gram -> the position just after its latest occurrence (`NgramDrafter`)."""
        self.indexed = 0
        """Tokens of prompt + output the index covers."""
        self.hits = prior_hits
        self.misses = prior_misses
        """Decayed counts of drafts accepted / rejected (verified or shadowed): p = hits / (hits + misses)."""
        self.shadow: list[int] = []
        """A proposal not verified: checked against the tokens the lane generates next."""
        self.drafted = 0
        self.accepted = 0
        self.verified = 0
        """Draft tokens fed, accepted, and verify rows run (usage and stats)."""

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


class NgramDrafter:
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
        # indexing them first would find themselves)
        index = st.index
        for end in range(max(st.indexed, 1), total):
            for n in range(self.n_min, self.n_max + 1):
                if end - n < 0:
                    break
                index[tuple(at(j) for j in range(end - n, end))] = end
        st.indexed = max(st.indexed, total)
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            after = index.get(tuple(at(j) for j in range(total - n, total)))
            if after is not None:
                # what followed, and where it runs into the end, the same period again (a loop
                # of period `total - after` continues as it went)
                period = total - after
                return [at(after + i % period) for i in range(k)]
        return []


class StepCost:
    """The step's time as a + b x rows, fitted by decayed least squares over the steps run."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, rows: int, seconds: float) -> None:
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

    def __init__(self, adaptive: bool = True) -> None:
        self.adaptive = adaptive
        self.cost = StepCost()

    def depth(self, st: LaneSpec, proposed: int, rows: int, lanes: int) -> int:
        """The largest i <= `proposed` with p^i above the row's cost (each deeper draft is
        accepted only if every one before it was)."""
        if not self.adaptive or proposed <= 0:
            return proposed
        c = self.cost.row_cost(rows, max(lanes, 1))
        p = st.p
        if p <= c or p <= 0.0:
            return 0
        if p >= 1.0 or c <= 0.0:
            return proposed
        return max(0, min(proposed, int(math.log(c) / math.log(p))))

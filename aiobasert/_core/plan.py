"""What one engine step does, as the batcher plans it and the step runs it: a `PlannedRow` per
lane (each names its request's `request.Request`), the `StepPlan`.

Plain data, below both the policy (aiobasert/batcher.py, which fills them) and the step
(`step.StepRunner`, which carries them out), as vLLM v1's `SchedulerOutput` sits between its
scheduler and its model runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .request import Request

RowKind = Literal["decode", "prefill", "embed"]


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """One lane's part of a step: `tokens` fed to its sequence."""

    lane: Request
    kind: RowKind
    tokens: int
    samples: bool
    """A token is sampled from this row: a decode row, or the chunk that ends a prompt."""
    drafts: int = 0
    """A decode row's draft tokens fed after its pending token (speculative verification):
    `tokens` is 1 + drafts, and the step leaves 1 + drafts logits rows for it."""

    @property
    def out_rows(self) -> int:
        """Logits rows the step leaves for this lane."""
        return 1 + self.drafts


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one engine step does: the lanes admitted for it and its rows, in
    admission order (the order of the fused call's sequences)."""

    admitted: tuple[Request, ...]
    rows: tuple[PlannedRow, ...]

    @property
    def drafts(self) -> int:
        """Draft tokens the step verifies."""
        return sum(r.drafts for r in self.rows)

    def of(self, kind: RowKind) -> tuple[PlannedRow, ...]:
        return tuple(r for r in self.rows if r.kind == kind)

    @property
    def tapped(self) -> int:
        """Hidden-state rows the step taps: the embedding chunks' tokens."""
        return sum(r.tokens for r in self.rows if r.kind == "embed")

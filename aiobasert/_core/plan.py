"""What one engine step does, as the batcher plans it and the step runs it: each request's
`LaneState` (what the policy knows of it), a `PlannedRow` per lane, the `StepPlan`.

Plain data, below both the policy (aiobasert/batcher.py, which fills them) and the step
(`step.StepRunner`, which carries them out), as vLLM v1's `SchedulerOutput` sits between its
scheduler and its model runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(eq=False)
class LaneState:
    """What the policy knows about one request. Owned by the engine thread."""

    rid: str
    prompt_len: int
    max_new_tokens: int
    prefilled: int = 0
    """Prompt tokens already in the KV (prefilled or seeded from the cache)."""
    generated: int = 0
    admitted: bool = False
    cancelled: bool = False
    embed: bool = False
    """An embedding lane: its prompt is the input to pool; it generates nothing."""
    client: str | None = None
    """Whose request this is (fair admission); None: a client of its own."""
    replay: int = 0
    """Output tokens fed again after the prompt: a paused request whose KV was released
    rebuilds it from prompt + output, and the chunk that ends them samples its next token."""
    arrival: int = -1
    """Queue order (set by `Batcher.enqueue`): the earliest first among equals."""
    due: int = 0
    """The batcher step it is due by (set by `Batcher.enqueue`: arrival + stretch x work)."""
    ran_from: int = -1
    """The batcher step of its latest admission."""
    started: bool = False
    """It has held a lane (a paused request is started, a new one is not)."""
    pauses: int = 0
    """Times it was taken out of its lane (`Batcher._pause`), its sequence and KV kept."""
    paused_at: int = -1
    """The batcher step of its latest pause."""
    longest_pause: int = 0
    """Its longest pause so far, in steps (batcher steps: one per engine step)."""
    kv_kept: int = 0
    """KV blocks its sequence keeps while it is paused (0 when running, or once released)."""

    def rewind(self) -> None:
        """Its KV released while paused: it resumes by feeding prompt + output again."""
        self.replay = self.generated
        self.prefilled = 0

    @property
    def owner(self) -> tuple[str, str]:
        """The client its lanes count for: its key, or the request itself."""
        return ("client", self.client) if self.client is not None else ("request", self.rid)

    @property
    def kv_target(self) -> int:
        """Tokens to feed before it samples: the prompt (and, recomputed, its output so far)."""
        return self.prompt_len + self.replay

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.kv_target


RowKind = Literal["decode", "prefill", "embed"]


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """One lane's part of a step: `tokens` fed to its sequence."""

    lane: LaneState
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

    admitted: tuple[LaneState, ...]
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

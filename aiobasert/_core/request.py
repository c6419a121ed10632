"""The engine thread's record of one request (as vLLM v1's `Request`): what the policy knows of
it (aiobasert/batcher.py reads and writes it), plain data below both the policy and the step.
Owned by the engine thread."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Request:
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

"""The engine thread's record of one request, one status for its whole life (as vLLM v1's
`Request` and its `RequestStatus`, llama.cpp's `slot_state`): preparing (its prompt tokenized, its
grammar compiled, off the engine thread), waiting for a lane, running in one, paused (taken out
of its lane, waiting to resume), then finished with its reason. A generation and an embedding are
the same record; an embedding is its pooling kind (`Request.embed`).

Plain data, below both the policy (aiobasert/batcher.py moves a request between waiting, running
and paused) and the engine thread (aiobasert/engine_thread.py creates it, ends it, and is the only
one that finishes it). Every move is checked against `LEGAL`: a move the life of a request does
not have is a bug (`IllegalTransition`), never a silent state."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..types import FinishReason


class RequestStatus(enum.Enum):
    """Where a request stands (`Request.status`)."""

    PREPARING = enum.auto()
    """Handed to its preparation (`prepare.Preparer`); its queue place is held."""
    WAITING = enum.auto()
    """Prepared, queued for a lane (`Batcher.waiting`)."""
    RUNNING = enum.auto()
    """In a lane: prefilling, decoding, or feeding an embedding's chunks (`Batcher.running`)."""
    PAUSED = enum.auto()
    """Taken out of its lane (preempted), waiting to resume (`Batcher.paused`): its sequence and KV
    kept, or released (it then resumes by recomputing: `Request.replay`)."""
    FINISHED_STOPPED = enum.auto()
    """Ended on a stop (EOS, stop token or string, its grammar's end), or an embedding pooled."""
    FINISHED_LENGTH = enum.auto()
    """Ended at its max_tokens (or the context window)."""
    FINISHED_ABORTED = enum.auto()
    """Cancelled (its reader left), or aborted by the engine's close."""
    FINISHED_ERROR = enum.auto()
    """Failed (its error is delivered), or refused once it was prepared (bad input)."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The stream's finish reason (None: not finished, or failed: its error says why)."""
        return _REASON.get(self)

    @staticmethod
    def finished(reason: FinishReason) -> RequestStatus:
        """The status of a request that ends with `reason`."""
        return _BY_REASON[reason]


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_REASON: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "aborted",
}
_BY_REASON = {reason: status for status, reason in _REASON.items()}

LEGAL: dict[RequestStatus, frozenset[RequestStatus]] = {
    # prepared, or ended without a lane: cancelled, refused, or an embedding done in one call
    RequestStatus.PREPARING: frozenset(
        {
            RequestStatus.WAITING,
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        }
    ),
    # it gets a lane, or ends waiting (cancelled, the engine aborted)
    RequestStatus.WAITING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
    ),
    # preempted, or it ends in its lane (any reason)
    RequestStatus.RUNNING: frozenset({RequestStatus.PAUSED} | _FINISHED),
    # it resumes, or ends paused (cancelled, the engine aborted)
    RequestStatus.PAUSED: frozenset(
        {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
    ),
    **{status: frozenset() for status in _FINISHED},  # a finished request never moves again
}
"""Each status's legal next statuses: the whole life of a request."""


_QUEUED = frozenset({RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PAUSED})


class IllegalTransition(RuntimeError):
    """A request was moved in a way its life does not allow (a bug in the engine or the policy)."""


@dataclass(eq=False)
class Request:
    """The engine thread's record of one request: its status, and what the policy knows of it
    (its lengths, its place in the queue, its pauses). Created when the request reaches the engine
    thread (PREPARING); its lengths are known once it is prepared (`prompt_len` 0 before)."""

    rid: str
    prompt_len: int
    max_new_tokens: int
    prefilled: int = 0
    """Prompt tokens already in the KV (prefilled or seeded from the cache)."""
    generated: int = 0
    status: RequestStatus = RequestStatus.PREPARING
    """Where it stands; changed only through `move` (checked against `LEGAL`)."""
    embed: bool = False
    """Its kind: an embedding (pooling) request, whose prompt is the input to pool; it generates
    nothing. False: a generation."""
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
    pauses: int = 0
    """Times it was taken out of its lane (`Batcher._pause`), its sequence and KV kept."""
    paused_at: int = -1
    """The batcher step of its latest pause."""
    longest_pause: int = 0
    """Its longest pause so far, in steps (batcher steps: one per engine step)."""
    kv_kept: int = 0
    """KV blocks its sequence keeps while it is paused (0 when running, or once released)."""

    def move(self, to: RequestStatus) -> None:
        """Its next status, if its life allows that move (`LEGAL`), else `IllegalTransition`."""
        if to not in LEGAL[self.status]:
            raise IllegalTransition(f"request {self.rid}: {self.status.name} -> {to.name}")
        self.status = to

    @property
    def admitted(self) -> bool:
        """It holds a lane now."""
        return self.status is RequestStatus.RUNNING

    @property
    def started(self) -> bool:
        """It has held a lane and may hold one again (a paused request is started, a new one is not)."""
        return self.status is RequestStatus.RUNNING or self.status is RequestStatus.PAUSED

    @property
    def queued(self) -> bool:
        """The policy holds it: waiting, running or paused."""
        return self.status in _QUEUED

    @property
    def cancelled(self) -> bool:
        return self.status is RequestStatus.FINISHED_ABORTED

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

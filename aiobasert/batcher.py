"""Scheduling policy for continuous batching: no FFI, no asyncio, no threads.

The engine thread asks `plan()` once per step and carries the `StepPlan` out
(as vLLM v1's `Scheduler.schedule()` hands `EngineCore.step` a
`SchedulerOutput`). The policy (in the spirit of vLLM's scheduler and llama.cpp's server slots):

* Admission is fair between clients (docs/fairness.md): at most
  `max_batch_size` lanes at once; a free lane goes to the waiting request whose
  client holds the fewest lanes, then to the one served least (a new request
  before a preempted one), then the earliest (a request's `client` key: the
  choices of one request share one; a request without a key is a client of its
  own). With every lane taken, a waiting request takes one back from a client
  that holds more (preemption by recompute, as vLLM's scheduler preempts): a
  request not yet started takes, at the next step, a lane from a client holding
  at least one more lane than its own will; a preempted one only from a client
  holding two more, after that lane ran `quantum` steps (so lanes never cycle
  between equals). The lane taken is the most-served one of the client holding
  the most, and only once it has sampled since its admission: every admission
  makes progress. A preempted request keeps its output; it resumes by
  prefilling prompt + output again (`LaneState.replay`), mostly from the prefix
  cache, and its output is the same as if it had never stopped. Within one
  client, shortest remaining work first: a new request whose `max_new_tokens`
  is at most half of what one of its client's running requests may still
  generate takes that lane back; requests of like length (the n choices of one
  request) never preempt each other and are served FIFO.
  `fair=False` is plain FIFO (the bench's baseline). The wait queue is bounded
  (`max_queue` requests waiting for a lane; those the next admission places do
  not count): past it `EngineOverloadedError`, never a silent drop.
* Every running decode lane advances one token every step, read or not: no
  lane ever waits for its reader (a slow or stuck reader's tokens spill into
  its stream's buffer, bounded by the request's max_tokens, as vLLM v1 keeps
  generating into its output queues). A lane is thus held only for as long as
  its own generation runs, never for as long as its reader lives, so slow
  readers cannot starve the queue and n streams > lanes always complete
  (docs/fairness.md).
* Prompt tokens share a per-step budget (`prefill_budget`), handed out to the
  lanes still prefilling in admission order (fair: new prompts before the
  replays of preempted lanes), so a long prompt is prefilled in
  chunks over several steps while running streams keep decoding (vllm #1026),
  and a cancel lands between chunks (tabbyAPI #383).
* Prefix-cache seeding is tried at admission for prompts longer than a page;
  the KV of a finished (or preempted) lane (prompt + output) is published for reuse.
* An embedding is a lane too (`LaneState.embed`): admitted like any
  request (never preempted), its input fed in chunks from the same prefill budget (and at most
  `tap_budget` tapped rows a step), done when all of it is fed.
  A long embedding thus costs running streams one chunk per step, never a
  whole forward (vllm's pooling requests share the scheduler the same way).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator

from ._core.plan import LaneState, PlannedRow, StepPlan
from .errors import ContextLengthExceededError, EngineOverloadedError, InvalidRequestError

_CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("aiobasert_client", default=None)


@contextlib.contextmanager
def client_scope(key: str | None) -> Iterator[None]:
    """Requests submitted inside count as client `key`'s for fair admission
    (docs/fairness.md): its requests share the lanes its fair share allows and
    are served FIFO among themselves (but a new request needing at most half of
    what a running one of the key may still generate takes its lane back), and
    other clients' requests are not starved by them. Outside any scope (or with None) each request is a client
    of its own. Tasks started inside inherit the key (contextvars)."""
    if key is not None and not isinstance(key, str):
        raise InvalidRequestError(f"a client key is a str, not {type(key).__name__}")
    token = _CLIENT.set(key)
    try:
        yield
    finally:
        _CLIENT.reset(token)


def current_client() -> str | None:
    """The client key of the current context (`client_scope`), or None."""
    return _CLIENT.get()


class Batcher:
    """Fair admission (with preemption), chunked prefill under a token budget, lane packing."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_context: int,
        prefill_budget: int,
        max_queue: int = 1024,
        page_size: int = 16,
        prefix_cache: bool = False,
        tap_budget: int | None = None,
        fair: bool = True,
        quantum: int = 16,
    ) -> None:
        if max_batch_size < 1 or max_context < 2 or prefill_budget < 1 or max_queue < 1:
            raise ValueError("batcher limits must be positive")
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.prefill_budget = prefill_budget
        self.max_queue = max_queue
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.tap_budget = tap_budget
        """Tapped rows one step may carry (the engine's tap capacity); None = unbounded."""
        self.fair = fair
        self.quantum = max(1, quantum)
        """Steps a lane runs after its admission before a preempted request may take it back."""
        self.step = 0
        """Plans made (the batcher's clock for `quantum`)."""
        self.preemptions = 0
        self.waiting: deque[LaneState] = deque()
        self.running: list[LaneState] = []
        self._arrivals = itertools.count()

    # ---- admission control ----------------------------------------------------------

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """The generation budget of a request, or ContextLengthExceededError.

        The KV holds prompt + all generated tokens but the last, so a request
        fits when prompt_len + max_tokens - 1 <= max_context.
        """
        if prompt_len < 1:
            raise ValueError("a prompt needs at least one token")
        room = self.max_context - prompt_len + 1
        if max_tokens is None:
            if room < 1:
                raise ContextLengthExceededError(prompt_len, 1, self.max_context)
            return room
        if max_tokens > room:
            raise ContextLengthExceededError(prompt_len, max_tokens, self.max_context)
        return max_tokens

    def queued(self, pending: int = 0) -> int:
        """Requests waiting for a lane (plus `pending` ones still being prepared):
        those the next admission cannot place."""
        return max(0, len(self.waiting) + pending - max(0, self.max_batch_size - len(self.running)))

    def check_room(self, pending: int = 0) -> None:
        """EngineOverloadedError when one more request would wait past `max_queue`.

        Only requests that actually wait count (and the `pending` ones being
        tokenized or compiled, which will): on an engine with free lanes a
        burst is admitted at the next step, whatever `max_queue` is."""
        if self.queued(pending) >= self.max_queue:
            raise EngineOverloadedError(
                f"request queue is full ({self.max_queue} waiting for a lane); retry later or raise max_queue"
            )

    def enqueue(self, lane: LaneState, *, reserved: bool = False) -> None:
        """Queue a lane; `reserved`: its room was checked when it arrived (before preparing it)."""
        if not reserved:
            self.check_room()
        lane.arrival = next(self._arrivals)
        self.waiting.append(lane)

    def remove(self, lane: LaneState) -> None:
        """Forget a lane (finished, cancelled or failed), wherever it is."""
        if lane.admitted:
            self.running.remove(lane)
        else:
            self.waiting.remove(lane)

    def should_match_prefix(self, lane: LaneState) -> bool:
        # a match always leaves one token to prefill, so it needs > one page; an
        # embedding pools every row's hidden state, so it cannot skip any
        return self.prefix_cache and not lane.embed and lane.kv_target > self.page_size

    def should_publish_prefix(self, lane: LaneState, kv_tokens: int) -> bool:
        return self.prefix_cache and not lane.cancelled and not lane.embed and kv_tokens >= self.page_size

    # ---- the plan ---------------------------------------------------------------------

    def has_runnable_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def admit(self, preempt: Callable[[LaneState], None] | None = None) -> list[LaneState]:
        """Move waiting requests into lanes: free ones first, then ones taken back
        from clients holding more (module docstring). `preempt` is called for each
        lane taken back before its state is rewound (the engine publishes its KV and
        frees its sequence there). The engine then creates the admitted lanes'
        sequences (and seeds cached prefixes) before `schedule()` (`plan()` does both)."""
        self.step += 1
        admitted: list[LaneState] = []
        if not self.fair:
            while self.waiting and len(self.running) < self.max_batch_size:
                admitted.append(self._place(self.waiting.popleft()))
            return admitted
        held: Counter[tuple[str, str]] = Counter(lane.owner for lane in self.running)
        while self.waiting:
            if len(self.running) < self.max_batch_size:
                lane = min(self.waiting, key=lambda w: self._order(w, held))
            else:
                found = self._take_back(held)
                if found is None:
                    break
                lane, victim = found
                if preempt is not None:
                    preempt(victim)
                self._rewind(victim)
                held[victim.owner] -= 1
            self.waiting.remove(lane)
            held[lane.owner] += 1
            admitted.append(self._place(lane))
        return admitted

    @staticmethod
    def _order(lane: LaneState, held: Counter[tuple[str, str]]) -> tuple[int, int, int]:
        """Admission order: the client holding fewest lanes, then the request served least
        (a new one before a preempted one), then arrival."""
        return held[lane.owner], lane.generated, lane.arrival

    def _place(self, lane: LaneState) -> LaneState:
        lane.admitted = lane.started = True
        lane.ran_from = self.step
        self.running.append(lane)
        return lane

    def _take_back(self, held: Counter[tuple[str, str]]) -> tuple[LaneState, LaneState] | None:
        """With every lane taken: the first waiting request (in admission order) that
        may take a lane back, and that lane; None when none may.

        A lane can be taken back once it has sampled a token since its admission (so
        every admission makes progress): for a new request, from a client holding at
        least one lane more than the new one's will; for a preempted one only once it
        has also run `quantum` steps, and from a client holding two more (a move that
        narrows the gap, so lanes never cycle between equals). The lane taken is the
        most-served one of the client holding the most."""
        sampled = [v for v in self.running if not v.embed and not v.prefilling and self.step > v.ran_from]
        if not sampled:
            return None
        most = max(held[v.owner] for v in sampled)
        # only requests whose client holds few enough lanes can take one back (one cheap pass:
        # the queue may hold a thousand preempted requests that cannot)
        able = [w for w in self.waiting if held[w.owner] + (2 if w.started else 1) <= most]
        tried: set[tuple[tuple[str, str], bool]] = set()  # same owner and kind: the same answer
        for w in sorted(able, key=lambda x: self._order(x, held)):
            need = held[w.owner] + (2 if w.started else 1)
            if (w.owner, w.started) in tried:
                continue
            tried.add((w.owner, w.started))
            victims = [
                v for v in sampled
                if v.owner != w.owner and held[v.owner] >= need
                and (not w.started or self.step - v.ran_from >= self.quantum)
            ]  # fmt: skip
            if victims:
                return w, max(victims, key=lambda v: (held[v.owner], v.generated, v.arrival))
        return self._take_back_within(sampled, held)

    def _take_back_within(
        self, sampled: list[LaneState], held: Counter[tuple[str, str]]
    ) -> tuple[LaneState, LaneState] | None:
        """Within one client (none of the above applies): the first new request (admission
        order) that needs at most half of what a running request of its own client may still
        generate (`max_new_tokens`), and that lane (the one with the most left). Shortest
        remaining work first, as an OS favours the short job: a client's short request does
        not wait behind its own long ones, while requests of like length (the n choices of one
        request) never preempt each other. Each new request preempts at most once."""
        longest: dict[tuple[str, str], LaneState] = {}
        for v in sampled:
            best = longest.get(v.owner)
            if best is None or (v.max_new_tokens - v.generated, v.generated) > (
                best.max_new_tokens - best.generated,
                best.generated,
            ):
                longest[v.owner] = v
        able = [
            w for w in self.waiting
            if not w.started and (lane := longest.get(w.owner)) is not None
            and 2 * w.max_new_tokens <= lane.max_new_tokens - lane.generated
        ]  # fmt: skip
        if not able:
            return None
        w = min(able, key=lambda x: self._order(x, held))
        return w, longest[w.owner]

    def _rewind(self, lane: LaneState) -> None:
        """Back to the queue (in its arrival place) to resume by recomputing prompt + output."""
        self.running.remove(lane)
        lane.admitted = False
        lane.rewind()
        self.preemptions += 1
        at = sum(1 for w in self.waiting if w.arrival < lane.arrival)
        self.waiting.insert(at, lane)

    def plan(
        self,
        start: Callable[[LaneState], None] | None = None,
        preempt: Callable[[LaneState], None] | None = None,
    ) -> StepPlan:
        """The next step: admit waiting requests (`admit`, which calls `preempt`
        for each lane it takes back), then plan every running lane's row.

        `start` is called for each lane as it is admitted, before any row is
        planned (as vLLM's scheduler allocates KV slots while it schedules): the
        engine creates the lane's sequence there and seeds a cached prefix
        (advancing `prefilled`), or removes the lane when it cannot start."""
        admitted = self.admit(preempt)
        if start is not None:
            for lane in admitted:
                start(lane)
        rows: list[PlannedRow] = []
        for lane, k in self.schedule():
            if lane.embed:
                rows.append(PlannedRow(lane, "embed", k, False))
            elif lane.prefilling:
                rows.append(PlannedRow(lane, "prefill", k, lane.prefilled + k == lane.kv_target))
            else:
                rows.append(PlannedRow(lane, "decode", k, True))
        return StepPlan(tuple(admitted), tuple(rows))

    def schedule(self) -> list[tuple[LaneState, int]]:
        """The rows of the next fused step: (lane, tokens fed), 1 for a decode
        lane, a chunk within the prefill budget for a prefilling one."""
        budget = self.prefill_budget
        taps = self.tap_budget if self.tap_budget is not None else budget
        prefilling = [lane for lane in self.running if lane.prefilling]
        if self.fair:  # new prompts before preempted lanes' replays (least served first), else admission order
            prefilling.sort(key=lambda lane: lane.generated)
        chunks: dict[int, int] = {}
        for lane in prefilling:
            chunk = min(lane.kv_target - lane.prefilled, budget, taps if lane.embed else budget)
            if chunk > 0:
                budget -= chunk
                if lane.embed:
                    taps -= chunk
                chunks[id(lane)] = chunk
        # rows in admission order (the fused call's sequence order)
        return [
            (lane, chunks[id(lane)] if lane.prefilling else 1)
            for lane in self.running
            if not lane.prefilling or id(lane) in chunks
        ]

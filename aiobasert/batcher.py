"""Scheduling policy for continuous batching: no FFI, no asyncio, no threads.

The engine thread asks `plan()` once per step and carries the `StepPlan` out
(as vLLM v1's `Scheduler.schedule()` hands `EngineCore.step` a
`SchedulerOutput`). The policy (in the spirit of vLLM's scheduler and llama.cpp's server slots):

* Admission is by urgency, fair between clients, and never thrashes
  (docs/fairness.md): at most `max_batch_size` lanes at once. Each request is
  due `stretch` (2) times its work after it arrives (`work`: its prompt's
  chunks and `max_tokens`); its slack is how many steps it can still wait and
  be done when due (constant while it runs, one less for each step it waits).
  A free lane goes to the waiting request, new or paused, of the client holding
  the fewest lanes (a request's `client` key, shared by the choices of one
  request; without a key a request is a client of its own), then the most
  urgent (least slack), then the earliest.
  With every lane taken, a waiting request takes a lane back (preemption, as
  vLLM's scheduler preempts) when the lane's request can afford it: after
  waiting all the steps the taker needs it would still have as much slack as
  the taker has now. So a short request does not wait behind long ones, while
  requests of like length never trade places (a burst is served in FIFO order),
  a request taken out can never take its lane back from its taker, and nobody
  is made late for a request due after it. A new request also takes a lane back
  from a client holding at least two lanes more than its own (clients converge
  to equal shares). A lane is taken back only once it sampled since its
  admission: every admission makes progress.
  The request taken out is paused, not recomputed: its sequence and KV stay in
  the pool (only while its KV fits beside every running request at its longest
  and the other paused requests' KV, `kv_blocks`: no step ever runs out), and it
  resumes in a lane where it stopped. Only when a resume or an urgent request
  would not fit is the KV of the latest paused requests released: they resume
  by recomputing prompt + output (`Request.replay`), mostly from the prefix
  cache (`_release_paused`, as vLLM recomputes when its KV blocks run out).
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
  replays of recomputed requests), so a long prompt is prefilled in
  chunks over several steps while running streams keep decoding (vllm #1026),
  and a cancel lands between chunks (tabbyAPI #383).
* Prefix-cache seeding is tried at admission for prompts longer than a page;
  the KV of a finished lane (prompt + output) is published for reuse.
* An embedding is a lane too (`Request.embed`): admitted like any
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

from ._core.plan import PlannedRow, StepPlan
from ._core.request import Request, RequestStatus
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
        stretch: int = 2,
        kv_blocks: int | None = None,
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
        self.stretch = max(1, stretch)
        """A request is due `stretch` times its work (`work`) after it arrives (`Request.due`)."""
        self.kv_blocks = kv_blocks
        """The KV pool's blocks (None: unknown, and no lane is ever taken back)."""
        self.step = 0
        """Plans made: the batcher's clock, in engine steps."""
        self.preemptions = 0
        self.waiting: deque[Request] = deque()
        """New requests, in arrival order."""
        self.paused: deque[Request] = deque()
        """Requests taken out of their lane with their KV kept, in the order they were paused."""
        self.running: list[Request] = []
        self._running_need = 0
        """KV blocks the running requests may reach at their longest (`kv_need`; fair mode)."""
        self._paused_kv = 0
        """KV blocks the paused requests keep (`Request.kv_kept`). A pause is only made while
        `_running_need + _paused_kv` stays within `kv_blocks` (`_fits`); with none paused,
        `max_batch_size` lanes of at most `max_context` fit the pool as the engine sized it."""
        self.recomputes = 0
        """Paused requests whose KV was released to make room (`_make_room`)."""
        self.max_drafts = 7
        """Draft tokens one decode lane may feed a step (speculative decoding): its 1 + drafts
        logits rows must fit the engine's scratch of 8 rows a lane."""
        self.draft_rows = 1 << 30
        """A step carries draft rows only while it has fewer rows than this (the engine sets it
        from `SpeculationConfig.max_step_rows`)."""
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
        waiting = len(self.waiting) + len(self.paused) + pending
        return max(0, waiting - max(0, self.max_batch_size - len(self.running)))

    def check_room(self, pending: int = 0) -> None:
        """EngineOverloadedError when one more request would wait past `max_queue`.

        Only requests that actually wait count (and the `pending` ones being
        tokenized or compiled, which will): on an engine with free lanes a
        burst is admitted at the next step, whatever `max_queue` is."""
        if self.queued(pending) >= self.max_queue:
            raise EngineOverloadedError(
                f"request queue is full ({self.max_queue} waiting for a lane); retry later or raise max_queue"
            )

    def enqueue(self, lane: Request, *, reserved: bool = False) -> None:
        """Queue a lane; `reserved`: its room was checked when it arrived (before preparing it)."""
        if not reserved:
            self.check_room()
        lane.move(RequestStatus.WAITING)
        lane.arrival = next(self._arrivals)
        lane.due = self.step + self.stretch * self.work(lane)
        self.waiting.append(lane)

    def remove(self, lane: Request) -> None:
        """Forget a request about to end (finished, cancelled or failed), wherever its status
        says it is (the engine thread then finishes it)."""
        if lane.status is RequestStatus.RUNNING:
            self.running.remove(lane)
            if self.fair:
                self._running_need -= self.kv_need(lane)
        elif lane.status is RequestStatus.PAUSED:
            self.paused.remove(lane)
            self._paused_kv -= lane.kv_kept
            lane.kv_kept = 0
        else:
            self.waiting.remove(lane)

    def holds(self, lane: Request) -> bool:
        """The request is running, paused or waiting here (its status says so)."""
        return lane.queued

    def should_match_prefix(self, lane: Request) -> bool:
        # a match always leaves one token to prefill, so it needs > one page; an
        # embedding pools every row's hidden state, so it cannot skip any
        return self.prefix_cache and not lane.embed and lane.kv_target > self.page_size

    def should_publish_prefix(self, lane: Request, kv_tokens: int) -> bool:
        return self.prefix_cache and not lane.cancelled and not lane.embed and kv_tokens >= self.page_size

    # ---- the plan ---------------------------------------------------------------------

    def has_runnable_work(self) -> bool:
        return bool(self.running) or bool(self.waiting) or bool(self.paused)

    def admit(
        self,
        preempt: Callable[[Request], None] | None = None,
        release: Callable[[Request], None] | None = None,
    ) -> list[Request]:
        """Move waiting requests into lanes: free ones first (`_next_for_free_lane`), then
        ones taken back (`_take_back`). `preempt` is called for each lane taken back (the
        engine keeps its sequence: its KV stays for the resume); `release` for each paused
        request whose KV must go to make room (`_make_room`: the engine publishes it to the
        prefix cache and frees the sequence, and the request resumes by recomputing it). The
        engine then creates the new lanes' sequences (and seeds cached prefixes) before
        `schedule()` (`plan()` does both)."""
        self.step += 1
        admitted: list[Request] = []
        if not self.fair:
            while self.waiting and len(self.running) < self.max_batch_size:
                admitted.append(self._place(self.waiting.popleft()))
            return admitted
        held: Counter[tuple[str, str]] = Counter(lane.owner for lane in self.running)
        while self.paused or self.waiting:
            if len(self.running) < self.max_batch_size:
                lane = self._next_for_free_lane(held, release)
            else:
                found = self._take_back(held, release)
                if found is None:
                    break
                lane, victim = found
                if preempt is not None:
                    preempt(victim)
                self._pause(victim)
                held[victim.owner] -= 1
            if lane.started:  # a paused request resumes where it stopped
                self._make_room(lane, release)
                self.paused.remove(lane)
                self._paused_kv -= lane.kv_kept
                lane.kv_kept = 0
                lane.longest_pause = max(lane.longest_pause, self.step - lane.paused_at)
            else:
                self.waiting.remove(lane)
            held[lane.owner] += 1
            admitted.append(self._place(lane))
        return admitted

    def _next_for_free_lane(self, held: Counter[tuple[str, str]], release: Callable[[Request], None] | None) -> Request:
        """Who gets a free lane: the waiting request, new or paused, of the client holding the
        fewest lanes, then the most urgent (least slack), then the earliest. A new one only
        where it fits the pool beside the paused requests' KV (some of it released if that
        makes it fit), else the first paused one."""

        def order(x: Request) -> tuple[int, int, int]:
            return held[x.owner], self.slack(x), x.arrival

        new = min(self.waiting, key=order, default=None)
        paused = min(self.paused, key=order, default=None)
        if paused is None or (new is not None and order(new) < order(paused)):
            assert new is not None
            if paused is None or self._fits(self.kv_need(new)):
                return new
            if self._release_paused(self.kv_need(new), release):
                return new
        assert paused is not None
        return paused

    def _make_room(self, lane: Request, release: Callable[[Request], None] | None) -> None:
        """Before a paused `lane` resumes: while the pool cannot hold the running requests at
        their longest, `lane` at its longest and the paused requests' KV, release the KV of the
        latest paused ones (they resume by recomputing prompt + output, mostly from the prefix
        cache, as vLLM preempts by recompute when its KV blocks run out). With no paused KV
        left the resume goes ahead: `max_batch_size` lanes fit the pool as the engine sized it."""
        self._release_paused(self.kv_need(lane) - lane.kv_kept, release, keep=lane, partly=True)

    def _fits(self, extra: int) -> bool:
        """The pool holds `extra` more blocks beside every running request at its longest and
        every paused request's KV (the invariant that keeps any step from running out)."""
        return self.kv_blocks is not None and self._running_need + self._paused_kv + extra <= self.kv_blocks

    def _place(self, lane: Request) -> Request:
        lane.move(RequestStatus.RUNNING)
        lane.ran_from = self.step
        self.running.append(lane)
        if self.fair:
            self._running_need += self.kv_need(lane)
        return lane

    def kv_need(self, lane: Request) -> int:
        """KV blocks a request may hold at its longest (prompt + every output token but the
        last), plus one for the private copy of a shared block it may write."""
        return -(-(lane.prompt_len + lane.max_new_tokens) // self.page_size) + 1

    def kv_held(self, lane: Request) -> int:
        """KV blocks a running request holds at most now (prompt + output but its last token)."""
        return -(-(lane.prompt_len + lane.generated) // self.page_size) + 1

    def work(self, lane: Request) -> int:
        """Steps a request holds a lane for at most, from its arrival: its prompt's chunks,
        then its output (an embedding: its chunks)."""
        return -(-lane.prompt_len // self.prefill_budget) + lane.max_new_tokens

    def left(self, lane: Request) -> int:
        """Steps it still needs a lane for: what is left of its prompt (or, recomputed, of its
        prompt + output) in chunks, then the output it may still generate."""
        chunks = -(-(lane.kv_target - lane.prefilled) // self.prefill_budget)
        return chunks + lane.max_new_tokens - lane.generated

    def slack(self, lane: Request) -> int:
        """Steps it can still wait and be done when due: its due step, less now, less `left`.
        Constant while it runs; it falls by one each step it waits."""
        return lane.due - self.step - self.left(lane)

    def _takeable(self, lane: Request) -> bool:
        """A lane may be taken back: a generation that sampled since its latest admission (so
        every admission makes progress) and is not done."""
        if lane.embed or lane.prefilling or lane.generated >= lane.max_new_tokens:
            return False
        return self.step > lane.ran_from

    def _take_back(
        self, held: Counter[tuple[str, str]], release: Callable[[Request], None] | None = None
    ) -> tuple[Request, Request] | None:
        """With every lane taken: the first waiting request (new or paused, in the order a free
        lane would take them) that may take a lane back, and that lane; None when none may.

        `w` takes lane `v` (`_takeable`) when the pool holds `v`'s KV as it is beside every
        running request at its longest, `w` included, and the other paused requests' KV
        (`_fits`: `v` keeps its KV and no step can run out), and either
        - `v` can afford it: after waiting all the steps `w` needs, `v` would still have at
          least the slack `w` has now (and never less than none), the lane with the most
          slack. So a short request does not wait behind long ones, requests of like length
          never trade places (a burst is served as FIFO serves it), the request taken out can
          never take the lane back from its taker, and no one is made late for a request
          due after it; or
        - `w` is new and `v`'s client holds at least two lanes more than `w`'s (the move
          narrows the gap: clients converge to equal shares and lanes never cycle between
          equals), the most-served lane of the client holding the most."""
        if self.kv_blocks is None or not (self.waiting or self.paused):
            return None
        victims = [v for v in self.running if self._takeable(v)]
        if not victims:
            return None
        most_slack = max(self.slack(v) for v in victims)
        most_held = max(held[v.owner] for v in victims)
        # one cheap pass first: the queue may hold a thousand requests that cannot
        able = [
            w for w in itertools.chain(self.paused, self.waiting)
            if self.left(w) + max(self.slack(w), 0) <= most_slack
            or (not w.started and held[w.owner] + 2 <= most_held)
        ]  # fmt: skip
        for w in sorted(able, key=lambda x: (held[x.owner], self.slack(x), x.arrival)):
            need = self.kv_need(w) - w.kv_kept  # a paused taker's kept KV is already counted
            swap = {id(v): need - self.kv_need(v) + self.kv_held(v) for v in victims}
            fit = [v for v in victims if self._fits(swap[id(v)])]
            urgent = [v for v in victims if self.slack(v) - self.left(w) >= max(self.slack(w), 0)]
            if urgent:
                v = max(urgent, key=lambda v: (v in fit, self.slack(v), held[v.owner], v.arrival))
                # an urgent request is not kept waiting by paused requests' KV: theirs is released
                # (the latest paused first) when that makes room, as vLLM recomputes under pressure
                if v in fit or self._release_paused(swap[id(v)], release, keep=w):
                    return w, v
            if not w.started:
                fair = [v for v in fit if v.owner != w.owner and held[v.owner] >= held[w.owner] + 2]
                if fair:
                    return w, max(fair, key=lambda v: (held[v.owner], v.generated, v.arrival))
        return None

    def _release_paused(
        self,
        extra: int,
        release: Callable[[Request], None] | None,
        keep: Request | None = None,
        *,
        partly: bool = False,
    ) -> bool:
        """Release paused requests' KV, the latest paused first (never `keep`'s), until `extra`
        more blocks fit (`_fits`); whether they fit. Nothing is released when releasing all of it
        would not do, unless `partly` (a resume goes ahead anyway). The engine's `release`
        publishes the KV to the prefix cache and frees the sequence; the request resumes by
        recomputing it."""
        releasable = sum(x.kv_kept for x in self.paused if x is not keep)
        if not partly and not self._fits(extra - releasable):
            return False
        for other in reversed(self.paused):
            if self._fits(extra):
                return True
            if other is keep or not other.kv_kept:
                continue
            if release is not None:
                release(other)
            self._paused_kv -= other.kv_kept
            other.kv_kept = 0
            other.rewind()
            self.recomputes += 1
        return self._fits(extra)

    def _pause(self, lane: Request) -> None:
        """Out of its lane, its sequence (and so its KV) kept: it resumes in a free lane where
        it stopped, with nothing to recompute."""
        self.running.remove(lane)
        self._running_need -= self.kv_need(lane)
        lane.move(RequestStatus.PAUSED)
        lane.pauses += 1
        lane.paused_at = self.step
        lane.kv_kept = self.kv_held(lane)
        self._paused_kv += lane.kv_kept
        self.preemptions += 1
        self.paused.append(lane)

    def plan(
        self,
        start: Callable[[Request], None] | None = None,
        preempt: Callable[[Request], None] | None = None,
        release: Callable[[Request], None] | None = None,
        draft: Callable[[Request, int, int, int], int] | None = None,
    ) -> StepPlan:
        """The next step: admit waiting requests (`admit`, which calls `preempt` for each
        lane it takes back and `release` for each paused request whose KV must go), then
        plan every running lane's row.

        `start` is called for each lane as it is admitted, before any row is
        planned (as vLLM's scheduler allocates KV slots while it schedules): the
        engine creates the lane's sequence there and seeds a cached prefix
        (advancing `prefilled`), or removes the lane when it cannot start.

        `draft(lane, cap, rows, lanes)` (speculative decoding) is asked, for each decode lane,
        how many draft tokens it feeds after its pending token: at most `cap`, in a step that
        so far carries `rows` rows and `lanes` decode lanes (`schedule`)."""
        admitted = self.admit(preempt, release)
        if start is not None:
            for lane in admitted:
                start(lane)
        rows: list[PlannedRow] = []
        for lane, k in self.schedule(draft):
            if lane.embed:
                rows.append(PlannedRow(lane, "embed", k, False))
            elif lane.prefilling:
                rows.append(PlannedRow(lane, "prefill", k, lane.prefilled + k == lane.kv_target))
            else:
                rows.append(PlannedRow(lane, "decode", k, True, drafts=k - 1))
        return StepPlan(tuple(admitted), tuple(rows))

    def draft_cap(self, lane: Request) -> int:
        """Draft tokens a decode lane may feed after its pending token: no more than it may
        still generate after that one (so the KV stays within `kv_need` and the context),
        and at most `max_drafts` (a lane's logits rows are bounded by the engine's scratch)."""
        return max(0, min(self.max_drafts, lane.max_new_tokens - lane.generated - 1))

    def schedule(self, draft: Callable[[Request, int, int, int], int] | None = None) -> list[tuple[Request, int]]:
        """The rows of the next fused step: (lane, tokens fed), 1 for a decode
        lane (1 + its drafts when `draft` gives it some), a chunk within the prefill
        budget for a prefilling one.

        Prompt chunks are served first; draft rows come out of what is left of the same
        budget, and only while the step carries fewer than `draft_rows` rows (the per-step
        speculation policy: a step that is already wide is compute-bound, and a draft row
        there costs as much as a token it might save)."""
        budget = self.prefill_budget
        taps = self.tap_budget if self.tap_budget is not None else budget
        prefilling = [lane for lane in self.running if lane.prefilling]
        if self.fair:  # new prompts before recomputed requests' replays (least served first)
            prefilling.sort(key=lambda lane: lane.generated)
        chunks: dict[int, int] = {}
        for lane in prefilling:
            chunk = min(lane.kv_target - lane.prefilled, budget, taps if lane.embed else budget)
            if chunk > 0:
                budget -= chunk
                if lane.embed:
                    taps -= chunk
                chunks[id(lane)] = chunk
        drafts: dict[int, int] = {}
        if draft is not None:
            decoding = [lane for lane in self.running if not lane.prefilling and not lane.embed]
            rows = len(decoding) + sum(chunks.values())
            for lane in decoding:
                cap = min(self.draft_cap(lane), budget, self.draft_rows - rows)
                if cap <= 0:
                    continue
                got = max(0, min(draft(lane, cap, rows, len(decoding)), cap))
                if got:
                    drafts[id(lane)] = got
                    budget -= got
                    rows += got
        # rows in admission order (the fused call's sequence order)
        return [
            (lane, chunks[id(lane)] if lane.prefilling else 1 + drafts.get(id(lane), 0))
            for lane in self.running
            if not lane.prefilling or id(lane) in chunks
        ]

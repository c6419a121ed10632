"""The request record's one status (`aiobasert._core.request`): only the moves of a request's life
are legal, and the batcher's queues and the statuses never disagree, whatever the order of
arrivals, admissions, preemptions, resumes, cancels, failures and ends."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from aiobasert._core.request import LEGAL, IllegalTransition, Request, RequestStatus
from aiobasert.batcher import Batcher

S = RequestStatus
FINISHED = (S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED, S.FINISHED_ERROR)

# The life of a request, written out: a change to `LEGAL` is a change to this table too.
LIFE = {
    S.PREPARING: {S.WAITING, S.FINISHED_STOPPED, S.FINISHED_ABORTED, S.FINISHED_ERROR},
    S.WAITING: {S.RUNNING, S.FINISHED_ABORTED, S.FINISHED_ERROR},
    S.RUNNING: {S.PAUSED, *FINISHED},
    S.PAUSED: {S.RUNNING, S.FINISHED_ABORTED, S.FINISHED_ERROR},
    **{f: set() for f in FINISHED},
}


def test_only_the_moves_of_a_requests_life_are_legal() -> None:
    assert {k: set(v) for k, v in LEGAL.items()} == LIFE
    for a, b in itertools.product(S, S):
        req = Request(rid="r", prompt_len=1, max_new_tokens=1, status=a)
        if b in LIFE[a]:
            req.move(b)
            assert req.status is b
        else:
            with pytest.raises(IllegalTransition, match=f"request r: {a.name} -> {b.name}"):
                req.move(b)
            assert req.status is a  # a refused move changes nothing


def test_finished_statuses_and_their_reasons() -> None:
    assert [s for s in S if s.is_finished] == list(FINISHED)
    assert [S.finished(r) for r in ("stop", "length", "aborted")] == list(FINISHED[:3])
    assert [s.finish_reason for s in S] == [None] * 4 + ["stop", "length", "aborted", None]
    req = Request(rid="r", prompt_len=1, max_new_tokens=1)
    assert req.status is S.PREPARING and not (req.queued or req.started or req.admitted)


class Traced(Request):
    """A request that keeps every move it made."""

    trail: list[tuple[RequestStatus, RequestStatus]]

    def move(self, to: RequestStatus) -> None:
        before = self.status
        super().move(to)
        self.trail.append((before, to))


class RequestLives(RuleBasedStateMachine):
    """Requests arrive (PREPARING), are prepared (the batcher queues them: WAITING), planned (the
    batcher admits, preempts and resumes them: RUNNING / PAUSED), fed (prefilled, then one token a
    step), and end at any point as the engine thread ends them (out of the batcher's queues, then
    finished): cancelled, failed, stopped, or at their length. Every status change seen is a legal
    move, and the batcher's queues hold exactly the requests whose status says they are there."""

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.b = Batcher(max_batch_size=2, max_context=1024, prefill_budget=8, page_size=4, kv_blocks=4000)
        self.all: list[Traced] = []
        self.n = 0

    @rule(target=live, client=st.sampled_from(["a", "b", None]))
    def arrive(self, client: str | None) -> Request:
        self.n += 1
        req = Traced(rid=f"r{self.n}", prompt_len=0, max_new_tokens=0, client=client)
        req.trail = []
        self.all.append(req)
        return req

    @rule(req=live, prompt=st.integers(1, 40), max_new=st.one_of(st.integers(1, 8), st.integers(100, 400)))
    def prepare(self, req: Request, prompt: int, max_new: int) -> None:
        if req.status is not S.PREPARING:
            with pytest.raises(IllegalTransition):
                self.b.enqueue(req, reserved=True)
            return
        req.prompt_len, req.max_new_tokens = prompt, max_new
        self.b.enqueue(req, reserved=True)

    @rule(steps=st.integers(1, 6))
    def step(self, steps: int) -> None:
        """Engine steps: each plans (admits, preempts, resumes), then feeds every planned row."""
        for _ in range(steps):
            self._step()

    def _step(self) -> None:
        for row in self.b.plan().rows:
            req = row.lane
            assert req.status is S.RUNNING
            if row.kind == "prefill":
                req.prefilled += row.tokens
            if row.samples:
                req.generated += 1
                if req.generated >= req.max_new_tokens:
                    self._end(req, S.FINISHED_LENGTH)

    def _end(self, req: Request, status: RequestStatus) -> None:
        """As the engine thread's `_end`: out of the queues, then finished (or refused)."""
        if status not in LEGAL[req.status]:
            with pytest.raises(IllegalTransition):
                req.move(status)
            return
        if self.b.holds(req):
            self.b.remove(req)
        req.move(status)

    @rule(req=consumes(live), how=st.sampled_from([S.FINISHED_ABORTED, S.FINISHED_ERROR, S.FINISHED_STOPPED]))
    def end(self, req: Request, how: RequestStatus) -> None:
        self._end(req, how)

    @precondition(lambda self: any(r.queued for r in self.all))
    @rule(data=st.data(), how=st.sampled_from([S.FINISHED_ABORTED, S.FINISHED_ERROR, S.FINISHED_STOPPED]))
    def end_where_it_is(self, data: st.DataObject, how: RequestStatus) -> None:
        """A request ends wherever it is: waiting, running or paused (each as likely)."""
        where = data.draw(st.sampled_from(sorted({r.status for r in self.all if r.queued}, key=lambda s: s.value)))
        self._end(data.draw(st.sampled_from([r for r in self.all if r.status is where])), how)

    @precondition(lambda self: any(r.status.is_finished for r in self.all))
    @rule(data=st.data(), to=st.sampled_from(list(S)))
    def a_finished_request_never_moves(self, data: st.DataObject, to: RequestStatus) -> None:
        req = data.draw(st.sampled_from([r for r in self.all if r.status.is_finished]))
        with pytest.raises(IllegalTransition):
            req.move(to)

    @invariant()
    def the_queues_are_the_statuses(self) -> None:
        b = self.b
        assert {id(r) for r in b.waiting} == {id(r) for r in self.all if r.status is S.WAITING}
        assert {id(r) for r in b.running} == {id(r) for r in self.all if r.status is S.RUNNING}
        assert {id(r) for r in b.paused} == {id(r) for r in self.all if r.status is S.PAUSED}
        assert len(b.running) <= b.max_batch_size
        for r in self.all:
            assert b.holds(r) == (r.status in (S.WAITING, S.RUNNING, S.PAUSED))
            assert r.started == (r.status in (S.RUNNING, S.PAUSED))
            # its life so far: a chain of legal moves from PREPARING to where it is
            assert all(to in LIFE[before] for before, to in r.trail), r.trail
            chain = [S.PREPARING] + [to for _, to in r.trail]
            assert [before for before, _ in r.trail] == chain[:-1] and chain[-1] is r.status


RequestLives.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRequestLives = RequestLives.TestCase


def test_the_machine_reaches_every_status() -> None:
    """The model above is not vacuous: one scripted life pauses a request and resumes it."""
    b = Batcher(max_batch_size=1, max_context=4096, prefill_budget=64, page_size=16, kv_blocks=1000)
    long = Request(rid="long", prompt_len=8, max_new_tokens=1500)
    b.enqueue(long)
    for _ in range(6):  # it prefills, then samples: a lane that sampled may be taken back
        for row in b.plan().rows:
            row.lane.prefilled += row.tokens if row.kind == "prefill" else 0
            row.lane.generated += row.samples
    short = Request(rid="short", prompt_len=8, max_new_tokens=4)
    b.enqueue(short)
    assert (short.status, long.status) == (S.WAITING, S.RUNNING)
    b.plan()
    assert (short.status, long.status) == (S.RUNNING, S.PAUSED) and b.preemptions == 1
    b.remove(short)
    short.move(S.FINISHED_STOPPED)
    b.plan()
    assert long.status is S.RUNNING and long.pauses == 1

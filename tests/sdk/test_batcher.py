"""The scheduling policy alone: no engine, no event loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobasert._core.plan import LaneState
from aiobasert.batcher import Batcher
from aiobasert.errors import ContextLengthExceededError, EngineOverloadedError


def lane(rid: str, prompt: int, max_new: int = 8) -> LaneState:
    return LaneState(rid=rid, prompt_len=prompt, max_new_tokens=max_new)


def make(**kw: int | bool) -> Batcher:
    args = dict(max_batch_size=2, max_context=64, prefill_budget=10, max_queue=4)
    args.update(kw)
    return Batcher(**args)  # type: ignore[arg-type]


def test_admission_is_fifo_and_bounded_by_lanes() -> None:
    b = make()
    lanes = [lane(str(i), 3) for i in range(4)]
    for x in lanes:
        b.enqueue(x)
    assert b.admit() == lanes[:2]
    assert b.admit() == []
    b.remove(lanes[0])
    assert b.admit() == [lanes[2]]
    assert list(b.waiting) == [lanes[3]]


def test_queue_bound_raises_overloaded_and_keeps_queue() -> None:
    # 2 lanes free: the first two requests are placed at the next admission and
    # do not count against max_queue; two more may wait, the fifth is refused.
    b = make(max_queue=2)
    for rid in "abcd":
        b.enqueue(lane(rid, 1))
    with pytest.raises(EngineOverloadedError):
        b.enqueue(lane("e", 1))
    assert [x.rid for x in b.waiting] == ["a", "b", "c", "d"]
    assert b.admit() == list(b.running) and b.queued() == 2
    with pytest.raises(EngineOverloadedError):  # lanes busy: still two waiting, still full
        b.enqueue(lane("e", 1))
    b.remove(b.running[0])
    b.enqueue(lane("e", 1))  # a lane came free: room for one more


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    b = make(prefill_budget=10)
    dec = lane("dec", 4)
    b.enqueue(dec)
    b.admit()
    dec.prefilled = 4  # prefill done: decoding
    long = lane("long", 25)
    b.enqueue(long)
    b.admit()
    chunks = []
    for _ in range(3):
        rows = dict((x.rid, n) for x, n in b.schedule())
        assert rows["dec"] == 1  # the running stream advances every step
        chunks.append(rows["long"])
        long.prefilled += rows["long"]
    assert chunks == [10, 10, 5]
    assert dict((x.rid, n) for x, n in b.schedule()) == {"dec": 1, "long": 1}


def test_prefill_budget_is_shared_in_admission_order() -> None:
    b = make(max_batch_size=3, prefill_budget=8)
    a, c = lane("a", 6), lane("c", 6)
    b.enqueue(a)
    b.enqueue(c)
    b.admit()
    assert [(x.rid, n) for x, n in b.schedule()] == [("a", 6), ("c", 2)]


def test_every_decode_lane_steps_whatever_its_reader_does() -> None:
    # No lane waits for its reader (docs/fairness.md): the policy has no notion
    # of unread tokens, every admitted decode lane gets a row every step.
    b = make()
    x, y = lane("x", 1), lane("y", 1)
    for z in (x, y):
        b.enqueue(z)
    b.admit()
    x.prefilled = y.prefilled = 1
    assert b.has_runnable_work()
    assert [(z.rid, n) for z, n in b.schedule()] == [("x", 1), ("y", 1)]


def test_context_budget() -> None:
    b = make(max_context=64)
    assert b.resolve_max_tokens(10, None) == 55
    assert b.resolve_max_tokens(10, 55) == 55
    with pytest.raises(ContextLengthExceededError) as err:
        b.resolve_max_tokens(10, 56)
    assert "exceeds the context window of 64" in str(err.value)
    with pytest.raises(ContextLengthExceededError):
        b.resolve_max_tokens(65, None)


def test_prefix_policy() -> None:
    b = make()
    b.prefix_cache = True
    assert not b.should_match_prefix(lane("s", 16))
    assert b.should_match_prefix(lane("l", 17))
    done = lane("d", 20)
    assert b.should_publish_prefix(done, 20)
    done.cancelled = True
    assert not b.should_publish_prefix(done, 20)


# ---- plan(): admission + rows, what one engine step does --------------------------------


def test_plan_admits_then_plans_rows_after_start_ran() -> None:
    # `start` runs for each admitted lane before its row is planned: a seeded
    # prefix shrinks the chunk, a lane that cannot start gets no row.
    b = make(max_batch_size=3, prefill_budget=10)
    seeded, failing, plain = lane("seeded", 20), lane("failing", 5), lane("plain", 4)
    for x in (seeded, failing, plain):
        b.enqueue(x)
    started: list[str] = []

    def start(st: LaneState) -> None:
        started.append(st.rid)
        if st is seeded:
            st.prefilled = 16  # a cached prefix of one page
        elif st is failing:
            b.remove(st)

    plan = b.plan(start)
    assert started == ["seeded", "failing", "plain"]
    assert [x.rid for x in plan.admitted] == ["seeded", "failing", "plain"]
    assert [(r.lane.rid, r.kind, r.tokens, r.samples) for r in plan.rows] == [
        ("seeded", "prefill", 4, True),  # 20 - 16 left: the chunk ends the prompt and samples
        ("plain", "prefill", 4, True),
    ]
    assert b.plan().admitted == ()  # admitted once only


def test_plan_rows_kinds_and_sampling() -> None:
    b = Batcher(max_batch_size=4, max_context=4096, prefill_budget=30, tap_budget=8)
    dec = LaneState(rid="d", prompt_len=3, max_new_tokens=5, prefilled=3)
    emb = LaneState(rid="e", prompt_len=20, max_new_tokens=0, embed=True)
    long = LaneState(rid="l", prompt_len=50, max_new_tokens=5)
    for x in (dec, emb, long):
        b.enqueue(x)
    plan = b.plan()
    assert [(r.lane.rid, r.kind, r.tokens, r.samples) for r in plan.rows] == [
        ("d", "decode", 1, True),
        ("e", "embed", 8, False),  # the tap budget bounds an embedding chunk
        ("l", "prefill", 22, False),  # the prefill budget left; mid-prompt: nothing sampled yet
    ]
    assert plan.tapped == 8
    assert [r.lane.rid for r in plan.of("decode")] == ["d"]


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 40), st.booleans(), st.integers(0, 40)), min_size=1, max_size=8),
    lanes=st.integers(1, 4),
    budget=st.integers(1, 32),
    taps=st.one_of(st.none(), st.integers(1, 16)),
)
def test_plan_properties(prompts: list[tuple[int, bool, int]], lanes: int, budget: int, taps: int | None) -> None:
    # Whatever the mix: at most max_batch_size lanes, FIFO admission, one token
    # per decode lane, prompt tokens within the prefill budget (embeddings also
    # within the tap budget), no chunk past the end of its prompt.
    b = Batcher(max_batch_size=lanes, max_context=4096, prefill_budget=budget, max_queue=64, tap_budget=taps)
    states = []
    for i, (n, embed, done) in enumerate(prompts):
        x = LaneState(rid=str(i), prompt_len=n, max_new_tokens=4, embed=embed, prefilled=min(done, n))
        if embed and x.prefilled == n:
            x.prefilled = 0  # an embedding with nothing left to feed has ended
        states.append(x)
        b.enqueue(x)
    plan = b.plan()
    assert list(plan.admitted) == states[:lanes]
    assert len(plan.rows) <= lanes
    fed = sum(r.tokens for r in plan.rows if r.kind != "decode")
    assert fed <= budget
    assert taps is None or plan.tapped <= taps
    for r in plan.rows:
        assert r.lane.admitted and r.tokens >= 1
        assert r.lane.prefilled + r.tokens <= r.lane.prompt_len or r.kind == "decode"
        if r.kind == "decode":
            assert r.tokens == 1 and r.samples and not r.lane.prefilling
        else:
            assert r.samples == (r.kind == "prefill" and r.lane.prefilled + r.tokens == r.lane.prompt_len)
    # every admitted decode lane has its row, whatever the budget
    assert {r.lane.rid for r in plan.of("decode")} == {x.rid for x in plan.admitted if not x.prefilling}


# ---- fair admission and preemption (docs/fairness.md) -----------------------------------


def keyed(rid: str, client: str | None, prompt: int = 3, max_new: int = 400) -> LaneState:
    return LaneState(rid=rid, prompt_len=prompt, max_new_tokens=max_new, client=client)


def run_steps(b: Batcher, n: int, preempt: Callable[[LaneState], None] | None = None) -> list[LaneState]:
    """n plans, every row applied as the engine would (prefill advances, a sampling row
    generates one token); returns the lanes admitted along the way."""
    admitted: list[LaneState] = []
    for _ in range(n):
        plan = b.plan(preempt=preempt)
        admitted += plan.admitted
        for r in plan.rows:
            if r.kind != "decode":
                r.lane.prefilled += r.tokens
            if r.samples:
                r.lane.generated += 1
    return admitted


def test_a_free_lane_goes_to_the_client_holding_fewest() -> None:
    # Client A holds one of two lanes and has three more waiting; B's request,
    # queued after them, gets the lane that comes free.
    b = make(max_batch_size=2, max_queue=8)
    a = [keyed(f"a{i}", "A") for i in range(4)]
    other = keyed("o", "O")
    for x in (a[0], other):
        b.enqueue(x)
    assert b.admit() == [a[0], other]
    for x in a[1:]:
        b.enqueue(x)
    bee = keyed("b", "B")
    b.enqueue(bee)
    b.remove(other)  # finished
    assert b.admit() == [bee]
    b.remove(bee)
    assert b.admit() == [a[1]]  # then A's, FIFO among themselves


def test_one_client_alone_is_served_fifo_without_preemption() -> None:
    b = make(max_batch_size=2, max_queue=8)
    mine = [keyed(str(i), "A") for i in range(5)]
    for x in mine:
        b.enqueue(x)
    admitted = run_steps(b, 100)
    assert admitted == mine[:2] and b.preemptions == 0


def test_a_short_request_takes_a_lane_back_from_its_own_clients_long_one() -> None:
    # One client (an app under one client_scope) holds both lanes with long requests: its
    # own 2-token request takes back the lane with the most left at the next step; one of
    # like length (half or more of what remains) waits its FIFO turn.
    b = make(max_batch_size=2, max_queue=8)
    old, young = keyed("old", "A", max_new=400), keyed("young", "A", max_new=100)
    for x in (old, young):
        b.enqueue(x)
    run_steps(b, 3)
    like = keyed("like", "A", max_new=200)  # old has 397 left: not at most half
    b.enqueue(like)
    assert run_steps(b, 5) == [] and b.preemptions == 0
    short = keyed("short", "A", max_new=2)
    b.enqueue(short)
    taken: list[str] = []
    assert run_steps(b, 1, lambda v: taken.append(v.rid)) == [short]
    assert taken == ["old"] and b.preemptions == 1
    assert short.generated == 1 and list(b.waiting) == [old, like]  # arrival order kept
    run_steps(b, 1)
    assert short.generated == 2


def test_a_fan_out_of_equal_choices_never_preempts_itself() -> None:
    b = make(max_batch_size=2, max_queue=16)
    choices = [keyed(f"c{i}", "n-1", max_new=50) for i in range(6)]
    for x in choices:
        b.enqueue(x)
    admitted = run_steps(b, 60)
    assert admitted[:2] == choices[:2] and b.preemptions == 0


def test_a_new_request_takes_a_lane_back_from_a_client_holding_more() -> None:
    # A holds both lanes: a new request of another client (no key: a client of its own)
    # is admitted at the next step, in the lane of A's most-served request (ties: the
    # latest arrival), which is rewound to resume from prompt + output.
    b = make(max_batch_size=2, max_queue=8)
    first, second = keyed("a0", "A"), keyed("a1", "A")
    for x in (first, second):
        b.enqueue(x)
    run_steps(b, 2)
    short = keyed("short", None, max_new=2)
    b.enqueue(short)
    seen: list[tuple[str, int, int]] = []

    def preempt(v: LaneState) -> None:  # called before the rewind: the engine still sees its KV
        seen.append((v.rid, v.prefilled, v.generated))

    assert run_steps(b, 1, preempt) == [short]
    assert seen == [("a1", 3, 2)]
    assert not second.admitted and list(b.waiting) == [second]
    assert second.replay == 2 and second.prefilled == 0 and second.kv_target == 5
    assert b.preemptions == 1
    assert short.generated == 1  # its prompt was fed and sampled in the step that admitted it
    run_steps(b, 1)
    assert short.generated == 2 and b.running == [first, short]


def test_only_a_lane_that_sampled_since_its_admission_is_taken_back() -> None:
    # Every admission makes progress: a lane still prefilling (its prompt, or a resumed
    # lane's replay) is not taken back; the newcomer waits until it has sampled.
    b = make(max_batch_size=1, max_queue=8, prefill_budget=4)
    long = keyed("long", "A", prompt=10)
    b.enqueue(long)
    run_steps(b, 1)
    b.enqueue(keyed("new", None))
    assert run_steps(b, 2) == []  # chunks of 4, 4, then 2 (which samples)
    assert long.generated == 1
    assert [x.rid for x in run_steps(b, 1)] == ["new"]


def test_the_most_served_lane_of_the_client_holding_most_is_taken_back() -> None:
    b = make(max_batch_size=3, max_queue=8)
    old, young = keyed("old", "A"), keyed("young", "A")
    other = keyed("other", "B")
    for x in (old, other):
        b.enqueue(x)
    run_steps(b, 5)
    b.enqueue(young)
    run_steps(b, 2)
    b.enqueue(keyed("new", None))
    taken: list[str] = []
    run_steps(b, 1, lambda v: taken.append(v.rid))
    assert taken == ["old"]  # A holds 2 (B 1); its request with the most output


def test_a_resumed_lane_replays_prompt_and_output_then_samples_once() -> None:
    b = make(max_batch_size=1, max_queue=8, prefill_budget=4)
    long = keyed("long", "A", prompt=3)
    b.enqueue(long)
    run_steps(b, 5)  # prompt in 1 chunk (1 token), then 4 decodes
    assert long.generated == 5
    b.enqueue(keyed("new", None, max_new=1))
    run_steps(b, 1)  # new preempts long, prefills, samples its one token
    assert long.replay == 5 and not long.admitted
    b.remove(b.running[0])  # new finished
    plan = b.plan()
    assert plan.admitted == (long,)
    # prompt 3 + output 5 = 8 tokens to rebuild, under a budget of 4: two chunks, the last samples
    assert [(r.kind, r.tokens, r.samples) for r in plan.rows] == [("prefill", 4, False)]
    long.prefilled += 4
    assert [(r.kind, r.tokens, r.samples) for r in b.plan().rows] == [("prefill", 4, True)]


def test_preempted_requests_do_not_take_lanes_back_from_equals() -> None:
    # Eight long requests of eight clients on 2 lanes: new ones each take one lane
    # back (they have not started), a preempted one only from a client holding two
    # more than its own: here never, so lanes do not cycle between equals.
    b = make(max_batch_size=2, max_queue=16, quantum=3)
    reqs = [keyed(str(i), None, max_new=1000) for i in range(8)]
    for x in reqs:
        b.enqueue(x)
    run_steps(b, 200)
    assert all(x.started for x in reqs)
    assert b.preemptions == 6  # one per request that started while every lane was held


def test_clients_converge_to_equal_shares_and_stay() -> None:
    # A holds all 4 lanes; B arrives with 4 requests: B's take lanes back until
    # both hold 2; no lane moves after that.
    b = make(max_batch_size=4, max_queue=16, quantum=2)
    for i in range(6):
        b.enqueue(keyed(f"a{i}", "A", max_new=10_000))
    run_steps(b, 5)
    for i in range(4):
        b.enqueue(keyed(f"b{i}", "B", max_new=10_000))
    run_steps(b, 50)
    held = {c: sum(1 for x in b.running if x.client == c) for c in "AB"}
    assert held == {"A": 2, "B": 2}
    moved = b.preemptions
    run_steps(b, 200)
    assert b.preemptions == moved


def test_embeddings_are_never_preempted_and_fifo_mode_never_preempts() -> None:
    b = make(max_batch_size=1, max_queue=8, quantum=1)
    emb = LaneState(rid="e", prompt_len=10_000, max_new_tokens=0, embed=True, client="A")
    b.enqueue(emb)
    b.enqueue(keyed("x", None))
    run_steps(b, 20)
    assert b.running == [emb] and b.preemptions == 0
    fifo = make(max_batch_size=1, max_queue=8, quantum=1, fair=False)
    hog = keyed("hog", "A", max_new=10_000)
    fifo.enqueue(hog)
    fifo.enqueue(keyed("x", None))
    run_steps(fifo, 20)
    assert fifo.running == [hog] and fifo.preemptions == 0


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.sampled_from([None, "A", "B", "C"]), st.integers(1, 40), st.integers(1, 60), st.integers(0, 80)),
        min_size=1,
        max_size=14,
    ),
    lanes=st.integers(1, 4),
    budget=st.integers(1, 32),
    quantum=st.integers(1, 20),
)
def test_fair_admission_model(
    reqs: list[tuple[str | None, int, int, int]], lanes: int, budget: int, quantum: int
) -> None:
    # Any arrivals of any clients: at most `lanes` run; a lane is taken back only
    # once it sampled since its admission, never an embedding, only for a client holding
    # fewer or a much shorter new request of its own client; each request ends with exactly its
    # max_new tokens (a resumed lane samples only once its replay is fed); all end.
    b = Batcher(max_batch_size=lanes, max_context=4096, prefill_budget=budget, max_queue=64, quantum=quantum)
    states = [keyed(str(i), c, prompt=p, max_new=n) for i, (c, p, n, _) in enumerate(reqs)]
    arrive = sorted(range(len(reqs)), key=lambda i: reqs[i][3])
    done: list[LaneState] = []
    work = sum(p + n for _, p, n, _ in reqs)
    for step in range(1, 40 * work + 200):
        while arrive and reqs[arrive[0]][3] < step:
            b.enqueue(states[arrive.pop(0)])

        def preempt(v: LaneState) -> None:
            # it sampled a token since its admission: every admission makes progress
            assert not v.embed and not v.prefilling and b.step > v.ran_from

            def held(owner: tuple[str, str]) -> int:
                return sum(1 for y in b.running if y.owner == owner)

            # taken back for a waiting request of a client holding fewer lanes than v's, or
            # for a new one of v's client needing at most half of what v may still generate
            assert any(
                (w.owner != v.owner and held(w.owner) < held(v.owner))
                or (w.owner == v.owner and not w.started and 2 * w.max_new_tokens <= v.max_new_tokens - v.generated)
                for w in b.waiting
            )

        plan = b.plan(preempt=preempt)
        assert len(b.running) <= lanes
        for r in plan.rows:
            assert r.lane.prefilled + r.tokens <= r.lane.kv_target or r.kind == "decode"
            if r.kind != "decode":
                r.lane.prefilled += r.tokens
            if r.samples:
                r.lane.generated += 1
                if r.lane.generated == r.lane.max_new_tokens:
                    b.remove(r.lane)
                    done.append(r.lane)
        if not arrive and not b.has_runnable_work():
            break
    assert sorted(x.rid for x in done) == sorted(x.rid for x in states), "a request never ended"
    assert all(x.generated == x.max_new_tokens for x in done)


def test_new_prompts_get_the_prefill_budget_before_replays() -> None:
    # A preempted lane's replay waits for the budget behind a new prompt (least served
    # first) whatever their order in the batch. FIFO mode: admission order for the budget.
    for fair, want in ((True, [("resumed", 2), ("new", 6)]), (False, [("resumed", 8)])):
        b = make(max_batch_size=2, max_queue=8, prefill_budget=8, fair=fair)
        resumed = keyed("resumed", "A", prompt=10)
        resumed.generated = resumed.replay = 5
        new = keyed("new", "B", prompt=6)
        b.enqueue(resumed)
        b.admit()  # admitted first: first in the batch
        b.enqueue(new)
        b.admit()
        assert [(x.rid, n) for x, n in b.schedule()] == want

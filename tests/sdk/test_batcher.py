"""The scheduling policy alone: no engine, no event loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobasert._core.request import Request, RequestStatus
from aiobasert.batcher import Batcher
from aiobasert.errors import ContextLengthExceededError, EngineOverloadedError


def lane(rid: str, prompt: int, max_new: int = 8) -> Request:
    return Request(rid=rid, prompt_len=prompt, max_new_tokens=max_new)


def make(**kw: int | bool) -> Batcher:
    args = dict(max_batch_size=2, max_context=64, prefill_budget=10, max_queue=4, kv_blocks=100_000)
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
    b.enqueue(done)
    b.remove(done)
    done.move(RequestStatus.FINISHED_ABORTED)  # cancelled: its KV is not published
    assert not b.should_publish_prefix(done, 20)


# ---- plan(): admission + rows, what one engine step does --------------------------------


def test_plan_admits_then_plans_rows_after_start_ran() -> None:
    # `start` runs for each admitted lane before its row is planned: a seeded
    # prefix shrinks the chunk, a lane that cannot start gets no row.
    b = make(max_batch_size=3, prefill_budget=32)
    seeded, failing, plain = lane("seeded", 20), lane("failing", 5), lane("plain", 4)
    for x in (seeded, failing, plain):
        b.enqueue(x)
    started: list[str] = []

    def start(st: Request) -> None:
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
    dec = Request(rid="d", prompt_len=3, max_new_tokens=5, prefilled=3)
    emb = Request(rid="e", prompt_len=20, max_new_tokens=0, embed=True)
    long = Request(rid="l", prompt_len=50, max_new_tokens=5)
    for x in (dec, emb, long):
        b.enqueue(x)
    plan = b.plan()
    assert [(r.lane.rid, r.kind, r.tokens, r.samples) for r in plan.rows] == [
        ("e", "embed", 8, False),  # the most urgent (one step of work); the tap budget bounds its chunk
        ("d", "decode", 1, True),
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
    # Whatever the mix: at most max_batch_size lanes, the most urgent admitted first (least
    # slack: 2 x work less what is left), one token per decode lane, prompt tokens within the
    # prefill budget (embeddings also within the tap budget), no chunk past the end of its prompt.
    b = Batcher(max_batch_size=lanes, max_context=4096, prefill_budget=budget, max_queue=64, tap_budget=taps)
    states = []
    for i, (n, embed, done) in enumerate(prompts):
        x = Request(rid=str(i), prompt_len=n, max_new_tokens=4, embed=embed, prefilled=min(done, n))
        if embed and x.prefilled == n:
            x.prefilled = 0  # an embedding with nothing left to feed has ended
        states.append(x)
        b.enqueue(x)
    urgent = sorted(states, key=lambda x: (b.slack(x), x.arrival))
    plan = b.plan()
    assert list(plan.admitted) == urgent[:lanes]
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


def keyed(rid: str, client: str | None, prompt: int = 3, max_new: int = 400) -> Request:
    return Request(rid=rid, prompt_len=prompt, max_new_tokens=max_new, client=client)


def run_steps(b: Batcher, n: int, preempt: Callable[[Request], None] | None = None) -> list[Request]:
    """n plans, every row applied as the engine would (prefill advances, a sampling row
    generates one token); returns the lanes admitted along the way."""
    admitted: list[Request] = []
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
    # own 2-token request takes back the lane with the most slack at the next step; one of
    # like length (more than half the work of what runs) waits its FIFO turn.
    b = make(max_batch_size=2, max_queue=8)
    old, young = keyed("old", "A", max_new=400), keyed("young", "A", max_new=100)
    for x in (old, young):
        b.enqueue(x)
    run_steps(b, 3)
    like = keyed("like", "A", max_new=250)  # old's slack, ~400, less 251 is under like's 251
    b.enqueue(like)
    assert run_steps(b, 5) == [] and b.preemptions == 0
    short = keyed("short", "A", max_new=2)
    b.enqueue(short)
    taken: list[str] = []
    assert run_steps(b, 1, lambda v: taken.append(v.rid)) == [short]
    assert taken == ["old"] and b.preemptions == 1
    assert short.generated == 1 and list(b.paused) == [old] and list(b.waiting) == [like]
    run_steps(b, 1)
    assert short.generated == 2


def test_a_fan_out_of_equal_choices_never_preempts_itself() -> None:
    b = make(max_batch_size=2, max_queue=16)
    choices = [keyed(f"c{i}", "n-1", max_new=50) for i in range(6)]
    for x in choices:
        b.enqueue(x)
    admitted = run_steps(b, 60)
    assert admitted[:2] == choices[:2] and b.preemptions == 0


def test_a_new_request_takes_a_lane_back_and_the_paused_one_keeps_its_place() -> None:
    # A holds both lanes: a short request of another client is admitted at the next step, in
    # the lane with the most left (ties: the latest arrival). The request taken out is paused
    # as it stood (its KV kept: nothing to recompute) and resumes in the next free lane with
    # a decode row, before any new request.
    b = make(max_batch_size=2, max_queue=8)
    first, second = keyed("a0", "A"), keyed("a1", "A")
    for x in (first, second):
        b.enqueue(x)
    run_steps(b, 2)
    short = keyed("short", None, max_new=2)
    b.enqueue(short)
    seen: list[tuple[str, int, int]] = []
    assert run_steps(b, 1, lambda v: seen.append((v.rid, v.prefilled, v.generated))) == [short]
    assert seen == [("a1", 3, 2)]
    assert not second.admitted and list(b.paused) == [second] and not b.waiting
    assert (second.prefilled, second.generated, second.pauses) == (3, 2, 1)
    assert b.preemptions == 1
    assert short.generated == 1  # its prompt was fed and sampled in the step that admitted it
    late = keyed("late", "A", max_new=600)
    b.enqueue(late)  # waits: not short enough to take a lane back, and with more slack than a1
    run_steps(b, 1)
    assert short.generated == 2 and b.running == [first, short]
    b.remove(short)  # finished
    plan = b.plan()
    assert plan.admitted == (second,) and list(b.waiting) == [late]
    assert [(r.lane.rid, r.kind, r.tokens) for r in plan.rows] == [("a0", "decode", 1), ("a1", "decode", 1)]
    assert second.longest_pause == 2  # paused in steps 3 and 4


def test_only_a_lane_that_sampled_since_its_admission_is_taken_back() -> None:
    # Every admission makes progress: a lane still prefilling its prompt is not taken back;
    # the newcomer waits until it has sampled.
    b = make(max_batch_size=1, max_queue=8, prefill_budget=4)
    long = keyed("long", "A", prompt=10)
    b.enqueue(long)
    run_steps(b, 1)
    b.enqueue(keyed("new", None, max_new=2))
    assert run_steps(b, 2) == []  # chunks of 4, 4, then 2 (which samples)
    assert long.generated == 1
    assert [x.rid for x in run_steps(b, 1)] == ["new"]


def test_the_most_served_lane_of_the_client_holding_most_is_taken_back() -> None:
    # Like lengths: only fair share moves a lane (A holds 2, the newcomer's client none).
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


def test_a_burst_of_like_requests_is_served_in_fifo_order_without_preemption() -> None:
    # Eight long requests of eight clients on 2 lanes: each client holds one lane at most and
    # none is short beside another, so no lane moves (issue 37: each newcomer used to take a
    # lane back, and the replays made a burst 2.3x slower than FIFO).
    b = make(max_batch_size=2, max_queue=16)
    reqs = [keyed(str(i), None, max_new=1000) for i in range(8)]
    for x in reqs:
        b.enqueue(x)
    assert run_steps(b, 200) == reqs[:2]
    assert b.preemptions == 0


def test_clients_converge_to_equal_shares_and_stay() -> None:
    # A holds all 4 lanes; B arrives with 4 requests: B's take lanes back until
    # both hold 2; no lane moves after that.
    b = make(max_batch_size=4, max_queue=16)
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


def test_a_lane_is_taken_back_only_while_the_pool_keeps_every_paused_kv() -> None:
    # A paused request keeps its KV: a lane is taken back only while the pool holds every
    # running request at its longest (kv_need: ceil((prompt + max_new) / page) + 1, the long
    # ones 27, the short ones 2) beside the paused requests' KV (kv_held: 3 blocks each after
    # three tokens), so no step can run out. 27 + 2 + 3 = 32 blocks for the first pause; the
    # second then needs 2 + 2 + 3 + 3.
    for blocks, taken in ((31, 0), (32, 2)):
        b = make(max_batch_size=2, max_queue=8, kv_blocks=blocks, page_size=16, prefill_budget=64)
        for i in range(2):
            b.enqueue(keyed(f"long{i}", None, prompt=16, max_new=400))
        run_steps(b, 3)
        for i in range(3):
            b.enqueue(keyed(f"s{i}", None, max_new=2))
        run_steps(b, 1)
        assert b.preemptions == taken, blocks
        assert [x.kv_kept for x in b.paused] == [3] * taken
        assert b._running_need + b._paused_kv == (54 if not taken else 10)
    unknown = make(max_batch_size=1, kv_blocks=None)  # an unknown pool: no lane is ever taken back
    unknown.enqueue(keyed("long", None))
    run_steps(unknown, 3)
    unknown.enqueue(keyed("short", None, max_new=1))
    assert run_steps(unknown, 3) == [] and unknown.preemptions == 0


def test_a_resume_that_would_not_fit_releases_the_latest_paused_kv() -> None:
    # Both long requests are paused (3 blocks each) by a 2-token and an 80-token request
    # (need 2 and 7). When the first long one resumes, the pool (34 blocks) holds it at its
    # longest (27) beside the 80-token one (7) only without the other paused request's KV:
    # that KV is released (the engine's callback publishes and frees it), and that request
    # resumes later by recomputing prompt + output, in one chunk here, which samples.
    b = make(max_batch_size=2, max_queue=8, kv_blocks=34, page_size=16, prefill_budget=64)
    longs = [keyed(f"long{i}", None, prompt=16, max_new=400) for i in range(2)]
    for x in longs:
        b.enqueue(x)
    run_steps(b, 3)
    s0, s1 = keyed("s0", None, max_new=2), keyed("s1", None, max_new=80)
    for x in (s0, s1):
        b.enqueue(x)
    run_steps(b, 2)
    assert list(b.paused) == longs[::-1] and [x.kv_kept for x in b.paused] == [3, 3]
    assert s0.generated == 2
    b.remove(s0)
    released: list[str] = []
    plan = b.plan(release=lambda x: released.append(x.rid))  # like slack: the earliest, long0
    assert plan.admitted == (longs[0],) and released == ["long1"] and b.recomputes == 1
    assert (longs[1].replay, longs[1].prefilled, longs[1].kv_kept) == (3, 0, 0)
    assert b._running_need + b._paused_kv == 34
    for r in plan.rows:
        r.lane.generated += r.samples
    b.remove(s1)
    plan = b.plan()
    assert plan.admitted == (longs[1],)
    assert [(r.lane.rid, r.kind, r.tokens, r.samples) for r in plan.rows] == [
        ("long0", "decode", 1, True), ("long1", "prefill", 16 + 3, True)]  # fmt: skip


def test_a_short_request_is_not_kept_waiting_by_paused_kv() -> None:
    # A 40-token request pauses long1 at its 300th token (21 blocks kept). A short request with
    # a 320-token prompt (need 22 blocks) then fits beside the running requests at their longest
    # only without long1's KV: that KV is released (long1 recomputes on its resume) and long0,
    # the lane with the most left, is paused for it.
    b = make(max_batch_size=2, max_queue=8, kv_blocks=60, page_size=16, prefill_budget=64)
    longs = [keyed(f"long{i}", None, prompt=16, max_new=400) for i in range(2)]
    for x in longs:
        b.enqueue(x)
    run_steps(b, 300)
    b.enqueue(keyed("mid", None, max_new=40))
    run_steps(b, 1)
    assert list(b.paused) == [longs[1]] and longs[1].kv_kept == 21
    big = keyed("big", None, prompt=320, max_new=2)
    b.enqueue(big)
    released: list[str] = []
    plan = b.plan(release=lambda x: released.append(x.rid))
    assert plan.admitted == (big,) and released == ["long1"] and b.recomputes == 1
    assert list(b.paused) == [longs[1], longs[0]] and longs[1].replay == 300 and longs[0].kv_kept == 21
    assert b._running_need + b._paused_kv <= 60


def test_a_long_request_beside_sustained_short_ones_is_done_when_due() -> None:
    # Issue 37's stall, on one lane: closed-loop 3-token requests take the long request's lane
    # while it can afford them (its slack: 2 x its 101 steps of work, less what it needs, less
    # what it waited); once it cannot, it runs to its end, the short ones waiting. It is done
    # by its due step (plus the last short one it waited for), and never ping-pongs.
    b = make(max_batch_size=1, max_queue=64, prefill_budget=16)
    long = keyed("long", None, max_new=100)
    b.enqueue(long)
    run_steps(b, 2)
    served = 0
    while long.generated < long.max_new_tokens:
        if not b.waiting:
            b.enqueue(keyed(f"s{served}", None, max_new=3))  # a closed-loop short client
        for r in b.plan().rows:
            r.lane.prefilled += r.tokens if r.kind != "decode" else 0
            r.lane.generated += r.samples
            if r.lane.generated == r.lane.max_new_tokens:
                b.remove(r.lane)
                served += r.lane is not long
    assert long.due == 2 * 101 and b.step <= long.due + 4
    assert long.pauses >= 1 and served >= 20
    assert long.longest_pause <= 101 + 3  # its own work (stretch 2) and the short it waited for


def test_embeddings_are_never_preempted_and_fifo_mode_never_preempts() -> None:
    b = make(max_batch_size=1, max_queue=8)
    emb = Request(rid="e", prompt_len=10_000, max_new_tokens=0, embed=True, client="A")
    b.enqueue(emb)
    run_steps(b, 1)
    b.enqueue(keyed("x", None, max_new=1))
    run_steps(b, 20)
    assert b.running == [emb] and b.preemptions == 0
    fifo = make(max_batch_size=1, max_queue=8, fair=False)
    hog = keyed("hog", "A", max_new=10_000)
    fifo.enqueue(hog)
    fifo.enqueue(keyed("x", None, max_new=1))
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
    stretch=st.integers(1, 4),
    kv_blocks=st.integers(2, 80),
)
def test_fair_admission_model(
    reqs: list[tuple[str | None, int, int, int]], lanes: int, budget: int, stretch: int, kv_blocks: int
) -> None:
    # Any arrivals of any clients, any pool: at most `lanes` run; a lane is taken back only
    # once it sampled since its latest admission, never an embedding, only for a waiting
    # request it can afford (after the taker's steps it keeps at least the taker's slack) or a
    # new one of a client holding two fewer, and only while every running request at its
    # longest fits the pool beside the paused requests' KV; each request ends with exactly its
    # max_new tokens, a paused one with its KV kept resuming as a decode lane; all end.
    b = Batcher(
        max_batch_size=lanes, max_context=4096, prefill_budget=budget, max_queue=64, stretch=stretch,
        page_size=4, kv_blocks=kv_blocks,
    )  # fmt: skip
    states = [keyed(str(i), c, prompt=p, max_new=n) for i, (c, p, n, _) in enumerate(reqs)]
    arrive = sorted(range(len(reqs)), key=lambda i: reqs[i][3])
    done: list[Request] = []
    work = sum(p + n for _, p, n, _ in reqs)
    for step in range(1, 40 * work + 200):
        while arrive and reqs[arrive[0]][3] < step:
            b.enqueue(states[arrive.pop(0)])

        def held(owner: tuple[str, str]) -> int:
            return sum(1 for y in b.running if y.owner == owner)

        taken: list[Request] = []

        def preempt(v: Request, taken: list[Request] = taken) -> None:
            taken.append(v)
            assert not v.embed and not v.prefilling and b.step > v.ran_from
            assert any(
                b.slack(v) - b.left(w) >= max(b.slack(w), 0) or (not w.started and held(v.owner) >= held(w.owner) + 2)
                for w in [*b.waiting, *b.paused]
            )

        kept = [x for x in b.paused if x.kv_kept]
        plan = b.plan(preempt=preempt)
        assert len(b.running) <= lanes
        assert b._paused_kv == 0 or b._running_need + b._paused_kv <= kv_blocks
        resumed = [x for x in plan.admitted if x.pauses]
        for r in plan.rows:
            assert r.lane.prefilled + r.tokens <= r.lane.kv_target or r.kind == "decode"
            if r.lane in resumed and r.lane in kept and not r.lane.replay:
                assert r.kind == "decode"
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
    assert b._running_need == b._paused_kv == 0 and not b.paused
    assert b.preemptions <= 2 * len(reqs)  # no thrash: about one pause per request at most

"""The scheduling policy alone: no engine, no event loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiobasert.batcher import Batcher, LaneState
from aiobasert.errors import ContextLengthExceededError, EngineOverloadedError


def lane(rid: str, prompt: int, max_new: int = 8) -> LaneState:
    return LaneState(rid=rid, prompt_len=prompt, max_new_tokens=max_new)


def make(**kw: int) -> Batcher:
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
def test_plan_properties(
    prompts: list[tuple[int, bool, int]], lanes: int, budget: int, taps: int | None
) -> None:
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

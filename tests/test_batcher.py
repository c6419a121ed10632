"""The scheduling policy alone: no engine, no event loop."""

from __future__ import annotations

import pytest

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

"""_core/plan.py: the plain data between the batcher and the step. What each value derives
(a lane's owner, its KV target after a rewind, a row's logits rows, a plan's drafts and taps) is
what both sides read, so it is pinned here, without an engine."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from aiobasert._core.plan import PlannedRow, StepPlan
from aiobasert._core.request import Request


def test_a_lane_counts_for_its_client_or_for_itself() -> None:
    assert Request(rid="r", prompt_len=1, max_new_tokens=1).owner == ("request", "r")
    assert Request(rid="r", prompt_len=1, max_new_tokens=1, client="k").owner == ("client", "k")


@given(prompt=st.integers(1, 64), generated=st.integers(0, 64))
def test_a_rewound_lane_feeds_its_prompt_and_its_output_again(prompt: int, generated: int) -> None:
    lane = Request(rid="r", prompt_len=prompt, max_new_tokens=128, prefilled=prompt, generated=generated)
    assert not lane.prefilling and lane.kv_target == prompt
    lane.rewind()
    assert lane.prefilled == 0 and lane.replay == generated
    assert lane.prefilling and lane.kv_target == prompt + generated
    lane.prefilled = prompt + generated - 1
    assert lane.prefilling  # one token short: it samples only when all of it is fed again
    lane.prefilled += 1
    assert not lane.prefilling


def test_a_step_plan_sums_its_drafts_and_taps_and_selects_rows_by_kind() -> None:
    a, b, c = (Request(rid=r, prompt_len=4, max_new_tokens=8) for r in "abc")
    dec = PlannedRow(a, "decode", 3, samples=True, drafts=2)
    pre = PlannedRow(b, "prefill", 4, samples=True)
    emb = PlannedRow(c, "embed", 3, samples=False)
    plan = StepPlan(admitted=(b,), rows=(dec, pre, emb))
    assert (dec.out_rows, pre.out_rows, emb.out_rows) == (3, 1, 1)  # 1 + drafts logits rows per lane
    assert plan.drafts == 2 and plan.tapped == 3
    assert plan.of("decode") == (dec,) and plan.of("prefill") == (pre,) and plan.of("embed") == (emb,)
    assert StepPlan(admitted=(), rows=()).drafts == 0


def test_lane_states_compare_by_identity() -> None:
    # The batcher keeps them in lists and removes by `is` equality: two requests with equal
    # fields are two lanes.
    one, two = (Request(rid="r", prompt_len=1, max_new_tokens=1) for _ in range(2))
    assert one != two and [one, two].index(two) == 1

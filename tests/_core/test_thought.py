"""_core/thought.py: the thought gate's phases driven by hand, its tags one token (`<think>`) or several
(Harmony's `<|channel|>analysis<|message|>` ... `<|end|><|start|>assistant<|channel|>final<|message|>`): whatever
tokens a model picks among those the gate allows, the thought stays within its budget, each tag is written whole
and in order, and the answer follows the close tag."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from aiobasert._core.protocol import ThoughtSpec
from aiobasert._core.thought import ThoughtGate

VOCAB = 64  # two bitmask words; ids 40.. are the tags' tokens, the rest ordinary text


def _allowed(gate: ThoughtGate) -> list[int]:
    mask = np.zeros(VOCAB // 32, dtype=np.int32)
    if not gate.fill_bitmask(mask):
        return list(range(VOCAB))
    words = mask.view("uint32")
    return [t for t in range(VOCAB) if words[t >> 5] >> (t & 31) & 1]


def _gate(open_tag: list[int], close_tag: list[int], budget: int | None, starts_open: bool = False) -> ThoughtGate:
    spec = ThoughtSpec("o", "c", starts_open=starts_open, budget=budget)
    return ThoughtGate(None, spec, open_id=open_tag, close_id=close_tag, end_ids=[])


def test_a_harmony_thought_is_opened_and_closed_whole() -> None:
    opening, closing = [40, 41, 42], [43, 44, 45, 46]
    gate = _gate(opening, closing, budget=2)
    assert gate.accept(40) and gate.in_thought  # the model chose the header's first token ...
    assert _allowed(gate) == [41] and gate.accept(41)  # ... the rest is forced
    assert _allowed(gate) == [42] and gate.accept(42)
    assert len(_allowed(gate)) == VOCAB  # the thought runs free
    assert gate.accept(7) and gate.accept(8) and gate.thought_tokens == 2
    for token in closing:  # past the budget: the close tag and the answer's header, token by token
        assert _allowed(gate) == [token] and gate.accept(token) and gate.in_thought
    assert len(_allowed(gate)) == VOCAB and gate.accept(9) and not gate.in_thought  # the answer
    assert gate.thought_tokens == 2


def test_a_close_the_model_starts_itself_is_finished_for_it() -> None:
    gate = _gate([40], [43, 44, 45], budget=None, starts_open=True)
    assert gate.accept(5) and gate.accept(43)
    assert _allowed(gate) == [44] and gate.accept(44) and _allowed(gate) == [45] and gate.accept(45)
    assert gate.accept(6) and not gate.in_thought and gate.thought_tokens == 1


def test_one_token_tags_are_as_before() -> None:
    gate = _gate([40], [41], budget=0)
    assert gate.accept(40) and _allowed(gate) == [41] and gate.accept(41)
    assert len(_allowed(gate)) == VOCAB and gate.accept(3) and not gate.in_thought


@given(
    open_len=st.integers(1, 3),
    close_len=st.integers(1, 5),
    budget=st.none() | st.integers(0, 6),
    starts_open=st.booleans(),
    data=st.data(),
)
def test_any_walk_among_the_allowed_tokens_keeps_the_tags_whole_and_the_budget(
    open_len: int, close_len: int, budget: int | None, starts_open: bool, data: st.DataObject
) -> None:
    opening = list(range(40, 40 + open_len))
    closing = list(range(50, 50 + close_len))
    gate = _gate(opening, closing, budget, starts_open)
    picked = []
    for _ in range(20):
        token = data.draw(st.sampled_from(_allowed(gate)))
        assert gate.accept(token)
        picked.append(token)
    if budget is not None:
        assert gate.thought_tokens <= budget
    thought_started = starts_open or picked[0] == opening[0]
    if not thought_started:
        return  # the answer came first: every tag id after it is plain text
    body = 0 if starts_open else open_len
    assert picked[:body] == opening[:body]  # the open tag, once started, is written whole
    if closing[0] in picked[body:]:  # so is the close tag, whoever started it
        at = picked.index(closing[0], body)
        assert picked[at : at + close_len] == closing[: len(picked) - at]
    elif budget is not None:
        assert body + budget >= len(picked)  # the budget had not run out yet


def _channels_gate(budget: int | None, starts_open: bool = False) -> ThoughtGate:
    """Harmony without a grammar (`ThoughtSpec.reopens`): 40 41 42 is `<|channel|>analysis<|message|>`,
    43.. the close with the final header (`<|end|><|start|>assistant<|channel|>final<|message|>`)."""
    spec = ThoughtSpec("o", "c", starts_open=starts_open, budget=budget, answer_tag="a", reopens=True)
    return ThoughtGate(None, spec, open_id=[40, 41, 42], close_id=[43, 44, 45, 46], end_ids=[])


def test_a_channel_thought_is_recognised_not_forced() -> None:
    gate = _channels_gate(budget=3)
    assert gate.accept(40) and not gate.in_thought  # `<|channel|>` may start any channel ...
    assert len(_allowed(gate)) == VOCAB and gate.accept(7)  # ... `final` (7), say: no thought
    assert gate.accept(42) and gate.accept(5) and gate.thought_tokens == 0 and not gate.in_thought
    for token in (40, 40, 41, 42):  # a header written whole (after a false start) opens the thought
        assert len(_allowed(gate)) == VOCAB and gate.accept(token)
    assert gate.in_thought and gate.accept(5) and gate.accept(6) and gate.thought_tokens == 2
    assert gate.accept(43) and gate.in_thought  # the model's own `<|end|>` ...
    assert len(_allowed(gate)) == VOCAB and gate.accept(44) and not gate.in_thought  # ... forces nothing after it
    for token in (40, 41, 42):  # another analysis message: the same budget
        assert gate.accept(token)
    assert gate.accept(5) and gate.thought_tokens == 3
    for token in (43, 44, 45, 46):  # spent: the close and the final header, token by token
        assert _allowed(gate) == [token] and gate.accept(token) and gate.in_thought
    assert len(_allowed(gate)) == VOCAB and gate.accept(9) and not gate.in_thought  # the answer


def test_a_channel_thought_the_prompt_opened_with_budget_0_closes_at_once() -> None:
    gate = _channels_gate(budget=0, starts_open=True)
    for token in (43, 44, 45, 46):
        assert _allowed(gate) == [token] and gate.accept(token)
    assert len(_allowed(gate)) == VOCAB and gate.accept(9) and gate.thought_tokens == 0


@given(budget=st.none() | st.integers(0, 6), starts_open=st.booleans(), data=st.data())
def test_any_walk_of_a_channel_thought_keeps_its_budget_and_forces_only_past_it(
    budget: int | None, starts_open: bool, data: st.DataObject
) -> None:
    """Whatever the model picks (header tokens often), the thought stays within its budget, and the gate
    narrows the choice only to write the whole close sequence once the budget is spent."""
    gate = _channels_gate(budget, starts_open)
    closing, forcing = [43, 44, 45, 46], 0
    for _ in range(30):
        allowed = _allowed(gate)
        token = data.draw(st.sampled_from([40, 41, 42, 43, 5]) if len(allowed) == VOCAB else st.just(allowed[0]))
        if len(allowed) != VOCAB:
            assert budget is not None and gate.thought_tokens == budget
            assert allowed == [closing[forcing]]
            forcing = (forcing + 1) % len(closing)
        else:
            assert forcing == 0  # a close the gate started is written whole
        assert gate.accept(token)
    if budget is not None:
        assert gate.thought_tokens <= budget

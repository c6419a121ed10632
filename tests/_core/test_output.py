"""_core/output.py: a sampled token becomes stream output (its text from the engine's exact
bytes, stop conditions, the finish reason), on a lane built by hand and a tokenizer-only handle
of the tiny model: every byte and every end-of-sequence answer comes from the real C library."""

from __future__ import annotations

from typing import Any

import pytest

from aiobasert import InvalidRequestError, SamplingParams
from aiobasert._core.intake import Tokenizer
from aiobasert._core.output import Detokenizer, OutputProcessor
from aiobasert._core.protocol import RequestSpec, Ticket
from aiobasert._core.step import Lane
from aiobasert.types import FinishReason


class _Sink:
    def alive(self) -> bool:
        return True

    def deliver(self, *args: Any) -> None:
        raise AssertionError("nothing is delivered here")


def _out(tok: Tokenizer) -> OutputProcessor:
    return OutputProcessor(tok.lib, tok.handle, Detokenizer(tok.lib, tok.handle))


def _lane(max_new: int = 16, constraint: Any = None, **params: Any) -> Lane:
    spec = RequestSpec(rid="r", prompt=[1], params=SamplingParams(**params))
    return Lane(spec, _Sink(), Ticket(), [1], max_new=max_new, constraint=constraint)


def _run(out: OutputProcessor, lane: Lane, ids: list[int]) -> tuple[str, list[FinishReason | None]]:
    """Feed `ids` as the engine thread does (applying each output), up to the first finish."""
    texts: list[str] = []
    finishes: list[FinishReason | None] = []
    for tok in ids:
        res = out.process(lane, tok, None, None)
        lane.generated.append(tok)
        lane.state.generated += 1
        texts.append(res.token.text)
        finishes.append(res.finish)
        assert res.token.finish_reason == res.finish and res.token.index == len(lane.generated) - 1
        if res.finish is not None:
            break
    return "".join(texts), finishes


def test_the_text_is_the_decode_of_the_ids_and_the_budget_ends_it_with_length(tok: Tokenizer) -> None:
    ids = tok.encode_list("hello world", special=False)
    lane = _lane(max_new=len(ids))
    text, finishes = _run(_out(tok), lane, ids)
    assert text == "hello world" == tok.decode(ids)
    assert finishes == [None] * (len(ids) - 1) + ["length"]


def test_an_end_token_ends_it_with_stop_and_outputs_nothing_of_its_own(tok: Tokenizer) -> None:
    out = _out(tok)
    eos = next(t for t in range(8) if out.is_eos(t))
    ids = tok.encode_list("ab", special=False)
    text, finishes = _run(out, _lane(), [*ids, eos, *ids])
    assert text == "ab" and finishes == [None] * len(ids) + ["stop"]


def test_ignore_eos_outputs_an_end_token_as_text(tok: Tokenizer) -> None:
    out = _out(tok)
    eos = next(t for t in range(8) if out.is_eos(t))
    _, finishes = _run(out, _lane(max_new=3, ignore_eos=True), [eos, eos, eos])
    assert finishes == [None, None, "length"]


def test_a_stop_token_id_ends_it_with_stop(tok: Tokenizer) -> None:
    a, b = tok.encode_list("ab", special=False)
    text, finishes = _run(_out(tok), _lane(stop_token_ids=[b]), [a, a, b, a])
    assert text == "aa" and finishes == [None, None, "stop"]


def test_a_stop_string_is_held_back_then_dropped_with_what_follows(tok: Tokenizer) -> None:
    ids = tok.encode_list("ab cd ef", special=False)  # a b ' ' c d ' ' ef
    out, lane = _out(tok), _lane(stop=["cd"])
    res = [out.process(lane, t, None, None) for t in ids[:4]]  # up to the "c" that may begin "cd"
    assert "".join(r.token.text for r in res) == "ab "  # "c" is held back: it may start the stop string
    lane.state.generated = 4
    last = out.process(lane, ids[4], None, None)
    assert last.finish == "stop" and last.token.text == ""


def test_held_text_that_never_completes_the_stop_string_is_released_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode_list("ab c", special=False)
    text, finishes = _run(_out(tok), _lane(max_new=len(ids), stop=["cd"]), ids)
    assert text == "ab c" and finishes[-1] == "length"


def test_bytes_of_a_character_split_over_tokens_join_and_a_cut_one_becomes_u_fffd(tok: Tokenizer) -> None:
    ids = tok.encode_list("é", special=False)
    assert len(ids) == 2  # the tiny vocabulary spells it in two byte tokens
    out = _out(tok)
    lane = _lane()
    first = out.process(lane, ids[0], None, None)
    assert first.token.text == ""  # half a character: held by the decoder
    text, _ = _run(out, _lane(max_new=1), ids[:1])
    assert text == "\ufffd"  # cut by the budget: pending bytes are released as U+FFFD


class _Grammar:
    """A constraint that accepts `allowed` and is finished after `finish_after` tokens."""

    def __init__(self, allowed: set[int], finish_after: int) -> None:
        self.allowed, self.left = allowed, finish_after
        self.error: str | None = None

    def accept(self, tok: int) -> bool:
        if tok not in self.allowed:
            self.error = f"{tok} is not allowed"
            return False
        self.left -= 1
        return True

    def is_finished(self) -> bool:
        return self.left <= 0


def test_a_token_the_grammar_rejects_is_a_typed_error_naming_why(tok: Tokenizer) -> None:
    a, b = tok.encode_list("ab", special=False)
    lane = _lane(constraint=_Grammar({a}, 5))
    with pytest.raises(InvalidRequestError, match=f"token {b} was sampled outside the output grammar: {b} is not"):
        _run(_out(tok), lane, [a, b])


def test_the_grammar_finishing_ends_it_with_stop(tok: Tokenizer) -> None:
    a, _ = tok.encode_list("ab", special=False)
    text, finishes = _run(_out(tok), _lane(constraint=_Grammar({a}, 2)), [a, a, a])
    assert text == "aa" and finishes == [None, "stop"]


def test_final_counts_the_lane_s_prompt_output_and_steps(tok: Tokenizer) -> None:
    lane = _lane()
    lane.generated = [5, 6, 7]
    lane.cached = 1
    lane.submitted_step, lane.admitted_step, lane.first_token_step = 2, 3, 4
    final = OutputProcessor.final(lane, "length", step=9)
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens) == (1, 3, 1)
    t = final.timing
    assert (t.submitted_step, t.admitted_step, t.first_token_step, t.finished_step) == (2, 3, 4, 9)

"""_core/step.py's choices, driven by a `Capabilities` value instead of a library that lacks a
function: which fused call a step takes (`Batch.path`) and which lanes sample in it
(`StepRunner.prepare`). Nothing here reaches the C library (`prepare` marshals the step's inputs
only); the forward itself is the engine's, tested through it (tests/sdk)."""

from __future__ import annotations

from typing import Any

import pytest

from aiobasert import Capabilities, InternalError, SamplingParams
from aiobasert._core.plan import PlannedRow
from aiobasert._core.protocol import RequestSpec, Ticket
from aiobasert._core.request import Request
from aiobasert._core.step import Lane, StepRunner
from aiobasert._ffi import Library


class _Sink:
    def alive(self) -> bool:
        return True

    def deliver(self, *args: Any) -> None:
        raise AssertionError("nothing is delivered here")


def _lane(rid: str, prompt: list[int], **params: Any) -> Lane:
    spec = RequestSpec(rid=rid, prompt=prompt, params=SamplingParams(**params))
    lane = Lane(spec, _Sink(), Ticket(), prompt, max_new=8)  # type: ignore[arg-type]
    lane.seq = 1  # admitted: `prepare` only checks that it has a sequence
    return lane


def _decode(lane: Lane, last: int = 9) -> PlannedRow:
    """Its prompt prefilled and `last` sampled: a decode row feeds it back."""
    lane.state.prefilled = lane.state.prompt_len
    lane.generated.append(last)
    lane.state.generated += 1
    return PlannedRow(lane.state, "decode", 1, samples=True)


def _runner(lib: Library, caps: Capabilities) -> StepRunner:
    return StepRunner(lib, 0, caps, vocab_size=16, stride=64, max_rows=4, token_text=str)


@pytest.mark.parametrize("fused", [True, False])
def test_a_greedy_step_samples_in_the_fused_call_only_where_the_engine_can(lib: Library, fused: bool) -> None:
    runner = _runner(lib, Capabilities(fused_sample=fused))
    lanes = [_lane("a", [3, 4]), _lane("b", [5], temperature=0.7, seed=1)]
    batch, failed = runner.prepare([(lane, _decode(lane, last)) for lane, last in zip(lanes, (4, 5), strict=True)])
    assert failed == [] and [lane.rid for lane, _ in batch.rows] == ["a", "b"]
    assert batch.path() == ("sample" if fused else "logits")
    assert [s is not None for s in batch.samplers] == [fused, fused]  # each lane's sampler rides the call
    assert batch.feed == [4, 5]  # each decode row feeds its lane's last token


def test_a_lane_that_needs_host_logits_takes_the_logits_path_whatever_the_engine(lib: Library) -> None:
    runner = _runner(lib, Capabilities(fused_sample=True))
    plain, host = _lane("plain", [3]), _lane("host", [4], logprobs=True)
    batch, failed = runner.prepare([(plain, _decode(plain)), (host, _decode(host))])
    assert failed == [] and batch.host and batch.path() == "logits"
    assert [s is not None for s in batch.samplers] == [True, False]  # the host lane is sampled on the host


def test_a_prefill_chunk_that_does_not_end_its_prompt_samples_nothing(lib: Library) -> None:
    runner = _runner(lib, Capabilities(fused_sample=True))
    lane = _lane("p", [3, 4, 5, 6])
    batch, _ = runner.prepare([(lane, PlannedRow(lane.state, "prefill", 2, samples=False))])
    assert batch.feed == [3, 4] and batch.samplers == [None] and not batch.sampling


def test_a_lane_not_ready_to_step_fails_alone_before_the_forward(lib: Library) -> None:
    runner = _runner(lib, Capabilities(fused_sample=True))
    ready, orphan = _lane("ready", [3]), _lane("orphan", [4])
    orphan.seq = None  # never admitted: no sequence to feed
    batch, failed = runner.prepare([(orphan, _decode(orphan)), (ready, _decode(ready))])
    assert [lane.rid for lane, _ in batch.rows] == ["ready"]
    (result,) = failed
    assert result.lane is orphan and isinstance(result.error, InternalError)
    assert "not ready to step" in str(result.error.__cause__ or result.error)


def test_lane_state_is_what_the_plan_reads() -> None:
    st = Request(rid="r", prompt_len=5, max_new_tokens=3, prefilled=5, generated=2)
    assert not st.prefilling and st.kv_target == 5
    st.rewind()  # its KV released while paused: prompt + output fed again
    assert st.prefilling and st.kv_target == 7 and st.prefilled == 0

"""`aiobasert.choices.Choices`, n samples of each prompt as one request (`Engine.generate_n`,
`stream_n`, `chat_n`): the choices are the single requests of seeds `seed + i`, usage counts each
prompt once, places are reserved all or none, and the first failure (or a cancel of the reader)
cancels every sibling, counted through `EngineStats`."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

import aiobasert.choices
from aiobasert import ContextLengthExceededError, Engine, EngineOverloadedError, InvalidRequestError, SamplingParams
from aiobasert.models.tiny import SPECIAL_TOKENS

pytestmark = pytest.mark.anyio

NO_END = {t: -100.0 for t in range(len(SPECIAL_TOKENS))}  # no choice ends by itself: it runs until cancelled
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)


async def test_n_choices_are_the_single_requests_of_seed_plus_i(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        choices = await engine.generate_n(LONG_PROMPT, params, n=3)
        singles = [await engine.generate(LONG_PROMPT, msgspec.structs.replace(params, seed=7 + i)) for i in range(3)]
        assert [c.token_ids for c in choices] == [s.token_ids for s in singles]
        assert len({tuple(c.token_ids) for c in choices}) > 1  # each its own seed stream

        # two prompts x 2: prompt-major indices, each prompt counted once, completions summed
        many = engine.stream_n(["Hello", LONG_PROMPT], params, n=2)
        seen: dict[int, list[int]] = {}
        ended = []
        async for event in many:
            if event.token is None:
                ended.append(event.index)
            else:
                seen.setdefault(event.index, []).append(event.token.id)
        done = await many
        assert sorted(ended) == [0, 1, 2, 3]
        assert [seen.get(i, []) for i in range(4)] == [c.token_ids for c in done]
        assert done[2].token_ids == singles[0].token_ids and done[3].token_ids == singles[1].token_ids
        prompts = [done[0].usage.prompt_tokens, done[2].usage.prompt_tokens]
        assert many.usage.prompt_tokens == sum(prompts)
        assert many.usage.completion_tokens == sum(c.usage.completion_tokens for c in done)


async def test_the_first_failure_cancels_the_siblings(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # choice 2 asks for more tokens than the context holds: the engine refuses it at intake, while
    # its siblings run (they could not end by themselves); they are cancelled, and its error raised
    real = aiobasert.choices.sample_params

    def one_bad(params: SamplingParams, i: int) -> SamplingParams:
        return msgspec.structs.replace(real(params, i), max_tokens=10_000) if i == 2 else real(params, i)

    monkeypatch.setattr(aiobasert.choices, "sample_params", one_bad)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=1, logit_bias=NO_END)
    async with Engine.open(tiny_model_path, max_batch_size=4, max_context=256) as engine:
        before = await engine.stats()
        with pytest.raises(ContextLengthExceededError):
            await engine.generate_n("Once upon a time", params, n=4)
        after = await engine.stats()  # answered after the cancels the failure posted
        assert after.requests_cancelled == before.requests_cancelled + 3
        assert after.active_lanes == 0 and after.live_sequences == 0 and after.waiting_requests == 0


async def test_more_choices_than_lanes_all_complete(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        done = await engine.generate_n("Hello", n=5, max_tokens=6, temperature=1.0, seed=2, logit_bias=NO_END)
        assert [c.finish_reason for c in done] == ["length"] * 5
        assert all(len(c.token_ids) == 6 for c in done)


async def test_cancelling_the_reader_frees_every_choice(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=4, max_context=512) as engine:
        before = await engine.stats()
        params = SamplingParams(max_tokens=500, temperature=1.0, seed=3, logit_bias=NO_END)
        running = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def read() -> None:
                async for event in engine.stream_n(["Hello"], params, n=3):
                    if event.token is not None and (await engine.stats()).active_lanes == 3:
                        running.set()  # every choice holds a lane

            tg.start_soon(read)
            await running.wait()
            tg.cancel_scope.cancel()  # from another task
        after = await engine.stats()
        assert after.requests_cancelled == before.requests_cancelled + 3
        assert after.active_lanes == 0 and after.live_sequences == 0


async def test_places_are_reserved_all_or_none(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=1, max_queue=2, prefix_cache=False) as engine:
        with pytest.raises(InvalidRequestError, match="at most 3"):
            await engine.generate_n("Hello", n=4, max_tokens=2)  # 1 lane + 2 queue places: never 4
        with pytest.raises(InvalidRequestError, match="n must be"):
            engine.stream_n(["Hello"], n=0)
        holder = engine.stream("Hello", max_tokens=400, logit_bias=NO_END)
        await anext(holder)  # it holds the lane (read from the stream itself: no loop to leave)
        with pytest.raises(EngineOverloadedError):
            await engine.generate_n("Hello", n=3, max_tokens=2)  # 2 places left: none is queued
        stats = await engine.stats()
        assert stats.waiting_requests == 0 and stats.requests_failed == 0
        await holder.aclose()
        assert len(await engine.generate_n("Hello", n=3, max_tokens=2)) == 3

"""Fair admission (issue 26 item 10, docs/fairness.md): one client holding every lane with
long generations does not starve another client's short request, and preempted requests
resume with the output they would have had. Measured in engine steps, never seconds."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from aiobasert import Completion, Engine, client_scope

pytestmark = pytest.mark.anyio

LONG = 400
PROMPT = "the lamp by the door is on and the cat sleeps under it while rain falls " * 2


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_short_request_is_not_starved_by_long_holders(untied_model_path: Path) -> None:
    async with Engine.open(untied_model_path, max_batch_size=8) as engine:
        greedy = await engine.generate(PROMPT, max_tokens=LONG, ignore_eos=True, temperature=0)
        seeded = await engine.generate(PROMPT, max_tokens=LONG, ignore_eos=True, temperature=0.9, seed=7)
        streamed: dict[int, list[int]] = {}
        longs: dict[int, Completion] = {}

        async def choice(i: int) -> None:  # one of a streamed n=16 request: one client
            with client_scope("fan-out"):
                stream = engine.stream(PROMPT, max_tokens=LONG, ignore_eos=True, temperature=0)
                streamed[i] = [t.id async for t in stream]
                longs[i] = await stream

        async def generation(i: int) -> None:  # eight long generations, each its own client
            sampled = i % 4 == 0
            longs[i] = await engine.generate(PROMPT, max_tokens=LONG, ignore_eos=True,
                                             temperature=0.9 if sampled else 0, seed=7 if sampled else None)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(choice, i)
            for i in range(16, 24):
                tg.start_soon(generation, i)
            # every lane held, each for more steps than the preemption quantum
            start = (await engine.stats()).steps
            while (s := await engine.stats()).active_lanes < 8 or s.steps < start + 40:
                await anyio.sleep(0.005)
            short = await engine.generate("hello", max_tokens=2, temperature=0)

        t = short.timing
        assert len(short.token_ids) == 2
        # Its first token in the next step (it takes back a lane that has sampled since its own
        # admission; one of the few being replayed may be waited for); FIFO: ~1,000 steps.
        assert t.first_token_step - t.submitted_step <= 3, t
        assert t.first_token_step < min(c.timing.finished_step for c in longs.values())
        assert (await engine.stats()).requests_preempted >= 1
        # the preempted requests resumed where they left off: the same output as alone
        for i, done in longs.items():
            want = seeded if i >= 16 and i % 4 == 0 else greedy
            assert done.token_ids == want.token_ids, i
            assert done.usage.prompt_tokens == greedy.usage.prompt_tokens
        assert all(streamed[i] == greedy.token_ids for i in range(16))

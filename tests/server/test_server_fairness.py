"""Fair admission over HTTP (issue 26 item 10, docs/fairness.md): each HTTP request is one
client, so one client's streamed n=16 request and eight long completions cannot starve
another client's 2-token request. Proved by the order requests end in, never by seconds."""

from __future__ import annotations

import functools
from pathlib import Path

import anyio
import httpx
import pytest
from loopback import serving

from aiobasert import Engine
from aiobasert.models.tiny import SPECIAL_TOKENS
from aiobasert.server import create_app

pytestmark = pytest.mark.anyio

NO_END = {str(t): -100 for t in range(len(SPECIAL_TOKENS))}  # every request runs to max_tokens
LONG = 400


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_short_request_ends_before_the_long_holders(untied_model_path: Path) -> None:
    factory = functools.partial(Engine.open, untied_model_path, max_batch_size=8)
    with serving(create_app(factory)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            ended: list[str] = []

            async def fan_out() -> None:  # a streamed n=16 x 400-token request, read to its end
                body = {"prompt": "Once upon a time", "n": 16, "max_tokens": LONG, "stream": True,
                        "temperature": 0.9, "seed": 1, "logit_bias": NO_END}  # fmt: skip
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for _chunk in r.aiter_bytes():
                        pass
                ended.append("n=16")

            async def long(i: int) -> None:
                body = {"prompt": f"A story, part {i}", "max_tokens": LONG, "temperature": 0, "logit_bias": NO_END}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                ended.append(f"long {i}")

            async with anyio.create_task_group() as tg:
                tg.start_soon(fan_out)
                for i in range(8):
                    tg.start_soon(long, i)
                while (await http.get("/v1/internal/stats")).json()["active_lanes"] < 8:  # every lane held
                    await anyio.sleep(0.01)
                r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                ended.append("short")
                # its time to first token in engine steps, as the client reads it (FIFO: hundreds)
                assert 0 <= r.json()["usage"]["first_token_steps"] <= 3, r.json()["usage"]
            # FIFO admission: it waited for eight of the long ones to end first
            assert ended[0] == "short", ended
            stats = (await http.get("/v1/internal/stats")).json()
            assert stats["requests_preempted"] >= 1 and stats["live_sequences"] == 0
            metrics = (await http.get("/metrics")).text
            counted = [line for line in metrics.splitlines() if line.startswith("aiobasert_num_preemptions_total{")]
            assert len(counted) == 1 and float(counted[0].rsplit(" ", 1)[1]) == stats["requests_preempted"]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_usage_reports_the_steps_to_the_first_token(untied_model_path: Path) -> None:
    # The usage extension `first_token_steps`: non-streamed (the latest of n choices), streamed
    # with include_usage, chat and completions; on an idle engine the first token is 1 step away.
    factory = functools.partial(Engine.open, untied_model_path, max_batch_size=2)
    with serving(create_app(factory)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            one = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert one.json()["usage"]["first_token_steps"] == 1, one.json()["usage"]
            # n=3 on 2 lanes: the third choice waits for a lane, so the latest first token is later. Token
            # ids: all three reach the queue together (a text prompt's choices are tokenized on the intake
            # workers, and on a loaded machine the third came after the first two had run their 8 steps)
            three = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "n": 3,
                                                             "logit_bias": NO_END})  # fmt: skip
            assert three.json()["usage"]["first_token_steps"] > 1, three.json()["usage"]
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            usage = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        usage = httpx.Response(200, content=line[6:]).json()["usage"]
            assert usage is not None and usage["first_token_steps"] == 1, usage


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_started_stream_ends_beside_sustained_short_requests(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 37 item 1, as its repro did it: 2 lanes, a long stream read from its 10th token on
    # while 6 closed-loop clients send 8-token requests (each HTTP request its own client). Its
    # 120-token stream got 3 of its 109 tokens in 40 s before (SmolLM2's steps; the tiny model's
    # are so short that the stream here is 400 tokens, for the clients' HTTP round trips to keep
    # the queue full); now it ends by its due step (the SDK test: 2 x work + one short request;
    # here twice that, for the steps the client's reads lag the engine), and the short requests
    # still pass it (more are served meanwhile than under FIFO, measured in the same run).
    served: dict[str, int] = {}
    for mode in ("fifo", "fair"):
        monkeypatch.setenv("AIOBASERT_ADMISSION", mode)
        factory = functools.partial(Engine.open, untied_model_path, max_batch_size=2)
        with serving(create_app(factory)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                count = 0
                body = {"prompt": "A long story", "max_tokens": LONG, "stream": True, "temperature": 0,
                        "logit_bias": NO_END, "stream_options": {"include_usage": True}}  # fmt: skip
                async with anyio.create_task_group() as tg, http.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.aiter_lines()
                    seen = 0
                    while seen < 10:
                        seen += (await lines.__anext__()).startswith('data: {"id"')
                    start = (await http.get("/v1/internal/stats")).json()["steps"]

                    async def client(i: int) -> None:
                        nonlocal count
                        while True:
                            short = {"prompt": f"short {i} {count}", "max_tokens": 8, "logit_bias": NO_END}
                            assert (await http.post("/v1/completions", json=short)).status_code == 200
                            count += 1

                    for i in range(6):
                        tg.start_soon(client, i)
                    usage = None
                    async for line in lines:
                        if line.startswith("data: {") and '"usage":{' in line:
                            usage = httpx.Response(200, content=line[6:]).json()["usage"]
                    took = (await http.get("/v1/internal/stats")).json()["steps"] - start
                    tg.cancel_scope.cancel()
                assert usage is not None and usage["completion_tokens"] == LONG, usage
                assert took <= 2 * (2 * (LONG + 1) + 9), (mode, took)
                served[mode] = count
                stats = (await http.get("/v1/internal/stats")).json()
                assert (stats["requests_preempted"] > 0) == (mode == "fair"), stats
    assert served["fair"] > served["fifo"] > 0, served


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_burst_of_distinct_prompts_takes_fifos_steps(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 37 item 2, as its repro did it: distinct long prompts at once, more than the lanes (it
    # took 462 engine steps fair, 330 FIFO). Two checks, each free of how the requests' arrivals
    # spread over the engine's steps (a loaded machine spreads 24 HTTP requests over tens of steps,
    # and that spread, not the policy, set the step counts of an earlier form of this test):
    # - 24 requests, one per client: requests of like length never take lanes from each other
    #   (nothing is paused), whenever each arrived;
    # - the same 24 prompts in one request, so they reach the engine together: the burst takes
    #   FIFO's steps (the issue allows 5% more), measured in the same run.
    def burst(seed: int) -> list[str]:
        return [" ".join(f"w{(i * 7919 + j * seed) % 1009}" for j in range(150)) for i in range(24)]

    steps: dict[str, int] = {}
    for mode in ("fifo", "fair"):
        monkeypatch.setenv("AIOBASERT_ADMISSION", mode)
        factory = functools.partial(Engine.open, untied_model_path, max_batch_size=8, max_context=1024)
        with serving(create_app(factory)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:

                async def one(p: str | list[str]) -> None:
                    body = {"prompt": p, "max_tokens": 24, "temperature": 0, "logit_bias": NO_END}
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert len(r.json()["choices"]) == (len(p) if isinstance(p, list) else 1)

                async with anyio.create_task_group() as tg:
                    for p in burst(1):
                        tg.start_soon(one, p)
                stats = (await http.get("/v1/internal/stats")).json()
                assert stats["requests_preempted"] == 0 and stats["live_sequences"] == 0, stats
                before = stats["steps"]
                await one(burst(3))  # none of them in the prefix cache
                after = (await http.get("/v1/internal/stats")).json()
                steps[mode] = after["steps"] - before
                assert after["requests_preempted"] == 0 and after["live_sequences"] == 0, after
    assert steps["fair"] <= 1.05 * steps["fifo"], steps

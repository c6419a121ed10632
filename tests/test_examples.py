"""Every script in examples/ runs, on the tiny model, as a user would run it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
from loopback import REPO, start_uvicorn, subprocess_env

from aiobasert.models.tiny import build_tiny_model

EXAMPLES = REPO / "examples"


def run_example(name: str, model: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=subprocess_env(model),
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def summary(out: str) -> dict[str, int]:
    m = re.search(r"(\d+) calls in [\d.]+ s .*: (\d+) ok, (\d+) timed out, (\d+) tokens", out)
    assert m, out
    e = re.search(r"live_sequences=(\d+) requests_finished=(\d+) requests_cancelled=(\d+)", out)
    assert e, out
    keys = ("calls", "ok", "timed_out", "tokens", "live", "finished", "cancelled")
    return dict(zip(keys, map(int, m.groups() + e.groups()), strict=True))


@pytest.mark.parametrize("script", ["agent_fanout.py", "trio_fanout.py"])
def test_fanout(script: str, tiny_model_path: Path) -> None:
    s = summary(run_example(script, tiny_model_path, "--max-tokens", "16"))
    assert s["calls"] == 50 and s["ok"] == 50 and s["timed_out"] == 0
    assert 50 <= s["tokens"] <= 50 * 16
    assert s["live"] == 0 and s["finished"] == 50 and s["cancelled"] == 0


@pytest.mark.parametrize("script", ["agent_fanout.py", "trio_fanout.py"])
def test_fanout_timeouts_free_their_lanes(script: str, tiny_model_path: Path) -> None:
    # 50 calls share 8 lanes: with a 1 ms deadline most of them cannot finish in time.
    s = summary(run_example(script, tiny_model_path, "--timeout", "0.001"))
    assert s["ok"] + s["timed_out"] == 50 and s["timed_out"] > 0
    assert s["live"] == 0 and s["cancelled"] > 0


def test_disconnect_example(tmp_path: Path) -> None:
    # A 16k window, so the abandoned completion would run for seconds: the hang-up always comes first.
    model = build_tiny_model(tmp_path / "long.base", max_position_embeddings=16384)
    out = run_example("disconnect.py", model, "--max-tokens", "16000")
    assert out.count("event ") == 3
    assert "client hung up after 3" in out
    assert re.search(r"live_sequences=0 active_lanes=0 requests_cancelled=1 requests_finished=0", out), out


def test_sse_app_serves_many_clients(tiny_model_path: Path) -> None:
    proc, _, port = start_uvicorn([str(EXAMPLES / "sse_app.py"), "--port", "0"], tiny_model_path)
    try:

        async def client(i: int, results: dict[int, list[dict[str, str]]]) -> None:
            params = {"prompt": f"Story {i}:", "max_tokens": "12"}
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
                http.stream("GET", "/stream", params=params) as r,
            ):
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                results[i] = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]

        async def main() -> dict[int, list[dict[str, str]]]:
            results: dict[int, list[dict[str, str]]] = {}
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(client, i, results)
            return results

        results = anyio.run(main)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert len(results) == 16
    for events in results.values():
        assert events[-1] == {"finish_reason": "length"}
        assert 1 <= len(events) - 1 <= 12 and all(e["text"] for e in events[:-1])

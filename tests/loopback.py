"""Servers on loopback for the tests: an ASGI app run by uvicorn in a thread, or
`python -m ...` serving in a subprocess (its stderr read by `Lines`)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

API_KEY = "sk-test-key"
MODEL_NAME = "tiny"
REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on a free loopback port; yields its base URL.
    Leaving the block stops it (lifespan shutdown included)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "the test server did not stop"


class Lines:
    """Lines of a subprocess's stream, read by a thread so the pipe never fills up."""

    def __init__(self, stream: Any) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self._queue.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s; got {self.seen}") from None
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match


def subprocess_env(model: Path) -> dict[str, str]:
    env = dict(os.environ, AIOBASERT_MODEL=str(model), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def start_uvicorn(args: list[str], model: Path) -> tuple[subprocess.Popen[str], Lines, int]:
    proc = subprocess.Popen(
        [sys.executable, *args], stderr=subprocess.PIPE, text=True, cwd=REPO, env=subprocess_env(model)
    )
    assert proc.stderr is not None
    lines = Lines(proc.stderr)
    try:
        port = int(lines.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", 60).group(1))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, lines, port


def sigterm_and_wait(proc: subprocess.Popen[str], timeout: float) -> bool:
    """SIGTERM `proc` and wait up to `timeout` s for it to exit (True); one still running then is
    killed (False), so no server outlives its test."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return False
    return True

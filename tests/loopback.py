"""Servers on loopback for the tests: an ASGI app run by uvicorn in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

API_KEY = "sk-test-key"
MODEL_NAME = "tiny"


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

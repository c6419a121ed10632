"""Work a request decides is bounded before it is paid, and paid where only that request
waits (issue 26; docs/fairness.md, HTTP): chat rendering off the event loop and capped by
counts checked first, fan-out admission as one atomic reservation, streamed responses bounded
in unsent bytes, and a Responses store that counts the memory it really holds."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from held_calls import HoldLane
from loopback import API_KEY, MODEL_NAME, serving, start_uvicorn

import aiobasert.tools._render
from aiobasert import Engine
from aiobasert.chat import MAX_CHAT_MESSAGES
from aiobasert.errors import InvalidConfigError
from aiobasert.models.tiny import SPECIAL_TOKENS, build_tiny_model
from aiobasert.server import create_app
from aiobasert.server.app import build_app
from aiobasert.server.provider import SingleEngineProvider
from aiobasert.testing import HeldLane
from aiobasert.tools import MAX_TOOLS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
NO_END = {str(t): -100 for t in range(len(SPECIAL_TOKENS))}
"""logit_bias that keeps a generation from ending before max_tokens."""
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The thread of every chat render (aiobasert.tools' template render, which every chat
    the server prepares goes through)."""
    seen: list[threading.Thread] = []
    real = aiobasert.tools._render.render_with_sentinels

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(aiobasert.tools._render, "render_with_sentinels", spy)
    return seen


def _loop_thread() -> threading.Thread:
    """The thread the served app's event loop runs in (tests/loopback.py's `serving`)."""
    return next(t for t in threading.enumerate() if t.name == "test-uvicorn")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_rendering_runs_off_the_event_loop(
    http: httpx.Client, renders: list[threading.Thread], stream: bool
) -> None:
    # Rendering costs what the request decides (every message and tool through the template):
    # on the event loop it froze every other client's stream for seconds (issue 26 item 2).
    loop = _loop_thread()
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}] * 40
    bodies = [
        ("/v1/chat/completions", {"messages": messages[:1], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "n": 2}),
        ("/v1/chat/completions", {"messages": messages[:1], "tools": [TOOL], "max_tokens": 2}),
        ("/v1/responses", {"input": "hello", "max_output_tokens": 2}),
    ]
    for path, body in bodies:
        r = http.post(path, json={"model": MODEL_NAME, "stream": stream, **body})
        assert r.status_code == 200, r.text
    assert len(renders) >= len(bodies)
    assert loop not in renders, [t.name for t in renders]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1)},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(MAX_TOOLS + 1)],
            },
            "tools",
        ),
        ("/v1/responses", {"input": [{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1)}, "input"),
        (
            "/v1/responses",
            {"input": "x", "tools": [{"type": "function", "name": f"t{i}"} for i in range(MAX_TOOLS + 1)]},
            "tools",
        ),
    ],
)
def test_chat_counts_are_refused_before_anything_is_rendered(
    http: httpx.Client, renders: list[threading.Thread], path: str, body: dict[str, Any], param: str
) -> None:
    # 150,000 tiny messages were rendered (seconds, on the loop) only to be refused as too long;
    # 3,000 tools took 15 s to refuse. A count is checked first, naming the field.
    r = http.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **body} if "messages" in body
                  else {"model": MODEL_NAME, "max_output_tokens": 2, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "at most" in error["message"], error
    assert renders == []


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "messages"), ("/v1/responses", "input")])
def test_a_chat_is_counted_before_its_messages_are_decoded(http: httpx.Client, path: str, field: str) -> None:
    # Decoding 150,000 messages into structs is 0.3 s on the event loop: a large body's lists are
    # counted first (as raw JSON). The proof of the order: a message that does not even decode
    # (its role is a number) is not what the 400 is about; the count is.
    messages: list[dict[str, Any]] = [{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1)
    messages[3] = {"role": 5, "content": "x"}
    r = http.post(path, json={"model": MODEL_NAME, field: messages})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"at most {MAX_CHAT_MESSAGES}" in error["message"], error


# ---- fan-out admission: one atomic reservation ------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_concurrent_fan_outs_are_served_whole_or_refused_with_nothing_queued(
    tiny_model_path: Path, stream: bool
) -> None:
    # Two overlapping n=4 requests both passed a stale check of the queue; the second was then
    # refused 503 after its choices were queued (and cancelled). Admission is now one reservation
    # of every place on the engine thread: each request runs whole or is refused before any work.
    factory = functools.partial(Engine.open, tiny_model_path, max_batch_size=2, max_queue=5)
    n, clients = 4, 8
    with serving(create_app(factory, api_key=API_KEY, model_name=MODEL_NAME)) as url:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
            before = (await http.get("/v1/internal/stats")).json()
            statuses: list[int] = []

            async def one(i: int) -> None:
                body = {"model": MODEL_NAME, "prompt": f"request {i} " * 40, "n": n, "max_tokens": 24,
                        "temperature": 1.0, "seed": i, "stream": stream}  # fmt: skip
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    raw = await r.aread()
                statuses.append(r.status_code)
                if r.status_code == 200:
                    text = raw.decode()
                    if stream:
                        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
                        ends = {c["index"] for line in text.splitlines() if line.startswith("data: {")
                                for c in json.loads(line[6:])["choices"] if c["finish_reason"]}  # fmt: skip
                    else:
                        ends = {c["index"] for c in json.loads(text)["choices"] if c["finish_reason"]}
                    assert ends == set(range(n)), text[-300:]
                else:
                    assert r.status_code == 503, raw
                    assert json.loads(raw)["error"]["code"] == "engine_overloaded"

            async with anyio.create_task_group() as tg:
                for i in range(clients):
                    tg.start_soon(one, i)
            after = (await http.get("/v1/internal/stats")).json()
    assert len(statuses) == clients and 200 in statuses, statuses
    # A refusal queued nothing: no choice was cancelled or failed for it.
    assert after["requests_cancelled"] == before["requests_cancelled"], (statuses, after)
    assert after["requests_failed"] == before["requests_failed"], (statuses, after)


# ---- trickle readers: streamed responses bounded in unsent bytes ----------------------------------


TRICKLE_CONTEXT = 32768


@pytest.fixture(scope="module")
def trickle_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 32k window: a generation that runs longer than the test needs."""
    return build_tiny_model(
        tmp_path_factory.mktemp("trickle") / "trickle.base", max_position_embeddings=TRICKLE_CONTEXT
    )


def _raw_stream(port: int, body: dict[str, Any]) -> socket.socket:
    """POST a streamed request on a socket with a 32 KB receive buffer (to be read slowly)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    return sock


def test_a_trickle_reader_is_dropped_and_its_generation_cancelled(trickle_model_path: Path) -> None:
    # A client that keeps taking bytes (so no write waits the write timeout, the default 30 s)
    # but slower than its generation left every unsent token buffered, the memory growing at the
    # engine's token rate until max_tokens (issue 26 item 6). Its backlog is now bounded: over
    # max_unsent_bytes and not shrinking for the backlog window (here 2 s; by default the write
    # timeout), the client is dropped and its generation cancelled, long before it could end.
    factory = functools.partial(Engine.open, trickle_model_path, max_batch_size=2, max_context=TRICKLE_CONTEXT)
    app, service = build_app(SingleEngineProvider(factory, model_name=MODEL_NAME), api_key=API_KEY,
                             write_timeout=30.0)  # fmt: skip
    service.backlog.max_unsent_bytes, service.backlog.timeout_s = 64 * 1024, 2.0
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": TRICKLE_CONTEXT - 256,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
        "logit_bias": NO_END,
    }  # fmt: skip  (~1.6 KB an event, never an early end)
    with serving(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        before = http.get("/v1/internal/stats").json()
        sock = _raw_stream(int(url.rsplit(":", 1)[1]), body)
        received = 0
        try:
            sock.settimeout(30)
            reads = 0
            # up to ~320 KB/s: enough for every write to go through well within the write timeout
            # (the kernel wakes a writer once half its send buffer, a few MB at most, is free), and
            # slower than the generation (~1.6 KB a token, hundreds of tokens a second)
            while chunk := sock.recv(16384):
                received += len(chunk)
                reads += 1
                time.sleep(0.05)
                if reads % 10:
                    continue
                s = http.get("/v1/internal/stats").json()
                if s["requests_cancelled"] > before["requests_cancelled"] or s["requests_finished"] > before[
                        "requests_finished"]:  # fmt: skip
                    break
        finally:
            sock.close()
        after = http.get("/v1/internal/stats").json()
    print(f"the trickle reader got {received} bytes before it was dropped")
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1, after
    assert after["requests_finished"] == before["requests_finished"], after  # cut long before max_tokens


# ---- the request's head (line and headers): bounded in bytes and in time, before the API key -------


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def _answer(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (b"" if it reset it)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_request_head_is_bounded_in_bytes_and_in_time(tiny_model_path: Path, parser: str) -> None:
    """`aiobasert serve` (an API key set): one never-ending header line is cut off after about
    --max-header-bytes, answered 431 (or reset) before any key is looked at, and the server's memory
    does not grow by what was sent; a head that stops half-way is answered 408 once --header-timeout
    passes, a connection that sends nothing is closed; a head just under the bound is served."""
    proc, _, port = start_uvicorn(
        ["-m", "aiobasert", "serve", str(tiny_model_path), "--port", "0", "--api-key", API_KEY, "--http", parser,
         "--max-header-bytes", "65536", "--header-timeout", "2"],
        tiny_model_path,
    )  # fmt: skip
    try:
        # a head just under the bound passes the parser and meets the API key
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"X-Pad": "p" * 60_000})
        assert r.status_code == 401
        before = _rss_bytes(proc.pid)
        sent, cap = 0, 64 * 2**20
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Junk: ")
            try:
                while sent < cap:
                    sock.sendall(b"a" * 2**20)
                    sent += 2**20
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = _answer(sock)
        grown = _rss_bytes(proc.pid) - before
        # cut off: what went in were the bytes up to the bound and what the two sockets' buffers held
        assert sent < 24 * 2**20, sent
        assert grown < 8 * 2**20, (grown, sent)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]

        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # and nothing more
            assert _answer(sock).startswith(b"HTTP/1.1 408 ")
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            assert _answer(sock) == b""  # nothing sent: closed
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # the server serves on
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- SSE keep-alive: a queued or paused stream sends comments, so proxies keep it ----------------------

_STREAMED: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
]


@pytest.mark.parametrize(("path", "body"), _STREAMED, ids=["chat", "completions", "responses"])
def test_a_queued_stream_sends_keepalive_comments(tiny_model_path: Path, hold_lane: HoldLane, path: str,
                                                  body: dict[str, Any]) -> None:  # fmt: skip
    """Every lane held (one, by `hold_lane`) and a keep-alive of 50 ms: a streamed request waiting for
    the lane gets `: keep-alive` comments before its first event (the response starts with one), then
    its events; the official client, reading comments among the events, parses the stream whole."""
    from openai import OpenAI

    opened: list[tuple[Engine, asyncio.AbstractEventLoop]] = []

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[Engine]:
        async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
            opened.append((engine, asyncio.get_running_loop()))
            yield engine

    app, _ = build_app(SingleEngineProvider(factory, model_name=MODEL_NAME), api_key=API_KEY, sse_keepalive=0.05)
    with serving(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        ((engine, loop),) = opened

        def hold() -> HeldLane:  # on the server's loop, where the engine lives
            return asyncio.run_coroutine_threadsafe(hold_lane(engine), loop).result(60)

        held = hold()
        raw = b""
        with http.stream("POST", path, json={"model": MODEL_NAME, "stream": True, **body}) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()
            while b"data:" not in raw:
                raw += next(chunks)
                if raw.count(b": keep-alive\n\n") >= 2:  # queued a while, and said so
                    held.release()
            raw += b"".join(chunks)
        assert raw.startswith(b": keep-alive\n\n") and raw.index(b": keep-alive") < raw.index(b"data:")
        events = [e for e in raw.split(b"\n\n") if e and not e.startswith(b":")]
        assert all(e.startswith((b"data: ", b"event: ")) for e in events), events

        held = hold()
        client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        if path == "/v1/chat/completions":
            stream: Any = client.chat.completions.create(model=MODEL_NAME, stream=True, **body)
        elif path == "/v1/completions":
            stream = client.completions.create(model=MODEL_NAME, stream=True, **body)
        else:
            stream = client.responses.create(model=MODEL_NAME, stream=True, **body)
        held.release()  # the response has started: its first bytes were a comment
        kinds = [getattr(chunk, "type", None) or chunk.object for chunk in stream]
        assert kinds and kinds[-1] in ("chat.completion.chunk", "text_completion", "response.incomplete",
                                       "response.completed"), kinds  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"write_timeout": -5}, "write_timeout must be >= 0"),
        ({"write_timeout": float("nan")}, "write_timeout must be >= 0"),
        ({"sse_keepalive": -1}, "sse_keepalive must be >= 0"),
        ({"response_store_bytes": -1}, "response_store_bytes must be >= 0"),
    ],
)
def test_create_app_refuses_negative_bounds(tiny_model_path: Path, options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        create_app(tiny_model_path, **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_header_bytes": 10}, "max_header_bytes must be an integer >= 1024"),
        ({"header_timeout": -1.0}, "header_timeout must be >= 0"),
        ({"http": "h2"}, "http must be 'auto', 'httptools' or 'h11'"),
    ],
)
def test_bounded_http_protocol_refuses_bad_bounds(options: dict[str, Any], message: str) -> None:
    from aiobasert.server import bounded_http_protocol

    with pytest.raises(InvalidConfigError, match=message):
        bounded_http_protocol(**options)

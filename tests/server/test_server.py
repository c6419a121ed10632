"""The OpenAI-compatible server, end to end over HTTP on the tiny model.

A uvicorn server runs in a background thread for the module; the official
`openai` client and raw httpx talk to it. The shutdown test runs `aiobasert
serve` as a subprocess and sends it SIGTERM.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import openai
import pytest
from loopback import API_KEY, MODEL_NAME, serving, start_uvicorn
from openai import AsyncOpenAI, OpenAI

from aiobasert import Engine, EngineConfig, InvalidConfigError
from aiobasert.models.tiny import SPECIAL_TOKENS, build_tiny_model
from aiobasert.server import create_app

LONG_CONTEXT = 16384


@pytest.fixture(scope="module")
def served_model(long_model_path: Path) -> Path:
    return long_model_path


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"api_key": API_KEY, "model_name": MODEL_NAME, "max_batch_size": 4, "max_context": LONG_CONTEXT}


@pytest.fixture(scope="module")
def long_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 16k window: room for a stream longer than every socket buffer."""
    return build_tiny_model(tmp_path_factory.mktemp("long") / "long.base", max_position_embeddings=LONG_CONTEXT)


# A streaming request whose events (~2.5 KB each, with 20 logprobs) add up to far more than the
# kernel and uvicorn buffer: a client that does not read keeps it in flight (its lane paused).
LONG_STREAM = {"prompt": "Hello", "max_tokens": 16000, "temperature": 0, "stream": True, "logprobs": 20}
RESPONSES_STREAM = {"input": "Hello", "max_output_tokens": 16000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


def stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/v1/internal/stats")
    assert r.status_code == 200
    result: dict[str, Any] = r.json()
    return result


def wait_idle(http: httpx.Client, timeout: float = 5.0) -> dict[str, Any]:
    """Engine stats once nothing is queued, running or live (or the last snapshot at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(http)
        idle = s["live_sequences"] == 0 and s["active_lanes"] == 0 and s["waiting_requests"] == 0
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


# ---- completions --------------------------------------------------------------------------


def test_completion_matches_its_stream(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    (choice,) = whole.choices
    assert choice.finish_reason == "length"
    assert choice.text
    assert whole.model == MODEL_NAME and whole.object == "text_completion"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_completion_stop_string(client: OpenAI) -> None:
    text = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=16, temperature=0).choices[0].text
    stop = text[-3:]
    (choice,) = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=16, temperature=0, stop=[stop]
    ).choices
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]


def test_completion_token_id_prompt_and_seed(client: OpenAI) -> None:
    ids = [5, 17, 42, 99]
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    sampled = [
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=8, temperature=1.0, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_completion_logprobs(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0
        assert 1 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
    assert lp.text_offset is not None and lp.text_offset == sorted(lp.text_offset)


# ---- chat ---------------------------------------------------------------------------------


def test_chat_matches_its_stream(client: OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    (choice,) = whole.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert whole.object == "chat.completion"
    assert whole.usage is not None and whole.usage.completion_tokens == 10

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in choices) == choice.message.content
    assert choices[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in choices[:-1])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_logprobs_and_content_parts(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    for entry in lp.content:
        assert len(entry.top_logprobs) == 2
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


@pytest.mark.anyio
async def test_concurrent_streams_are_batch_invariant(base_url: str) -> None:
    """Identical greedy requests streamed together (sharing the engine's lanes) agree."""
    texts: list[str] = []

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as aclient:

        async def one() -> None:
            stream = await aclient.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "Count with me"}],
                max_tokens=24,
                temperature=0,
                stream=True,
            )
            texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(one)
    assert len(texts) == 6 and texts[0] and len(set(texts)) == 1


# ---- models, embeddings, health -------------------------------------------------------------


def test_models(client: OpenAI, http: httpx.Client) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "aiobasert"
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_embeddings(client: OpenAI, http: httpx.Client) -> None:
    r = client.embeddings.create(model=MODEL_NAME, input=["a cat", "a dog", "a cat"])  # the client asks for base64
    vectors = [np.array(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2]
    assert all(v.shape == (64,) for v in vectors)  # the tiny model's dim
    assert np.array_equal(vectors[0], vectors[2]) and not np.array_equal(vectors[0], vectors[1])
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens

    floats = http.post("/v1/embeddings", json={"input": "a cat", "encoding_format": "float"}).json()
    np.testing.assert_allclose(np.array(floats["data"][0]["embedding"]), vectors[0], rtol=1e-6)


def test_health_needs_no_key(base_url: str) -> None:
    r = httpx.get(f"{base_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", b"{not json", None, "not valid JSON"),
        ("/v1/completions", {"max_tokens": 4}, None, "prompt"),
        ("/v1/completions", {"prompt": 5}, "prompt", "Expected"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be in"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo", "not supported"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
        ("/v1/completions", {"prompt": [1, 10**6]}, None, "token id"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 20000}, "messages", "maximum context length is"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 20000, "stream": True}, "messages", "maximum context"),
        ("/v1/chat/completions", {"messages": []}, "messages", "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": " ".join(map(str, range(9000)))}], "stream": True},
            "messages",
            "maximum context length is",
        ),
        ("/v1/embeddings", {"input": []}, "input", "empty"),
    ],
)
def test_bad_requests_are_400(http: httpx.Client, path: str, body: Any, param: str | None, message: str) -> None:
    before = stats(http)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]
    after = wait_idle(http)
    assert after["live_sequences"] == 0 and after["requests_finished"] == before["requests_finished"]


def test_context_error_code_through_the_client(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=20000)
    assert info.value.code == "context_length_exceeded"
    # openai 3.x keeps only the message in the exception text; LangChain finds the code there
    assert "context_length_exceeded" in str(info.value)


@pytest.mark.parametrize(
    ("path", "prefix", "suffix", "param"),
    [
        (
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"x"}],"max_tokens":2,'
            '"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":',
            "}}}",
            "response_format.json_schema.schema.a",
        ),
        (
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"tools":[{"type":"function",'
            '"function":{"name":"f","parameters":',
            "}}]}",
            "tools.0.function.parameters",
        ),
        (
            "/v1/responses",
            '{"input":"x","max_output_tokens":2,"text":{"format":{"type":"json_schema","name":"n","schema":',
            "}}}",
            "text.format.schema.a",
        ),
    ],
)
def test_deeply_nested_json_is_a_400_naming_the_field(
    http: httpx.Client, path: str, prefix: str, suffix: str, param: str
) -> None:
    # ~2,000 levels: past the JSON decoder's own recursion (a 500 and a logged traceback before)
    deep = '{"a":' * 2000 + "1" + "}" * 2000
    r = http.post(path, content=prefix + deep + suffix, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "nests JSON deeper" in error["message"], error
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200  # still serving


def test_unknown_fields_are_refused_naming_them(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}, "user": "u"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    no_end = {str(t): -100 for t in range(len(SPECIAL_TOKENS))}  # sampled: it must not end by itself
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "u", "logit_bias": no_end})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_api_key_is_required(base_url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with (
        OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()


def test_the_bearer_scheme_is_case_insensitive(base_url: str) -> None:
    """RFC 6750 / RFC 7235: the auth scheme is case-insensitive."""
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(
            f"{base_url}/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Authorization": f"{scheme} {API_KEY}"},
        )
        assert r.status_code == 200, (scheme, r.text)
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Basic {API_KEY}"})
    assert r.status_code == 401


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ],
)
def test_a_body_not_declared_json_is_415(http: httpx.Client, content_type: str | None) -> None:
    """A web page may POST these to any origin without a CORS preflight (a "simple
    request"): served, they would let any page drive a local server with no API key."""
    before = stats(http)
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    request = http.build_request("POST", "/v1/completions", content=body, headers=headers)
    assert request.headers.get("Content-Type") == content_type
    r = http.send(request)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert stats(http)["requests_finished"] == before["requests_finished"]
    ok = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}}}},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#/nope"}}}},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [
                    {"type": "function", "function": {"name": "f"}},
                    {
                        "type": "function",
                        "function": {
                            "name": "g",
                            "parameters": {"type": "object", "properties": {"a": {"type": "frob"}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        (
            "/v1/responses",
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "frob"}}}},
            "text.format.schema",
        ),
        (
            "/v1/responses",
            {
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "frob"}}},
                    }
                ]
            },
            "tools[0].parameters",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_schema_errors_name_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, stream: bool
) -> None:
    """A schema the grammar cannot enforce is a 400 naming its field, in words of the
    request (not the grammar's rules and source)."""
    prompt = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"input": "x"}
    r = http.post(path, json={**prompt, **body, "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    for internal in ("%json", "args_", "call_0", "x-guidance", "\n"):
        assert internal not in error["message"], error


# ---- disconnects and shutdown ---------------------------------------------------------------


def test_client_disconnect_frees_the_lane(http: httpx.Client) -> None:
    before = wait_idle(http)
    body = {"prompt": "Once upon a time", "max_tokens": 16000, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                events += 1
                if events == 2:
                    break
    # The body was not read to the end: closing the response closed the connection.
    after = wait_idle(http)
    assert after["live_sequences"] == 0 and after["active_lanes"] == 0
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["requests_finished"] == before["requests_finished"]


def raw_stream_request(port: int, body: dict[str, Any], path: str = "/v1/completions") -> socket.socket:
    """POST a streaming request on a socket with a small receive buffer, to be read later (or never)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_sigterm_ends_streams_cleanly_and_exits(long_model_path: Path) -> None:
    args = ["-m", "aiobasert", "serve", "--port", "0", "--max-context", str(LONG_CONTEXT)]
    proc, _, port = start_uvicorn(args, long_model_path)
    try:
        reader, stuck = raw_stream_request(port, LONG_STREAM), raw_stream_request(port, LONG_STREAM)
        # and a Responses stream, read as it comes
        responder = raw_stream_request(port, RESPONSES_STREAM, "/v1/responses")
        responded = bytearray()

        def read_responses() -> None:
            responder.settimeout(30)
            while chunk := responder.recv(65536):
                responded.extend(chunk)

        responses_reader = threading.Thread(target=read_responses, daemon=True)
        responses_reader.start()
        reader.settimeout(10)
        received = bytearray(reader.recv(4096))
        assert received.startswith(b"HTTP/1.1 200")
        time.sleep(0.2)
        sent_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while chunk := reader.recv(65536):  # the server closes the connection when the stream ends
            received += chunk
        proc.wait(timeout=30)  # a hang guard, not a speed check: a server that hangs fails here
        elapsed = time.monotonic() - sent_at
        responses_reader.join(30)
        reader.close()
        stuck.close()
        responder.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Measured, not asserted (machines here are noisy): ~0.2 s; by design it is bounded by the
    # abort of in-flight streams plus the 1 s cut-off for a client that never reads.
    print(f"server exited {elapsed:.2f} s after SIGTERM")
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful exit
    tail = bytes(received[-600:])
    assert b'"code":"aborted"' in tail, tail  # the in-flight stream ended with an error event ...
    assert tail.rstrip().endswith(b"data: [DONE]\n\n\r\n0"), tail  # ... then [DONE] and the last HTTP chunk
    # The Responses stream ended as OpenAI ends a failed response: `error`, then `response.failed`.
    events = re.findall(rb"^event: (\S+)", bytes(responded), re.M)
    assert events[:2] == [b"response.created", b"response.in_progress"], events[:4]
    assert events[-2:] == [b"error", b"response.failed"], events[-4:]
    failed = json.loads(bytes(responded).rsplit(b"data: ", 1)[1].split(b"\n")[0])
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "aborted"


def test_full_queue_is_503_and_queued_disconnects_are_cancelled(long_model_path: Path) -> None:
    factory = functools.partial(Engine.open, long_model_path, max_batch_size=1, max_queue=1, max_context=LONG_CONTEXT)
    with serving(create_app(factory)) as url, httpx.Client(base_url=url, timeout=30) as http:
        port = int(url.rsplit(":", 1)[1])

        def wait_for(key: str) -> None:
            deadline = time.monotonic() + 10
            while stats(http)[key] < 1:
                assert time.monotonic() < deadline, stats(http)
                time.sleep(0.01)

        running = raw_stream_request(port, LONG_STREAM)  # holds the only lane: its client reads nothing
        wait_for("active_lanes")
        queued = raw_stream_request(port, LONG_STREAM)
        wait_for("waiting_requests")
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_overloaded" and r.headers["retry-after"] == "1"
        assert http.get("/v1/models").json()["data"][0]["id"] == long_model_path.stem
        running.close()
        queued.close()  # hangs up while waiting for a lane, before any byte of its response
        after = wait_idle(http)
        assert after["live_sequences"] == 0 and after["waiting_requests"] == 0
        assert after["requests_cancelled"] == 2 and after["requests_finished"] == 0


# ---- fairness: no request can stall, starve or kill the others (docs/fairness.md) -----------------

# Special tokens (EOS included) banned: a generation runs to max_tokens, whatever the random weights say.
NO_END = {str(t): -100 for t in range(len(SPECIAL_TOKENS))}


def test_streamed_n_beyond_the_lanes_runs_every_choice(base_url: str, http: httpx.Client) -> None:
    # 8 choices on 4 lanes, each longer than a stream's 256-token buffer: the writer must
    # forward the running choices while the others wait in the queue (it used to wait for
    # every choice's first token: the first 4 filled their buffers, paused holding every
    # lane, and the request never started nor ended).
    n, max_tokens = 8, 300
    with OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt="Once upon a time",
                n=n,
                max_tokens=max_tokens,
                temperature=1.0,
                seed=3,
                logit_bias=NO_END,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    finish = {c.index: c.finish_reason for c in ends}
    assert finish == {i: "length" for i in range(n)}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == n * max_tokens
    after = wait_idle(http)
    assert after["live_sequences"] == 0 and after["active_lanes"] == 0


def test_a_client_that_stops_reading_is_dropped_and_frees_its_lane(long_model_path: Path) -> None:
    # Every lane held by clients that never read (small receive buffers, streams far longer
    # than every socket buffer; one of them with 2 choices): with a write timeout they are
    # dropped, their generations cancelled, and a normal client is served; without one it
    # would wait forever.
    factory = functools.partial(Engine.open, long_model_path, max_batch_size=3, max_context=LONG_CONTEXT)
    with serving(create_app(factory, write_timeout=1.0)) as url, httpx.Client(base_url=url, timeout=60) as http:
        port = int(url.rsplit(":", 1)[1])
        before = wait_idle(http)
        stuck = [raw_stream_request(port, LONG_STREAM), raw_stream_request(port, {**LONG_STREAM, "n": 2})]
        try:
            deadline = time.monotonic() + 30
            while stats(http)["active_lanes"] < 3:
                assert time.monotonic() < deadline, stats(http)
                time.sleep(0.01)
            r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
            after = wait_idle(http, timeout=60)
            assert after["requests_cancelled"] == before["requests_cancelled"] + 3
            assert after["live_sequences"] == 0 and after["active_lanes"] == 0
            for sock in stuck:  # each got a cut stream: what was buffered, then the connection closed
                sock.settimeout(30)
                received = bytearray()
                while chunk := sock.recv(1 << 20):
                    received += chunk
                assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
        finally:
            for sock in stuck:
                sock.close()


@pytest.fixture(scope="module")
def queue_of_two(long_model_path: Path) -> Iterator[str]:
    """A server with 1 lane and a queue of 2 (3 requests at once at most), no write timeout: the
    fan-out bound is read from `engine.config`, the EngineConfig create_app was given."""
    config = EngineConfig(max_batch_size=1, max_queue=2, max_context=LONG_CONTEXT)
    with serving(create_app(long_model_path, config=config, write_timeout=None)) as url:
        yield url


def test_create_app_takes_a_config_for_a_model_path_only(tiny_model_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="max_batch_size"):  # checked at once, not at startup
        create_app(tiny_model_path, config=EngineConfig(max_batch_size=0))
    with pytest.raises(InvalidConfigError, match="max_context"):  # given twice: refused, not dropped
        create_app(tiny_model_path, config=EngineConfig(), max_context=64)
    factory = functools.partial(Engine.open, tiny_model_path)
    with pytest.raises(InvalidConfigError, match="EngineFactory"):  # a factory opens its own engine
        create_app(factory, config=EngineConfig())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "a", "n": 4, "max_tokens": 2, "stream": True}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 2}, "n"),
        ("/v1/embeddings", {"input": ["a", "b", "c", "d"]}, "input"),
    ],
)
def test_fan_out_past_lanes_and_queue_is_refused_before_any_work(
    queue_of_two: str, path: str, body: dict[str, Any], param: str
) -> None:
    with httpx.Client(base_url=queue_of_two, timeout=60) as http:
        before = wait_idle(http)
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "at most 3" in r.json()["error"]["message"]
        after = wait_idle(http)
        assert after["requests_finished"] == before["requests_finished"]  # nothing ran
        assert after["requests_failed"] == before["requests_failed"]


def test_fan_out_without_room_in_the_queue_is_503_before_any_work(queue_of_two: str) -> None:
    with httpx.Client(base_url=queue_of_two, timeout=60) as http:
        port = int(queue_of_two.rsplit(":", 1)[1])
        before = wait_idle(http)
        holder = raw_stream_request(port, LONG_STREAM)  # holds the lane: its client reads nothing
        deadline = time.monotonic() + 10
        while stats(http)["active_lanes"] < 1:
            assert time.monotonic() < deadline, stats(http)
            time.sleep(0.01)
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})  # 2 places left
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_overloaded" and r.headers["retry-after"] == "1"
        s = stats(http)
        assert s["waiting_requests"] == 0  # none of the three was queued
        holder.close()
        after = wait_idle(http)
        assert after["requests_finished"] == before["requests_finished"]
        assert after["requests_cancelled"] == before["requests_cancelled"] + 1  # the holder only

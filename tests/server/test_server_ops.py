"""Operator basics: `aiobasert serve MODEL` (positional), --served-model-name,
AIOBASERT_API_KEY, --log-level and the log lines (startup, every refused or failed
request), CORS, X-Request-Id, /tokenize, /detokenize, /version, and n > 1 sharing
the prompt's KV through the prefix cache."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import httpx
import pytest
from faults import failing_step
from hypothesis import given, settings
from hypothesis import strategies as st
from loopback import MODEL_NAME, REPO, start_uvicorn, subprocess_env
from openai import OpenAI

import aiobasert
from aiobasert import Engine, SamplingParams
from aiobasert.models.tiny import SPECIAL_TOKENS
from aiobasert.server._malloc import SERVER_ARENAS

ORIGIN = "http://app.example"
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"api_key": "k", "model_name": MODEL_NAME, "max_batch_size": 4, "allowed_origins": [ORIGIN]}


def test_request_id_is_echoed_or_generated(base_url: str) -> None:
    h = {"Authorization": "Bearer k"}
    r = httpx.get(f"{base_url}/v1/models", headers={**h, "X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    a, b = (httpx.get(f"{base_url}/v1/models", headers=h).headers["x-request-id"] for _ in range(2))
    assert a and b and a != b
    assert httpx.get(f"{base_url}/v1/models").headers["x-request-id"]  # also on a 401


def _lines_of(caplog: pytest.LogCaptureFixture, request_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aiobasert.server" and f"request_id={request_id}:" in r.getMessage()]


def test_refused_and_failed_requests_are_logged_with_their_reason(
    base_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One line per refused (INFO) or failed (WARNING) request: status, type, code, param and
    the request id; none for a request that succeeds."""
    caplog.set_level(logging.INFO, logger="aiobasert.server")
    h = {"Authorization": "Bearer k"}
    with httpx.Client(base_url=base_url, timeout=30) as http:
        assert http.get("/v1/models", headers={"X-Request-Id": "no-key"}).status_code == 401
        bad = http.post("/v1/completions", headers={**h, "X-Request-Id": "bad-field"},
                        json={"model": MODEL_NAME, "prompt": "x", "logprobs": 50})  # fmt: skip
        assert bad.status_code == 400
        ok = http.post("/v1/completions", headers={**h, "X-Request-Id": "fine"},
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200
        with failing_step(1):
            failed = http.post("/v1/completions", headers={**h, "X-Request-Id": "engine-fault"},
                               json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})  # fmt: skip
        assert failed.status_code == 500
        with failing_step(3):  # after the first token: an error event in a 200 stream
            body = {
                "model": MODEL_NAME,
                "prompt": "x",
                "max_tokens": 20,
                "stream": True,
                "logit_bias": {str(t): -100 for t in range(len(SPECIAL_TOKENS))},
            }
            with http.stream("POST", "/v1/completions", json=body, headers={**h, "X-Request-Id": "mid-stream"}) as r:
                assert r.status_code == 200
                assert any('"engine_error"' in line for line in r.iter_lines())

    (no_key,) = _lines_of(caplog, "no-key")
    assert no_key.levelno == logging.INFO
    assert re.match(r"refused GET /v1/models: 401 type=invalid_request_error code=invalid_api_key param=None ",
                    no_key.getMessage())  # fmt: skip
    (field,) = _lines_of(caplog, "bad-field")
    assert field.levelno == logging.INFO
    assert re.match(r"refused POST /v1/completions: 400 type=invalid_request_error code=None param=logprobs "
                    r"request_id=bad-field: logprobs must be in \[0, 20\], got 50$", field.getMessage())  # fmt: skip
    assert _lines_of(caplog, "fine") == []
    (fault,) = _lines_of(caplog, "engine-fault")
    assert fault.levelno == logging.WARNING
    assert fault.getMessage().startswith("failed POST /v1/completions: 500 type=server_error code=engine_error ")
    (mid,) = _lines_of(caplog, "mid-stream")
    assert mid.levelno == logging.WARNING
    assert mid.getMessage().startswith("failed POST /v1/completions: 500 in-band type=server_error code=engine_error ")


# Characters that end a line (or that a log viewer acts on) in some reader: C0, DEL, C1, U+2028/2029.
_LINE_BREAKERS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def test_client_text_cannot_forge_or_flood_a_log_line(base_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A path with %0a (a 401), a JSON field name with a newline (a 400), a request id with a
    C1 NEL and U+2028, a 60 KB path: each request is one log line, its client text escaped and capped."""
    caplog.set_level(logging.INFO, logger="aiobasert.server")
    forged = "2026-01-01 00:00:00,000 INFO aiobasert.server: refused GET /admin: 401"
    h = {"Authorization": "Bearer k"}
    with httpx.Client(base_url=base_url, timeout=30) as http:
        # the path, percent-encoded on the wire and decoded by the server
        r = http.get("/v1/models%0a" + forged.replace(" ", "%20"), headers={"X-Request-Id": "lf-path"})
        assert r.status_code == 401
        body = b'{"model": "tiny", "prompt": "x", "bad\\n' + forged.encode() + b'": 1}'
        r = http.post("/v1/completions", content=body,
                      headers={**h, "X-Request-Id": "lf-field", "Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad\n" + forged
        r = http.get("/v1/nowhere", headers={**h, "X-Request-Id": "lf-id\u0085\u2028x".encode()})
        assert r.status_code == 404
        r = http.get("/v1/" + "a" * 60_000, headers={"X-Request-Id": "lf-long"})
        assert r.status_code == 401

    lines = [r.getMessage() for r in caplog.records if r.name == "aiobasert.server"]
    assert all(not _LINE_BREAKERS.search(line) for line in lines), lines
    for rid in ("lf-path", "lf-field", "lf-long"):
        assert len([line for line in lines if f"request_id={rid}:" in line]) == 1, (rid, lines)
    (path,) = [line for line in lines if "request_id=lf-path:" in line]
    assert path.startswith("refused GET /v1/models\\n2026-01-01\\x2000:00:00,000\\x20INFO")
    (field,) = [line for line in lines if "request_id=lf-field:" in line]
    assert " param=bad\\n2026-01-01\\x2000:00:00,000" in field
    (rid,) = [line for line in lines if line.startswith("refused GET /v1/nowhere: 404")]
    assert "request_id=lf-id\u00c2\\x85\u00e2\\x80\u00a8x:" in rid  # the header's bytes as latin-1: C1 escaped
    (long,) = [line for line in lines if "request_id=lf-long:" in line]
    assert f"/v1/{'a' * 252}...[{60_004 - 256} more chars]: 401" in long and len(long) < 1000


def _unescape(text: str) -> str:
    """The inverse of `escape_field` on a text it did not cut (its escapes are Python's)."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


@given(st.text(max_size=300), st.booleans())
@settings(max_examples=500, deadline=None)
def test_escape_field_leaves_one_distinguishable_line(text: str, spaces: bool) -> None:
    from aiobasert.server.oplog import MAX_FIELD, escape_field

    out = escape_field(text, spaces=spaces)
    assert not _LINE_BREAKERS.search(out) and all(unicodedata.category(c) not in ("Cs", "Zl", "Zp") for c in out)
    assert not (spaces and " " in out)
    if len(text) <= MAX_FIELD:
        assert _unescape(out) == text  # injective: distinct texts never log alike
    else:
        assert out.endswith(f"...[{len(text) - MAX_FIELD} more chars]")
        assert _unescape(out.rpartition("...[")[0]) == text[:MAX_FIELD]


def test_the_access_line_escapes_and_caps_the_raw_path() -> None:
    from aiobasert.server.oplog import log_config

    config = log_config("info")["formatters"]["access"]
    factory = config.pop("()")
    module, _, name = factory.rpartition(".")
    formatter = getattr(__import__(module, fromlist=[name]), name)(**config)
    raw = "/v1/x\x85y\x7f" + "b" * 1000  # bytes 0x85 (NEL) and DEL in a raw path, decoded as latin-1
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", raw, "1.1", 401), None)  # fmt: skip
    line = formatter.format(record)
    assert not _LINE_BREAKERS.search(line)
    assert '"GET /v1/x\\x85y\\x7f' in line and 'more chars] HTTP/1.1" 401' in line


def test_the_library_installs_no_log_handler(base_url: str) -> None:
    """create_app leaves logging to its user: its lines propagate to whatever the application configured."""
    assert httpx.get(f"{base_url}/health").status_code == 200  # the app is up
    for name in ("aiobasert", "aiobasert.server"):
        assert logging.getLogger(name).handlers == [], name
    assert logging.getLogger("aiobasert.server").propagate


_LOG_LINE = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: "


def test_cli_serve_logs_its_start_and_each_refusal(tiny_model_path: Path) -> None:
    proc, lines, port = start_uvicorn(
        [
            "-m",
            "aiobasert",
            "serve",
            str(tiny_model_path),
            "--port",
            "0",
            "--max-batch-size",
            "3",
            "--kv-cache-dtype",
            "f16",
        ],
        tiny_model_path,
    )
    try:
        ready = lines.wait_for(
            _LOG_LINE + r"aiobasert \S+ ready: 'tiny' \(3 lanes x 2048 tokens, "
            r"KV f16 ([\d.]+) MiB\); (\d+) engine threads; "
            r"listening on http://127\.0\.0\.1:(\d+)$",
            30,
        )
        assert ready.group(1) == "INFO" and float(ready.group(2)) > 0 and int(ready.group(3)) >= 1
        assert int(ready.group(4)) == port
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={"X-Request-Id": "cli-400"},
                       json={"model": "tiny", "prompt": "x", "top_p": 7})  # fmt: skip
        assert r.status_code == 400
        refused = lines.wait_for(r"aiobasert\.server: refused POST /v1/completions: 400 .*request_id=cli-400: ", 30)
        assert re.match(_LOG_LINE, refused.string) and "param=top_p" in refused.string
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert all(re.match(_LOG_LINE, line) for line in lines.seen), lines.seen  # every line: time, level, logger


def test_an_unknown_log_level_is_refused_before_anything_loads(tmp_path: Path) -> None:
    from aiobasert.server import serve

    with pytest.raises(ValueError, match=r"log_level must be one of critical, error, warning, info, debug, trace"):
        serve(tmp_path / "never-opened.base", log_level="loud")
    proc = subprocess.run([sys.executable, "-m", "aiobasert", "serve", "--log-level", "loud"], capture_output=True,
                          text=True, cwd=REPO, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--log-level: invalid choice: 'loud'" in proc.stderr, proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_log_level_applies_to_uvicorn_and_aiobasert(tiny_model_path: Path, tmp_path: Path) -> None:
    """--log-level warning: no INFO line of uvicorn's (startup, access) or aiobasert's (startup,
    refusals); a failed request's WARNING line still shows."""
    port = _free_port()
    env = {**subprocess_env(tiny_model_path), "BASERT_REF_FAIL_STEP": "1"}  # the engine's first step fails
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "aiobasert", "serve", str(tiny_model_path), "--port", str(port),
                                 "--log-level", "warning"], stderr=err, stdout=err, cwd=REPO, env=env)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "top_p": 7}).status_code == 400
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                       headers={"X-Request-Id": "cli-500"})  # fmt: skip
        assert r.status_code == 500, r.text
        while "request_id=cli-500" not in (tmp_path / "stderr").read_text():
            assert time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    logged = (tmp_path / "stderr").read_text().splitlines()
    assert [line for line in logged if " INFO " in line or " DEBUG " in line] == []
    warning = _LOG_LINE.replace("(DEBUG|INFO|WARNING|ERROR)", "WARNING")
    assert any(
        re.match(
            warning + r"failed POST /v1/completions: 500 type=server_error code=engine_error "
            r".*request_id=cli-500: ",
            line,
        )
        for line in logged
    ), logged


def test_cors_preflight_and_open_paths(base_url: str) -> None:
    pre = httpx.options(
        f"{base_url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{base_url}/v1/chat/completions",
        headers={
            "Origin": "http://evil.example",
            "Access-Control-Request-Method": "POST",
        },
    )
    assert other.headers.get("access-control-allow-origin") != "http://evil.example"
    assert httpx.get(f"{base_url}/version").json() == {"version": aiobasert.__version__}
    assert httpx.get(f"{base_url}/metrics").status_code == 200  # scrapers send no key
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": "x"}).status_code == 401


def test_tokenize_detokenize_round_trip(base_url: str) -> None:
    h = {"Authorization": "Bearer k"}
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello <|im_end|> world"}, headers=h).json()
    assert r["count"] == len(r["tokens"]) > 3 and r["max_model_len"] > 0
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": r["tokens"]}, headers=h).json()
    assert back == {"prompt": "Hello <|im_end|> world"}
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**7]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_n_choices_share_the_prompt_prefill(base_url: str) -> None:
    with OpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0) as client:
        r = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=6, n=3, temperature=1.0, seed=11)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage is not None and 3 <= r.usage.completion_tokens <= 18
        assert all(c.finish_reason in ("length", "stop") for c in r.choices)
        single = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=6, seed=11, temperature=1.0)
        assert single.usage is not None and r.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
        assert r.choices[0].text == single.choices[0].text  # choice 0 keeps the request's seed
        assert len({c.text for c in r.choices}) > 1  # each choice its own seed stream
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=4, n=2, seed=3
        )
        assert len(chat.choices) == 2 and chat.usage is not None and 2 <= chat.usage.completion_tokens <= 8
        batch = client.completions.create(model=MODEL_NAME, prompt=["Hi", "Once"], max_tokens=2, n=2)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]


def test_streamed_n_choices_equal_the_whole_ones(base_url: str) -> None:
    with OpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0) as client:
        kw: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=8, n=3, temperature=1.0, seed=21)
        whole = client.completions.create(prompt=LONG_PROMPT, **kw)
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        chunks = list(
            client.completions.create(prompt=LONG_PROMPT, stream=True, stream_options={"include_usage": True}, **kw)
        )
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
        assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
        assert chunks[-1].usage is not None and whole.usage is not None
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

        messages: list[Any] = [{"role": "user", "content": LONG_PROMPT}]
        chat_whole = client.chat.completions.create(messages=messages, **kw)
        content: dict[int, str] = {}
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
            for c in chunk.choices:
                content[c.index] = content.get(c.index, "") + (c.delta.content or "")
        assert [content[i] for i in range(3)] == [c.message.content for c in chat_whole.choices]


@pytest.mark.anyio
async def test_sdk_n_samples_hit_the_prefix_cache(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        params = SamplingParams(max_tokens=5, temperature=1.0, seed=5)
        await engine.evict_prefix_cache()
        done = await engine.generate_n(LONG_PROMPT, params, n=4)
        prompt_len = done[0].usage.prompt_tokens
        for c in done:  # every sample seeded its KV from the one prefill: at most a page left to prefill
            assert c.usage.cached_prompt_tokens >= prompt_len - 16, c.usage
        assert len({tuple(c.token_ids) for c in done}) > 1
        stats = await engine.stats()
        assert stats.prefix_blocks_cached > 0
        prepared: list[int] = []
        prepare = engine._prepare_chat  # private on purpose: renders counted where they happen (no public count)

        def counted(*args: Any, **kwargs: Any) -> Any:
            prepared.append(1)
            return prepare(*args, **kwargs)

        engine._prepare_chat = counted  # type: ignore[method-assign]
        replies = await engine.chat_n([{"role": "user", "content": LONG_PROMPT}], params, n=3)
        assert all(r.usage.cached_prompt_tokens > 0 for r in replies)
        assert len(prepared) == 1  # the conversation rendered once for its 3 replies (a prefill and 3 samples)


def test_cli_serve_positional_model_name_and_env_key(tiny_model_path: Path) -> None:
    os.environ["AIOBASERT_API_KEY"] = "env-key"
    try:
        proc, _, port = start_uvicorn(
            ["-m", "aiobasert", "serve", str(tiny_model_path), "--port", "0", "--served-model-name", "served"],
            tiny_model_path,
        )
    finally:
        del os.environ["AIOBASERT_API_KEY"]
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer env-key"}).json()
        assert [m["id"] for m in models["data"]] == ["served"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_disconnect_frees_every_choice_of_a_streamed_n(base_url: str) -> None:
    h = {"Authorization": "Bearer k"}
    body = {
        "model": MODEL_NAME,
        "prompt": LONG_PROMPT,
        "max_tokens": 1800,
        "n": 3,
        "stream": True,
        # no choice may end by itself before the disconnect: every end-of-text marker is banned
        # (EOS and <|endoftext|>, which the engine also stops on, as llama.cpp's end-of-generation set)
        "logit_bias": {str(t): -100 for t in range(len(SPECIAL_TOKENS))},
    }
    with httpx.Client(base_url=base_url, timeout=30, headers=h) as http:
        cancelled = http.get("/v1/internal/stats").json()["requests_cancelled"]
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)  # one choice has a token; the others may be a step behind
            deadline = time.monotonic() + 10
            while (st := http.get("/v1/internal/stats").json())["active_lanes"] < 3:  # all three choices run
                assert time.monotonic() < deadline, repr(st)
                time.sleep(0.005)
        deadline = time.monotonic() + 10
        while (s := http.get("/v1/internal/stats").json())["live_sequences"] or s["active_lanes"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.02)
        assert s["requests_cancelled"] == cancelled + 3, repr(s)  # cancelled, not run to the end


def _maps_numpy(pid: int) -> bool:
    """Whether process `pid` has numpy's C core mapped (it is, from the moment numpy is imported)."""
    with open(f"/proc/{pid}/maps") as f:
        return "_multiarray_umath" in f.read()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the server's memory map from /proc")
def test_a_text_server_never_imports_numpy_until_an_embedding_needs_it(tiny_model_path: Path) -> None:
    """numpy is ~15 MiB of a server's resident memory: `aiobasert serve --no-grammar-backend-at-open` (a
    server for text alone: the grammar backend imports numpy) generating text (completions, chat,
    streamed, with logprobs, a sampled n) never imports it; the first embedding does, and works."""
    args = ["-m", "aiobasert", "serve", str(tiny_model_path), "--port", "0", "--no-grammar-backend-at-open"]
    proc, _, port = start_uvicorn(args, tiny_model_path)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert not _maps_numpy(proc.pid)
            r = http.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "logprobs": 2, "n": 2, "temperature": 0.7},
            )
            assert r.status_code == 200, r.text
            with http.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "stream": True,
                    "logprobs": True,
                    "top_logprobs": 3,
                    "logit_bias": {"5": 2},
                    "seed": 1,
                },
            ) as s:
                assert s.status_code == 200
                assert any(line.startswith("data: [DONE]") for line in s.iter_lines())
            assert not _maps_numpy(proc.pid)
            r = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "a cat", "encoding_format": "float"})
            assert r.status_code == 200, r.text
            assert len(r.json()["data"][0]["embedding"]) > 0
            assert _maps_numpy(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


_ARENAS_OF_EIGHT_THREADS = """
import ctypes, sys, threading
from aiobasert.server._malloc import limit_malloc_arenas
print(limit_malloc_arenas() if sys.argv[1] == "limit" else None)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
go = threading.Barrier(9)
def hold():
    libc.malloc(1 << 16)  # this thread's first malloc picks (or makes) its arena
    go.wait()
threads = [threading.Thread(target=hold) for _ in range(8)]
for t in threads: t.start()
go.wait()
libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
for t in threads: t.join()
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="glibc's malloc arenas")
@pytest.mark.parametrize("mode", ["limit", "default"])
def test_the_server_process_keeps_two_malloc_arenas(mode: str) -> None:
    """`aiobasert serve` caps glibc's arenas (server/_malloc.py): eight allocating threads share two,
    where glibc's default gives most of them one each."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    proc = subprocess.run([sys.executable, "-c", _ARENAS_OF_EIGHT_THREADS, mode], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    arenas = proc.stderr.count("Arena ")
    if mode == "limit":
        assert proc.stdout.strip() == "True"
        assert arenas <= SERVER_ARENAS, proc.stderr
    else:
        assert arenas > SERVER_ARENAS, proc.stderr  # what the cap saves: glibc's own default
    refused = subprocess.run([sys.executable, "-c", "from aiobasert.server._malloc import limit_malloc_arenas as f;"
                              "print(f())"], capture_output=True, text=True, env={**env, "MALLOC_ARENA_MAX": "4"},
                             timeout=60)  # fmt: skip
    assert refused.stdout.strip() == "False", refused.stderr  # the environment's own setting wins

"""The `aiobasert` command on a tiny model: run (text, --verbose, --json), convert's errors, chat,
serve of a GGUF, and help text on every option."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import msgspec
import pytest
from loopback import sigterm_and_wait
from tiny_gguf import write_gguf

from aiobasert import Completion, InvalidConfigError
from aiobasert import cli as cli_module
from aiobasert.config import SpeculationConfig
from aiobasert.models import convert


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiobasert", *args], capture_output=True, text=True, input=stdin, timeout=120
    )


def test_run_streams_text(tiny_model_path: Path) -> None:
    proc = cli("run", "Once upon a time", "--model", str(tiny_model_path), "-n", "8", "-v", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time") and proc.stdout.endswith("\n")
    summary = proc.stderr.strip().splitlines()[-1]
    match = re.fullmatch(
        r"\[prompt (\d+) tokens, output (\d+) tokens \(length\), TTFT (\d+) ms, (\d+\.\d) tok/s\]", summary
    )
    assert match, summary
    assert int(match[1]) >= 2 and int(match[2]) == 8 and float(match[4]) > 0


def test_summary_line_rates() -> None:
    from aiobasert.types import Timing, Usage

    timing = Timing(queued_s=0.0, time_to_first_token_s=0.5, total_s=1.5, submitted_step=0, admitted_step=0,
                    finished_step=9)  # fmt: skip
    line = cli_module.summary_line(Usage(prompt_tokens=4, completion_tokens=11), timing, "stop")
    assert line == "[prompt 4 tokens, output 11 tokens (stop), TTFT 500 ms, 10.0 tok/s]"  # 10 tokens after the first


def test_run_json_is_a_completion(tiny_model_path: Path) -> None:
    # --ignore-eos: only the -n bound can end it, so the reason and count are exact
    proc = cli("run", "Once upon a time", "--model", str(tiny_model_path), "-n", "5", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    done = msgspec.json.decode(proc.stdout.strip(), type=Completion)
    assert done.usage.completion_tokens == len(done.token_ids) == 5
    assert json.loads(proc.stdout)["finish_reason"] == "length"


def test_run_reports_a_bad_model_clearly(tmp_path: Path) -> None:
    proc = cli("run", "hi", "--model", str(tmp_path / "nope.base"))
    assert proc.returncode == 1
    assert "nope.base" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_keeps_history(tiny_model_path: Path) -> None:
    proc = cli("chat", "--model", str(tiny_model_path), "-n", "4", stdin="hello\nagain\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") >= 2


def test_convert_refuses_a_non_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all")
    proc = cli("convert", str(bogus), str(tmp_path / "x.base"))
    assert proc.returncode != 0
    assert "x.gguf" in proc.stderr and "Traceback" not in proc.stderr


def _converter_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aiobasert.models.convert")
    convert.add_arguments(parser)
    return parser


def _parsers(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


@pytest.mark.parametrize(
    "parser",
    [cli_module.build_parser(), _converter_parser()],
    ids=["aiobasert", "python -m aiobasert.models.convert"],
)
def test_every_option_has_help(parser: argparse.ArgumentParser) -> None:
    checked = 0
    for path, sub in _parsers(parser, parser.prog):
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"`{path}` {name} has no help text"
            checked += 1
    assert checked >= (40 if parser.prog == "aiobasert" else 4)


def test_help_runs_for_every_command() -> None:
    for command in ("run", "chat", "pull", "list", "rm", "convert", "serve", "bench"):
        proc = cli(command, "--help")
        assert proc.returncode == 0 and "usage: aiobasert" in proc.stdout, proc.stderr


def test_serve_a_gguf(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "pocket.gguf")
    env = {**os.environ, "AIOBASERT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "aiobasert", "serve", str(src), "--port", "0", "--dtype", "q8",
                             "--kv-cache-dtype", "f16"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr

    def pump() -> None:  # the server's log, read off its pipe so it never blocks on a full one
        for line in stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        seen: list[str] = []
        port = None
        while port is None:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                pytest.fail(f"the server did not start: {seen}")
            seen.append(line)
            if found := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                port = int(found[1])
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["pocket"]
            reply = http.post("/v1/completions", json={"model": "pocket", "prompt": "hi", "max_tokens": 3})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
            # --kv-cache-dtype reached the engine's load: the pool is f16
            assert re.search(
                r'aiobasert_kv_cache_bytes\{kv_cache_dtype="f16",model_name="pocket"\} [1-9]', http.get("/metrics").text
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert list((tmp_path / "cache").glob("pocket-*.q8.base"))


@pytest.mark.ray
def test_serve_ray_starts_a_cluster_and_serves(tiny_model_path: Path, second_tiny_model_path: Path) -> None:
    """`aiobasert serve --ray` as a user runs it: a local cluster, Serve's proxy on the port,
    two named models; SIGTERM shuts Serve and the cluster down."""
    import socket

    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a cluster of its own
    cmd = [sys.executable, "-m", "aiobasert", "serve", "--ray", "--replicas", "1", str(tiny_model_path),
           "--model", f"other={second_tiny_model_path}", "--port", str(port), "--max-batch-size", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    out = proc.stdout
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True).start()
    seen: list[str] = []
    try:
        while not any("aiobasert on Ray Serve:" in line for line in seen):
            try:
                seen.append(lines.get(timeout=150))
            except queue.Empty:
                pytest.fail("the Ray Serve app did not start:\n" + "".join(seen))
            assert proc.poll() is None or not lines.empty(), "".join(seen)
        with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60) as client:
            assert sorted(m.id for m in client.models.list()) == ["other", "tiny"]
            stream = client.chat.completions.create(
                model="other", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        if not sigterm_and_wait(proc, 90):
            pytest.fail("serve --ray did not stop on SIGTERM")
    assert proc.returncode == 0, "".join(seen)


def test_run_into_a_closed_pipe_ends_quietly(tiny_model_path: Path) -> None:
    """`aiobasert run ... | head -c 1`: no traceback when the reader leaves early."""
    proc = subprocess.Popen([sys.executable, "-m", "aiobasert", "run", "-m", str(tiny_model_path), "-n", "400",
                             "--ignore-eos", "Once"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)
    proc.stdout.close()  # the reader leaves while tokens are still coming
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["a={model}", "a={model}"], "two models are named 'a'"),
        (["missing.base"], "missing.base: no such model file"),
        (["{model}", "--ray", "--replicas", "0"], "--replicas must be at least 1"),
        (["{model}", "--max-batch-size", "0"], "max_batch_size must be an integer"),
        (["{model}", "--kv-cache-dtype", "bf16"], "--kv-cache-dtype: invalid choice: 'bf16'"),
        (["{model}", "--served-model-name", "x", "--model", "y={model}"], "--served-model-name names one model"),
        (["{model}", "--chat-template", "/no/such.jinja"], "--chat-template: cannot read /no/such.jinja"),
        # flags that would be dropped in silence: speculation without a method, or under --ray (its replicas
        # open their engines without it)
        (["{model}", "--num-speculative-tokens", "3"], "--num-speculative-tokens is for --speculative or"),
        (["{model}", "--ray", "--speculative", "ngram"], "--speculative / --draft-model are not served with --ray"),
        (["{model}", "--ray", "--draft-model", "{model}"], "--speculative / --draft-model are not served with --ray"),
    ],
)
def test_serve_refuses_a_bad_command_line_before_starting(
    tiny_model_path: Path, extra: list[str], message: str
) -> None:
    proc = cli("serve", *[e.format(model=tiny_model_path) for e in extra], "--port", "0")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "startup failed" not in proc.stderr


@pytest.mark.parametrize("command", [["run", "hi", "--model"], ["pull"], ["serve", "--port", "0"]])
def test_an_inexact_tokenizer_is_one_line_before_any_conversion(tmp_path: Path, command: list[str]) -> None:
    # A byte-level BPE whose pre-tokenizer the engine does not run as llama.cpp does: refused at the GGUF
    # inspection (nothing converted, nothing cached), one line naming it, exit 1, no traceback.
    src = write_gguf(tmp_path / "deepseek.gguf", pre="deepseek-llm")
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "aiobasert", *command, str(src)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "AIOBASERT_CACHE_DIR": str(cache)})  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "pre-tokenizer 'deepseek-llm' is not one the engine runs exactly" in proc.stderr
    assert not list(cache.glob("**/*.base")) and not list(cache.glob("**/*.tmp"))


def test_serve_refuses_a_cached_bundle_with_an_inexact_tokenizer(tmp_path: Path, tiny_model_path: Path) -> None:
    # A bundle an older aiobasert converted from a GGUF whose pre-tokenizer the engine refuses (the tiny
    # model's header with 'smollm' turned into 'falcon', same length): one line before the server starts.
    old = tmp_path / "old.base"
    old.write_bytes(
        tiny_model_path.read_bytes().replace(b'"tokenizer.ggml.pre":"smollm"', b'"tokenizer.ggml.pre":"falcon"', 1)
    )
    proc = subprocess.run([sys.executable, "-m", "aiobasert", "serve", str(old), "--port", "0"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "tokenizer.ggml.pre 'falcon' is not a pre-tokenizer the engine runs exactly" in proc.stderr


def test_serve_a_model_that_cannot_load_is_one_line(tmp_path: Path, tiny_model_path: Path) -> None:
    # A bundle whose header is fine but whose tensor data is cut short: the engine refuses it when the server
    # starts; the server says so in one line (the engine's message), no traceback, and exits non-zero.
    cut = tmp_path / "cut.base"
    data = tiny_model_path.read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    proc = subprocess.run([sys.executable, "-m", "aiobasert", "serve", str(cut), "--port", "0"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr and 'File "' not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "aiobasert: cannot start:" in ln]
    assert len(lines) == 1 and "cut.base" in lines[0], proc.stderr


def test_serving_a_bundle_never_loads_the_gguf_reader(tiny_model_path: Path) -> None:
    """The converter (and `gguf`, a few MB of RSS) is imported only to convert: a server and an engine
    on a `.base` bundle run without it."""
    code = (
        "import sys, anyio, aiobasert.cli, aiobasert.server\n"
        "async def main():\n"
        f"    async with aiobasert.Engine.open({str(tiny_model_path)!r}) as e:\n"
        "        await e.generate('hi', max_tokens=2)\n"
        "anyio.run(main)\n"
        "print(sorted(m for m in sys.modules if m == 'gguf' or m.endswith('models.convert')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


# ---- the edges: version, checks before loading, names, damaged files, missing extras -----------------


def cli_with_cache(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`aiobasert ARGS` with its own model cache, so what it converted (or did not) can be looked at."""
    env = {k: v for k, v in os.environ.items() if k != "AIOBASERT_MODEL"} | {"AIOBASERT_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "aiobasert", *args], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip


def left_in(cache: Path) -> list[str]:
    """The files a command left in the cache (bundles, manifests, temporaries, lock files)."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


def test_version() -> None:
    import aiobasert

    proc = cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"aiobasert {aiobasert.__version__}\n"


@pytest.mark.parametrize("command", ["run", "chat"])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "5"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--top-k", "-3"], "top_k"),
        (["-n", "-1"], "max_tokens"),
        (["--max-context", "0"], "max_context"),
    ],
)
def test_run_refuses_bad_flags_before_touching_the_model(tmp_path: Path, command: str, flags: list[str],
                                                         message: str) -> None:  # fmt: skip
    # A GGUF model: had it been resolved first, its conversion would be in the cache.
    src = write_gguf(tmp_path / "pocket.gguf")
    prompt = ["hi"] if command == "run" else []
    proc = cli_with_cache(tmp_path / "cache", command, *prompt, "--model", str(src), *flags)
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not [f for f in left_in(tmp_path / "cache") if f.endswith(".base")]


@pytest.mark.parametrize(
    ("host", "port", "message"),
    [
        ("127.0.0.1", "70000", "--port must be in 0..65535, got 70000"),
        ("192.0.2.1", "0", "cannot listen on 192.0.2.1:0"),  # TEST-NET-1: an address of no machine here
        ("127.0.0.1", "{busy}", "cannot listen on 127.0.0.1:{busy}"),
    ],
    ids=["port-range", "foreign-address", "port-in-use"],
)
def test_serve_checks_where_it_listens_before_loading(tmp_path: Path, host: str, port: str, message: str) -> None:
    import socket

    src = write_gguf(tmp_path / "pocket.gguf")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        proc = cli_with_cache(tmp_path / "cache", "serve", str(src), "--host", host, "--port", port.format(busy=busy))
    assert proc.returncode != 0
    assert message.format(busy=busy) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not [f for f in left_in(tmp_path / "cache") if f.endswith(".base")]  # nothing converted, nothing loaded


@pytest.mark.parametrize("command", [["run", "hi", "-n", "2", "--model"], ["serve", "--port", "0"]])
def test_a_name_typo_offers_the_cached_names(tmp_path: Path, tiny_model_path: Path, command: list[str]) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny-model.f32.base").write_bytes(tiny_model_path.read_bytes())
    (cache / "other.base").write_bytes(tiny_model_path.read_bytes())
    proc = cli_with_cache(cache, *command, "Tiny-modle.f32")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no model file and no cached model named 'Tiny-modle.f32'; did you mean 'tiny-model.f32'?" in proc.stderr
    assert "cached models: other, tiny-model.f32" in proc.stderr
    good = cli_with_cache(cache, "run", "hi", "-n", "2", "--model", "tiny-model.f32")
    assert good.returncode == 0, good.stderr


def test_a_file_named_gguf_that_is_not_one_is_refused_as_such(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("these are my notes, not a model\n")
    proc = cli_with_cache(tmp_path / "cache", "run", "hi", "--model", str(text))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == f"aiobasert: {text}: not a GGUF file (it does not start with the GGUF magic b'GGUF')\n"
    assert left_in(tmp_path / "cache") == []


@pytest.mark.parametrize("keep", [0.005, 0.3, 0.8], ids=["in-metadata", "in-tensor-table", "in-tensor-data"])
@pytest.mark.parametrize("command", [["run", "hi", "--model"], ["pull"], ["convert"]])
def test_a_truncated_gguf_is_one_line_and_leaves_nothing(tmp_path: Path, keep: float, command: list[str]) -> None:
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: int(len(whole) * keep)])
    cache = tmp_path / "cache"
    extra = [str(tmp_path / "out.base")] if command == ["convert"] else []
    proc = cli_with_cache(cache, *command, str(cut), *extra)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{cut}: unreadable GGUF: " in proc.stderr
    if keep > 0.01:  # the header's counts are cut off first; past them, the file's length is what is wrong
        assert "truncated: the file" in proc.stderr and "(an interrupted download?)" in proc.stderr, proc.stderr
    for python_words in ("unpack_from", "dtype", "buffer", "Error:"):
        assert python_words not in proc.stderr, proc.stderr
    assert [f for f in left_in(cache) if not f.startswith("downloads/")] == []  # no bundle, temporary or lock
    assert not (tmp_path / "out.base").exists()


def test_the_cache_lock_is_exclusive_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiobasert.models import cache as models

    monkeypatch.setenv("AIOBASERT_CACHE_DIR", str(tmp_path))
    inside: list[int] = []
    overlaps: list[int] = []
    gate = threading.Barrier(6)

    def worker(n: int) -> None:
        gate.wait()
        for _ in range(20):
            with models._locked("entry"):
                inside.append(n)
                if len(inside) > 1:
                    overlaps.append(n)
                inside.remove(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert overlaps == [] and not any(t.is_alive() for t in threads)
    assert list((tmp_path / "locks").iterdir()) == []


def test_serve_without_the_server_extra_names_it(tiny_model_path: Path) -> None:
    code = ("import sys\nsys.modules['uvicorn'] = None  # as if not installed\n"
            "from aiobasert.cli import main\n"
            f"sys.exit(main(['serve', {str(tiny_model_path)!r}, '--port', '0']))\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr == "aiobasert serve needs uvicorn (not installed): pip install 'aiobasert[server]'\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "hi", "--model", "{tmp}/missing.gguf"], "aiobasert: {tmp}/missing.gguf: no such model file"),
        (["chat", "--model", "{tmp}/missing.base"], "aiobasert: {tmp}/missing.base: no such model file"),
        (["pull", "{tmp}/missing-path"], "aiobasert: {tmp}/missing-path: no such file, nor a published model's name"),
    ],
    ids=["run-gguf", "chat-base", "pull"],
)
def test_a_missing_model_file_is_one_line_saying_so(tmp_path: Path, args: list[str], message: str) -> None:
    proc = cli_with_cache(tmp_path / "cache", *[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(message.format(tmp=tmp_path)) and proc.stderr.count("\n") == 1, proc.stderr
    assert "baseRT_" not in proc.stderr and "not a GGUF" not in proc.stderr  # no C function name, no wrong kind


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--write-timeout", "-5"], "argument --write-timeout: must be >= 0, got -5"),
        (["--write-timeout", "nan"], "argument --write-timeout: must be >= 0, got nan"),
        (["--response-store-mb", "-1"], "argument --response-store-mb: must be >= 0, got -1"),
        (["--response-store-mb", "lots"], "argument --response-store-mb: not a number: 'lots'"),
        (["--max-header-bytes", "100"], "argument --max-header-bytes: must be >= 1024, got 100"),
        (["--header-timeout", "-1"], "argument --header-timeout: must be >= 0, got -1"),
    ],
)
def test_serve_refuses_negative_bounds_in_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    proc = cli_with_cache(tmp_path / "cache", "serve", str(tmp_path / "m.base"), "--port", "0", *flags)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("usage: aiobasert serve ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [["run", "hi"], ["chat"], ["serve"], ["pull"], ["list"], ["ls"], ["rm", "x"]])
def test_an_unknown_flag_prints_the_subcommands_usage(tmp_path: Path, command: list[str]) -> None:
    proc = cli_with_cache(tmp_path / "cache", *command, "--bogus")
    assert proc.returncode == 2, proc.stderr
    name = "list" if command[0] == "ls" else command[0]
    assert proc.stderr.startswith(f"usage: aiobasert {name} "), proc.stderr
    assert proc.stderr.rstrip().endswith("error: unrecognized arguments: --bogus"), proc.stderr


def test_serve_flag_defaults_are_the_servers() -> None:
    """The flags' defaults are written out in cli.py (it loads without the server extra): the server's."""
    from aiobasert.server import app, connection, streaming

    args = cli_module.build_parser().parse_args(["serve"])
    assert args.max_header_bytes == connection.DEFAULT_MAX_HEADER_BYTES
    assert args.header_timeout == connection.DEFAULT_HEADER_TIMEOUT_S
    assert args.write_timeout == streaming.DEFAULT_WRITE_TIMEOUT_S
    assert args.sse_keepalive == streaming.DEFAULT_SSE_KEEPALIVE_S
    assert args.response_store_mb * 2**20 == app.DEFAULT_STORE_BYTES
    assert args.reasoning_budget == -1  # create_app's default: no bound


def test_serve_reasoning_budget_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`--reasoning-budget N` as llama-server's: -1 no bound, 0 thinking off, N tokens; below -1 is refused
    under the subcommand's usage."""
    parser = cli_module.build_parser()
    assert parser.parse_args(["serve", "--reasoning-budget", "0"]).reasoning_budget == 0
    assert parser.parse_args(["serve", "--reasoning-budget", "256"]).reasoning_budget == 256
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reasoning-budget", "-2"])
    assert "--reasoning-budget: must be >= -1" in capsys.readouterr().err


def test_serve_draft_model_flag_implies_the_method() -> None:
    """`--draft-model PATH` is speculation from a draft model (issue 36); `--speculative` names the others."""

    def spec(*flags: str) -> SpeculationConfig | None:
        return cli_module._speculation(cli_module.build_parser().parse_args(["serve", "m.base", *flags]))

    drafted = SpeculationConfig(method="draft", draft_model="d.base", num_speculative_tokens=3)
    assert spec("--draft-model", "d.base", "--num-speculative-tokens", "3") == drafted
    assert spec("--speculative", "mtp") == SpeculationConfig(method="mtp")
    with pytest.raises(InvalidConfigError, match="--draft-model"):
        spec("--speculative", "ngram", "--draft-model", "d.base")


@pytest.mark.parametrize("which", ["missing", "not-a-model", "other-vocabulary"])
def test_serve_a_bad_draft_model_is_one_line(tmp_path: Path, tiny_model_path: Path, which: str) -> None:
    # `serve --draft-model` with a draft that cannot be one: one line naming the flag's field and the
    # file, no traceback, a non-zero exit (never a server that starts without its draft)
    from aiobasert.models.tiny import build_tiny_model

    if which == "missing":
        path = tmp_path / "missing.base"
    elif which == "not-a-model":
        path = tmp_path / "notes.base"
        path.write_text("not a model\n")
    else:
        path = build_tiny_model(tmp_path / "bytes.base", vocab="bytes")
    proc = subprocess.run([sys.executable, "-m", "aiobasert", "serve", str(tiny_model_path), "--port", "0",
                           "--draft-model", str(path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr and 'File "' not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "speculation.draft_model" in ln]
    assert len(lines) == 1 and path.name in lines[0], proc.stderr

"""The docs are current and every code block in README.md and docs/*.md runs.

Each fenced block is a test of its own (`test_doc_block[FILE:LINE]`), run as a reader would
run it, on the tiny model:

- `python`: a snippet with top-level `await` runs in an event loop with `engine` (the tiny
  model, opened) and `messages` defined; a script (`anyio.run(...)`) runs as a program; the
  OpenAI- and Anthropic-client snippets run against a server on loopback; the Django site is served by
  uvicorn (it needs Django: the `dev` extra has it).
- `bash`: each command runs (`aiobasert` as `python -m aiobasert`); a `serve` starts, answers
  `/v1/models` and stops on SIGTERM. Leading `pip install ... &&` commands are not run (the
  suite runs in what they install); the blocks not run at all are `NOT_RUN`, each with why.
- `console`: `$ ` lines run and the lines after them are the expected output (`(...)`
  stands for any text).
- `jsonc` (the bundle header): every key it names is a key of a real bundle's header.
- `text`: drawings, not code. docs/API.md's signature blocks are generated from the code
  (`test_api_reference_is_current`).

Placeholders (`model.gguf`, `a.base`, `SRC.gguf`, `KEY`, port 8000, ...) stand for the tiny
models and a free port (`PLACEHOLDERS`); a cached NAME is the one `aiobasert pull` printed.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import httpx
import pytest
from loopback import API_KEY, REPO, Lines, serving, sigterm_and_wait, subprocess_env
from tiny_gguf import write_gguf

import aiobasert

DOCS = REPO / "docs"


def test_api_reference_is_current() -> None:
    import runpy

    render = runpy.run_path(str(DOCS / "gen_api.py"))["render"]
    assert (DOCS / "API.md").read_text() == render(), "docs/API.md is stale: run python docs/gen_api.py"


def test_every_public_object_has_a_docstring() -> None:
    for name in aiobasert.__all__:
        assert getattr(aiobasert, name).__doc__, f"aiobasert.{name} has no docstring"


# ---- the blocks ----------------------------------------------------------------------------


class Block(NamedTuple):
    file: str  # relative to the repository
    line: int
    lang: str
    code: str

    @property
    def first(self) -> str:
        return self.code.strip().splitlines()[0] if self.code.strip() else ""


FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def doc_blocks() -> list[Block]:
    out = []
    for path in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            out.append(Block(str(path.relative_to(REPO)), text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)))
    return out


NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "pip install -e '.[dev]' && python -m pytest"): "installs the dev extras and runs this very suite",
}
"""Blocks not run, by (file, first line), each with why: only install commands."""

INSTALL = re.compile(r"^pip install( -e)? \S+$")
"""A command left out of a block that is run: the suite runs in what it installs."""

NEEDS_LLAMA_CPP = "--llama-bin-dir", "--record"
"""Oracle commands that drive llama.cpp's own binaries: run where `LLAMA_CPP_BIN_DIR` names a
folder with them (the suite does not build llama.cpp), the `--recorded` one always."""


def _is_signature(block: Block) -> bool:
    return block.file == "docs/API.md" and re.fullmatch(r"(class|def) \w+\(.*\)( -> .*)?\n", block.code) is not None


BLOCKS = doc_blocks()


_FILE = re.compile(r"(?<![\w/.])((?:aiobasert|tests|bench|native|examples|docs)/[\w./-]+?\.(?:py|pyi|md|c|h))\b")
_IN_PACKAGE = re.compile(r"(?<![\w/.])((?:_core|server|models|tools)/\w+\.py)\b")
_DOTTED = re.compile(r"(?<![\w.])(aiobasert(?:\.\w+)+)")


def _named_in(text: str) -> list[str]:
    """What a text names: repository files, package files (`_core/step.py`), dotted paths."""
    return _FILE.findall(text) + [f"aiobasert/{m}" for m in _IN_PACKAGE.findall(text)] + _DOTTED.findall(text)


def _exists(name: str) -> bool:
    if "/" in name:
        return (REPO / name).exists()
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_path_named_in_the_docs_and_docstrings_exists() -> None:
    # Issue 34 item 6: a layout move left sentences naming modules that had gone. Every file path
    # (`aiobasert/_core/step.py`, `_core/loaded.py`) and dotted path (`aiobasert.tools.ToolFormat`)
    # named in the docs, the README and the package's docstrings and comments exists. The
    # CHANGELOG is history: it names what was removed.
    texts = {p: p.read_text(encoding="utf-8") for p in [*DOCS.glob("*.md"), REPO / "README.md"]}
    texts |= {p: p.read_text(encoding="utf-8") for p in (REPO / "aiobasert").rglob("*.py")}
    gone = sorted(
        {(name, str(p.relative_to(REPO))) for p, t in texts.items() for name in _named_in(t) if not _exists(name)}
    )
    assert not gone, gone
    assert _exists("aiobasert._core.step.StepRunner") and not _exists("aiobasert._core.step.Nothing")  # the check bites
    assert _named_in("see `_core/plan.py` and aiobasert/batcher.py") == [
        "aiobasert/batcher.py",
        "aiobasert/_core/plan.py",
    ]


def test_every_block_has_a_way_to_run() -> None:
    """A new block fails here until it is one of the kinds above."""
    for block in BLOCKS:
        assert block.lang in ("python", "bash", "console", "jsonc", "text", "yaml"), block
    assert {(b.file, b.first) for b in BLOCKS} >= set(NOT_RUN), "a NOT_RUN block is gone: drop it from the list"


# ---- placeholders --------------------------------------------------------------------------


class Models(NamedTuple):
    tiny: Path  # a .base
    gguf: Path  # a GGUF the engine runs
    second: Path  # another .base


def placeholders(models: Models, tmp: Path) -> dict[str, str]:
    return {
        "model.base": str(models.tiny), "a.base": str(models.tiny), "b.base": str(models.second),
        "model.gguf": str(models.gguf), "b.gguf": str(models.gguf), "SRC.gguf": str(models.gguf),
        "OUT.base": str(tmp / "out.base"), "KEY": API_KEY,
        "~/models/foo.Q4_K_M.gguf": str(tmp / "models" / "foo.Q4_K_M.gguf"),
    }  # fmt: skip


def substitute(text: str, subs: dict[str, str], *, quoted: bool = False) -> str:
    for name in sorted(subs, key=len, reverse=True):  # longest first: b.base before b
        value = repr(subs[name])[1:-1] if quoted else subs[name]
        text = re.sub(rf"(?<![\w.~/-]){re.escape(name)}(?![\w.-])", lambda _m, v=value: v, text)
    return text


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, second_tiny_model_path: Path) -> Models:
    return Models(tiny_model_path, write_gguf(tmp_path_factory.mktemp("gguf") / "pocket.gguf"), second_tiny_model_path)


# ---- runners -------------------------------------------------------------------------------


def run_snippet(block: Block, models: Models, tmp: Path) -> None:
    """Top-level `await`s in a loop, with `engine` (the tiny model) and `messages` defined."""
    code = substitute(block.code, placeholders(models, tmp), quoted=True)
    compiled = compile(code, f"{block.file}:{block.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)

    async def main() -> None:
        async with aiobasert.Engine.open(models.tiny, max_batch_size=4) as engine:
            namespace: dict[str, Any] = {
                "aiobasert": aiobasert, "engine": engine,
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            }  # fmt: skip
            result = eval(compiled, namespace)
            if result is not None:
                await result

    anyio.run(main)


def run_script(block: Block, models: Models, tmp: Path) -> None:
    """A program (it runs its own event loop), and its trio variant where a comment offers one."""
    variants = [block.code]
    trio = re.search(r"# or (anyio\.run\(main, backend=\"trio\"\))", block.code)
    if trio:
        variants.append(block.code.replace("anyio.run(main)", trio.group(1), 1))
    for i, code in enumerate(variants):
        script = tmp / f"block{i}.py"
        script.write_text(substitute(code, placeholders(models, tmp), quoted=True))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp,
                              env=subprocess_env(models.tiny))  # fmt: skip
        assert proc.returncode == 0, f"{block.file}:{block.line} (variant {i}):\n{proc.stdout}\n{proc.stderr}"
        assert proc.stdout.strip()


def run_client(block: Block, models: Models, tmp: Path) -> None:
    """The OpenAI (or Anthropic) client against `aiobasert serve`'s app on loopback (the block names port 8000)."""
    from aiobasert.server import create_app

    with serving(create_app(models.tiny, api_key=API_KEY, max_batch_size=4)) as url:
        code = substitute(block.code, placeholders(models, tmp), quoted=True).replace("http://127.0.0.1:8000", url)
        namespace: dict[str, Any] = {}
        exec(compile(code, f"{block.file}:{block.line}", "exec"), namespace)


def check_recording_rules(block: Block, tmp: Path) -> None:
    """Prometheus recording rules: each series an `expr` names is one the server exports, and promtool
    (installed by .ci/run) accepts the file."""
    import yaml

    from aiobasert.server.metrics import Metrics

    registry = Metrics().registry
    exported = {s.name for family in registry.collect() for s in family.samples}
    for family in registry.collect():  # a labelled family shows no samples until a label is used
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        exported |= {family.name + suffix for suffix in suffixes}
    rules = [rule for group in yaml.safe_load(block.code)["groups"] for rule in group["rules"]]
    named = {name for rule in rules for name in re.findall(r"\b[a-z_]+_[a-z_]+\b", rule["expr"])}
    assert rules and named and named <= exported, sorted(named - exported)
    if shutil.which("promtool") or os.environ.get("CI"):
        (tmp / "rules.yml").write_text(block.code)
        found = subprocess.run(["promtool", "check", "rules", str(tmp / "rules.yml")], capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert found.returncode == 0, found.stdout + found.stderr


def run_django_site(block: Block, models: Models, tmp: Path) -> None:
    """`uvicorn djsite:application`: concurrent first requests open one engine; SIGTERM
    drains and closes it through the lifespan lines (uvicorn logs their completion)."""
    import django  # noqa: F401  (the dev extra has it: a missing Django is a broken install, not a skip)

    (tmp / "djsite.py").write_text(block.code)
    env = subprocess_env(models.tiny)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env["PYTHONPATH"]])
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "djsite:application", "--port", "0"], cwd=tmp,
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    assert proc.stderr is not None
    lines = Lines(proc.stderr)
    try:
        port = int(lines.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", 60).group(1))
        replies: list[httpx.Response] = []

        def ask(i: int) -> None:
            replies.append(httpx.get(f"http://127.0.0.1:{port}/complete", params={"prompt": f"Hi {i}"}, timeout=60))

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in askers:
            t.start()
        for t in askers:
            t.join()
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert all(r.json()["text"] for r in replies)
    finally:
        stopped = sigterm_and_wait(proc, 60)
    assert stopped
    lines.wait_for(r"Application shutdown complete", 10)  # after engine.aclose() returned


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def run_serve(argv: list[str], env: dict[str, str], cwd: Path) -> None:
    """A `serve` command: it starts, lists its models, and stops on SIGTERM."""
    ray = "--ray" in argv
    if ray:
        pytest.importorskip("ray.serve")
        argv = [a if a != "4" else "1" for a in argv]  # one replica: the suite's 2 cores
        env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
    port = free_port()  # Serve's proxy binds the port it is given; uvicorn takes 0 and says which
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port) if ray else "0"
    else:
        argv += ["--port", str(port) if ray else "0"]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stderr=subprocess.STDOUT if ray else subprocess.PIPE,
                            stdout=subprocess.PIPE if ray else subprocess.DEVNULL, text=True)  # fmt: skip
    stream = proc.stdout if ray else proc.stderr
    assert stream is not None
    lines = Lines(stream)
    try:
        if ray:
            lines.wait_for("aiobasert on Ray Serve:", 240)
        else:
            port = int(lines.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", 90).group(1))
        headers = {"Authorization": f"Bearer {argv[argv.index('--api-key') + 1]}"} if "--api-key" in argv else {}
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["data"], r.text
    finally:
        stopped = sigterm_and_wait(proc, 90)
    assert stopped, "".join(lines.seen)


def run_commands(block: Block, models: Models, tmp: Path, request: pytest.FixtureRequest) -> None:
    subs = placeholders(models, tmp)
    env = subprocess_env(models.tiny)
    env["AIOBASERT_CACHE_DIR"] = str(tmp / "cache")
    if any(line.split("#")[0].split() == ["aiobasert", "pull"] for line in block.code.splitlines()):
        # `aiobasert pull` alone fetches the demo: it is in the session's model cache, fetched once
        env["AIOBASERT_CACHE_DIR"] = str(Path(request.getfixturevalue("smollm2_path")).parent)
    llama_bin_dir = os.environ.get("LLAMA_CPP_BIN_DIR", "")
    if "bench/llama_oracle.py" in block.code:
        recorded = REPO / "tests" / "data" / "llama_cpp" / "SmolLM2-135M-Instruct.Q4_1.json"
        subs.update(
            {
                "FILE.gguf": str(request.getfixturevalue("smollm2_gguf")),
                "DIR": llama_bin_dir,
                "tests/data/llama_cpp/NAME.json": str(tmp / "record.json") if llama_bin_dir else str(recorded),
            }
        )
    if "~/models/foo.Q4_K_M.gguf" in block.code:
        (tmp / "models").mkdir()
        write_gguf(Path(subs["~/models/foo.Q4_K_M.gguf"]))
    stdin = "Hi\n"  # `aiobasert chat`'s one turn; then end of input
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            command, words = words[:cut], words[cut + 1 :]
            if INSTALL.match(" ".join(command)):
                continue
            oracle = "bench/llama_oracle.py" in command
            needs_llama_cpp = any(f in command for f in NEEDS_LLAMA_CPP) or (oracle and "--recorded" not in command)
            if needs_llama_cpp and not llama_bin_dir:
                continue  # llama.cpp's binaries are not built by the suite
            argv = [substitute(w, subs) for w in command]
            if argv[0] in ("aiobasert", "python"):
                argv = [sys.executable, "-m", "aiobasert", *argv[1:]] if argv[0] == "aiobasert" else [
                    sys.executable, *argv[1:]]  # fmt: skip
            if argv[3:4] == ["serve"]:
                run_serve(argv, env, tmp)
                continue
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
                                  input=stdin)  # fmt: skip
            if oracle:  # its documented exit: 1 when a greedy id differs
                assert proc.returncode in (0, 1) and "(d) RSS" in proc.stdout, f"{line}:\n{proc.stdout}\n{proc.stderr}"
                continue
            assert proc.returncode == 0, f"{line}:\n{proc.stdout}\n{proc.stderr}"
            if argv[3:4] == ["pull"] and len(argv) > 4:  # `NAME: path (...)`: the NAME later lines use
                name = proc.stderr.strip().splitlines()[-1].split(":")[0]
                subs["foo.Q4_K_M-1a2b3c4d.auto"] = name


def run_console(block: Block, models: Models, tmp: Path) -> None:
    """`$ command` then the output it prints, `(...)` for any text."""
    (tmp / "deepseek-llm-7b.Q4_K_M.gguf").write_bytes(write_gguf(tmp / "src.gguf", pre="deepseek-llm").read_bytes())
    env = subprocess_env(models.tiny)
    env["AIOBASERT_CACHE_DIR"] = str(tmp / "cache")
    runs = re.split(r"^\$ ", block.code, flags=re.M)[1:]
    for run in runs:
        command, *expected = run.rstrip("\n").split("\n")
        argv = shlex.split(command)
        assert argv[0] == "aiobasert"
        proc = subprocess.run([sys.executable, "-m", "aiobasert", *argv[1:]], capture_output=True, text=True,
                              timeout=120, cwd=tmp, env=env)  # fmt: skip
        got = (proc.stdout + proc.stderr).rstrip("\n").split("\n")
        assert len(got) == len(expected), got
        for want, line in zip(expected, got, strict=True):
            pattern = ".*".join(re.escape(part) for part in want.split("(...)"))
            assert re.fullmatch(pattern, line), (want, line)


def check_bundle_header(block: Block, models: Models) -> None:
    """Every key the documented header names is a key of a real bundle's header (a GGUF's conversion)."""
    from aiobasert.models.bundle import read_bundle
    from aiobasert.models.cache import gguf_bundle_path

    def keys(value: Any) -> set[str]:
        if isinstance(value, dict):
            return set(value) | {k for v in value.values() for k in keys(v)}
        if isinstance(value, list):
            return {k for v in value for k in keys(v)}
        return set()

    header = read_bundle(gguf_bundle_path(models.gguf, progress=False)).header
    documented = set(re.findall(r'"([\w.]+)"\s*:', block.code))
    assert documented <= keys(header), documented - keys(header)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.file}:{b.line}" for b in BLOCKS])
def test_doc_block(block: Block, models: Models, tmp_path: Path, request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("AIOBASERT_CACHE_DIR", str(tmp_path / "cache"))
    if (block.file, block.first) in NOT_RUN or block.lang == "text" or _is_signature(block):
        return
    if block.lang == "bash":
        run_commands(block, models, tmp_path, request)
    elif block.lang == "console":
        run_console(block, models, tmp_path)
    elif block.lang == "jsonc":
        check_bundle_header(block, models)
    elif block.lang == "yaml":
        check_recording_rules(block, tmp_path)
    elif "get_asgi_application" in block.code:
        run_django_site(block, models, tmp_path)
    elif "from openai import OpenAI" in block.code or "import anthropic" in block.code:
        run_client(block, models, tmp_path)
    elif "anyio.run(" in block.code:
        run_script(block, models, tmp_path)
    else:
        run_snippet(block, models, tmp_path)

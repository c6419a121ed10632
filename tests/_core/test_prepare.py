"""Request preparation (tokenizing, grammar compiles, decode) is bounded before it is paid and
paid where only that request waits: never on the engine thread, never ahead of cheaper work
(docs/fairness.md, "The engine thread only steps")."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiobasert
from aiobasert import _ffi as ffi
from aiobasert._core.cost import MAX_DECODE_IDS, QUICK_COST
from aiobasert.errors import ContextLengthExceededError, InvalidRequestError
from aiobasert.testing import snapshot, wait_until

# numpy's import held open (its module half initialized in sys.modules) on the worker thread that
# the first embedding imports it on, while the loop submits plain requests of every shape.
_NUMPY_IMPORT_RACE = """
import sys, threading, anyio, aiobasert
importing, release = threading.Event(), threading.Event()
class SlowNumpy:  # numpy's own loader, which waits (module already in sys.modules) before running numpy
    def find_spec(self, name, path=None, target=None):
        if name != "numpy":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec("numpy")
        real = spec.loader.exec_module
        def exec_module(module):
            importing.set()
            release.wait()
            real(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, SlowNumpy())
async def main():  # numpy's import left to the first embedding: no grammar backend at open
    async with aiobasert.Engine.open(sys.argv[1], max_batch_size=4, grammar_backend_at_open=False) as engine:
        results = []
        async def embed():
            results.append(len(await engine.embed("a cat")))
        async with anyio.create_task_group() as tg:
            tg.start_soon(embed)
            while not importing.is_set():
                await anyio.sleep(0.005)
            assert "numpy" in sys.modules  # half initialized, right now
            ok = failed = 0

            async def one(call):
                nonlocal ok, failed
                try:
                    await call()
                    ok += 1
                except Exception as exc:
                    failed += 1
                    print(type(exc).__name__, exc, file=sys.stderr)

            for i in range(12):
                # a grammar needs numpy itself: it is served once the import is done
                tg.start_soon(one, lambda: engine.generate("x", max_tokens=2, json_schema={"type": "integer"}))
                await one(lambda: engine.generate("hello", max_tokens=2, temperature=0.5))
                await one(lambda: engine.generate([1, 2, 3], max_tokens=2))
                await one(lambda: engine.decode([1, 2, 3]))
            release.set()
        print(ok, failed, results[0] > 0, sep="|")
anyio.run(main)
"""


def test_requests_never_see_a_half_imported_numpy(tiny_model_path: Path) -> None:
    """Issue 26 #1: numpy is imported lazily on a worker; every request submitted while that import is
    under way is served (none fails on the partially initialized module), and the embedding works."""
    proc = subprocess.run([sys.executable, "-c", _NUMPY_IMPORT_RACE, str(tiny_model_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "48|0|True", proc.stderr[-3000:]


def _held_costly_lane(engine: aiobasert.Engine) -> tuple[threading.Event, threading.Event]:
    """Occupy the intake's costly lane with a job that waits for `release`; (started, release)."""
    started, release = threading.Event(), threading.Event()
    intake = engine._thread.intake
    assert intake is not None

    def hold(tok: object) -> None:
        started.set()
        release.wait(60)

    intake.submit(hold, lambda result, error: None, grammar=True, cost=QUICK_COST + 1)
    return started, release


async def _until(event: threading.Event) -> None:
    while not event.is_set():
        await anyio.sleep(0.005)


@pytest.mark.anyio
async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(long_untied_model_path: Path) -> None:
    """Issue 26 #4: a text whose characters cannot encode to max_context tokens (no token stands for
    more than the vocabulary's longest) is refused with ContextLengthExceededError and never tokenized;
    one just inside the bound is tokenized and counted exactly."""
    async with aiobasert.Engine.open(long_untied_model_path, max_batch_size=2, max_context=8192) as engine:
        intake = engine._thread.intake  # private on purpose: "never tokenized" is counted on the workers
        assert intake is not None
        before = intake.texts_encoded()
        huge = "ab " * 1_000_000  # 3 MB: at least 230,000 tokens (the longest token is 13 bytes)
        for call in (lambda: engine.generate(huge, max_tokens=1),
                     lambda: engine.chat([{"role": "user", "content": huge}], max_tokens=1),
                     lambda: engine.embed(huge)):  # fmt: skip
            with pytest.raises(ContextLengthExceededError, match="characters is at least"):
                await call()
        assert intake.texts_encoded() == before  # not one of them was tokenized
        fits = "ab " * (QUICK_COST // 3 + 1)  # costly, within the bound: tokenized, then counted exactly
        with pytest.raises(ContextLengthExceededError, match="alone exceeds"):
            await engine.generate(fits, max_tokens=1)
        assert intake.texts_encoded() == before + 1
        assert (await engine.generate("ab", max_tokens=1)).text is not None


@pytest.mark.anyio
async def test_cheap_preparation_never_waits_behind_costly_preparation(tiny_model_path: Path) -> None:
    """Issue 26 #3/#4: while the costly lane is busy (a job that only ends when the test says so) and a
    costly prompt waits behind it, cheap text and cheap grammar requests and Engine.encode are served:
    they finish first, and the costly prompt finishes once the lane is free."""
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2, max_context=2048) as engine:
        started, release = _held_costly_lane(engine)
        await _until(started)
        done: list[str] = []

        async def run(name: str, call: Any) -> None:
            try:
                await call()
            except ContextLengthExceededError:  # the costly prompt: counted once tokenized, too long
                assert name == "costly"
            done.append(name)

        async with anyio.create_task_group() as tg:
            big = "ab " * (QUICK_COST // 3 + 1)
            tg.start_soon(run, "costly", lambda: engine.generate(big, max_tokens=1, ignore_eos=True))
            await run("text", lambda: engine.generate("hello", max_tokens=2))
            await run("schema", lambda: engine.generate("x", max_tokens=3, json_schema={"type": "integer"}))
            await run("encode", lambda: engine.encode("hello"))
            await run("chat", lambda: engine.chat([{"role": "user", "content": "hi"}], max_tokens=2))
            release.set()
        assert done == ["text", "schema", "encode", "chat", "costly"]


@pytest.mark.anyio
async def test_decode_runs_on_a_tokenizer_worker_and_is_capped(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 #5: Engine.decode (POST /detokenize) is decoded on an intake worker, never on the engine
    thread (which stepped every stream meanwhile), with the engine thread's exact text; more than
    MAX_DECODE_IDS ids are refused by count, before any id is read."""
    from aiobasert._core.intake import Tokenizer
    from aiobasert.engine_thread import EngineThread

    threads: list[str] = []
    real = Tokenizer.decode

    def decode(self: Tokenizer, ids: Any) -> str:
        threads.append(threading.current_thread().name)
        return real(self, ids)

    monkeypatch.setattr(Tokenizer, "decode", decode)
    monkeypatch.setattr(EngineThread, "decode_ids", lambda self, ids: pytest.fail("decoded on the engine thread"))
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2) as engine:
        done = await engine.generate("Once upon a time", max_tokens=24, ignore_eos=True)
        assert await engine.decode(done.token_ids) == done.text
        assert await engine.decode([]) == ""
        long = list(done.token_ids) * (QUICK_COST // len(done.token_ids) + 1)  # the costly lane
        assert await engine.decode(long) == done.text * (QUICK_COST // len(done.token_ids) + 1)
        assert threads == ["aiobasert-tokenize", "aiobasert-tokenize", "aiobasert-grammar-1"]

        class Unreadable(list[int]):  # counted, never read
            def __iter__(self) -> Any:
                pytest.fail("read before it was counted")

        too_many = Unreadable(range(MAX_DECODE_IDS + 1))
        with pytest.raises(InvalidRequestError, match=f"decode input of {MAX_DECODE_IDS + 1} token ids exceeds"):
            await engine.decode(too_many)
        with pytest.raises(InvalidRequestError, match="decode input token 1 is -1"):
            await engine.decode([1, -1])
        with pytest.raises(ContextLengthExceededError):  # a prompt of ids: counted before it is read too
            engine.stream(Unreadable(range(engine.info.max_context + 1)))
        assert len(threads) == 3  # the bad id was refused on the worker before decoding


@pytest.mark.anyio
async def test_the_same_grammar_is_compiled_once(tiny_model_path: Path) -> None:
    """Issue 26 #3: a grammar is cached by its source's digest: the same json_schema (the engine's own
    grammar: a finished lane's handle is reset and reused) and the same Lark grammar (llguidance: a
    copy of the compiled prototype) are compiled once however many requests use them; another
    source is compiled anew. Every output still follows its grammar."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    reordered = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "boolean"}},
                 "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    enum = {"enum": [1, 22, "x"]}  # the engine's compiler does not take enums: llguidance's does
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2) as engine:
        for _ in range(3):
            done = await engine.generate("x", max_tokens=60, json_schema=schema, temperature=0.8)
            assert set(json.loads(done.text)) == {"a", "b"}
        assert (await snapshot(engine)).grammar_compiles == {"engine": 1}
        assert (await snapshot(engine)).grammar_backends == {"engine": 3}
        done = await engine.generate("x", max_tokens=60, json_schema=reordered)  # another source
        assert list(json.loads(done.text)) == ["b", "a"]
        assert (await snapshot(engine)).grammar_compiles == {"engine": 2}
        for _ in range(3):
            done = await engine.generate("x", max_tokens=60, json_schema=enum, temperature=0.8)
            assert json.loads(done.text) in enum["enum"]
        assert (await snapshot(engine)).grammar_compiles == {"engine": 2, "llguidance": 1}
        assert (await snapshot(engine)).grammar_backends == {"engine": 4, "llguidance": 3}

        async def lark() -> str:
            # private on purpose: a raw Lark grammar is the chat-with-tools path's, with no public call of its own
            params = engine._params(None, {"max_tokens": 8, "temperature": 0.9})
            return (await engine._new_stream("x", params, True, lark='start: "yes" | "no"')).text

        assert {await lark() for _ in range(3)} <= {"yes", "no"}
        assert (await snapshot(engine)).grammar_compiles == {"engine": 2, "llguidance": 2}
        assert (await snapshot(engine)).grammar_backends == {"engine": 4, "llguidance": 6}
        assert (await engine.stats()).live_grammars == 0


@pytest.mark.anyio
async def test_a_compile_over_its_budget_is_refused_and_never_compiled_again(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 #3: a compile that takes longer than COMPILE_BUDGET_S is refused with an
    InvalidRequestError naming the field, and the refusal is cached: the same schema is refused
    at once afterwards, without compiling; so is a schema the compiler rejects. Other requests go on."""
    from aiobasert._core import cost

    schema = {"type": "array", "items": {"type": "integer"}}
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2) as engine:
        monkeypatch.setattr(cost, "COMPILE_BUDGET_S", -1.0)  # every compile is over it
        over = r"^invalid json_schema: its grammar took .* to compile, over the budget"
        with pytest.raises(InvalidRequestError, match=over):
            await engine.generate("x", max_tokens=4, json_schema=schema)
        monkeypatch.setattr(cost, "COMPILE_BUDGET_S", 5.0)
        compiled = (await snapshot(engine)).grammar_compiles
        with pytest.raises(InvalidRequestError, match="over the budget"):
            await engine.generate("y", max_tokens=4, json_schema=schema)  # refused at once
        assert (await snapshot(engine)).grammar_compiles == compiled
        bad = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
        for _ in range(2):
            with pytest.raises(InvalidRequestError, match="json_schema"):
                await engine.generate("x", max_tokens=4, json_schema=bad)
        done = await engine.generate("x", max_tokens=12, json_schema={"type": "integer"})
        assert int(done.text) == json.loads(done.text)
        assert (await engine.stats()).live_grammars == 0


class _Handle:
    """An engine grammar handle's part the cache uses."""

    def __init__(self) -> None:
        self.resets = self.closes = 0

    def reset(self) -> bool:
        self.resets += 1
        return True

    def close(self) -> None:
        self.closes += 1


class _Host:
    copies = 0

    def copy(self) -> _Host:
        _Host.copies += 1
        return _Host()


def test_the_grammar_cache_is_a_bounded_lru() -> None:
    """At most `entries` sources of each kind, the least recently used dropped first (an engine
    handle dropped is freed); at most `idle` handles kept per source; `close` frees the rest."""
    from aiobasert._core.grammar_cache import GrammarCache

    cache = GrammarCache(entries=2, idle=1)
    a, b, c = _Handle(), _Handle(), _Handle()
    assert cache.give_back(b"a", a) and not cache.give_back(b"a", _Handle())  # one idle per source
    assert cache.give_back(b"b", b)
    assert cache.take(b"a") is a and cache.take(b"a") is None  # taken: compiled anew until given back
    assert cache.give_back(b"a", a)  # a is now the most recent
    assert cache.give_back(b"c", c) and b.closes == 1  # b was the least recently used: freed
    assert b"b" not in cache and b"a" in cache and b"c" in cache
    cache.remember(b"h", _Host())
    assert isinstance(cache.take(b"h"), _Host) and b"h" in cache
    cache.refuse(b"r", InvalidRequestError("json_schema: no"))
    with pytest.raises(InvalidRequestError, match="no"):
        cache.take(b"r")
    cache.refuse(b"s", InvalidRequestError("json_schema: no"))  # h was the least recent of those two
    assert b"h" not in cache
    cache.close()
    assert (a.closes, c.closes) == (1, 1) and b"a" not in cache


def _record_backend_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads llguidance's backend (`GrammarBackend.for_tokenizer`) is built on, in order."""
    from aiobasert._core.grammar import GrammarBackend

    built: list[str] = []
    real = GrammarBackend.for_tokenizer.__func__  # type: ignore[attr-defined]

    def for_tokenizer(cls: type[GrammarBackend], *args: Any, **kwargs: Any) -> GrammarBackend:
        built.append(threading.current_thread().name)
        return real(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(GrammarBackend, "for_tokenizer", classmethod(for_tokenizer))
    return built


@pytest.mark.anyio
@pytest.mark.parametrize("own_compiler", [True, False], ids=["reference-engine", "no-grammar-compiler"])
async def test_the_host_grammar_backend_is_built_at_open(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, own_compiler: bool
) -> None:
    """Issue 26 #9b: llguidance builds its tokenizer holding the GIL (every stream pauses meanwhile), so
    an engine builds it at open, on a worker, before any stream runs, whether or not the engine has a
    grammar compiler of its own: the first request it serves (an `enum`, which the reference engine's
    compiler does not take; any schema without a compiler) finds it built."""
    built = _record_backend_builds(monkeypatch)
    if not own_compiler:
        has = ffi.Library.has
        monkeypatch.setattr(ffi.Library, "has", lambda self, name: "grammar" not in name and has(self, name))
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2) as engine:
        assert built == ["aiobasert-grammar-1"]  # at open, on a worker
        done = await engine.generate("x", max_tokens=12, json_schema={"enum": ["red", "green"]})
        assert json.loads(done.text) in ("red", "green")
        assert (await snapshot(engine)).grammar_compiles == {"llguidance": 1} and len(built) == 1


@pytest.mark.anyio
async def test_grammar_backend_at_open_false_leaves_it_to_the_first_request_that_needs_it(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The opt-out for a server that serves text alone (its memory kept): nothing is built at open,
    nor for a schema the engine compiles itself; the first `enum` builds it, once."""
    built = _record_backend_builds(monkeypatch)
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2, grammar_backend_at_open=False) as engine:
        assert built == [] and not (await snapshot(engine)).host_grammar_built
        done = await engine.generate("x", max_tokens=12, json_schema={"type": "boolean"})
        assert json.loads(done.text) in (True, False) and built == []  # the engine's own compiler
        for _ in range(2):
            done = await engine.generate("x", max_tokens=12, json_schema={"enum": ["red", "green"]})
            assert json.loads(done.text) in ("red", "green")
        assert built == ["aiobasert-grammar-1"]


@pytest.mark.anyio
async def test_the_host_grammar_backend_is_built_on_the_costly_worker_where_only_its_request_waits(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 left (b), with `grammar_backend_at_open=False`: the host backend is built on first use.
    A small schema only llguidance takes (`enum`) is a cheap-lane job, but the build is costly: the
    job moves, whole, to the costly lane, and the cheap worker goes on. While the costly lane is held,
    other schemas are served and the build has not begun; then it runs on the costly worker, once,
    and the request is served."""
    built = _record_backend_builds(monkeypatch)
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2, grammar_backend_at_open=False) as engine:
        started, release = _held_costly_lane(engine)
        await _until(started)
        done: list[str] = []

        async def host() -> None:
            out = await engine.generate("x", max_tokens=8, json_schema={"enum": ["red", "green"]})
            assert json.loads(out.text) in ("red", "green")
            done.append("host")

        async with anyio.create_task_group() as tg:
            tg.start_soon(host)
            await wait_until(engine, lambda s: s.count("preparing") > 0)  # handed to the intake (the cheap lane)
            with anyio.fail_after(30):
                for schema in ({"type": "integer"}, {"type": "boolean"}, {"type": "integer"}):
                    # cheap-lane schemas the engine compiles: served meanwhile
                    out = await engine.generate("y", max_tokens=12, json_schema=schema)
                    done.append(f"engine {type(json.loads(out.text)).__name__}")
            assert built == [] and not (await snapshot(engine)).host_grammar_built  # waits for the costly lane
            release.set()
        assert done == ["engine int", "engine bool", "engine int", "host"]
        assert built == ["aiobasert-grammar-1"]
        assert (await engine.stats()).live_grammars == 0


def _texts_encoded_by_worker(engine: aiobasert.Engine) -> dict[str, int]:
    intake = engine._thread.intake  # private on purpose: which worker tokenized is the intake's machinery
    assert intake is not None
    return {w.thread.name: w.tok.encoded if w.tok is not None else 0 for w in intake._workers}


@pytest.mark.anyio
async def test_a_request_moved_to_the_costly_worker_is_tokenized_once(tiny_model_path: Path) -> None:
    """A cheap request whose grammar needs the host backend's first build (`grammar_backend_at_open=False`)
    moves to the costly worker (`intake.Reroute`): that is decided before its prompt is tokenized, so
    the prompt is tokenized once, on the costly worker, and never on the cheap worker that handed it
    over."""
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2, grammar_backend_at_open=False) as engine:
        started, release = _held_costly_lane(engine)  # the cheap grammar worker takes the request
        await _until(started)
        before = _texts_encoded_by_worker(engine)
        async with anyio.create_task_group() as tg:

            async def host() -> None:
                out = await engine.generate("a prompt", max_tokens=8, json_schema={"enum": ["red", "green"]})
                assert json.loads(out.text) in ("red", "green")

            tg.start_soon(host)
            await wait_until(engine, lambda s: s.host_grammar_built or _moved(engine))
            release.set()
        after = _texts_encoded_by_worker(engine)
        assert (await snapshot(engine)).host_grammar_built  # built: the request went the costly way
        encoded = {name: after[name] - before[name] for name in after}
        assert encoded == {"aiobasert-tokenize": 0, "aiobasert-grammar-0": 0, "aiobasert-grammar-1": 1}


@pytest.mark.anyio
async def test_a_grammar_built_for_a_prompt_then_refused_is_freed_on_its_worker(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grammar comes before the prompt (see the test above): when the prompt is then refused, the
    grammar (here the engine's, kept from an earlier request and so adopted by the engine thread) is
    freed on the worker through its own library view, never through the engine thread's."""
    from aiobasert._core.grammar import EngineGrammarConstraint

    schema = {"type": "integer"}
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2, thread_check=True) as engine:
        await engine.generate("x", max_tokens=4, json_schema=schema)  # its grammar is kept for the next
        closed: list[str] = []
        real = EngineGrammarConstraint.close

        def close(self: EngineGrammarConstraint) -> None:
            closed.append(threading.current_thread().name)
            real(self)

        monkeypatch.setattr(EngineGrammarConstraint, "close", close)
        with pytest.raises(ContextLengthExceededError, match="characters is at least"):
            await engine.generate("ab " * 100_000, max_tokens=1, json_schema=schema)
        assert closed == []  # a text that cannot fit is refused before its grammar is taken
        with pytest.raises(InvalidRequestError, match="NUL"):  # refused as it is tokenized
            await engine.generate("a\x00b", max_tokens=1, json_schema=schema)
        (worker,) = closed  # the kept grammar, taken for it and freed there
        assert worker.startswith("aiobasert-grammar-")
        assert (await snapshot(engine)).grammar_compiles == {"engine": 1}
        assert engine._thread.lib.violations == 0  # private on purpose: the thread-binding check of the C handle
        out = await engine.generate("x", max_tokens=4, json_schema=schema)
        assert isinstance(json.loads(out.text), int) or out.finish_reason == "length"
        assert (await engine.stats()).live_grammars == 0


def _moved(engine: aiobasert.Engine) -> bool:
    """Whether a job waits in the costly lane (the held lane's own job is running, not waiting)."""
    intake = engine._thread.intake  # private on purpose: the intake's own lanes
    assert intake is not None
    return bool(intake.jobs._queues["costly"])


@pytest.mark.anyio
async def test_a_long_prompt_is_held_as_a_c_array_not_a_python_list(long_untied_model_path: Path) -> None:
    """Issue 26 #9a: a tokenized prompt travels from the C call to the engine as a C array (4 bytes a
    token): no list of Python ints (8 bytes a token plus ~32 per id above 256, built holding the GIL)
    is made for it on the way, worker or engine thread. tracemalloc's peak from submission to the
    first token, over a prompt of ~6,000 tokens, most of them ids above 256."""
    import gc
    import tracemalloc

    async with aiobasert.Engine.open(long_untied_model_path, max_batch_size=2, max_context=8192) as engine:
        text = "hello world " * 1000
        n = len(await engine.encode(text, special=True))
        assert 4000 < n < 8000
        await engine.generate(text[:100], max_tokens=2)  # warm: caches, first-use allocations
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            stream = engine.stream(text, max_tokens=40, ignore_eos=True)
            await stream.__anext__()  # tokenized, queued, prefilled: its lane runs
            peak = tracemalloc.get_traced_memory()[1] - before
            async for _ in stream:
                pass
        finally:
            tracemalloc.stop()
        # the C call's buffer (4 bytes a byte of text: 8 a token here), the exact copy (4), the text's
        # bytes (2): ~14 a token; a list of the ids alone would add ~30 a token
        assert peak < 24 * n, (peak, n)


@pytest.mark.anyio
async def test_request_fields_are_counted_before_they_are_walked_and_a_schema_walked_once(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a request's params cost the event loop is bounded before it is paid: logit_bias, stop and
    stop_token_ids are counted before anything reads them, and a json_schema (capped at
    MAX_SCHEMA_NODES values) is walked once and used as it is, not copied and walked again (a 0.7 MB
    schema cost the loop ~1.6 s, now ~0.3 s, measured on the shared machine)."""
    from aiobasert import types
    from aiobasert.errors import InvalidSamplingParamsError

    class Unreadable(dict[int, float]):
        def items(self) -> Any:
            pytest.fail("walked before it was counted")

    walks: list[int] = []
    plains: list[int] = []
    measure, plain = types._measure_schema, types._plain
    monkeypatch.setattr(types, "_measure_schema", lambda schema: walks.append(id(schema)) or measure(schema))
    monkeypatch.setattr(types, "_plain", lambda value: plains.append(id(value)) or plain(value))
    schema = {"type": "object", "properties": {f"f{i}": {"type": "boolean"} for i in range(2000)}}
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2) as engine:
        with pytest.raises(InvalidSamplingParamsError, match="logit_bias: at most 1024 entries"):
            engine.stream("x", logit_bias=Unreadable({i: 1.0 for i in range(2000)}))
        with pytest.raises(InvalidSamplingParamsError, match="stop_token_ids: at most 1024 token ids"):
            engine.stream("x", stop_token_ids=list(range(2000)))
        with pytest.raises(InvalidSamplingParamsError, match="stop: at most 16"):
            engine.stream("x", stop=[str(i) for i in range(17)])
        stream = engine.stream("x", max_tokens=1, json_schema=schema)
        assert walks == [id(schema)] and id(schema) not in plains
        await stream.aclose()
        # a schema holding a tuple is converted (a copy), still walked once by normalized()
        walks.clear()
        engine.stream("x", max_tokens=1, json_schema={"enum": (1, 2)})
        assert len(walks) == 2  # normalized's walk, then validate's walk of the converted copy


@pytest.mark.anyio
async def test_encode_refuses_a_text_of_more_ids_than_its_limit_before_listing_them(tiny_model_path: Path) -> None:
    """Engine.encode (POST /tokenize) of a text past MAX_ENCODE_IDS tokens is refused once the C call
    has counted them, before a list of that many Python ints (~280 MB for a 15 MB text) is built:
    tracemalloc's peak stays near the C call's own buffer."""
    import tracemalloc

    from aiobasert._core.cost import MAX_ENCODE_IDS

    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2) as engine:
        unit = "lamp "
        per_unit = len(await engine.encode(unit * 1000)) / 1000
        text = unit * int(MAX_ENCODE_IDS / per_unit * 1.05)
        tracemalloc.start()
        try:
            with pytest.raises(InvalidRequestError, match=f"more than the limit of {MAX_ENCODE_IDS}"):
                await engine.encode(text)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 6 * len(text), (peak, len(text))  # the buffer: 4 bytes a byte of text; a list: ~36 an id
        assert len(await engine.encode(unit * int(MAX_ENCODE_IDS / per_unit * 0.95))) <= MAX_ENCODE_IDS


# ---- the status of a request being prepared (issue 29 #1) ------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(lib: Any, tiny_model_path: Path) -> Any:
    """A real tokenizer-only handle: the inline preparation (an engine without intake workers) uses it."""
    from aiobasert._core.intake import Tokenizer

    tok = Tokenizer.load(lib, str(tiny_model_path))
    yield tok
    tok.close()


_OPS = st.lists(st.tuples(st.sampled_from(["submit", "cancel", "abort", "return"]), st.integers(0, 3)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(ops=_OPS)
def test_a_request_being_prepared_has_one_status(lib: Any, tiny_model_path: Path, tokenizer: Any, ops: Any) -> None:
    """A model of a request's preparation, whose status is its record's (`request.Request`): a
    request handed to its preparation is held until it returns, answered meanwhile or not (a
    Cancel or an abort finishes its record once: a second cancel or an abort finds nothing to
    answer), and its return hands back the record whose status says how it stood; the count of
    requests being prepared (each holds a queue place) is the number not back yet."""
    from aiobasert._core.model_file import ModelFile
    from aiobasert._core.prepare import Preparer
    from aiobasert._core.protocol import Embed, Message, Prepared
    from aiobasert._core.request import Request, RequestStatus
    from aiobasert.types import Capabilities

    posted: list[Message] = []
    prep = Preparer(lib, ModelFile(tiny_model_path), caps=Capabilities(), grammar_reset=False, vocab_size=256,
                    max_context=64, intake=None, inline=tokenizer, post=posted.append)  # fmt: skip
    model: dict[str, RequestStatus] = {}
    records: dict[str, Request] = {}

    def answer(rid: str) -> bool:  # as the engine thread's `_end` does: once, while it is preparing
        req = records.get(rid)
        if req is None or req.status.is_finished:
            return False
        req.move(RequestStatus.FINISHED_ABORTED)
        return True

    for op, i in ops:
        rid = f"r{i}"
        if op == "submit" and rid not in model:  # a request id is unique while the request lives
            records[rid] = Request(rid=rid, prompt_len=0, max_new_tokens=0, embed=True)
            prep.submit_embed(Embed(rid, "a cat", lambda *_: None), "a cat", records[rid])
            model[rid] = RequestStatus.PREPARING
        elif op == "cancel":
            assert answer(rid) == (model.get(rid) is RequestStatus.PREPARING)
            if rid in model:
                model[rid] = RequestStatus.FINISHED_ABORTED
        elif op == "abort":
            answered = [r for r in records if prep.holds(r) and answer(r)]
            assert answered == [r for r, s in model.items() if s is RequestStatus.PREPARING]
            assert all(isinstance(prep.message(r), Embed) for r in answered)
            model = dict.fromkeys(model, RequestStatus.FINISHED_ABORTED)
        elif op == "return" and rid in model:
            assert prep.returned(rid).status is model.pop(rid)
            del records[rid]
        assert prep.preparing == len(model) and all(prep.holds(r) for r in model)
    assert all(isinstance(m, Prepared) and m.error is None and len(m.result) > 0 for m in posted)

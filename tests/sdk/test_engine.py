"""The SDK core end to end: engine thread + batcher + streams over the real
reference engine (ctypes, tiny generated model), under asyncio and trio."""

from __future__ import annotations

import functools
import random
import threading
from pathlib import Path

import anyio
import pytest
from held_calls import HeldCall, assert_engine_steps_on

import aiobasert
from aiobasert import (
    ContextLengthExceededError,
    Engine,
    EngineClosedError,
    InvalidRequestError,
    InvalidSamplingParamsError,
)
from aiobasert._ffi import Library
from aiobasert.chat import DEFAULT_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE, render_chat
from aiobasert.models.tiny import build_tiny_model
from aiobasert.testing import snapshot, thread_state, wait_until

pytestmark = pytest.mark.anyio

PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "def main():\n    return 0",
    "日本語のテキスト",
    "1234567890",
    "Hello, world! 😀",
    "<|im_start|>user\nhi<|im_end|>",
    "a",
]


def prompt(i: int) -> str:
    return f"{PROMPTS[i % len(PROMPTS)]} #{i}"


async def tokens_of(engine: Engine, p: str | list[int], **kw: object) -> list[int]:
    return [t.id async for t in engine.stream(p, **kw)]  # type: ignore[arg-type]


async def solo_and_together(engine: Engine, n: int, *, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of prompt(0..n-1), each run alone, then all n at once."""
    solo = [await tokens_of(engine, prompt(i), max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    together: list[list[int]] = [[] for _ in range(n)]

    async def run(i: int) -> None:
        together[i] = await tokens_of(engine, prompt(i), max_tokens=max_tokens, ignore_eos=True)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(run, i)
    return solo, together


async def test_stream_yields_tokens_and_final(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        toks = [t async for t in engine.stream("Once upon a time", max_tokens=12, ignore_eos=True)]
        assert len(toks) == 12
        assert [t.index for t in toks] == list(range(12))
        assert all(t.finish_reason is None for t in toks[:-1])
        assert toks[-1].finish_reason == "length"
        assert all(0 <= t.id < engine.info.vocab_size for t in toks)
        done = await engine.generate("Once upon a time", max_tokens=12, ignore_eos=True)
        assert done.token_ids == [t.id for t in toks]
        assert done.text == "".join(t.text for t in toks)
        assert done.usage.completion_tokens == 12
        assert done.usage.prompt_tokens == len(await engine.encode("Once upon a time", special=True))


async def test_32_concurrent_greedy_streams_equal_solo(tiny_model_path: Path) -> None:
    n = 32
    async with Engine.open(tiny_model_path, max_batch_size=32, prefix_cache=False) as engine:
        solo, together = await solo_and_together(engine, n, max_tokens=10)
        assert together == solo
        assert len({tuple(s) for s in solo}) > 1  # the prompts really differ


async def test_seeded_sampling_is_reproducible_under_batching(tiny_model_path: Path) -> None:
    params = dict(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, ignore_eos=True)
    async with Engine.open(tiny_model_path, max_batch_size=16) as engine:
        alone = await tokens_of(engine, "Once upon a time", seed=1234, **params)
        results: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            # every third lane uses the host-logits path (logprobs) to mix step kinds
            results[i] = await tokens_of(
                engine, "Once upon a time", seed=1234 if i < 8 else i, logprobs=(i % 3 == 0), **params
            )

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(run, i)
        assert all(results[i] == alone for i in range(8))
        assert len({tuple(results[i]) for i in range(8, 16)}) > 1  # other seeds differ


async def test_request_arriving_mid_flight_is_admitted_within_one_step(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=8) as engine:
        long_streams = [engine.stream(prompt(i), max_tokens=200, ignore_eos=True) for i in range(4)]
        for s in long_streams:
            await s.__anext__()
        for _ in range(5):
            await long_streams[0].__anext__()
        late = await engine.generate("late arrival", max_tokens=3, ignore_eos=True)
        assert late.timing.admitted_step - late.timing.submitted_step <= 1
        for s in long_streams:
            await s.aclose()


async def test_cancelling_1000_streams_leaks_nothing(tiny_model_path: Path) -> None:
    rng = random.Random(7)
    async with Engine.open(tiny_model_path, max_batch_size=16, max_context=256) as engine:
        keep = [prompt(i) for i in range(4)]
        expected = [await tokens_of(engine, p, max_tokens=20, ignore_eos=True) for p in keep]
        got: list[list[int]] = [[] for _ in keep]
        cancelled = 0

        async def victim(i: int) -> None:
            nonlocal cancelled
            stream = engine.stream(prompt(i) * rng.randint(1, 6), max_tokens=50, ignore_eos=True)
            stop_after = rng.randint(0, 12)
            how = i % 3
            if how == 0:  # break out of the loop
                async for tok in stream:
                    if tok.index >= stop_after:
                        break
            elif how == 1:  # a timeout cancels the task while it waits
                with anyio.move_on_after(rng.random() * 0.02):
                    async for _ in stream:
                        pass
            else:  # explicit close, possibly before the first token
                n = 0
                async for _ in stream:
                    n += 1
                    if n > stop_after:
                        break
                await stream.aclose()
            cancelled += 1

        async def survivor(j: int) -> None:
            got[j] = await tokens_of(engine, keep[j], max_tokens=20, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for j in range(len(keep)):
                tg.start_soon(survivor, j)
            for batch in range(10):
                async with anyio.create_task_group() as inner:
                    for i in range(100):
                        inner.start_soon(victim, batch * 100 + i)
        assert cancelled == 1000
        assert got == expected
        # Every cancel was posted when its consumer left; the stats call is queued
        # behind them on the engine thread, so no lane may be left by now.
        stats = await engine.stats()
        assert stats.live_sequences == 0
        assert stats.active_lanes == 0 and stats.waiting_requests == 0
        assert stats.kv_blocks_used == stats.prefix_blocks_cached
        await engine.evict_prefix_cache()
        assert (await engine.stats()).kv_blocks_used == 0


async def test_stop_string_across_token_boundary(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        base = [t async for t in engine.stream("The quick brown fox", max_tokens=40, ignore_eos=True)]
        text = "".join(t.text for t in base)
        # a stop string that starts inside one token and ends inside a later one
        pos = 0
        for t in base[:-2]:
            pos += len(t.text)
            if len(t.text) >= 2 and pos < len(text) - 2:
                break
        stop = text[pos - 1 : pos + 2]
        assert len(stop) == 3
        out = await engine.generate("The quick brown fox", max_tokens=40, ignore_eos=True, stop=[stop])
        assert out.finish_reason == "stop"
        assert out.text == text[: text.find(stop)]
        assert stop not in out.text


async def test_max_tokens_eos_and_stop_ids(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        out = await engine.generate("Once upon a time", max_tokens=5, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.token_ids) == 5
        first = out.token_ids[0]
        stopped = await engine.generate("Once upon a time", max_tokens=5, stop_token_ids=[first])
        assert stopped.finish_reason == "stop" and stopped.token_ids == [first]
        eos = 2  # <|im_end|> in the tiny vocabulary: force it with a logit bias
        forced = await engine.generate("hi", max_tokens=5, logit_bias={eos: 100.0})
        assert forced.finish_reason == "stop" and forced.token_ids == [eos]
        assert forced.text == ""  # a control token never leaks into text


async def test_context_overflow_and_bad_input_raise_in_caller(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_context=64) as engine:
        ok = engine.stream("Once upon a time", max_tokens=8, ignore_eos=True)
        first = await ok.__anext__()
        with pytest.raises(ContextLengthExceededError):
            await engine.generate("word " * 100, max_tokens=4)
        with pytest.raises(ContextLengthExceededError):
            await engine.generate("hello", max_tokens=200)
        with pytest.raises(InvalidRequestError):
            engine.stream([1, 2, engine.info.vocab_size])
        with pytest.raises(InvalidRequestError):
            engine.stream([1, -1])
        with pytest.raises(InvalidRequestError):
            await engine.generate("")
        with pytest.raises(InvalidRequestError):
            await engine.generate("nul \x00 byte")
        with pytest.raises(InvalidRequestError, match="message 0 contains a NUL"):
            engine.chat([{"role": "user", "content": "nul \x00"}])
    async with Engine.open(tiny_model_path) as engine:
        # the model's own output fed back (it may have sampled a NUL byte token): U+FFFD in the prompt
        fed_back = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b\x00"},
            {"role": "user", "content": "c"},
        ]
        assert (await engine.chat(fed_back, max_tokens=1)).token_ids
        for bad in (
            dict(temperature=-1.0),
            dict(top_p=0.0),
            dict(top_p=1.5),
            dict(top_k=-2),
            dict(max_tokens=0),
            dict(min_p=2.0),
            dict(temperature=float("nan")),
            dict(logit_bias={10**9: 1.0}),
            dict(stop=[""]),
            dict(top_logprobs=99),
            dict(not_a_param=1),
        ):
            with pytest.raises(InvalidSamplingParamsError):
                engine.stream("x", **bad)  # type: ignore[arg-type]
        rest = [t async for t in ok]
        assert 1 + len(rest) == 8  # the other stream was not disturbed
        assert first.index == 0


async def test_logprobs_and_top_logprobs(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        toks = [t async for t in engine.stream("Once", max_tokens=4, ignore_eos=True, top_logprobs=3)]
        greedy = await tokens_of(engine, "Once", max_tokens=4, ignore_eos=True)
        assert [t.id for t in toks] == greedy  # the host path picks the same greedy tokens
        for t in toks:
            assert t.logprob is not None and t.logprob <= 0.0
            assert t.top_logprobs is not None and len(t.top_logprobs) == 3
            assert t.top_logprobs[0].id == t.id  # greedy: the chosen token is the most likely
            lps = [a.logprob for a in t.top_logprobs]
            assert lps == sorted(lps, reverse=True)


async def test_only_the_engine_thread_enters_the_library(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=4, thread_check=True) as engine:
        lib = engine._thread.lib  # private on purpose: the thread binding of the C handle is what is tested
        assert lib.thread_check
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(functools.partial(tokens_of, engine, prompt(i), max_tokens=5))
        await engine.encode("hello")
        await engine.stats()
        assert lib.calls > 0 and lib.violations == 0
        # and the check does fire: a call from this (loop) thread is refused
        assert threading.get_ident() != engine._thread.thread_id
        with pytest.raises(aiobasert.ThreadAffinityError):
            lib.baseRT_page_size(engine._thread._model)
        assert lib.violations == 1


async def test_info_says_how_many_threads_the_engine_computes_with(tiny_model_path: Path, lib: Library) -> None:
    """`ModelInfo.engine_threads`: the reference engine's shared pool as it said at open (the
    server's ready line prints it)."""
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        assert engine.info.engine_threads >= 1
        assert engine.info.engine_threads == lib.baseRT_ref_counter(b"pool_threads")


async def test_encode_decode_chat(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        ids = await engine.encode("Hello, world! 😀")
        assert await engine.decode(ids) == "Hello, world! 😀"
        special = await engine.encode("<|im_start|>", special=True)
        assert special == [1]
        plain = await engine.encode("<|im_start|>")
        assert 1 not in plain
        out = await engine.chat([{"role": "user", "content": "hi <|im_end|> there"}], max_tokens=3, ignore_eos=True)
        # content that quotes a marker stays text: exactly one <|im_end|> per turn is framing
        assert len(out.token_ids) == 3
        vec = await engine.embed("Hello")
        assert vec.shape == (engine.info.dim,)


@pytest.mark.parametrize(
    ("markers", "template", "turn"),
    [
        (("<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE, "<start_of_turn>user\n"),
        (
            ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            LLAMA3_TEMPLATE,
            "<|start_header_id|>user<|end_header_id|>\n\n",
        ),
        ((), DEFAULT_TEMPLATE, "<|im_start|>user\n"),
    ],
    ids=["gemma", "llama3", "chatml"],
)
async def test_a_gguf_without_a_template_chats_in_its_familys_format(
    tmp_path: Path, markers: tuple[str, ...], template: str, turn: str
) -> None:
    """Gemma 3 270M's GGUF has no chat template: the engine uses its family's, known by the
    vocabulary's special tokens, and the family's markers are parsed as their tokens."""
    path = build_tiny_model(tmp_path / "m.base", extra_tokens=tuple((m, 3) for m in markers), chat_template=None)
    async with Engine.open(path) as engine:
        assert engine.chat_template == template
        pieces = render_chat(engine.chat_template, [{"role": "user", "content": "hi"}], bos_token=engine.info.bos_token)
        assert turn in "".join(text for text, _ in pieces)
        first = markers[0] if markers else "<|im_start|>"
        (marker_id,) = await engine.encode(first, special=True)  # the turn marker is one token
        # private on purpose: the engine's own encoding of chat pieces has no public call
        prompt_ids = await engine._call(lambda: engine._thread.encode_pieces(pieces))
        assert marker_id in prompt_ids
        out = await engine.chat([{"role": "user", "content": "hi"}], max_tokens=2, ignore_eos=True)
        assert len(out.token_ids) == 2 and out.usage.prompt_tokens == len(prompt_ids)


async def test_aclose_drain_abort_and_reuse(tiny_model_path: Path) -> None:
    engine = await Engine.open(tiny_model_path, max_batch_size=2)
    s1 = engine.stream("a", max_tokens=30, ignore_eos=True)
    await s1.__anext__()
    await engine.aclose()  # drain: the in-flight stream finishes
    assert len([t async for t in s1]) == 29 and s1.finish_reason == "length"
    await engine.aclose()  # a second close is a no-op
    assert thread_state(engine).models_freed == 1
    with pytest.raises(EngineClosedError):
        engine.stream("x")
    with pytest.raises(EngineClosedError):
        await engine.encode("x")

    engine = await Engine.open(tiny_model_path, max_batch_size=2)
    s2 = engine.stream("b", max_tokens=10_000 // 10, ignore_eos=True)
    await s2.__anext__()
    await engine.aclose(abort=True)
    rest = [t async for t in s2]
    assert s2.finish_reason == "aborted" and len(rest) < 999
    closed = thread_state(engine)
    assert closed.models_freed == 1 and not closed.alive


async def test_break_frees_the_lane_at_once(tiny_model_path: Path) -> None:
    """sglang #36333: a consumer that leaves must not decode on to max_tokens."""
    async with Engine.open(tiny_model_path) as engine:
        async for _ in engine.stream("x", max_tokens=2000, ignore_eos=True):
            break
        stats = await engine.stats()
        assert stats.active_lanes == 0 and stats.live_sequences == 0
        # never decoded on towards 2000: at most the stream's buffer bound (256) ahead of the reader
        assert stats.requests_cancelled == 1 and stats.requests_finished == 0
        assert stats.steps <= 256 + 2


async def test_long_prompt_prefills_in_chunks_without_freezing_streams(tiny_model_path: Path) -> None:
    """vllm #1026 / tabbyAPI #383: a long prompt is prefilled a chunk per step while
    running streams keep decoding every step, and a cancel lands mid-prefill."""
    # prefill_chunk=4: the SDK's per-step prompt budget (the engine's own chunk stays larger),
    # so the 1900-token prompt takes 475 steps
    async with Engine.open(tiny_model_path, prefill_chunk=4, prefix_cache=False) as engine:
        long_prompt = list(range(3, 3 + 475)) * 4
        runner = engine.stream("running", max_tokens=2000, ignore_eos=True)
        await runner.__anext__()
        long = engine.stream(long_prompt, max_tokens=3, ignore_eos=True)
        long.submit()

        first = await snapshot(engine)  # queued behind the submit: taken between two steps
        last = await wait_until(engine, lambda s: s.stats.steps - first.stats.steps >= 8)  # in steps, not seconds
        assert last.requests[long.request_id].prefilling  # in its lane after 8+ steps: chunked, not one stall
        ran = last.stats.steps - first.stats.steps
        got = last.requests[runner.request_id].generated - first.requests[runner.request_id].generated
        assert got == ran  # the running stream got a token every step
        await long.aclose()  # cancel mid-prefill
        after = await engine.stats()  # queued behind the cancel: the lane must be gone
        assert after.active_lanes == 1 and after.requests_cancelled == 1
        await runner.aclose()


async def test_idle_engine_does_not_step(tiny_model_path: Path) -> None:
    """With no work the engine thread blocks on its inbox: no steps while idle."""
    async with Engine.open(tiny_model_path) as engine:
        await engine.generate("warm", max_tokens=2)
        idle = await engine.stats()
        await anyio.sleep(0.1)
        assert (await engine.stats()).steps == idle.steps
        await engine.generate("again", max_tokens=2, ignore_eos=True)
        assert (await engine.stats()).steps > idle.steps


async def test_penalties_change_repetitive_output(tiny_model_path: Path) -> None:
    """The tied tiny model loves repeating itself; penalties must break that, on the
    greedy (CPU pipeline) and on the sampled (engine row sampler) paths alike."""
    async with Engine.open(tiny_model_path) as engine:
        plain = await engine.generate("Once upon a time", max_tokens=24, ignore_eos=True)
        greedy_pen = await engine.generate("Once upon a time", max_tokens=24, ignore_eos=True, repeat_penalty=5.0)
        assert len(set(greedy_pen.token_ids)) > len(set(plain.token_ids))
        sampled = dict(max_tokens=24, ignore_eos=True, temperature=0.7, seed=5)
        free = await engine.generate("Once upon a time", **sampled)
        pen = await engine.generate("Once upon a time", presence_penalty=2.0, frequency_penalty=2.0, **sampled)
        assert pen.token_ids != free.token_ids
        assert len(set(pen.token_ids)) >= len(set(free.token_ids))


async def test_a_slow_tokenization_does_not_stop_other_lanes(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenizing a huge prompt (15 MB: 0.8 s) runs off the engine thread: held
    here until released, while the engine steps the running stream on (counted
    in steps and delivered tokens, not seconds); Engine.encode likewise."""
    from aiobasert._core.prepare import Preparer

    tokenize = HeldCall(
        monkeypatch, Preparer, "tokenize_prompt", when=lambda args: getattr(args[-1], "prompt", None) == "huge"
    )
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        running = engine.stream("running", max_tokens=2000, ignore_eos=True)
        await running.__anext__()
        huge = engine.stream("huge", max_tokens=4, ignore_eos=True)
        huge.submit()
        async with tokenize.holding():
            await assert_engine_steps_on(engine, running, tokenize)
        with anyio.fail_after(60):
            assert len((await huge).token_ids) == 4
        await running.aclose()


@pytest.mark.parametrize("bad", [5, 2.5, ["a"], {"a": 1}, b"a", (1,), object()])
async def test_wrong_typed_arguments_are_typed_errors(tiny_model_path: Path, bad: object) -> None:
    from aiobasert import InvalidConfigError

    for kwargs in ({"model": bad}, {"model": tiny_model_path, "library": bad}):
        with pytest.raises(InvalidConfigError, match="must be a path"):
            Engine.open(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="thread_check"):
        Engine.open(tiny_model_path, thread_check=bad)  # type: ignore[arg-type]
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        if not isinstance(bad, (list, tuple)):
            with pytest.raises(InvalidRequestError, match="tools must be a list"):
                engine.chat([{"role": "user", "content": "hi"}], tools=bad)  # type: ignore[call-overload]
        assert len((await engine.generate("still serving", max_tokens=2, ignore_eos=True)).token_ids) == 2


async def test_a_deeply_nested_tool_schema_is_a_typed_error(tiny_model_path: Path) -> None:
    # It raised a raw RecursionError from the tool-grammar rendering.
    schema: dict[str, object] = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    parameters = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        with pytest.raises(InvalidRequestError, match=r"tools\[0\] is nested more than 64 levels"):
            engine.chat([{"role": "user", "content": "hi"}], tools=[tool], max_tokens=3)
        assert len((await engine.generate("still serving", max_tokens=2, ignore_eos=True)).token_ids) == 2


# ---- memory: the intake's tokenizer handles load before the weights -------------------------------

ENGINE_RSS = """
import anyio, json, re, sys
from pathlib import Path
import aiobasert
# The grammar worker's code (llguidance, the bundle reader), imported lazily at the first schema, is
# loaded up front: this measures data (a header's parse tree), not a module import after `ready`.
import aiobasert._core.grammar, aiobasert.models._hf_tokenizer, aiobasert.models.bundle
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) * 1024
async def main():
    # no llguidance backend: it is not a header's data, and llguidance builds its view of 200k added tokens
    # in time that grows faster than their count (32k: 8 s, 64k: 65 s here; a real vocabulary has a few k)
    opened = aiobasert.Engine.open(sys.argv[1], max_batch_size=2, max_context=256, grammar_backend_at_open=False)
    async with opened as engine:
        ready = status("VmHWM")
        await engine.generate("hello", max_tokens=4, temperature=0.0)  # the tokenizer worker
        await engine.generate("hello", max_tokens=4, json_schema={"type": "object"})  # a grammar worker
        print(json.dumps({"ready": ready, "peak": status("VmHWM"), "steady": status("VmRSS")}))
anyio.run(main)
"""


def test_tokenizer_handles_load_before_the_weights(tmp_path: Path) -> None:
    """The intake workers' tokenizer-only handles each parse the bundle's header (for a big vocabulary a
    tree of tens of MB, freed when the load ends). They load when the engine opens, one at a time and
    before the model's weights, so neither opening nor the first requests (tokenizer and grammar
    workers) ever hold a header's tree beside the weights: the process peaks near its steady state.
    Before, each worker loaded at its first job, and the first request peaked ~25 MB higher."""
    import json
    import subprocess
    import sys

    from tiny_gguf import big_vocab_gguf

    from aiobasert.models.convert import convert_gguf

    src = big_vocab_gguf(tmp_path / "big-vocab.gguf")
    path = convert_gguf(src, tmp_path / "auto.base", dtype="auto", progress=False)
    proc = subprocess.run([sys.executable, "-c", ENGINE_RSS, str(path)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout)
    assert rss["peak"] - rss["ready"] < 10 << 20, rss  # the first requests load no header
    assert rss["peak"] - rss["steady"] < 10 << 20, rss  # nor did opening, beside the weights


async def test_kv_cache_dtype_is_the_pool_the_engine_allocates(head32_model_path: Path) -> None:
    """kv_cache_dtype reaches the load: info names what was allocated, the pool's capacity is half
    (f16, the reference engine's "auto") and 34/128 (Q8_0) of the exact f32 pool's, and concurrent
    greedy streams still equal solo."""
    capacity: dict[str, int] = {}
    for kv, want in (("auto", "f16"), ("f16", "f16"), ("q8", "q8"), ("f32", "f32")):
        async with Engine.open(head32_model_path, kv_cache_dtype=kv, max_batch_size=4, max_context=128) as engine:  # type: ignore[arg-type]
            assert engine.info.kv_cache_dtype == want
            stats = await engine.stats()
            assert capacity.setdefault(want, stats.kv_cache_bytes) == stats.kv_cache_bytes
            assert stats.engine_bytes > stats.kv_cache_bytes > 0
            solo, together = await solo_and_together(engine, 4, max_tokens=12)
            assert together == solo
    assert capacity["f16"] * 2 == capacity["f32"]
    assert capacity["q8"] * 128 == capacity["f32"] * 34


async def test_kv_cache_dtype_falls_back_where_the_head_cannot_take_q8(head16_model_path: Path) -> None:
    """head_dim 16: a Q8_0 block of 32 would straddle two heads, so the engine allocates f16 and says so."""
    async with Engine.open(head16_model_path, kv_cache_dtype="q8", max_batch_size=2, max_context=64) as engine:
        assert engine.info.kv_cache_dtype == "f16"
        assert len(await tokens_of(engine, "abc", max_tokens=4, ignore_eos=True)) == 4


async def test_the_reservation_holds_queue_places_all_or_none(tiny_model_path: Path) -> None:
    # issue 26 item 7: a fan-out's places are taken in one atomic step on the engine thread, so no
    # other request can take them between the check and the submits (which the old stats-then-
    # submit check allowed); places not used go back. Private on purpose: `_reserve` is the n primitive's
    # plumbing, no longer public (issue 34 item 3), and its atomicity is what is tested.
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=1, max_queue=2, prefix_cache=False) as engine:
        with pytest.raises(aiobasert.EngineOverloadedError, match="room for 3 of this request's 4"):
            await engine._reserve(4)  # 1 lane + 2 queue places: never all 4 at once
        with await engine._reserve(3) as places:
            with pytest.raises(aiobasert.EngineOverloadedError):
                await engine._reserve(1)  # every place is held
            with pytest.raises(aiobasert.EngineOverloadedError):
                await engine.generate("Hello", max_tokens=2)  # an outsider cannot take one
            streams = [engine.stream("Hello", max_tokens=4, temperature=0) for _ in range(3)]
            places.submit(streams)  # into the held places: none refused
            assert places.left == 0
            done = [await s for s in streams]
        assert [c.finish_reason for c in done] == ["length"] * 3
        with await engine._reserve(2) as places:
            places.submit(streams[:0])
        assert places.left == 0  # released on leaving the block
        with await engine._reserve(3):  # so all of them are free again
            pass
        with anyio.CancelScope() as scope:  # the caller leaves before the places come: they go back
            scope.cancel()
            await engine._reserve(3)
        await engine.stats()  # answered after the reservation's answer, which gave its places back
        with await engine._reserve(3):
            pass
        stats = await engine.stats()
        assert stats.requests_cancelled == 0 and stats.requests_failed == 0

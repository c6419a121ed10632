"""Structured output (json_schema): the llguidance grammar backend on its own, and
constrained lanes in the engine, batched with free lanes, under asyncio and trio."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest
from held_calls import HeldCall, assert_engine_steps_on

from aiobasert import Completion, Engine, InvalidRequestError
from aiobasert._core.grammar import GrammarBackend
from aiobasert._ffi import Library
from aiobasert.models.bundle import read_bundle
from aiobasert.models.tiny import EOS_ID, build_tiny_model
from aiobasert.testing import thread_state, wait_until

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "nick": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["name", "age", "active", "nick"],
    "additionalProperties": False,
}
COLOR: dict[str, Any] = {"enum": ["red", "green", "blue", 7, None]}
DIGITS: dict[str, Any] = {
    "type": "array",
    "items": {"type": "integer", "minimum": -9, "maximum": 9},
    "minItems": 1,
    "maxItems": 5,
}
NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
                "y": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "label": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["point", "label", "tags"],
    "additionalProperties": False,
}
BOUNDED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.125},
    },
    "required": ["count", "ratio"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, COLOR, DIGITS, NESTED, BOUNDED]

PROMPTS = ["Once upon a time", "The answer is", "def f(x):", "日本語", "1234", "Hello, world!", "{", "a"]


def check_json(done: Completion, schema: dict[str, Any] | bool) -> Any:
    """The completion ended by its grammar and is JSON matching `schema`."""
    assert done.finish_reason == "stop", done
    value = json.loads(done.text)
    if schema is not True:
        jsonschema.validate(value, schema)
    return value


# ---- the backend alone ---------------------------------------------------------------


def allowed_ids(mask: np.ndarray[Any, Any]) -> set[int]:
    return {int(i) for i in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))}


def test_backend_masks_steps_and_finishes(untied_model_path: Path, host_grammar: Callable[..., GrammarBackend]) -> None:
    header = read_bundle(untied_model_path)
    vocab = header.config["vocab_size"]
    tokens = header.tokenizer["tokenizer.ggml.tokens"]
    backend = host_grammar(untied_model_path, vocab_size=vocab)
    assert EOS_ID in backend.end_ids
    assert all(header.tokenizer["tokenizer.ggml.token_type"][i] == 3 for i in backend.end_ids)

    constraint = backend.compile({"enum": ["red", "green"]})
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    assert constraint.fill_bitmask(mask)
    first = allowed_ids(mask)
    assert first and not first & set(backend.end_ids)  # something must be written before the end
    quote = tokens.index('"')
    assert quote in first
    assert constraint.accept(quote) and not constraint.is_finished()
    for piece in ("g", "re", "en", '"'):  # byte-level text of the tiny vocabulary's tokens
        tok = tokens.index(piece)
        constraint.fill_bitmask(mask)
        assert tok in allowed_ids(mask)
        assert constraint.accept(tok)
    assert constraint.is_finished()
    constraint.fill_bitmask(mask)
    assert allowed_ids(mask) == set(backend.end_ids)  # complete: only the end tokens remain


def test_backend_rejects_a_token_outside_the_grammar(
    untied_model_path: Path, host_grammar: Callable[..., GrammarBackend]
) -> None:
    vocab = read_bundle(untied_model_path).config["vocab_size"]
    constraint = host_grammar(untied_model_path, vocab_size=vocab).compile({"type": "integer"})
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    constraint.fill_bitmask(mask)
    rejected = min(set(range(vocab)) - allowed_ids(mask))
    assert not constraint.accept(rejected)
    assert constraint.error and "doesn't satisfy the grammar" in constraint.error


def test_backend_pads_to_the_engine_vocabulary(
    untied_model_path: Path, host_grammar: Callable[..., GrammarBackend]
) -> None:
    n_tokens = len(read_bundle(untied_model_path).tokenizer["tokenizer.ggml.tokens"])
    padded = n_tokens + 40
    constraint = host_grammar(untied_model_path, vocab_size=padded).compile(True)
    mask = np.zeros((padded + 31) // 32, dtype=np.int32)
    constraint.fill_bitmask(mask)
    assert allowed_ids(mask) and max(allowed_ids(mask)) < n_tokens  # padding ids are never allowed
    with pytest.raises(ValueError, match="int32 words"):
        constraint.fill_bitmask(np.zeros(2, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="tokens"):
        host_grammar(untied_model_path, vocab_size=n_tokens - 1)


# ---- constrained lanes in the engine --------------------------------------------------


@pytest.mark.anyio
async def test_100_constrained_generations_batched_with_free_lanes(untied_model_path: Path) -> None:
    free_params: list[dict[str, Any]] = [
        dict(max_tokens=24, ignore_eos=True),
        dict(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11),
        dict(max_tokens=24, ignore_eos=True, temperature=1.0, top_k=40, seed=12),
        dict(max_tokens=24, ignore_eos=True, repeat_penalty=1.3),
    ]
    free_prompts = [f"{PROMPTS[i % len(PROMPTS)]} free {i}" for i in range(8)]
    jobs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for k, schema in enumerate(SCHEMAS):
        for i in range(20):
            params: dict[str, Any] = dict(max_tokens=96, json_schema=schema)
            if i % 2:
                params.update(temperature=0.9, seed=1000 * k + i)
            jobs.append((f"{PROMPTS[i % len(PROMPTS)]} {k}:{i}", params, schema))

    async with Engine.open(untied_model_path, max_batch_size=16) as engine:
        solo = [await engine.generate(p, **free_params[i % len(free_params)]) for i, p in enumerate(free_prompts)]
        constrained: list[Completion | None] = [None] * len(jobs)
        free: list[Completion | None] = [None] * len(free_prompts)

        async def run_constrained(j: int) -> None:
            constrained[j] = await engine.generate(jobs[j][0], **jobs[j][1])

        async def run_free(j: int) -> None:
            # grammars compile off the engine thread, so a free request no longer waits
            # behind them: start once constrained lanes are in the engine, to share steps
            await wait_until(engine, lambda s: s.stats.live_grammars > 0)
            free[j] = await engine.generate(free_prompts[j], **free_params[j % len(free_params)])

        async with anyio.create_task_group() as tg:
            for j in range(len(jobs)):
                tg.start_soon(run_constrained, j)
                if j % 12 == 0 and j // 12 < len(free_prompts):
                    tg.start_soon(run_free, j // 12)

    values: list[list[Any]] = [[] for _ in SCHEMAS]
    for (_, _, schema), done in zip(jobs, constrained, strict=True):
        assert done is not None
        values[SCHEMAS.index(schema)].append(check_json(done, schema))
    for per_schema in values:  # the model really chose: not one answer everywhere
        assert len({json.dumps(v) for v in per_schema}) > 1

    steps = [(d.timing.admitted_step, d.timing.finished_step) for d in constrained if d is not None]
    for alone, together in zip(solo, free, strict=True):
        assert together is not None
        assert together.token_ids == alone.token_ids
        assert together.finish_reason == "length"
        lo, hi = together.timing.admitted_step, together.timing.finished_step
        assert any(a <= hi and lo <= b for a, b in steps)  # it shared steps with constrained lanes


@pytest.mark.anyio
async def test_an_engine_without_the_mask_op_masks_on_the_host(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine older than baseRT_mask_logits_row: the grammar mask is applied to the host's f16
    logits row instead, with the same outputs (greedy and seeded) as the engine's own mask op."""
    jobs = [(f"{PROMPTS[i % len(PROMPTS)]} {i}", dict(max_tokens=64, json_schema=SCHEMAS[i % len(SCHEMAS)],
             **({"temperature": 0.9, "seed": i} if i % 2 else {}))) for i in range(6)]  # fmt: skip

    async def run() -> list[Completion]:  # the jobs at once, sharing steps
        out: dict[int, Completion] = {}
        async with Engine.open(untied_model_path, max_batch_size=4) as engine:

            async def one(i: int) -> None:
                out[i] = await engine.generate(jobs[i][0], **jobs[i][1])

            async with anyio.create_task_group() as tg:
                for i in range(len(jobs)):
                    tg.start_soon(one, i)
        return [out[i] for i in range(len(jobs))]

    with_op = await run()
    real_has = Library.has
    monkeypatch.setattr(Library, "has", lambda self, name: name != "baseRT_mask_logits_row" and real_has(self, name))
    on_host = await run()
    for (_, params), a, b in zip(jobs, with_op, on_host, strict=True):
        check_json(b, params["json_schema"])
        assert a.token_ids == b.token_ids


@pytest.mark.anyio
async def test_any_json_value(untied_model_path: Path) -> None:
    async with Engine.open(untied_model_path, max_batch_size=8) as engine:
        # A random model rarely closes what it opens; a mild bias toward the closing
        # tokens lets every output finish, while the grammar decides what is allowed.
        closers = {(await engine.encode(s))[0]: 5.0 for s in ('"', "]", "}")}
        closers[EOS_ID] = 5.0
        outputs = []
        for i in range(12):
            sampled: dict[str, Any] = dict(temperature=1.0, seed=i) if i >= 4 else {}
            done = await engine.generate(
                f"{PROMPTS[i % len(PROMPTS)]} {i}", max_tokens=96, json_schema=True, logit_bias=closers, **sampled
            )
            outputs.append(check_json(done, True))
        assert len({type(v) for v in outputs}) > 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "foo"}, "Invalid type"),
        ({"not": {"type": "string"}}, "not"),
        ({"$ref": "#/definitions/missing"}, "missing"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"enum": [float("nan")]}, "invalid json_schema"),
    ],
)
async def test_invalid_schema_fails_its_caller_only(untied_model_path: Path, schema: Any, message: str) -> None:
    async with Engine.open(untied_model_path, max_batch_size=4) as engine:
        alone = await engine.generate("keep going", max_tokens=32, ignore_eos=True)
        other = engine.stream("keep going", max_tokens=32, ignore_eos=True)
        first = [await other.__anext__() for _ in range(4)]
        with pytest.raises(InvalidRequestError, match=message):
            await engine.generate("bad", max_tokens=16, json_schema=schema)
        rest = [t async for t in other]
        assert [t.id for t in first + rest] == alone.token_ids
        assert rest[-1].finish_reason == "length"
        check_json(await engine.generate("still fine", max_tokens=32, json_schema=COLOR), COLOR)


def _integer_fields(n: int) -> dict[str, Any]:
    """`n` integer properties, each with its own minimum: a lexeme each, and a large lexer."""
    return {"type": "object", "properties": {f"f{i}": {"type": "integer", "minimum": i} for i in range(n)}}


@pytest.mark.anyio
async def test_a_pathological_schema_stops_at_the_compilers_limits(untied_model_path: Path) -> None:
    # Issue 26 left (a): a compile's work is bounded while it runs, not judged after it returns.
    # 8,000 integer properties (0.4 MB, within every cap; more than the engine's compiler takes)
    # need more lexer fuel than GRAMMAR_LIMITS give: llguidance stops there (0.1-0.5 s on SmolLM2's
    # vocabulary) with its reason, where it used to build the whole grammar twice (2 x 6 s there,
    # paid in full before the 5 s budget could refuse it; on a faster machine it was accepted).
    async with Engine.open(untied_model_path, max_batch_size=2) as engine:
        with pytest.raises(InvalidRequestError, match=r"^invalid json_schema: .*lexer .*too big"):
            await engine.generate("x", max_tokens=4, json_schema=_integer_fields(8000))
        done = await engine.generate("x", max_tokens=12, json_schema={"type": "integer"})
        assert int(done.text) == json.loads(done.text)


def test_the_largest_tool_set_allowed_compiles_within_the_limits(
    untied_model_path: Path, host_grammar: Callable[..., GrammarBackend]
) -> None:
    # 128 tools (aiobasert.tools.MAX_TOOLS) of 40 mixed properties each, and 1,000 integer fields:
    # the limits refuse only what is far past real schemas.
    from aiobasert.tools import MAX_TOOLS, parse_tools, tool_grammar

    kinds: list[dict[str, Any]] = [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "number"},
                                   {"type": "boolean"}, {"enum": ["a", "b"]}, {"type": "array"}]  # fmt: skip
    tools = parse_tools([{"type": "function", "function": {"name": f"tool_{t}", "parameters": {
        "type": "object", "properties": {f"p{i}": kinds[i % len(kinds)] for i in range(40)}}}}
        for t in range(MAX_TOOLS)])  # fmt: skip
    vocab = read_bundle(untied_model_path).config["vocab_size"]
    backend = host_grammar(untied_model_path, vocab_size=vocab)
    lark = tool_grammar(tools, "required")
    assert lark is not None
    assert backend.compile_lark(lark).error is None
    assert backend.compile(_integer_fields(1000)).error is None


# ---- the real model -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.anyio
async def test_smollm2_chat_answers_in_schema(smollm2_f16_path: Path) -> None:
    # f16: the demo's q4 weights with 8-bit activations, held to this schema, keep writing digits of
    # population_millions (11.1111...) until max_tokens; the grammar itself is the same on both.
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    }
    messages = [
        {
            "role": "user",
            "content": "What is the capital of France? Answer in JSON with the city, "
            "its country and its population in millions.",
        }
    ]
    async with Engine.open(smollm2_f16_path, max_batch_size=2) as engine:
        done = await engine.chat(messages, max_tokens=80, json_schema=schema)
    value = check_json(done, schema)
    assert value["city"] == "Paris"


def ref_chain(n: int) -> dict[str, Any]:
    """A schema of n `$ref`s, each to the next (the issue-18 attack: llguidance
    recurses once per link; ~1,000 of them overflowed the engine thread's stack)."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string", "maxLength": 3}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


_REF_CHAIN_RUN = """
import json, sys, anyio
from pathlib import Path
from aiobasert import Engine, InvalidRequestError
sys.path[:0] = [sys.argv[2], str(Path(sys.argv[2]).parent)]  # tests/sdk and tests/ (its helpers)
from test_structured import ref_chain

async def main() -> None:
    out = {}
    async with Engine.open(sys.argv[1], max_batch_size=4) as engine:
        neighbour = engine.stream("neighbour", max_tokens=64, ignore_eos=True)
        await neighbour.__anext__()
        for n in (1000, 5000):
            try:
                done = await engine.generate("chain", max_tokens=8, json_schema=ref_chain(n))
                out[n] = "compiled:" + done.finish_reason
            except InvalidRequestError as exc:
                out[n] = "refused:" + str(exc)
        out["neighbour"] = 1 + len([t async for t in neighbour])
    print(json.dumps(out))

anyio.run(main)
"""


def test_a_deep_ref_chain_cannot_crash_the_process(untied_model_path: Path) -> None:
    # In a child process: on failure (a segfault) the suite survives to report it.
    import subprocess
    import sys

    here = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", _REF_CHAIN_RUN, str(untied_model_path), here],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["1000"].startswith(("compiled:", "refused:")), out  # within the caps: compiles on a worker
    assert out["5000"].startswith("refused:") and "json_schema" in out["5000"] and "$ref" in out["5000"], out
    assert out["neighbour"] == 64  # the other stream went on


@pytest.mark.anyio
async def test_a_slow_grammar_compile_does_not_stop_other_lanes(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compile is held until released (a 40,000-entry enum took 0.7 s): the
    # engine keeps stepping the running stream meanwhile. Counted in engine
    # steps and delivered tokens, not seconds.
    from aiobasert._core.prepare import Preparer

    compile = HeldCall(monkeypatch, Preparer, "build_constraint")
    async with Engine.open(untied_model_path, max_batch_size=4) as engine:
        running = engine.stream("running", max_tokens=2000, ignore_eos=True)
        await running.__anext__()
        constrained = engine.stream("json", max_tokens=64, json_schema=PERSON)
        constrained.submit()
        async with compile.holding():
            await assert_engine_steps_on(engine, running, compile)  # steps on while the compile is held
        with anyio.fail_after(60):
            check_json(await constrained, PERSON)
        await running.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("levels", [100, 5000])
async def test_a_deeply_nested_schema_is_a_typed_error(untied_model_path: Path, levels: int) -> None:
    # 5000 levels raised a raw RecursionError in the caller; 100 reached the compilers.
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    async with Engine.open(untied_model_path, max_batch_size=2) as engine:
        with pytest.raises(InvalidRequestError, match="json_schema: is nested more than 64 levels"):
            await engine.generate("x", max_tokens=3, json_schema=schema)
        assert len((await engine.generate("x", max_tokens=3, ignore_eos=True)).token_ids) == 3


@pytest.mark.anyio
async def test_a_request_cancelled_while_its_grammar_compiles_is_dropped(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiobasert._core.prepare import Preparer

    compile = HeldCall(monkeypatch, Preparer, "build_constraint")
    async with Engine.open(untied_model_path, max_batch_size=2) as engine:
        s = engine.stream("json", max_tokens=16, json_schema=PERSON)
        s.submit()
        async with compile.holding():
            await s.aclose()
            stats = await engine.stats()  # answered while the compile is held
            assert stats.requests_cancelled == 1 and stats.active_lanes == stats.waiting_requests == 0
        with anyio.fail_after(30):  # the late grammar is freed, never run
            await wait_until(engine, lambda s: s.stats.live_grammars == 0 and s.count("preparing") == 0)
            assert (await engine.stats()).active_lanes == 0


@pytest.mark.anyio
async def test_an_abort_does_not_wait_for_a_grammar_compile(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compile is held; closing with abort=True answers its request with
    # EngineClosedError and returns without it (the compile was on the engine
    # thread and the close waited for it).
    from aiobasert import EngineClosedError
    from aiobasert._core.prepare import Preparer

    compile = HeldCall(monkeypatch, Preparer, "build_constraint")
    engine = await Engine.open(untied_model_path, max_batch_size=2)
    s = engine.stream("json", max_tokens=16, json_schema=PERSON)
    s.submit()
    async with compile.holding():
        await engine.aclose(abort=True)
        assert not compile.released and thread_state(engine).models_freed == 1
        with pytest.raises(EngineClosedError):
            await s


@pytest.mark.anyio
async def test_backend_end_ids_are_the_engines(lib: Library, tmp_path: Path) -> None:
    """The grammar offers exactly the tokens the engine ends generation on (asked of the engine,
    not a copy of its list): here Gemma's <end_of_turn> stored as a normal token, as older Gemma
    GGUFs do. The engine's own backend, built for its first schema only llguidance takes (`enum`)."""
    path = build_tiny_model(tmp_path / "gemma_vocab.base", extra_tokens=(("<start_of_turn>", 3), ("<end_of_turn>", 1)))
    tokens = read_bundle(path).tokenizer["tokenizer.ggml.tokens"]
    m = lib.baseRT_load_tokenizer_only(str(path).encode())
    try:
        engine_ends = [t for t in range(len(tokens)) if lib.baseRT_is_eos_token(m, t)]
    finally:
        lib.baseRT_free_model(m)
    async with Engine.open(path, max_batch_size=1) as engine:
        await engine.generate("x", max_tokens=4, json_schema={"enum": ["red", "green"]})
        backend = engine._thread.prep.backend  # private on purpose: the host backend's end ids have no public view
    assert backend is not None and backend.end_ids == engine_ends
    assert tokens.index("<end_of_turn>") in engine_ends


@pytest.mark.anyio
@pytest.mark.parametrize("host", [False, True])
async def test_an_object_without_additional_properties_gets_only_its_properties(
    tiny_model_path: Path, host: bool
) -> None:
    """The engine's own grammar reads an absent additionalProperties as false; the host's
    (llguidance, for schemas the engine cannot enforce: here an anyOf) reads the schema the
    same way, so one request means one thing on either. Biased towards "," (a model adding
    properties), the output still closes once its properties are written."""
    from tool_checks import backends

    schema: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    if host:
        schema["properties"]["b"] = {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        bias = {(await engine.encode(","))[0]: 8.0, (await engine.encode('"'))[0]: 4.0}
        done = await engine.generate("{", json_schema=schema, max_tokens=200, temperature=1.0, seed=1,
                                     logit_bias=bias)  # fmt: skip
        assert await backends(engine) == ({"llguidance": 1} if host else {"engine": 1})
        assert done.finish_reason == "stop", done
        assert set(json.loads(done.text)) <= set(schema["properties"])
        jsonschema.validate(json.loads(done.text), schema)

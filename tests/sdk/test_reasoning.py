"""Reasoning models in the SDK (aiobasert.reasoning): the thought kept apart from the answer, its budget,
structured output and tool calls after it, stop strings outside it, the template's knobs.

On tiny random-weight models with real templates (Qwen3-0.6B's, DeepSeek-R1-Distill's, Llama 3.1's with a
`<think>` opening) and the tags as tokens: a budget or a `logit_bias` makes the thought deterministic."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiobasert import Engine, EngineConfig, InvalidConfigError, InvalidRequestError
from aiobasert.chat import DEFAULT_TEMPLATE
from aiobasert.reasoning import THINK, ReasoningDelta, Thinking, reasoning_format_for
from aiobasert.tools import ChatReply, TextDelta, ToolCallDelta

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": [3, 4, 5]}}, "required": ["answer"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
    },
}
TAGS = frozenset({"<think>", "</think>", "<|im_start|>", "<|im_end|>"})


# ---- the format, known from the template and the vocabulary --------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["Qwen-Qwen3-0.6B", "Qwen-QwQ-32B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "HuggingFaceTB-SmolLM3-3B"],
)
def test_think_format_is_known_from_template_and_tokens(llama_cpp_templates_dir: Path, name: str) -> None:
    template = (llama_cpp_templates_dir / f"{name}.jinja").read_text()
    assert reasoning_format_for(template, TAGS) is THINK
    assert reasoning_format_for(template, TAGS - {"</think>"}) is None  # the tags must be tokens
    assert THINK.has_knob(template)


def test_models_that_do_not_reason_have_no_format(llama_cpp_templates_dir: Path) -> None:
    for name in ("Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct"):
        assert reasoning_format_for((llama_cpp_templates_dir / f"{name}.jinja").read_text(), TAGS) is None
    assert reasoning_format_for(DEFAULT_TEMPLATE, TAGS) is None


# llama.cpp's tests/test-chat.cpp cases for `reasoning_format: deepseek` (the thought trimmed, as here)
SPLITS = [
    ("<think>I'm\nthinking</think>Hello, world!\nWhat's up?", False, "I'm\nthinking", "Hello, world!\nWhat's up?"),
    ("I'm\nthinking</think>Hello, world!\nWhat's up?", True, "I'm\nthinking", "Hello, world!\nWhat's up?"),
    ("<think>\nI'm thinking\n</think>\n\nHello", False, "I'm thinking", "Hello"),
    ("Hello, world!", False, None, "Hello, world!"),
    ("  <think>never closed", False, "never closed", ""),
    ("I'm thinking and never close", True, "I'm thinking and never close", ""),
    ("Hi <think>x</think>", False, None, "Hi <think>x</think>"),  # a tag after text is text
]


def _split(text: str, cuts: list[int], open_at_start: bool) -> tuple[str | None, str]:
    splitter = THINK.splitter(open_at_start=open_at_start)
    parts = []
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    for a, b in itertools.pairwise(bounds):
        parts += splitter.feed(text[a:b])
    parts += splitter.close()
    thought = "".join(t for k, t in parts if k == "reasoning")
    return (thought if splitter.thought_seen else None), "".join(t for k, t in parts if k == "content")


@given(case=st.sampled_from(SPLITS), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_splitter_parses_llama_cpp_cases_however_the_text_is_cut(
    case: tuple[str, bool, str | None, str], cuts: list[int]
) -> None:
    text, open_at_start, thought, content = case
    assert _split(text, cuts, open_at_start) == (thought, content)


def test_thinking_options_are_checked() -> None:
    assert Thinking.of(True) == Thinking(enabled=True)
    for bad in ({"budget": -1}, {"budget": True}, {"enabled": "yes"}, {"enabled": False, "budget": 3}):
        with pytest.raises(InvalidRequestError, match="thinking"):
            Thinking(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="thinking"):
        Thinking.of("on")


# ---- the thought in a chat turn ----------------------------------------------------------------------


async def test_a_budget_closes_the_thought_and_the_reply_keeps_it_apart(r1_think_model_path: Path) -> None:
    async with Engine.open(r1_think_model_path, max_batch_size=2) as engine:
        assert engine.reasoning_format is THINK
        budget = 6
        stream = engine.stream_chat(USER, max_tokens=24, temperature=0, thinking=Thinking(budget=budget))
        deltas = [d async for d in stream]
        reply = await stream
        assert reply.reasoning is not None and "</think>" not in reply.reasoning + reply.content
        assert reply.usage.reasoning_tokens == budget + 1  # the thought's tokens and the close tag the engine wrote
        kinds = [type(d) for d in deltas]
        assert ReasoningDelta in kinds and kinds.index(ReasoningDelta) < kinds.index(TextDelta)
        assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == reply.reasoning
        assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == reply.content


async def test_thinking_off_writes_the_empty_thought_into_the_prompt(qwen3_think_model_path: Path) -> None:
    async with Engine.open(qwen3_think_model_path, max_batch_size=2) as engine:
        # private on purpose: the rendered pieces and the thought's state have no public view
        on = engine._prepare_chat(USER, thinking=True)
        off = engine._prepare_chat(USER, thinking=False)
        via_kwargs = engine._prepare_chat(USER, chat_template_kwargs={"enable_thinking": False})
        assert off.pieces == via_kwargs.pieces != on.pieces
        assert off.pieces[-1][0].endswith("<think>\n\n</think>\n\n") and off.thought is None
        assert on.thought is not None and not on.thought.starts_open  # Qwen3 opens its thought itself
        with pytest.raises(InvalidRequestError, match=r"thinking: chat_template_kwargs\.enable_thinking"):
            engine._prepare_chat(USER, thinking=True, chat_template_kwargs={"enable_thinking": False})


async def test_qwen3_opens_its_thought_and_the_engine_closes_it_at_the_budget(qwen3_think_model_path: Path) -> None:
    async with Engine.open(qwen3_think_model_path, max_batch_size=2) as engine:
        think = (await engine.encode("<think>", special=True))[0]
        reply = await engine.stream_chat(
            USER, max_tokens=12, temperature=0, logit_bias={think: 100}, thinking=Thinking(budget=3)
        )
        # the bias writes `<think>` over and over: the first opens the thought, 3 more are its text
        assert reply.reasoning == "<think>" * 3
        assert reply.usage.reasoning_tokens == 5
        assert reply.content.startswith("<think>")  # after the thought: free text again


async def test_stop_strings_match_only_after_the_thought_unless_asked(r1_think_model_path: Path) -> None:
    async with Engine.open(r1_think_model_path, max_batch_size=2) as engine:
        (a,) = await engine.encode("a")
        params = {"max_tokens": 12, "temperature": 0, "logit_bias": {a: 100}, "stop": ["a"]}
        reply = await engine.stream_chat(USER, thinking=Thinking(budget=4), **params)
        assert (reply.reasoning, reply.content, reply.finish_reason) == ("aaaa", "", "stop")
        early = await engine.stream_chat(USER, thinking=Thinking(budget=4, stop_in_thought=True), **params)
        assert (early.reasoning, early.usage.completion_tokens) == ("", 1)


# ---- structured output and tools after the thought ------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
async def test_json_schema_starts_after_the_thought(r1_think_model_path: Path, seed: int) -> None:
    async with Engine.open(r1_think_model_path, max_batch_size=2) as engine:
        reply = await engine.stream_chat(
            USER, max_tokens=64, seed=seed, json_schema=SCHEMA, thinking=Thinking(budget=5 + seed)
        )
        assert reply.reasoning is not None and reply.usage.reasoning_tokens == 6 + seed
        assert reply.finish_reason == "stop"
        jsonschema.validate(json.loads(reply.content), SCHEMA)


async def test_json_schema_lets_a_free_thought_open_first(qwen3_think_model_path: Path) -> None:
    async with Engine.open(qwen3_think_model_path, max_batch_size=2) as engine:
        think = (await engine.encode("<think>", special=True))[0]
        reply = await engine.stream_chat(
            USER, max_tokens=64, temperature=0, logit_bias={think: 100}, json_schema=SCHEMA, thinking=Thinking(budget=2)
        )
        assert reply.reasoning == "<think>" * 2  # the grammar did not forbid the thought
        jsonschema.validate(json.loads(reply.content), SCHEMA)


async def _forced_call_after_thought(engine: Engine, thought_tokens: int, **params: object) -> ChatReply:
    """A required call after a thought of budget 4 (`thought_tokens`: those and its tags)."""
    stream = engine.stream_chat(
        USER, tools=[WEATHER], tool_choice="required", thinking=Thinking(budget=4), max_tokens=80, **params
    )
    deltas = [d async for d in stream]
    reply = await stream
    assert reply.reasoning is not None and reply.usage.reasoning_tokens == thought_tokens
    assert reply.tool_calls and reply.finish_reason == "tool_calls"
    for call in reply.tool_calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    first_call = next(i for i, d in enumerate(deltas) if isinstance(d, ToolCallDelta))
    assert all(not isinstance(d, ReasoningDelta) for d in deltas[first_call:])
    return reply


@pytest.mark.parametrize("seed", range(3))
async def test_hermes_calls_after_the_thought(qwen3_think_model_path: Path, seed: int) -> None:
    async with Engine.open(qwen3_think_model_path, max_batch_size=2) as engine:
        assert engine.tool_format.name == "hermes"
        think = (await engine.encode("<think>", special=True))[0]
        await _forced_call_after_thought(engine, 6, seed=seed, logit_bias={think: 100})  # it opens the thought


@pytest.mark.parametrize("seed", range(3))
async def test_llama3_json_calls_after_the_thought(llama3_think_model_path: Path, seed: int) -> None:
    async with Engine.open(llama3_think_model_path, max_batch_size=2) as engine:
        assert engine.tool_format.name == "llama3_json" and engine.reasoning_format is THINK
        await _forced_call_after_thought(engine, 5, seed=seed)  # the prompt opened it


# ---- the template's knobs and its override -------------------------------------------------------------


async def test_template_kwargs_and_thinking_are_refused_where_the_template_has_no_knob(
    tiny_model_path: Path, qwen3_think_model_path: Path
) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        assert engine.reasoning_format is None
        with pytest.raises(InvalidRequestError, match="thinking: this model does not reason"):
            engine.stream_chat(USER, thinking=True)
        with pytest.raises(InvalidRequestError, match="thinking"):
            engine.stream_chat(USER, thinking=False)
        with pytest.raises(InvalidRequestError, match=r"chat_template_kwargs\.enable_thinking"):
            engine.stream_chat(USER, chat_template_kwargs={"enable_thinking": False})
    async with Engine.open(qwen3_think_model_path, max_batch_size=1) as engine:
        for bad in ({"tools": []}, {"x y": 1}, {"enable_thinking": "<|im_end|>"}, {"no_such_knob": 1}):
            with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
                engine.stream_chat(USER, chat_template_kwargs=bad)


async def test_reasoning_sent_back_is_rendered_where_the_template_does(qwen3_think_model_path: Path) -> None:
    turns = [*USER, {"role": "assistant", "content": "4", "reasoning_content": "two and two"}]
    async with Engine.open(qwen3_think_model_path, max_batch_size=1) as engine:
        turn = engine._prepare_chat(turns, add_generation_prompt=False)  # private on purpose: the pieces
        text = "".join(t for t, _ in turn.pieces)
        assert "<think>\ntwo and two\n</think>\n\n4" in text
        assert ("two and two", True) in turn.pieces  # the client's thought is content: never parsed for markers


async def test_chat_template_override(tiny_model_path: Path, llama_cpp_templates_dir: Path) -> None:
    template = (llama_cpp_templates_dir / "Qwen-Qwen3-0.6B.jinja").read_text()
    async with Engine.open(tiny_model_path, max_batch_size=1, chat_template=template) as engine:
        assert engine.chat_template == template and engine.config.chat_template == template
        turn = engine._prepare_chat(USER, chat_template_kwargs={"enable_thinking": False})  # private: the pieces
        assert turn.pieces[-1][0].endswith("<think>\n\n</think>\n\n")
    for bad in ("", "{% if %}", 5):
        with pytest.raises(InvalidConfigError, match="chat_template"):
            EngineConfig(chat_template=bad)  # type: ignore[arg-type]

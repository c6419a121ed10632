"""gpt-oss's tool calls (aiobasert/tools/harmony.py): a commentary message `to=functions.NAME`, its JSON arguments,
`<|call|>`. The parser's oracle is llama.cpp's tests/test-chat.cpp gpt-oss cases (the recipient in the channel's
header or the role's, after a thought or not), cut anywhere; on the tiny model with Harmony's markers and gpt-oss's
own template, a budget closes the thought and the grammar writes one call (or the final answer) after it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiobasert import Engine
from aiobasert.reasoning import HARMONY, ReasoningDelta, Thinking
from aiobasert.tools import HARMONY_TOOLS, HarmonyCallParser, TextDelta, ToolCallDelta, tool_format_for

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ARGS = '{"arg1": 1}'

# llama.cpp's tests/test-chat.cpp, "GPT-OSS format tests": text -> (thought, answer, calls as (name, arguments))
CASES: list[tuple[str, str | None, str, list[tuple[str, str]]]] = [
    ("<|channel|>final<|message|>Hello, world!\nWhat's up?", None, "Hello, world!\nWhat's up?", []),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
        "I'm\nthinking",
        "Hello!",
        [],
    ),
    # the recipient in the role's header
    (
        " to=functions.special_function<|channel|>commentary <|constrain|>json<|message|>" + ARGS,
        None,
        "",
        [("special_function", ARGS)],
    ),
    (
        " to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>" + ARGS,
        None,
        "",
        [("special_function", ARGS)],
    ),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
        "<|start|>assistant to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>" + ARGS,
        "I'm\nthinking",
        "",
        [("special_function", ARGS)],
    ),
    # the recipient in the channel's header (what gpt-oss writes), ended by <|call|>
    (
        "<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>" + ARGS + "<|call|>",
        None,
        "",
        [("special_function", ARGS)],
    ),
    (
        "<|channel|>analysis<|message|>I'll look<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        "I'll look",
        "",
        [("get_weather", '{"city":"Paris"}')],
    ),
    # a preamble to the user on the commentary channel, then the call
    (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.f"
        "<|message|>{}<|call|>",
        None,
        "Checking.",
        [("f", "{}")],
    ),
    # gpt-oss's built-in tools are not functions: neither a call nor text
    (
        "<|channel|>analysis<|message|>I will execute python<|end|>"
        '<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
        "I will execute python",
        "",
        [],
    ),
    # arguments that are not JSON (no grammar held them) are reported as written, as the Hermes parser does
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": <|call|>', None, "", [("f", '{"a": ')]),
]


def _parse(text: str, cuts: list[int]) -> tuple[str | None, str, list[tuple[str, str]], list[Any]]:
    """`text` cut at `cuts` and fed, as a chat stream does, to the reasoning splitter and the call parser."""
    splitter, parser = HARMONY.splitter(open_at_start=False), HarmonyCallParser()
    thought, deltas = [], []
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    for a, b in itertools.pairwise(bounds):
        thought += [t for k, t in splitter.feed(text[a:b]) if k == "reasoning"]
        deltas += parser.feed(text[a:b])
    thought += [t for k, t in splitter.close() if k == "reasoning"]
    deltas += parser.close()
    calls = [(c.name, c.arguments) for c in parser.calls]
    return ("".join(thought) if splitter.thought_seen else None), parser.content, calls, deltas


@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_the_parser_reads_llama_cpp_cases_however_the_text_is_cut(
    case: tuple[str, str | None, str, list[tuple[str, str]]], cuts: list[int]
) -> None:
    text, thought, content, calls = case
    got_thought, got_content, got_calls, deltas = _parse(text, cuts)
    assert (got_thought, got_content, got_calls) == (thought, content, calls)
    # the deltas say the same: the answer in order, each call's id and name first, then its arguments
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == content
    streamed: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.name is not None:
                assert d.index == len(streamed) and d.arguments == ""
                streamed[d.index] = [d.name, ""]
            else:
                streamed[d.index][1] += d.arguments
    assert [tuple(v) for v in streamed.values()] == calls


def test_gpt_oss_template_renders_tools_and_past_calls(llama_cpp_templates_dir: Path) -> None:
    """gpt-oss's template is Harmony's tool format, and renders the tools (its `functions` namespace) and a past
    call with its result as the model writes them."""
    from aiobasert.tools import prepare_chat_turn

    template = (llama_cpp_templates_dir / "openai-gpt-oss-120b.jinja").read_text()
    assert tool_format_for(template) is HARMONY_TOOLS
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    turn = prepare_chat_turn(template, turns, tool_format=HARMONY_TOOLS, tools=[WEATHER], tool_choice="auto",
                             parallel=True, reasoning=HARMONY)  # fmt: skip
    prompt = "".join(text for text, _ in turn.pieces)
    assert "namespace functions" in prompt and "type get_weather = " in prompt
    past = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    assert past in prompt
    # (the template writes a tool's result as JSON)
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>' in prompt
    assert turn.thought is not None and turn.thought.answer_tag == "<|start|>assistant"  # the grammar names the channel
    # several calls in one assistant turn: the template renders one a turn, so each is a turn of its own
    second = {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    turns[1] = {**turns[1], "reasoning_content": "Two calls", "tool_calls": [call, second]}
    turns.append({"role": "tool", "tool_call_id": "c2", "content": "noon"})
    turn = prepare_chat_turn(template, turns, tool_format=HARMONY_TOOLS, tools=[WEATHER, TIME], tool_choice="auto",
                             parallel=True, reasoning=HARMONY)  # fmt: skip
    prompt = "".join(text for text, _ in turn.pieces)
    assert prompt.count("<|channel|>analysis<|message|>Two calls<|end|>") == 1
    assert (
        past in prompt
        and "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>" in (prompt)
    )


async def _turn(engine: Engine, **kwargs: Any) -> tuple[Any, list[Any]]:
    stream = engine.stream_chat(USER, tools=[WEATHER, TIME], max_tokens=200, **kwargs)
    deltas = [d async for d in stream]
    return await stream, deltas


@pytest.mark.parametrize("seed", range(3))
async def test_a_required_call_follows_the_thought(harmony_model_path: Path, seed: int) -> None:
    """tool_choice "required" (and a named function): after the thought the engine closes at its budget, one call
    on the commentary channel, its arguments under the tool's schema, ended by `<|call|>` (which ends the turn)."""
    async with Engine.open(harmony_model_path, max_batch_size=1) as engine:
        assert engine.tool_format is HARMONY_TOOLS
        for choice in ("required", "get_weather"):
            reply, deltas = await _turn(
                engine, tool_choice=choice, thinking=Thinking(budget=3), seed=seed, temperature=1.0
            )
            assert reply.reasoning is not None and reply.usage.reasoning_tokens >= 3 + 1
            assert reply.content == "" and reply.finish_reason == "tool_calls"
            (call,) = reply.tool_calls
            assert choice == "required" or call.name == choice
            schema = WEATHER if call.name == "get_weather" else TIME
            jsonschema.validate(json.loads(call.arguments), schema["function"]["parameters"])  # type: ignore[index]
            assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == reply.reasoning
            calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
            assert (calls[0].id, calls[0].name) == (call.id, call.name)
            assert "".join(d.arguments for d in calls) == call.arguments


async def test_auto_is_a_call_or_the_final_answer_and_none_the_answer(harmony_model_path: Path) -> None:
    """tool_choice "auto": after the thought, the final answer (the turn ends at `<|return|>`) or a call, as the
    model picks (across seeds, both); "none": the final answer, its body without framing."""
    kinds = set()
    async with Engine.open(harmony_model_path, max_batch_size=1) as engine:
        for seed in range(6):
            params: dict[str, Any] = {"thinking": Thinking(budget=2), "seed": seed, "temperature": 1.0}
            reply, deltas = await _turn(engine, **params)
            assert reply.reasoning is not None
            assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == reply.content
            assert "<|" not in reply.content  # the final channel's body: no framing
            if reply.tool_calls:
                assert reply.content == "" and reply.finish_reason == "tool_calls"
                kinds.add("call")
            elif reply.finish_reason == "stop":
                kinds.add("answer")
            none, _ = await _turn(engine, tool_choice="none", **params)
            assert none.tool_calls == [] and none.reasoning is not None and "<|" not in none.content
    assert kinds == {"call", "answer"}


def test_a_continued_final_answer_is_not_made_to_open_a_message(llama_cpp_templates_dir: Path) -> None:
    """A prefill on gpt-oss continues the final channel's body (`...<|channel|>final<|message|>The`): the call
    grammar, which opens a new message (`<|channel|>` then final or a call), cannot follow there; it made the
    model write a channel header inside its answer. "auto" and "none" continue the answer free; a call that
    must come cannot, and is refused by name."""
    from aiobasert.errors import InvalidRequestError
    from aiobasert.tools._turn import prepare_chat_turn

    template = (llama_cpp_templates_dir / "openai-gpt-oss-120b.jinja").read_text()
    turns = [*USER, {"role": "assistant", "content": "The weather"}]
    for choice in ("auto", "none"):
        turn = prepare_chat_turn(template, turns, tool_format=HARMONY_TOOLS, tools=[WEATHER], tool_choice=choice,
                                 parallel=True, reasoning=HARMONY, continue_final_message=True)  # fmt: skip
        assert "".join(t for t, _ in turn.pieces).endswith("<|channel|>final<|message|>The weather")
        assert turn.lark is None and turn.thought is None and not turn.forced
    for choice in ("required", "get_weather"):
        with pytest.raises(InvalidRequestError, match=r"^tool_choice: .*continue"):
            prepare_chat_turn(template, turns, tool_format=HARMONY_TOOLS, tools=[WEATHER], tool_choice=choice,
                              parallel=True, reasoning=HARMONY, continue_final_message=True)  # fmt: skip

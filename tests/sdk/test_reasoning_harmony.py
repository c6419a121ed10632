"""gpt-oss's Harmony framing as a reasoning format (aiobasert/reasoning/harmony.py): the analysis channel is the
thought, the final (and commentary) channel the answer, calls and framing neither; detected from gpt-oss's own
template and the markers as tokens; a reasoning budget closes the thought with the final channel's header (tool
calls: tests/sdk/test_tools_harmony.py).

The splitter's oracle is llama.cpp's tests/test-chat.cpp gpt-oss cases, and a property: however a rendered turn is
cut into deltas, the same thought and answer come out. The tiny model has Harmony's markers as control tokens and
gpt-oss's template (llama.cpp's copy)."""

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
from aiobasert.reasoning import HARMONY, THINK, ReasoningDelta, Thinking, reasoning_format_for
from aiobasert.tools import TextDelta, prepare_chat_turn

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "What is 2 + 2?"}]
MARKERS = frozenset(("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"))

# llama.cpp's tests/test-chat.cpp, "GPT-OSS format tests" (reasoning_format auto): text -> (reasoning, content)
LLAMA_CPP_CASES: list[tuple[str, str | None, str]] = [
    ("<|channel|>final<|message|>Hello, world!\nWhat's up?", None, "Hello, world!\nWhat's up?"),
    ("<|channel|>commentary<|message|>Hello, world!\nWhat's up?", None, "Hello, world!\nWhat's up?"),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello, "
        "world!\nWhat's up?",
        "I'm\nthinking",
        "Hello, world!\nWhat's up?",
    ),
    ("<|channel|>analysis<|message|>I'm\nthinking", "I'm\nthinking", ""),  # partial
    # calls (a recipient in the role header or the channel's): neither thought nor answer
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', None, ""),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', None, ""),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', None, ""),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', None, ""),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
        '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
        "I'm\nthinking",
        "",
    ),
    (
        "<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
        '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}',
        "I need to output the invoice details in JSON",
        '{"amount": 123.45, "date": "2025-12-03"}',
    ),
    (
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
        "<|start|>assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
        "I will execute python to say hello",
        "",
    ),
    (
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
        '<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
        "I will execute python to say hello",
        "",
    ),
    (
        "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello, world!\nWhat's up?",
        "I'm\nthinking",
        "Hello, world!\nWhat's up?",
    ),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>commentary to=assistant"
        "<|channel|>final<|message|>Hello, world!\nWhat's up?",
        "I'm\nthinking",
        "Hello, world!\nWhat's up?",
    ),
    # ours: a turn's end, unframed text (fail open: nothing generated is lost)
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>", "a", "b"),
    ("Hello <|channel|>x", None, "Hello <|channel|>x"),
]


def _split(text: str, cuts: list[int], open_at_start: bool = False) -> tuple[str | None, str]:
    splitter = HARMONY.splitter(open_at_start=open_at_start)
    parts = []
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    for a, b in itertools.pairwise(bounds):
        parts += splitter.feed(text[a:b])
    parts += splitter.close()
    thought = "".join(t for k, t in parts if k == "reasoning")
    return (thought if splitter.thought_seen else None), "".join(t for k, t in parts if k == "content")


@given(case=st.sampled_from(LLAMA_CPP_CASES), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_splitter_parses_llama_cpp_cases_however_the_text_is_cut(
    case: tuple[str, str | None, str], cuts: list[int]
) -> None:
    text, thought, content = case
    assert _split(text, cuts) == (thought, content)


BODY = st.text(alphabet="ab <|>\nto=é", max_size=12).filter(lambda s: not any(m in s for m in MARKERS))
MESSAGE = st.tuples(st.sampled_from(["analysis", "final", "commentary", "commentary to=functions.f"]), BODY)


@given(
    messages=st.lists(MESSAGE, min_size=1, max_size=5),
    last=st.sampled_from(["", "<|return|>", "<|end|>"]),
    open_at_start=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=10),
)
def test_any_turn_cut_anywhere_gives_the_same_thought_and_answer(
    messages: list[tuple[str, str]], last: str, open_at_start: bool, cuts: list[int]
) -> None:
    """A turn of Harmony messages (the first's header given by the prompt when it opened the thought), cut into
    deltas at random: the analysis bodies are the thought, the final and commentary ones the answer, calls neither."""
    if open_at_start:
        messages = [("analysis", messages[0][1]), *messages[1:]]
    texts = []
    for i, (channel, body) in enumerate(messages):
        header = "" if i == 0 else "<|start|>assistant"
        end = last if i == len(messages) - 1 else ("<|call|>" if "to=" in channel else "<|end|>")
        texts.append(f"{header}<|channel|>{channel}<|message|>{body}{end}")
    text = "".join(texts)
    if open_at_start:
        text = text.removeprefix("<|channel|>analysis<|message|>")
    thought = "".join(body for channel, body in messages if channel == "analysis")
    seen = any(channel == "analysis" for channel, _ in messages)
    answer = "".join(body for channel, body in messages if channel in ("final", "commentary"))
    assert _split(text, cuts, open_at_start) == ((thought if seen else None), answer)
    assert _split(text, [], open_at_start) == ((thought if seen else None), answer)


def test_harmony_is_known_from_gpt_oss_template_and_its_markers(llama_cpp_templates_dir: Path) -> None:
    template = (llama_cpp_templates_dir / "openai-gpt-oss-120b.jinja").read_text()
    assert reasoning_format_for(template, MARKERS) is HARMONY
    assert reasoning_format_for(template, MARKERS - {"<|channel|>"}) is None  # the markers must be tokens
    qwen3 = (llama_cpp_templates_dir / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert reasoning_format_for(qwen3, MARKERS | {"<think>", "</think>"}) is THINK
    assert not HARMONY.has_knob(template)  # gpt-oss always thinks: `thinking=True/False` is refused
    assert HARMONY.prompt_state("<|start|>assistant") == "free"
    assert HARMONY.prompt_state("<|start|>assistant<|channel|>analysis<|message|>") == "open"
    assert HARMONY.prompt_state("<|start|>assistant<|channel|>final<|message|>") == "closed"


async def test_a_harmony_model_streams_its_thought_apart(harmony_model_path: Path) -> None:
    """On the tiny model: with gpt-oss's template (the model names its channel) the random model writes no
    header, so its text is all answer (fail open); with the template changed so the generation prompt opens
    the analysis channel, its text is thought up to the `<|end|>` a bias makes it write, and the turn goes on
    after it (Harmony's `<|end|>` ends a message, not the turn: the reference engine does not stop on it where
    the vocabulary has `<|return|>` / `<|call|>`); the unframed text after it is the answer."""
    params = {"max_tokens": 16, "temperature": 0}
    async with Engine.open(harmony_model_path, max_batch_size=1) as engine:
        assert engine.reasoning_format is HARMONY
        end = (await engine.encode("<|end|>", special=True))[0]
        raw = await engine.stream(await _prompt(engine), **params)
        reply = await engine.stream_chat(USER, **params)
        assert (reply.reasoning, reply.content) == (None, raw.text) and raw.text
        assert reply.usage.reasoning_tokens == 0
        template = engine.chat_template
    opening = "<|start|>assistant\n{%- endif -%}"
    assert opening in template
    template = template.replace(opening, "<|start|>assistant<|channel|>analysis<|message|>\n{%- endif -%}")
    async with Engine.open(harmony_model_path, max_batch_size=1, chat_template=template) as engine:
        params["logit_bias"] = {end: 5}  # type: ignore[assignment]
        raw = await engine.stream(await _prompt(engine), **params)
        stream = engine.stream_chat(USER, **params)
        deltas = [d async for d in stream]
        reply = await stream
    assert 0 < raw.token_ids.index(end) < len(raw.token_ids) - 1  # the bias closed the thought mid-reply ...
    assert raw.finish_reason == "length"  # ... and the turn went on: <|end|> ends a message, not the turn
    at = raw.token_ids.index(end)
    assert reply.reasoning == "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    assert reply.reasoning == raw.text[: raw.text.index("<|end|>")]
    assert reply.usage.reasoning_tokens == at + 1  # the thought's tokens and its end
    assert reply.content == "".join(d.text for d in deltas if isinstance(d, TextDelta))
    assert reply.content and not reply.content.startswith("<|end|>")


async def _prompt(engine: Engine) -> str:
    turn = prepare_chat_turn(
        engine.chat_template,
        USER,
        tool_format=engine.tool_format,
        tools=None,
        tool_choice=None,
        parallel=True,
        reasoning=engine.reasoning_format,
    )
    return "".join(text for text, _ in turn.pieces)


def _opening(template: str) -> str:
    """gpt-oss's template with its generation prompt opening the analysis channel: the model's output is thought
    from its first token (the random tiny model never writes the header itself)."""
    opening = "<|start|>assistant\n{%- endif -%}"
    assert opening in template
    return template.replace(opening, "<|start|>assistant<|channel|>analysis<|message|>\n{%- endif -%}")


FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.mark.parametrize("budget", [0, 1, 3])
async def test_a_budget_closes_a_harmony_thought_and_the_final_channel_follows(
    harmony_model_path: Path, budget: int
) -> None:
    """Past the budget the engine writes `<|end|>` and the final channel's header itself (as it writes `</think>`
    for a `<think>` model): the thought has `budget` tokens (a bias makes each one `a`), the answer is what the
    model writes on the final channel, and the thought's tokens are counted with its end (`<|end|>`), as a
    `<think>` model's with its tags."""
    async with Engine.open(harmony_model_path, max_batch_size=1) as plain:
        template = _opening(plain.chat_template)
    async with Engine.open(harmony_model_path, max_batch_size=1, chat_template=template) as engine:
        final = await engine.encode(FINAL, special=True)
        (a,) = await engine.encode("a")
        params: dict[str, Any] = {"max_tokens": 16, "temperature": 0, "logit_bias": {a: 100}}
        stream = engine.stream_chat(USER, thinking=Thinking(budget=budget), **params)
        ids, deltas = [], []
        async for tok in stream.tokens:  # the tokens, and the deltas each completes
            ids.append(tok.id)
            deltas += stream.feed(tok)
        deltas += stream.close_parser()
        reply = stream.reply()
        unbounded = await engine.stream_chat(USER, **params)
    assert ids == [a] * budget + final + [a] * (16 - budget - len(final))
    assert (reply.reasoning, reply.content) == ("a" * budget, "a" * (16 - budget - len(final)))
    assert reply.reasoning == "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    assert reply.content == "".join(d.text for d in deltas if isinstance(d, TextDelta))
    assert reply.usage.reasoning_tokens == budget + 1
    assert reply.usage.completion_tokens == 16 and reply.finish_reason == "length"
    # unbounded, the biased model never closes its thought: all of it is reasoning
    assert (unbounded.reasoning, unbounded.content) == ("a" * 16, "")
    assert unbounded.usage.reasoning_tokens == 16


async def test_a_budget_forces_nothing_on_a_harmony_model_that_does_not_think(harmony_model_path: Path) -> None:
    """With gpt-oss's own template the model names its channel: `<|channel|>` may open any channel, so the gate
    never forces `analysis` after it (a bias makes the model write nothing but `<|channel|>`), and a budget
    leaves the reply as it was. Stop strings still match in the answer."""
    async with Engine.open(harmony_model_path, max_batch_size=1) as engine:
        channel = (await engine.encode("<|channel|>", special=True))[0]
        params: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "logit_bias": {channel: 100}}
        for budget in (None, 0, 2):
            stream = engine.stream_chat(USER, thinking=Thinking(budget=budget), **params)
            assert [tok.id async for tok in stream.tokens] == [channel] * 6
        reply = await engine.stream_chat(USER, max_tokens=4, stop=["a"], thinking=Thinking(budget=1))
        assert reply.usage.completion_tokens <= 4


SCHEMA = {"type": "object", "properties": {"answer": {"enum": [3, 4, 5]}}, "required": ["answer"]}


@pytest.mark.parametrize("seed", range(3))
async def test_json_schema_starts_on_the_final_channel_after_a_harmony_thought(
    harmony_model_path: Path, seed: int
) -> None:
    """With a grammar after the thought the engine writes the final channel's header after `<|end|>` (the
    grammar starts there), and the turn cannot end inside the thought."""
    async with Engine.open(harmony_model_path, max_batch_size=1) as plain:
        template = _opening(plain.chat_template)
    async with Engine.open(harmony_model_path, max_batch_size=1, chat_template=template) as engine:
        reply = await engine.stream_chat(
            USER, max_tokens=64, seed=seed, json_schema=SCHEMA, thinking=Thinking(budget=3 + seed)
        )
    assert reply.reasoning is not None and reply.usage.reasoning_tokens == 4 + seed
    assert reply.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.content), SCHEMA)


def test_a_thought_sent_back_reaches_gpt_oss_template_as_thinking(llama_cpp_templates_dir: Path) -> None:
    """gpt-oss's template reads an assistant turn's thought as `thinking` (and renders it before a tool call)."""
    template = (llama_cpp_templates_dir / "openai-gpt-oss-120b.jinja").read_text()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [
        *USER,
        {"role": "assistant", "content": None, "reasoning_content": "I should call f", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    from aiobasert.tools import tool_format_for

    turn = prepare_chat_turn(
        template, turns, tool_format=tool_format_for(template), tools=None, tool_choice=None, parallel=True
    )
    prompt = "".join(text for text, _ in turn.pieces)
    assert "<|start|>assistant<|channel|>analysis<|message|>I should call f<|end|>" in prompt


async def test_speculation_gives_the_plain_harmony_turns(harmony_model_path: Path) -> None:
    """The thought gate's tags of several tokens (forced one by one), its budget, the call grammar after the
    thought and a json_schema on the final channel, verified as draft rows: n-gram drafts and a draft model
    (the target's weights) give the replies of plain decoding, greedy and seeded, several lanes at once."""
    import anyio

    from aiobasert.config import SpeculationConfig

    user = [{"role": "user", "content": "What is the weather in Paris? the cat sat on the mat the cat sat"}]
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": city}}

    async def replies(spec: SpeculationConfig | None) -> list[Any]:
        out: list[Any] = [None] * 5
        async with Engine.open(harmony_model_path, max_batch_size=4, speculation=spec) as engine:
            (a,) = await engine.encode("a")
            (channel,) = await engine.encode("<|channel|>", special=True)
            bias = {channel: 8.0, a: 3.0}  # the random model opens channels and fills them
            cases: list[dict[str, Any]] = [
                dict(tools=[weather], tool_choice="required", thinking=Thinking(budget=3), seed=1, temperature=1.0),
                dict(tools=[weather], thinking=Thinking(budget=2), temperature=0.0, logprobs=True, top_logprobs=2),
                dict(
                    json_schema={"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]},
                    thinking=Thinking(budget=4),
                    temperature=0.0,
                    logit_bias={channel: 5.0},
                ),
                dict(thinking=Thinking(budget=5), temperature=0.0, logit_bias=bias, stop=["aa"]),
                dict(thinking=Thinking(budget=5), temperature=0.7, seed=4, logit_bias=bias),
            ]

            async def one(i: int) -> None:
                r = await engine.stream_chat(user, max_tokens=60, **cases[i])
                calls = [(c.name, c.arguments) for c in r.tool_calls]
                out[i] = (
                    r.content,
                    r.reasoning,
                    calls,
                    r.finish_reason,
                    r.usage.completion_tokens,
                    r.usage.draft_tokens,
                )

            async with anyio.create_task_group() as tg:
                for i in range(len(cases)):
                    tg.start_soon(one, i)
        return out

    want = await replies(None)
    assert any(w[1] for w in want) and any(w[2] for w in want)  # thoughts and calls among them
    for spec in (SpeculationConfig(adaptive=False, num_speculative_tokens=5),
                 SpeculationConfig(method="draft", draft_model=str(harmony_model_path), adaptive=False)):  # fmt: skip
        got = await replies(spec)
        assert [g[:5] for g in got] == [w[:5] for w in want], spec.method
        assert sum(g[5] for g in got) > 0  # drafts were verified

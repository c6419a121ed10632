"""A final assistant turn continued (a prefill: `continue_final_message`, Anthropic's final assistant
turn, vLLM's option): the prompt is the conversation rendered without a generation prompt and cut
right after that turn's text, as llama.cpp continues one; the reply holds only what follows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiobasert import Engine
from aiobasert.chat import render_chat
from aiobasert.errors import InvalidRequestError
from aiobasert.reasoning import reasoning_format_for
from aiobasert.tools import ToolCall, tool_format_for
from aiobasert.tools._turn import prepare_chat_turn

ASK: list[dict[str, Any]] = [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes, and "}]


def rendered(template: str, messages: list[dict[str, Any]], **kw: Any) -> list[tuple[str, bool]]:
    return prepare_chat_turn(
        template, messages, tool_format=tool_format_for(template), tools=None, tool_choice=None, parallel=True,
        bos_token="<s>", eos_token="</s>", reasoning=reasoning_format_for(template, ("<think>", "</think>")), **kw,
    ).pieces  # fmt: skip


@pytest.mark.parametrize(
    ("template", "expected"),
    [  # the template prints the text as it is: its trailing space is kept
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "<|im_start|>assistant\nYes, and "),
        # Llama 3.1 trims a message's text: so is the continued one
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|start_header_id|>assistant<|end_header_id|>\n\nYes, and"),
        # Qwen3 writes an assistant turn's empty thought before its text: the model goes on with the answer
        ("Qwen-Qwen3-0.6B.jinja", "<|im_start|>assistant\n<think>\n\n</think>\n\nYes, and "),
    ],
)
def test_the_prompt_ends_with_the_final_turns_text(llama_cpp_templates_dir: Path, template: str, expected: str) -> None:
    text = (llama_cpp_templates_dir / template).read_text()
    pieces = rendered(text, ASK, continue_final_message=True)
    prompt = "".join(t for t, _ in pieces)
    assert prompt.endswith(expected), prompt[-80:]
    assert pieces[-1] == ("Yes, and", True) or pieces[-2] == ("Yes, and", True)  # the client's text, never framing
    closed = "".join(t for t, _ in rendered(text, ASK))  # without: the turn is closed and a new one opened
    assert closed.startswith(prompt.rstrip()) and len(closed) > len(prompt)


def test_a_continued_thought_stays_a_thought(llama_cpp_templates_dir: Path) -> None:
    # DeepSeek-R1's distill opens the thought in its generation prompt; a past assistant turn keeps
    # only its answer, so a continued turn is an answer (closed), never a thought reopened
    text = (llama_cpp_templates_dir / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    turn = prepare_chat_turn(text, ASK, tool_format=tool_format_for(text), tools=None, tool_choice=None,
                             parallel=True, reasoning=reasoning_format_for(text, ("<think>", "</think>")),
                             continue_final_message=True)  # fmt: skip
    assert turn.thought is None


@pytest.mark.parametrize(
    ("messages", "flag", "match"),
    [
        ([{"role": "user", "content": "Hi"}], True, "last message must be an assistant turn"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}], "yes", "must be a bool"),
    ],
)
def test_what_cannot_be_continued_is_refused_by_name(messages: list[dict[str, Any]], flag: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"continue_final_message.*{match}|{match}") as err:
        rendered("", messages, continue_final_message=flag)
    assert "continue_final_message" in str(err.value)


def test_a_template_that_drops_the_final_turn_cannot_continue_it() -> None:
    drops_last = "{% for m in messages[:-1] %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(InvalidRequestError, match="does not print the final assistant turn"):
        rendered(drops_last, ASK, continue_final_message=True)


@pytest.mark.anyio
async def test_the_engine_continues_the_turn(untied_model_path: Path) -> None:
    async with Engine.open(untied_model_path) as engine:
        closed = await engine.count_chat_tokens(ASK)
        cont = await engine.count_chat_tokens(ASK, continue_final_message=True)
        assert cont < closed  # no end of turn, no new turn opened
        reply = await engine.stream_chat(ASK, continue_final_message=True, max_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens == cont and reply.usage.completion_tokens > 0
        with pytest.raises(InvalidRequestError, match="continue_final_message"):
            engine.stream_chat(ASK[:1], continue_final_message=True)
        n = await engine.chat_n(ASK, n=2, continue_final_message=True, max_tokens=3)
        assert [r.usage.prompt_tokens for r in n] == [cont, cont]


@pytest.mark.parametrize(
    ("template", "header"),
    [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "<|im_start|>assistant\n"),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        ("openai-gpt-oss-120b.jinja", "<|start|>assistant<|channel|>final<|message|>"),
        ("", "<|im_start|>assistant\n"),  # the default ChatML
    ],
)
def test_an_empty_final_turn_is_continued_from_its_header(
    llama_cpp_templates_dir: Path, template: str, header: str
) -> None:
    # An empty assistant turn continued: the prompt is that turn's header, as `Engine.chat`'s plain
    # renderer gives it (the tool-aware renderer, `stream_chat`'s, refused it as "not a turn with text")
    text = (llama_cpp_templates_dir / template).read_text() if template else ""
    turns = [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": ""}]
    prompt = "".join(t for t, _ in rendered(text, turns, continue_final_message=True))
    plain = render_chat(text, turns, continue_final_message=True, bos_token="<s>", eos_token="</s>")
    assert prompt == "".join(t for t, _ in plain)
    assert prompt.endswith(header), prompt[-80:]


@pytest.mark.parametrize(
    "template",
    ["Qwen-Qwen2.5-7B-Instruct.jinja", "openai-gpt-oss-120b.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja", ""],
)
@pytest.mark.parametrize("content", ["Let me check", ""])
def test_a_final_turn_with_tool_calls_is_refused_not_cut(
    llama_cpp_templates_dir: Path, template: str, content: str
) -> None:
    # The turn's calls follow its text (Hermes' <tool_call>, gpt-oss's commentary message, the default
    # format's call text): a prompt cut after the text would drop them in silence (gpt-oss even renders
    # the text as the thought); refused by name as Anthropic refuses a final tool_use
    text = (llama_cpp_templates_dir / template).read_text() if template else ""
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": content, "tool_calls": [call]}]
    with pytest.raises(InvalidRequestError, match=r"^continue_final_message: .*tool call"):
        rendered(text, turns, continue_final_message=True)
    assert rendered(text, turns)  # the same turn as history renders


@pytest.mark.anyio
async def test_the_engine_continues_an_empty_turn_on_both_paths(untied_model_path: Path) -> None:
    # `chat` (plain) and `stream_chat` (the tool-aware renderer, the server's) give the same prompt
    empty = [ASK[0], {"role": "assistant", "content": ""}]
    async with Engine.open(untied_model_path) as engine:
        plain = await engine.chat(empty, continue_final_message=True, max_tokens=3, temperature=0)
        reply = await engine.stream_chat(empty, continue_final_message=True, max_tokens=3, temperature=0)
        assert (
            reply.usage.prompt_tokens
            == plain.usage.prompt_tokens
            == await engine.count_chat_tokens(empty, continue_final_message=True)
        )
        assert reply.content == plain.text

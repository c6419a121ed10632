"""Chat templates rendered byte for byte as llama.cpp renders them (issue 35 item 5).

Every template llama.cpp tests with (models/templates/*.jinja in the llama-cpp-python sdist), on the
cases bench/llama_templates.py asked llama-server's `/apply-template` to render and recorded in
tests/data/llama_cpp/apply_template.json (plain turns, a system prompt, history, whitespace and
non-ASCII content, `enable_thinking` on and off through `chat_template_kwargs`, no generation
prompt). Ours is the renderer a chat turn goes through (`prepare_chat_turn`, as `Engine.stream_chat`
and both HTTP chat endpoints call it), given the same BOS / EOS text and kwargs. Where the two
part on purpose, DIFFERENCES says why; everything else must be equal, byte for byte."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from aiobasert.errors import InvalidRequestError
from aiobasert.reasoning import reasoning_format_for
from aiobasert.tools import tool_format_for
from aiobasert.tools._turn import prepare_chat_turn

RECORD_PATH = Path(__file__).resolve().parents[1] / "data" / "llama_cpp" / "apply_template.json"
RECORD: dict[str, Any] = json.loads(RECORD_PATH.read_text())
CASES = {case["name"]: case for case in RECORD["cases"]}

# Where ours is not llama.cpp's on purpose: (template, case) -> (why, the kwargs that make ours
# llama.cpp's). Each is checked both ways: different as recorded, equal with those kwargs.
_PRESERVE = (
    "llama-server keeps earlier turns' reasoning by default (its `preserve_reasoning`, which sets "
    "`drop_thinking` false in every template); we keep the template's own default, as HF transformers "
    "and vLLM do. chat_template_kwargs {drop_thinking: false} asks for llama-server's",
    {"drop_thinking": False},
)
_FUNCTIONS = (
    "the template concatenates a `functions` variable no caller sets: Jinja (HF transformers, vLLM, "
    "ours) refuses the undefined value, llama.cpp's engine reads it as an empty string",
    {"functions": ""},
)
_V4 = ("deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja")
DIFFERENCES: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {
    **{(t, c): _PRESERVE for t in _V4 for c in ("multi_turn", "whitespace_unicode")},
    **{("fireworks-ai-llama-3-firefunction-v2.jinja", c): _FUNCTIONS for c in ("user", "system_user", "multi_turn")},
    ("fireworks-ai-llama-3-firefunction-v2.jinja", "whitespace_unicode"): _FUNCTIONS,
}


def ours(template: str, case: dict[str, Any], kwargs: dict[str, Any], rec: dict[str, Any]) -> str:
    turn = prepare_chat_turn(
        template,
        case["messages"],
        tool_format=tool_format_for(template),
        tools=None,
        tool_choice=None,
        parallel=True,
        add_generation_prompt=case.get("add_generation_prompt", True),
        bos_token=rec["bos_token"],
        eos_token=rec["eos_token"],
        reasoning=reasoning_format_for(template, ()),
        template_kwargs=kwargs,
    )
    return "".join(text for text, _ in turn.pieces)


@pytest.mark.parametrize("name", sorted(RECORD["templates"]))
def test_each_template_renders_as_llama_cpp_renders_it(llama_cpp_templates_dir: Path, name: str) -> None:
    rec = RECORD["templates"][name]
    path = llama_cpp_templates_dir / name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["sha256"], "not the template that was recorded"
    if "refused" in rec:
        pytest.skip(f"llama-server refused the template itself: {rec['refused'][:200]}")
    template = path.read_text()
    wrong: list[str] = []
    for case_name, got in rec["cases"].items():
        difference = DIFFERENCES.get((name, case_name))
        try:
            text: str | None = ours(template, CASES[case_name], got["kwargs"], rec)
            error = None
        except InvalidRequestError as exc:
            text, error = None, str(exc)
        if "error" in got:  # llama.cpp refused the conversation: so do we, with a typed error
            if error is None:
                wrong.append(f"{case_name}: llama.cpp refused it ({got['error'][:120]}), we rendered it")
            continue
        if difference is not None:
            if text == got["prompt"]:
                wrong.append(f"{case_name}: listed as a difference ({difference[0]}) but equal: take it off")
            text = ours(template, CASES[case_name], {**got["kwargs"], **difference[1]}, rec)
        if text != got["prompt"]:
            mine = text if error is None else f"error: {error}"
            wrong.append(f"{case_name}:\n    ours      {mine!r:.400}\n    llama.cpp {got['prompt']!r:.400}")
    assert not wrong, "\n".join(wrong)


def test_the_record_covers_every_case_and_most_templates() -> None:
    # the recording is llama.cpp's answer for every template it ships; a template it could not serve
    # is marked, never dropped
    rendered = [t for t in RECORD["templates"].values() if "refused" not in t]
    assert len(RECORD["templates"]) >= 60 and len(rendered) >= 50, len(rendered)
    assert {c for t in rendered for c in t["cases"]} == set(CASES)


@pytest.mark.parametrize(
    "template",
    [
        "{% set tools = none %}{% for t in tools %}{{ t }}{% endfor %}",
        "{{ messages[5]['content'] }}{{ (messages | length) // 0 }}",
        "{{ messages[0]['content'] + 1 }}",
    ],
)
def test_a_template_that_fails_on_a_conversation_is_the_requests_typed_error(template: str) -> None:
    # a template's own fault (a None iterated, a division by zero, a str + int) was a TypeError out of
    # the renderer, a server fault; it is the request's error, named
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        ours(template, {"messages": [{"role": "user", "content": "hi"}]}, {}, {"bos_token": "", "eos_token": ""})

"""Output constraints beyond JSON Schema (issue 35 item 4): `regex`, `choice` and `grammar` (Lark, or
llama.cpp's GBNF converted to Lark) on generate / stream / chat, with random-weight tiny models:
every output matches, is one of the choices, or parses by the grammar; each refused by name when it
cannot compile, cached and under the same compile budget as a json_schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiobasert import Engine, InvalidRequestError, InvalidSamplingParamsError, SamplingParams
from aiobasert.models.tiny import EOS_ID
from aiobasert.testing import snapshot

SEEDS = range(8)


def _balanced(text: str) -> bool:
    """`text` is one or more balanced groups of `(`, `)` around letters: what PARENS derives."""
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return False
        elif not ("a" <= ch <= "z" and depth > 0):
            return False
    return depth == 0 and bool(text)


# The same context-free language twice: balanced parentheses around lowercase letters.
PARENS_GBNF = 'root ::= group+\ngroup ::= "(" ( [a-z] | group )+ ")"'
PARENS_LARK = 'start: group+\ngroup: "(" (/[a-z]/ | group)+ ")"'


@pytest.mark.anyio
@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-c]+", r"(yes|no), because [a-z ]{1,12}\.", r"-?\d+(\.\d{1,2})?"])
async def test_every_output_matches_the_regex(untied_model_path: Path, pattern: str) -> None:
    async with Engine.open(untied_model_path, max_batch_size=4) as engine:
        for seed in SEEDS:
            done = await engine.generate(
                "Once upon a time", max_tokens=48, regex=pattern, temperature=1.0, seed=seed, logit_bias={EOS_ID: 4.0}
            )
            assert done.finish_reason == "stop", done
            assert re.fullmatch(pattern, done.text), done.text


@pytest.mark.anyio
async def test_every_output_is_one_of_the_choices_streamed_and_in_chat(untied_model_path: Path) -> None:
    choices = ["yes", "no", "maybe so", 'a "quoted" one', "日本"]
    async with Engine.open(untied_model_path, max_batch_size=4) as engine:
        seen = set()
        for seed in SEEDS:
            stream = engine.stream("Is it?", max_tokens=16, choice=choices, temperature=1.0, seed=seed)
            text = "".join([tok.text async for tok in stream])
            assert text in choices and stream.finish_reason == "stop"
            messages = [{"role": "user", "content": "Is it?"}]
            reply = await engine.chat(messages, choice=choices, temperature=1.0, seed=seed)
            assert reply.text in choices
            seen |= {text, reply.text}
        assert len(seen) > 1  # sampled among them, not one forced answer


@pytest.mark.anyio
@pytest.mark.parametrize("grammar", [PARENS_GBNF, PARENS_LARK], ids=["gbnf", "lark"])
async def test_every_output_parses_by_the_grammar(untied_model_path: Path, grammar: str) -> None:
    async with Engine.open(untied_model_path, max_batch_size=4) as engine:
        close = (await engine.encode(")"))[0]
        for seed in SEEDS:
            params = SamplingParams(
                max_tokens=64, grammar=grammar, temperature=1.0, seed=seed, logit_bias={close: 3.0, EOS_ID: 3.0}
            )
            done = await engine.generate("Lisp:", params)
            assert done.finish_reason == "stop", done
            assert _balanced(done.text), done.text


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regex": "(ab"}, r"(?s)^invalid sampling parameter regex: .*unclosed group"),
        ({"grammar": "root ::= ("}, r"^invalid sampling parameter grammar: a GBNF grammar that cannot be converted"),
        ({"grammar": "start: nowhere"}, r"(?s)^invalid sampling parameter grammar: .*unknown name"),
        ({"choice": []}, r"^invalid sampling parameter choice: must be a non-empty list"),
        ({"choice": ["a", ""]}, r"^invalid sampling parameter choice: '' must be a non-empty string"),
        ({"regex": ""}, r"^invalid sampling parameter regex: '' must be a non-empty string"),
        ({"regex": "a", "choice": ["b"]}, r"^invalid sampling parameter choice: cannot be combined with regex"),
        ({"json_schema": True, "grammar": 'start: "x"'}, r"^invalid sampling parameter grammar: cannot be combined"),
    ],
)
async def test_a_constraint_that_cannot_compile_is_refused_by_name(
    untied_model_path: Path, kwargs: dict[str, object], message: str
) -> None:
    async with Engine.open(untied_model_path, max_batch_size=2) as engine:
        with pytest.raises(InvalidRequestError, match=message):
            await engine.generate("x", max_tokens=4, **kwargs)  # type: ignore[arg-type]
        assert re.fullmatch("[ab]+", (await engine.generate("x", max_tokens=8, regex="[ab]+")).text)


@pytest.mark.anyio
async def test_a_constraint_beside_tools_is_refused(untied_model_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with Engine.open(untied_model_path, max_batch_size=2) as engine:
        with pytest.raises(InvalidRequestError, match=r"^regex cannot be combined with tools"):
            engine.stream_chat([{"role": "user", "content": "hi"}], tools=tools, regex="a+")


@pytest.mark.anyio
async def test_constraints_are_cached_and_under_the_compile_budget(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One compile per source (cached by its digest, as a schema), and a compile over
    COMPILE_BUDGET_S refused naming the field, the refusal remembered."""
    from aiobasert._core import cost

    async with Engine.open(untied_model_path, max_batch_size=2) as engine:
        for seed in range(3):
            done = await engine.generate("x", max_tokens=8, choice=["up", "down"], temperature=1.0, seed=seed)
            assert done.text in ("up", "down")
        assert (await snapshot(engine)).grammar_compiles["llguidance"] == 1
        monkeypatch.setattr(cost, "COMPILE_BUDGET_S", -1.0)  # every compile is over it
        over = r"^invalid sampling parameter regex: its grammar took .* over the budget"
        with pytest.raises(InvalidRequestError, match=over):
            await engine.generate("x", max_tokens=4, regex="[xyz]+")
        monkeypatch.setattr(cost, "COMPILE_BUDGET_S", 5.0)
        with pytest.raises(InvalidRequestError, match=over):  # refused at once, never compiled again
            await engine.generate("x", max_tokens=4, regex="[xyz]+")
        assert (await snapshot(engine)).grammar_compiles["llguidance"] == 2
        assert (await engine.stats()).live_grammars == 0


def test_a_constraint_needs_host_logits_and_is_validated_without_an_engine() -> None:
    assert SamplingParams(regex="a").needs_host_logits and SamplingParams(choice=["a"]).constrained
    assert not SamplingParams().constrained
    with pytest.raises(InvalidSamplingParamsError, match="choice: at most 1024 choices"):
        SamplingParams(choice=["a"] * 1025).normalized().validate()

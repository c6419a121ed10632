"""Tool-call formats (aiobasert.tools' format modules and their registry): each model's format
chosen from its chat template, every registered format reading back the calls it writes, Llama
3.x's bare JSON calls parsed from any token split (and anything else kept as text), and its
grammar forcing well-formed calls on a tiny model with Llama 3.1's own template (random weights:
only the grammar makes its calls well-formed)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_layering import PACKAGE, import_graph
from tool_checks import backends, json_complete

from aiobasert import Engine
from aiobasert.chat import DEFAULT_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE
from aiobasert.models.tiny import CHATML_TEMPLATE
from aiobasert.tools import (
    HERMES,
    LLAMA3_JSON,
    CallParser,
    ChatReply,
    ChatStream,
    HermesFormat,
    Llama3JsonParser,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
    register_tool_format,
    registered_tool_formats,
    render_tool_chat,
    tool_format_for,
)

if TYPE_CHECKING:  # llguidance: imported where a grammar is built
    from aiobasert._core.grammar import GrammarBackend

pytestmark = pytest.mark.anyio

# Inside what the engine's own grammar enforces: these run on its structural tag.
E_WEATHER = Tool(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
E_TIME = Tool(
    name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
)
# maxLength / minimum: only llguidance enforces these (the Lark grammar runs on the host).
WEATHER = Tool(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]

# ---- the format of each model, from its template --------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json"),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3_json"),
        ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3_json"),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
        ("Qwen-Qwen3-0.6B.jinja", "hermes"),
        ("HuggingFaceTB-SmolLM3-3B.jinja", "hermes"),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),  # Llama 3.1 weights, Hermes calls
        ("meetkai-functionary-medium-v3.1.jinja", "hermes"),  # <|python_tag|>, but not the JSON instruction
        ("openai-gpt-oss-120b.jinja", "harmony"),
    ],
)
def test_each_models_template_gives_its_format(llama_cpp_templates_dir: Path, template: str, expected: str) -> None:
    assert tool_format_for((llama_cpp_templates_dir / template).read_text()).name == expected


def test_templates_without_tools_get_the_default_format() -> None:
    """A template that renders no tools gets the default tool prompt, which asks for Hermes calls
    (the built-in Llama 3 template included: it has no tool instruction)."""
    for template in ("", DEFAULT_TEMPLATE, CHATML_TEMPLATE, LLAMA3_TEMPLATE, GEMMA_TEMPLATE):
        assert tool_format_for(template) is HERMES


def test_the_tool_modules_import_one_way() -> None:
    """aiobasert.tools is a package: one module per call format (hermes, llama3_json, harmony), the pieces
    every format shares in `_` modules. A format module builds on the shared ones only, the
    shared ones know no format (they reach one through the registry), and the package imports
    each format (which registers it). Nothing in it imports the engine, which hands its template,
    tokens and format down; the shared call syntax (_syntax) imports nothing of the package.
    Layers and circles: tests/test_layering.py."""
    graph = import_graph(PACKAGE)
    package = {m: t for m, t in graph.items() if m == "aiobasert.tools" or m.startswith("aiobasert.tools.")}
    tools = {m: t for m, t in package.items() if m != "aiobasert.tools"}
    formats = {m for m in tools if not m.rpartition(".")[2].startswith("_")}
    assert formats == {"aiobasert.tools.hermes", "aiobasert.tools.llama3_json", "aiobasert.tools.harmony"}
    assert {(m, t) for m, targets in tools.items() for t in targets if t in formats} == set()
    assert formats <= graph["aiobasert.tools"]
    assert [m for m, t in package.items() if "aiobasert.engine" in t] == []
    assert graph["aiobasert.tools._syntax"] == set()


def test_each_format_module_registers_one_format() -> None:
    """A new family is one new module: importing it registers its one `ToolFormat` under a name
    no other format has. The registry holds exactly the package's format modules, each found
    again by `tool_format_for` from a template it detects, so each is under the tests below."""
    formats = registered_tool_formats()
    modules = {p.stem for p in (PACKAGE / "tools").glob("*.py") if not p.stem.startswith("_")}
    assert sorted(type(f).__module__ for f in formats.values()) == sorted(f"aiobasert.tools.{m}" for m in modules)
    assert all(isinstance(f, ToolFormat) and f.name == name for name, f in formats.items())
    assert list(formats) == ["harmony", "hermes", "llama3_json"]  # the order tool_format_for asks them in
    with pytest.raises(ValueError, match="'hermes' is already registered"):
        register_tool_format(HermesFormat())
    assert registered_tool_formats() == formats


# ---- the Llama 3 parser: any token split, text stays text ------------------------------------

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
ARGS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
NAMES = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
SPLITS = st.lists(st.integers(1, 9), min_size=1, max_size=30)
# JSON-ish text: braces, quotes and separators where a parser could lose its way
TEXT = st.lists(
    st.sampled_from([*'{}[]";:, \n\\ab<|>', "<|python_tag|>", '"name"', '"parameters"', '"f"']), max_size=30
).map("".join)


def parse(
    text: str, splits: list[int], *, forced: bool = False, fmt: ToolFormat = LLAMA3_JSON
) -> tuple[CallParser, list[Any]]:
    """`text` fed to a fresh parser of `fmt` in chunks of the `splits` sizes (cycled), then closed."""
    parser, pos, deltas = fmt.parser(forced=forced), 0, []
    for size in itertools.cycle(splits):
        if pos >= len(text):
            break
        deltas += parser.feed(text[pos : pos + size])
        pos += size
    deltas += parser.close()
    return parser, deltas


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def check_deltas(parser: CallParser, deltas: list[Any]) -> None:
    """The deltas say what the parser holds: text in order, each call's id and name first."""
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == parser.content
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index not in calls:
                assert d.id == parser.calls[d.index].id and d.name == parser.calls[d.index].name
                assert d.arguments == ""
                calls[d.index] = []
            else:
                assert d.id is None and d.name is None
                calls[d.index].append(d.arguments)
    assert ["".join(a) for a in calls.values()] == [c.arguments for c in parser.calls]


# ---- every registered format: its calls written, constrained and read back --------------------


FORMATS = list(registered_tool_formats().values())
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3).map(
    lambda calls: [ToolCall(id=f"call_{i}", name=name, arguments=compact(args)) for i, (name, args) in enumerate(calls)]
)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda fmt: fmt.name)
@given(calls=CALLS, splits=SPLITS, forced=st.booleans())
def test_every_format_reads_back_the_calls_it_writes(
    fmt: ToolFormat, calls: list[ToolCall], splits: list[int], forced: bool
) -> None:
    """The proof that a format is one file: whatever calls a registered format writes (`call_text`,
    how a past turn goes back into the prompt, and what its grammar has the model write), its
    parser reads back as exactly those calls and no text, whole, and streamed in chunks of any
    sizes the same as whole, delta by delta."""
    text = fmt.call_text(calls)
    whole, _ = parse(text, [len(text) + 1], forced=forced, fmt=fmt)
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in calls]
    assert whole.content == ""
    streamed, deltas = parse(text, splits, forced=forced, fmt=fmt)
    assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]
    assert streamed.content == whole.content
    check_deltas(streamed, deltas)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda fmt: fmt.name)
def test_every_formats_structural_tag_frames_its_calls_as_it_writes_them(fmt: ToolFormat) -> None:
    """Each call tag of a format's structural tag is its call as `call_text` writes it (head,
    arguments, end), and several are separated as it separates them."""
    first, second = (ToolCall(id="c", name=t.name, arguments='{"tz":"UTC"}') for t in (E_WEATHER, E_TIME))
    tag = fmt.structural_tag([E_WEATHER, E_TIME], "required")
    if tag is None:  # a format whose calls no structural tag can say: the Lark grammar runs
        return
    tags, separator = tag["format"]["tags"], tag["format"]["separator"]
    assert [t["begin"] + '{"tz":"UTC"}' + t["end"] for t in tags] == [fmt.call_text([c]) for c in (first, second)]
    assert fmt.call_text([first, second]) == fmt.call_text([first]) + separator + fmt.call_text([second])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda fmt: fmt.name)
@pytest.mark.parametrize("choice", ["auto", "required", "get_time"])
def test_every_formats_grammar_admits_the_calls_it_writes(
    tiny_model_path: Path,
    harmony_model_path: Path,
    host_grammar: Callable[..., GrammarBackend],
    fmt: ToolFormat,
    choice: str,
) -> None:
    """What a format writes for its calls is what its grammar admits (fed token by token through the
    compiled Lark grammar, what the engine masks with), and a call of another tool than the named
    one is refused. A format whose grammar starts after the thought (`after_thought`: Harmony's, on a
    vocabulary with its markers) is fed what follows that opening; it has one call a turn."""
    from aiobasert.models.bundle import read_bundle

    model = harmony_model_path if fmt.after_thought is not None else tiny_model_path
    vocab = len(read_bundle(model).tokenizer["tokenizer.ggml.tokens"])
    backend = host_grammar(model, vocab_size=vocab)
    weather = ToolCall(id="c1", name="get_weather", arguments='{"city":"Rom","days":2}')
    time = ToolCall(id="c2", name="get_time", arguments='{"tz":"UTC"}')
    one_call_a_turn = fmt.after_thought is not None
    for calls, ok in [([time], True), ([weather, time], choice != "get_time" and not one_call_a_turn)]:
        lark = fmt.grammar([WEATHER, E_TIME], choice)
        assert lark is not None
        constraint = backend.compile_lark(lark)
        text = fmt.call_text(calls).removeprefix(fmt.after_thought or "")
        accepted = all(constraint.accept(t) for t in backend._tokenizer.tokenize_str(text))
        assert accepted == ok, (calls, constraint.error)


@given(
    calls=st.lists(st.tuples(NAMES, ARGS, st.sampled_from(["parameters", "arguments"])), min_size=1, max_size=3),
    seps=st.lists(st.sampled_from(["; ", ";", " ; ", "\n", ";\n", ""]), min_size=3, max_size=3),
    spaced=st.booleans(),
    tag=st.sampled_from(["", "<|python_tag|>", " <|python_tag|>\n"]),
    splits=SPLITS,
    forced=st.booleans(),
)
def test_llama_calls_parse_the_same_from_any_split(
    calls: list[tuple[str, dict[str, Any], str]],
    seps: list[str],
    spaced: bool,
    tag: str,
    splits: list[int],
    forced: bool,
) -> None:
    """Llama calls (after <|python_tag|> or not, `;` or blank between them, "parameters" or
    vLLM's "arguments", any JSON spacing), in chunks of any sizes: exactly those calls, their
    arguments re-serialised compactly, and no text."""
    dump = (lambda v: json.dumps(v, indent=1)) if spaced else compact
    text = tag + "".join(
        sep + "{" + f'"name": {json.dumps(name)}, "{key}": {dump(args)}' + "}"
        for (name, args, key), sep in zip(calls, ["", *seps], strict=False)
    )
    parser, deltas = parse(text, splits, forced=forced)
    assert [(c.name, c.arguments) for c in parser.calls] == [(n, compact(a)) for n, a, _ in calls]
    assert parser.content == ""
    assert all(c.id.startswith("call_") for c in parser.calls) and len({c.id for c in parser.calls}) == len(calls)
    check_deltas(parser, deltas)


@given(text=TEXT | st.text(max_size=40), splits=SPLITS, other=SPLITS)
def test_any_text_parses_the_same_from_any_split_and_non_calls_stay_text(
    text: str, splits: list[int], other: list[int]
) -> None:
    """Whatever the text and its chunks: the same content and calls; a text without calls
    comes back unchanged as text, and one that does not start like a call comes back at once."""
    parser, deltas = parse(text, splits)
    again, _ = parse(text, other)
    assert parser.content == again.content
    assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in again.calls]
    check_deltas(parser, deltas)
    if not parser.calls:
        assert parser.content == text
    head = text.lstrip()
    if head and not head.startswith("{") and not "<|python_tag|>".startswith(head[:14]):
        streamed = Llama3JsonParser()
        assert "".join(d.text for d in streamed.feed(text) if isinstance(d, TextDelta)) == text  # not held back


# Replies mixing whole calls, call-like JSON, separators, markers and free text, in any order.
MIXED = st.lists(
    st.one_of(
        st.builds(lambda n, a: json.dumps({"name": n, "parameters": a}), NAMES, ARGS),
        TEXT,
        st.text(max_size=8),
        st.sampled_from(["; ", ";", " ", "\n", "<|python_tag|>", "{", "}", '"', "\\"]),
    ),
    max_size=6,
).map("".join)


@given(text=MIXED, splits=SPLITS, forced=st.booleans())
def test_llama_parser_never_loses_or_duplicates_text(text: str, splits: list[int], forced: bool) -> None:
    """Any reply in any chunks: the text reported is exactly a suffix of the reply (nothing lost inside it,
    nothing twice), all of it when there are no calls (unless forced), and the calls are the ones the rest,
    the reply's prefix, holds when parsed alone."""
    parser, deltas = parse(text, splits, forced=forced)
    check_deltas(parser, deltas)
    assert text.endswith(parser.content)
    if not parser.calls and not forced:
        assert parser.content == text
    prefix, _ = parse(text[: len(text) - len(parser.content)], [len(text) + 1], forced=forced)
    assert [(c.name, c.arguments) for c in prefix.calls] == [(c.name, c.arguments) for c in parser.calls]


@given(
    blank=st.sampled_from(["\v", "\f", "\u00a0", "\x1c", "\x85", "\u2028", "\u3000"]),
    lead=st.sampled_from(["", " ", "\n\t", "<|python_tag|>"]),
    name=NAMES,
    args=ARGS,
    splits=SPLITS,
)
def test_a_call_after_a_space_json_does_not_know_is_text(
    blank: str, lead: str, name: str, args: dict[str, Any], splits: list[int]
) -> None:
    """The "auto" grammar opens a call only after JSON's blanks (space, tab, CR, LF): after any other white
    space (str.isspace's \\v, NBSP, ...) the reply is TEXT, unconstrained, so a call written there was never
    held to its schema. The parser agrees: it is text, whole, not a call."""
    text = lead + blank + json.dumps({"name": name, "parameters": args})
    parser, deltas = parse(text, splits)
    assert parser.calls == [] and parser.content == text
    check_deltas(parser, deltas)


@given(
    obj=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4),
    tail=st.text(max_size=20),
    splits=SPLITS,
)
def test_json_that_is_not_a_call_stays_text(obj: dict[str, Any], tail: str, splits: list[int]) -> None:
    """A reply that is JSON, but not {"name": str, "parameters": object}, is text, byte for byte."""
    text = json.dumps(obj) + tail
    name, args = obj.get("name"), {k: v for k, v in obj.items() if k not in ("name", "type")}
    is_call = (
        isinstance(name, str)
        and obj.get("type", "function") == "function"
        and len(args) == 1
        and (isinstance(args.get("parameters"), dict) or isinstance(args.get("arguments"), dict))
    )
    parser, deltas = parse(text, splits)
    if is_call:
        assert len(parser.calls) >= 1
    else:
        assert parser.calls == [] and parser.content == text
    check_deltas(parser, deltas)


TWO_LLAMA_CALLS = (
    '{"name": "get_time", "parameters": {"tz":"UTC"}}; {"name": "get_weather", "parameters": {"city":"Rom","days":2}}'
)


@given(cut=st.integers(0, len(TWO_LLAMA_CALLS)), splits=SPLITS)
def test_a_forced_llama_turn_cut_anywhere_reports_no_text_and_closes_once(cut: int, splits: list[int]) -> None:
    """Wherever max_tokens cuts a forced turn: no text, the complete calls a prefix of the whole
    turn's, a call cut in its arguments reported with what it has, a second close adds nothing."""
    parser, deltas = parse(TWO_LLAMA_CALLS[:cut], splits, forced=True)
    assert parser.content == "" and not any(isinstance(d, TextDelta) for d in deltas)
    whole, _ = parse(TWO_LLAMA_CALLS, [len(TWO_LLAMA_CALLS)])
    assert [c.name for c in parser.calls] == [c.name for c in whole.calls][: len(parser.calls)]
    complete = [c.arguments for c in parser.calls if json_complete(c.arguments)]
    assert complete == [c.arguments for c in whole.calls][: len(complete)]
    calls = list(parser.calls)
    assert parser.close() == [] and parser.calls == calls


def test_llama_parser_examples() -> None:
    parser = Llama3JsonParser()
    assert parser.feed('  {"name": "f", "param') == []  # may still be a call: held back
    deltas = parser.feed('eters": {"s": "}{"}}')
    assert deltas[1:] == [ToolCallDelta(index=0, arguments='{"s":"}{"}')] and isinstance(deltas[0], ToolCallDelta)
    assert parser.feed("; then text") == [TextDelta("; then text")]  # not another call: text from the separator
    parser = Llama3JsonParser()
    assert parser.feed("<|python") == []
    assert parser.feed("_tag|>print(1)") == [TextDelta("<|python_tag|>print(1)")]  # a built-in tool's code
    parser = Llama3JsonParser()
    assert parser.feed("{this is no JSON") == [TextDelta("{this is no JSON")]  # not a key: text at once


# ---- the Llama 3 grammar --------------------------------------------------------------------


def llama_call(name: str, args: str) -> str:
    return '{"name": "' + name + '", "parameters": ' + args + "}"


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("auto", True, "Sunny, I think.", True),
        ("auto", True, llama_call("get_weather", '{"city":"Rom","days":9}'), True),
        ("auto", True, "  {not a call}", False),  # a reply starting with "{" is a call
        # only JSON's blanks lead to a call: after any other space the reply is text, even a call's text
        ("auto", True, "\v" + llama_call("get_weather", '{"city":"Rom","days":"x"}'), True),
        ("auto", True, "\u00a0" + llama_call("get_weather", '{"nope":1}'), True),
        ("required", True, "\v" + llama_call("get_weather", '{"city":"Rom","days":9}'), False),
        # "<|python_tag|>" spelt in ordinary tokens then "{": the parser reads a call there, so it is no text
        ("auto", True, "<|python_tag|>" + llama_call("get_weather", '{"nope":1}'), False),
        ("auto", True, "<|python_tag|> \n{x", False),
        ("auto", True, "<|python_tag|>print(1)", True),
        ("auto", True, "Text, then " + llama_call("get_weather", '{"city":"Rom","days":9}'), True),  # text
        ("auto", True, llama_call("get_weather", '{"city":"Paris"}'), False),  # days is required
        ("auto", True, llama_call("get_weather", '{"city":"Paris","days":0}'), False),  # minimum 1
        ("auto", True, llama_call("get_sun", "{}"), False),
        ("auto", True, '{"name": "get_time", "arguments": {"tz":"UTC"}}', False),  # the model's key only
        ("required", True, "Sunny.", False),
        (
            "required",
            True,
            llama_call("get_time", '{"tz":"UTC"}') + "; " + llama_call("get_time", '{"tz":"CET"}'),
            True,
        ),
        ("required", False, llama_call("get_time", '{"tz":"UTC"}') + "; {", False),
        ("get_time", True, llama_call("get_weather", '{"city":"x","days":1}'), False),
        ("get_time", True, llama_call("get_time", '{"tz":"CET"}'), True),
        ("none", True, llama_call("get_time", '{"tz":"UTC"}'), False),
        ("none", True, "It is noon {UTC}.", True),
    ],
)
def test_the_llama_grammar_admits_exactly_the_contract(
    tiny_model_path: Path, host_grammar: Callable[..., GrammarBackend], choice: str, parallel: bool, text: str, ok: bool
) -> None:
    """Text fed token by token through the compiled Lark grammar (what the engine masks with)."""
    from aiobasert.models.bundle import read_bundle

    time = Tool(
        name="get_time",
        parameters={
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    )
    vocab = len(read_bundle(tiny_model_path).tokenizer["tokenizer.ggml.tokens"])
    backend = host_grammar(tiny_model_path, vocab_size=vocab)
    lark = LLAMA3_JSON.grammar([WEATHER, time], choice, parallel=parallel)
    assert lark is not None
    constraint = backend.compile_lark(lark)
    accepted = all(constraint.accept(t) for t in backend._tokenizer.tokenize_str(text))
    assert accepted == ok, constraint.error


def test_llama_structural_tag_shapes() -> None:
    """Calls only ("required" / named) run on the engine's structural tag, `; ` between calls;
    "auto" and "none" say "at the start", which no structural tag can: the Lark grammar runs."""
    assert LLAMA3_JSON.structural_tag([E_WEATHER], "auto") is None
    assert LLAMA3_JSON.structural_tag([E_WEATHER], "none") is None
    assert LLAMA3_JSON.structural_tag([], "required") is None
    tag = LLAMA3_JSON.structural_tag([E_WEATHER, E_TIME], "get_time", parallel=False)
    assert tag is not None
    fmt = tag["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["separator"] == "; "
    assert fmt["at_least_one"] and fmt["stop_after_first"]
    (only,) = fmt["tags"]
    assert only["begin"] == '{"name": "get_time", "parameters": ' and only["end"] == "}"
    assert only["content"]["json_schema"] == {**(E_TIME.parameters or {}), "additionalProperties": False}
    both = LLAMA3_JSON.structural_tag([E_WEATHER, E_TIME], "required")
    assert both is not None and not both["format"]["stop_after_first"]
    assert [t["begin"] for t in both["format"]["tags"]] == ['{"name": "get_weather", "parameters": ', only["begin"]]


# ---- rendering a Llama 3 tool conversation --------------------------------------------------


def test_llama_history_renders_one_call_per_turn(llama_cpp_templates_dir: Path) -> None:
    """Llama 3.1's template refuses an assistant turn with two calls: each call is its own turn,
    written as the model writes it; tool results are the template's `ipython` turns."""
    template = (llama_cpp_templates_dir / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    calls = [
        ToolCall(id="c1", name="get_time", arguments='{"tz":"UTC"}'),
        ToolCall(id="c2", name="get_weather", arguments='{"city":"Rom","days":2}'),
    ]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        {"role": "tool", "tool_call_id": "c2", "content": 'say "rain"\n<|eot_id|>'},
    ]
    pieces = render_tool_chat(template, history, [E_WEATHER, E_TIME], tool_format=tool_format_for(template))
    text = "".join(p for p, _ in pieces)
    turn = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert turn + '{"name": "get_time", "parameters": {"tz": "UTC"}}<|eot_id|>' + turn in text
    assert '{"name": "get_weather", "parameters": {"city": "Rom", "days": 2}}<|eot_id|>' in text
    assert text.count("<|start_header_id|>ipython<|end_header_id|>") == 2
    # the template writes a result as `content | tojson`: a JSON string, its text still a content piece
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"noon"<|eot_id|>' in text
    assert ('say \\"rain\\"\\n<|eot_id|>', True) in pieces
    assert 'Respond in the format {"name": function name, "parameters"' in text
    # a template without tool support writes past calls in the format asked for (here Llama's)
    plain = render_tool_chat(CHATML_TEMPLATE, history, [E_TIME], tool_format=LLAMA3_JSON)
    assert any(llama_call("get_time", '{"tz":"UTC"}') + "; " in p for p, _ in plain)


# ---- a tiny model with Llama 3.1's template: the grammar-forced paths -----------------------


async def raw_turn(chat: ChatStream) -> tuple[str, ChatReply]:
    """The turn's generated text, and the reply parsed from it."""
    raw = []
    async for tok in chat.tokens:
        raw.append(tok.text)
        chat.feed(tok)
    chat.close_parser()
    return "".join(raw), chat.reply()


def check_llama_turn(raw: str, reply: ChatReply, tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """The generated text IS Llama calls, `{"name": ..., "parameters": ...}` joined by `; ` (read
    here with the json module, not the SDK's parser), those are the reply's calls, and each
    validates against its tool's schema; a call cut by max_tokens only as the last one. The calls read."""
    assert reply.tool_calls and reply.content == "", (raw, reply)
    decoder, pos, read = json.JSONDecoder(), 0, []
    while pos < len(raw):
        assert raw.startswith('{"name": "', pos), raw
        try:
            obj, end = decoder.raw_decode(raw, pos)
        except ValueError:
            assert reply.finish_reason == "length", raw  # cut inside the last call
            break
        assert list(obj) == ["name", "parameters"] and raw[end : end + 2] in ("; ", ""), raw
        read.append(obj)
        pos = end + 2
    assert [o["name"] for o in read] == [c.name for c in reply.tool_calls][: len(read)]
    assert [o["parameters"] for o in read] == [json.loads(c.arguments) for c in reply.tool_calls[: len(read)]]
    assert len(reply.tool_calls) - len(read) in ((0, 1) if reply.finish_reason == "length" else (0,))
    if reply.finish_reason != "length":
        assert reply.finish_reason == "tool_calls"
    for obj, call in zip(read, reply.tool_calls, strict=False):
        assert call.name in tools and call.id.startswith("call_")
        jsonschema.validate(obj["parameters"], tools[call.name].parameters)
    return read


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_required_llama_calls_are_llama_json_with_valid_arguments(
    llama3_tools_model_path: Path, seed: int
) -> None:
    """tool_choice "required" on a model with Llama 3.1's template: the output is Llama's bare
    JSON calls, every time, on the engine's structural tag and on llguidance alike."""
    async with Engine.open(llama3_tools_model_path, max_batch_size=4) as engine:
        assert engine.tool_format is LLAMA3_JSON
        for tools in ([E_WEATHER, E_TIME], [WEATHER, E_TIME]):
            chat = engine.stream_chat(
                MESSAGES, tools=tools, tool_choice="required", max_tokens=120, temperature=1.0, seed=seed
            )
            raw, reply = await raw_turn(chat)
            check_llama_turn(raw, reply, {t.name: t for t in tools})
        assert await backends(engine) == {"engine": 1, "llguidance": 1}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_named_llama_call_is_the_only_one(llama3_tools_model_path: Path, seed: int) -> None:
    async with Engine.open(llama3_tools_model_path, max_batch_size=4) as engine:
        for tools in ([E_WEATHER, E_TIME], [WEATHER, E_TIME]):
            chat = engine.stream_chat(
                MESSAGES,
                tools=tools,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=200,
                temperature=1.0,
                seed=seed,
            )
            raw, reply = await raw_turn(chat)
            read = check_llama_turn(raw, reply, {t.name: t for t in tools})
            assert [c.name for c in reply.tool_calls] == ["get_weather"]
            if reply.finish_reason == "tool_calls":
                assert len(read) == 1 and raw.endswith("}")  # the grammar ended the turn after the call


@pytest.mark.parametrize("seed", range(4))
async def test_auto_llama_turns_are_text_or_calls(llama3_tools_model_path: Path, seed: int) -> None:
    """ "auto": a turn is text (never starting with "{") or calls from its first character; a strong
    nudge towards "{" (odd seeds) makes the turn a call. "none": text that never starts a call."""
    async with Engine.open(llama3_tools_model_path, max_batch_size=4) as engine:
        brace = (await engine.encode("{"))[0]
        chat = engine.stream_chat(
            MESSAGES, tools=[WEATHER], max_tokens=80, temperature=1.0, seed=seed, logit_bias={brace: 10.0 * (seed % 2)}
        )
        raw, reply = await raw_turn(chat)
        if raw.lstrip().startswith("{") or seed % 2:
            check_llama_turn(raw, reply, {"get_weather": WEATHER})
        else:
            assert reply.tool_calls == [] and reply.content == raw
        none = await engine.chat(
            MESSAGES,
            tools=[WEATHER],
            tool_choice="none",
            max_tokens=30,
            temperature=1.0,
            seed=seed,
            logit_bias={brace: 5.0},
        )
        assert none.tool_calls == [] and not none.content.lstrip().startswith("{")
        assert await backends(engine) == {"llguidance": 2}


async def test_a_llama_tool_loop_completes(llama3_tools_model_path: Path) -> None:
    """Two calls, their results, the next turn: the history renders through Llama 3.1's template."""
    calls = [
        ToolCall(id="call_a", name="get_time", arguments='{"tz":"UTC"}'),
        ToolCall(id="call_b", name="get_weather", arguments='{"city":"Rom","days":2}'),
    ]
    async with Engine.open(llama3_tools_model_path, max_batch_size=2) as engine:
        history: list[dict[str, Any]] = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'} for c in calls),
        ]
        answer = await engine.chat(history, tools=[E_WEATHER, E_TIME], tool_choice="none", max_tokens=8, seed=1)
        assert answer.tool_calls == [] and answer.finish_reason in ("stop", "length")
        again = engine.stream_chat(
            history, tools=[E_WEATHER, E_TIME], tool_choice="required", max_tokens=100, temperature=1.0, seed=3
        )
        check_llama_turn(*await raw_turn(again), {"get_weather": E_WEATHER, "get_time": E_TIME})


async def test_a_gguf_with_llama3s_vocabulary_and_template_calls_in_its_format(
    llama_cpp_vocab_dir: Path, llama_cpp_templates_dir: Path, tmp_path: Path
) -> None:
    """Llama 3's real vocabulary (llama.cpp's llama-bpe test GGUF, 128k tokens) with Llama 3.1's
    template in the GGUF, converted and opened as a model would be: the format comes from the
    GGUF's template, the grammars compile over the real tokenizer (the engine's tag and
    llguidance), and forced calls are Llama's JSON with schema-valid arguments."""
    from tiny_gguf import write_gguf

    import aiobasert.models.convert

    _, meta = aiobasert.models.convert._read_gguf(llama_cpp_vocab_dir / "ggml-vocab-llama-bpe.gguf")
    fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    fields["tokenizer.chat_template"] = (llama_cpp_templates_dir / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    bundle = aiobasert.models.convert.convert_gguf(
        write_gguf(tmp_path / "llama3.gguf", tokenizer=fields), tmp_path / "llama3.base", progress=False
    )
    async with Engine.open(bundle, max_batch_size=2) as engine:
        assert engine.tool_format is LLAMA3_JSON
        # towards closing strings, numbers and objects (random weights otherwise run on to max_tokens)
        bias = {(await engine.encode(s))[0]: 6.0 for s in ('"', "}", ",")}
        for tools in ([E_WEATHER, E_TIME], [WEATHER]):
            chat = engine.stream_chat(
                MESSAGES, tools=tools, tool_choice="required", max_tokens=120, temperature=1.0, seed=1, logit_bias=bias
            )
            raw, reply = await raw_turn(chat)
            read = check_llama_turn(raw, reply, {t.name: t for t in tools})
            assert read, raw  # at least one whole call
        auto = engine.stream_chat(
            MESSAGES,
            tools=[WEATHER],
            max_tokens=120,
            temperature=1.0,
            seed=1,
            logit_bias=bias | {(await engine.encode("{"))[0]: 20.0},
        )
        check_llama_turn(*await raw_turn(auto), {"get_weather": WEATHER})
        assert await backends(engine) == {"engine": 1, "llguidance": 2}

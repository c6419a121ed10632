"""The reference engine's structural-tag grammar (native/src/grammar.c,
baseRT_grammar_create_from_structural_tag): creation and refusals, free text
(nothing to apply), trigger dispatch, at_least_one / stop_after_first, control
tokens, "never completed", reset; and a hypothesis walk through the masks:
every output the grammar lets through is well-formed per the tag, with
arguments that validate against their schema."""

from __future__ import annotations

import contextlib
import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_abi import coded_error as error
from raw_abi import encode

from aiobasert._ffi import Library
from aiobasert.models.bundle import read_bundle
from aiobasert.models.tiny import EOS_ID

INVALID_ARGUMENT, UNSUPPORTED = 2, 5
IM_START = 1  # a CONTROL token of the tiny vocabulary that is not an end token

TRIGGER = "<tool_call>"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "description": "a zone"}}, "required": ["tz"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
END = "}\n</tool_call>"


def begin(name: str) -> str:
    return f'{TRIGGER}\n{{"name": "{name}", "arguments": '


def tag_doc(
    *,
    at_least_one: bool = False,
    stop_after_first: bool = False,
    names: tuple[str, ...] = ("get_weather", "get_time"),
    separator: str | None = None,
) -> dict[str, Any]:
    tags = [
        {"type": "tag", "begin": begin(n), "content": {"type": "json_schema", "json_schema": SCHEMAS[n]}, "end": END}
        for n in names
    ]
    if separator is not None:
        return {
            "type": "structural_tag",
            "format": {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": separator,
                "at_least_one": at_least_one,
                "stop_after_first": stop_after_first,
            },
        }
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [TRIGGER],
            "tags": tags,
            "at_least_one": at_least_one,
            "stop_after_first": stop_after_first,
        },
    }


@pytest.fixture
def token_bytes(lib: Library, model: int, tiny_model_path: Path) -> list[bytes]:
    vocab = int(read_bundle(tiny_model_path).config["vocab_size"])
    out: list[bytes] = []
    buf = ctypes.create_string_buffer(256)
    for t in range(vocab):
        n = lib.baseRT_decode_token_raw(model, t, buf, 256)
        out.append(buf.raw[: max(n, 0)])
    return out


def create(lib: Library, m: int, doc: Any) -> int:
    g = lib.baseRT_grammar_create_from_structural_tag(m, json.dumps(doc).encode())
    assert g, error(lib)
    return int(g)


@contextlib.contextmanager
def grammar(lib: Library, m: int, doc: Any) -> Iterator[int]:
    """create()'s grammar, freed on leaving the block."""
    g = create(lib, m, doc)
    try:
        yield g
    finally:
        lib.baseRT_grammar_free(g)


@contextlib.contextmanager
def grammar_or_refusal(lib: Library, m: int, text: bytes) -> Iterator[int]:
    """The grammar of the document `text`, freed on leaving the block; 0 where the engine refuses the
    document, which it must do with a typed code."""
    g = lib.baseRT_grammar_create_from_structural_tag(m, text)
    if not g:
        assert error(lib)[0] in (INVALID_ARGUMENT, UNSUPPORTED)
        yield 0
        return
    try:
        yield int(g)
    finally:
        lib.baseRT_grammar_free(g)


def fill(lib: Library, g: int) -> tuple[int, set[int]]:
    mask = np.zeros(lib.baseRT_grammar_bitmask_size(g), dtype=np.int32)
    rc = int(lib.baseRT_grammar_fill_bitmask(g, mask.ctypes.data))
    return rc, {int(i) for i in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))}


def feed(lib: Library, g: int, ids: list[int]) -> bool:
    return all(lib.baseRT_grammar_accept_token(g, t) == 1 for t in ids)


def call_text(name: str, args: str) -> str:
    return begin(name) + args + END


# ---- creation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "code", "needle"),
    [
        ("{", INVALID_ARGUMENT, "not valid JSON"),
        ([1], INVALID_ARGUMENT, "JSON object"),
        ({"type": "structural_tag", "format": {"type": "sequence", "elements": []}}, UNSUPPORTED, "any_text"),
        ({"type": "any_text", "max_tokens": 5}, UNSUPPORTED, "max_tokens"),
        ({"type": "any_text", "excludes": "<a"}, INVALID_ARGUMENT, "excludes"),
        ({"type": "any_text", "excludes": ["<a", "<ab"]}, INVALID_ARGUMENT, "prefix"),
        (
            {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [TRIGGER]}},
            INVALID_ARGUMENT,
            "needs tags",
        ),
        (
            {
                "type": "triggered_tags",
                "tags": [{"begin": "<a", "content": {"type": "json_schema", "json_schema": True}, "end": "x"}],
            },
            INVALID_ARGUMENT,
            "triggers",
        ),
        (
            {
                "type": "tags_with_separator",
                "tags": [{"begin": "<a", "end": "x", "content": {"type": "json_schema", "json_schema": True}}],
            },
            INVALID_ARGUMENT,
            "separator",
        ),
        ({"type": "triggered_tags", "triggers": [TRIGGER], "tags": []}, UNSUPPORTED, "1-64 tags"),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a", "<ab"],
                "tags": [
                    {"begin": "<ab", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "x"}
                ],
            },
            INVALID_ARGUMENT,
            "prefix",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a", "b"],
                "tags": [{"begin": "<a", "content": {"type": "json_schema", "json_schema": True}, "end": "x"}],
            },
            INVALID_ARGUMENT,
            "every trigger needs a tag",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<b"],
                "tags": [{"begin": "<a", "content": {"type": "json_schema", "json_schema": True}, "end": "x"}],
            },
            INVALID_ARGUMENT,
            "no trigger",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a"],
                "tags": [
                    {"begin": "<a", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "x"},
                    {"begin": "<ab", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "x"},
                ],
            },
            INVALID_ARGUMENT,
            "prefix of another",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a"],
                "tags": [{"begin": "<a", "content": {"type": "any_text"}, "end": "x"}],
            },
            UNSUPPORTED,
            "json_schema",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a"],
                "tags": [
                    {"begin": "<a", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "5"}
                ],
            },
            UNSUPPORTED,
            "number",
        ),
        # schemas the reference cannot enforce are refused, never accepted loosely
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a"],
                "tags": [
                    {
                        "begin": "<a",
                        "content": {
                            "type": "json_schema",
                            "json_schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
                        },
                        "end": "x",
                    }
                ],
            },
            UNSUPPORTED,
            "minimum",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a"],
                "tags": [
                    {
                        "begin": "<a",
                        "content": {
                            "type": "json_schema",
                            "json_schema": {"type": "object", "properties": {"n": {"enum": ["x"]}}},
                        },
                        "end": "x",
                    }
                ],
            },
            UNSUPPORTED,
            "enum",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a"],
                "tags": [
                    {
                        "begin": "<a",
                        "content": {
                            "type": "json_schema",
                            "json_schema": {
                                "type": "object",
                                "properties": {"o": {"type": "object", "properties": {}}},
                            },
                        },
                        "end": "x",
                    }
                ],
            },
            UNSUPPORTED,
            "properties",
        ),
    ],
)
def test_refusals(lib: Library, model: int, doc: Any, code: int, needle: str) -> None:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    assert not lib.baseRT_grammar_create_from_structural_tag(model, text.encode())
    got, msg = error(lib)
    assert got == code and needle in msg, msg


def test_null_arguments(lib: Library, model: int) -> None:
    assert not lib.baseRT_grammar_create_from_structural_tag(model, None)
    assert error(lib)[0] == INVALID_ARGUMENT
    assert not lib.baseRT_grammar_create_from_structural_tag(None, json.dumps(tag_doc()).encode())
    assert error(lib)[0] == INVALID_ARGUMENT


def test_legacy_structures_form(lib: Library, model: int) -> None:
    doc = {
        "type": "structural_tag",
        "triggers": [TRIGGER],
        "structures": [{"begin": begin("get_time"), "schema": TIME, "end": END}],
    }
    with grammar(lib, model, doc) as g:
        assert feed(lib, g, encode(lib, model, "ok " + call_text("get_time", '{"tz":"UTC"}') + " bye"))
        assert not feed(lib, g, encode(lib, model, "<tool_call>\nx"))


# ---- stepping -------------------------------------------------------------------------------


def test_free_text_trigger_call_and_eos(lib: Library, model: int) -> None:
    with grammar(lib, model, tag_doc()) as g:
        rc, allowed = fill(lib, g)
        assert rc == 0  # free text: every token may follow, nothing to apply
        assert EOS_ID in allowed and IM_START in allowed
        assert feed(lib, g, encode(lib, model, "Let me check. "))
        assert feed(lib, g, [IM_START])  # a marker is text in free text
        assert feed(lib, g, encode(lib, model, TRIGGER))
        rc, allowed = fill(lib, g)
        assert rc == 1 and EOS_ID not in allowed and IM_START not in allowed  # inside a tag: masked, no end
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 0 and error(lib)[0] == INVALID_ARGUMENT
        assert feed(lib, g, encode(lib, model, '\n{"name": "get_weather", "arguments": {"days":2,'))
        assert lib.baseRT_grammar_accept_token(g, IM_START) == 0  # never inside the JSON
        assert not fill(lib, g)[1] & set(encode(lib, model, "}"))  # "city" is required: no '}' yet
        assert feed(lib, g, encode(lib, model, '"city":"Paris"}' + END))
        assert fill(lib, g)[0] == 0 and lib.baseRT_grammar_is_completed(g) == 0  # free text again: never completed
        assert feed(lib, g, encode(lib, model, "\n" + call_text("get_time", '{"tz":"CET"}')))
        assert lib.baseRT_grammar_is_terminated(g) == 0
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 1
        assert lib.baseRT_grammar_is_terminated(g) == 1 and lib.baseRT_grammar_is_completed(g) == 0
        lib.baseRT_grammar_reset(g)
        assert lib.baseRT_grammar_is_terminated(g) == 0 and fill(lib, g)[0] == 0


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (call_text("get_weather", '{"city":"Rom","days":9}'), True),
        (call_text("get_weather", '{"days":9,"city":"Rom","metric":true}'), True),
        (call_text("get_weather", '{"city":"Rom"}'), False),  # a required property missing
        (call_text("get_weather", '{"city":"Rom","days":1.5}'), False),  # integer
        (call_text("get_weather", '{"city":"Rom","days":1,"city":"x"}'), False),  # a key twice
        (call_text("get_weather", '{"city":"Rom","days":1,"x":1}'), False),  # not declared
        (call_text("get_weather", '{"city": "Rom","days":1}'), False),  # compact only
        (call_text("get_sun", "{}"), False),  # not a tool
        (call_text("get_time", '{"tz":"UTC"}'), True),
        (call_text("get_time", '{"tz":"UTC","tz2":1}'), False),  # absent additionalProperties = false
        ("<tool_call> oops", False),  # a trigger starts a call: it must be well-formed
        ("<tool_ call> is text", True),
    ],
)
def test_the_tag_admits_exactly_the_contract(lib: Library, model: int, text: str, ok: bool) -> None:
    with grammar(lib, model, tag_doc()) as g:
        assert feed(lib, g, encode(lib, model, "Sure. " + text)) == ok, error(lib)


def test_at_least_one_and_stop_after_first(lib: Library, model: int, token_bytes: list[bytes]) -> None:
    with grammar(lib, model, tag_doc(at_least_one=True, stop_after_first=True)) as g:
        rc, allowed = fill(lib, g)
        assert rc == 1 and EOS_ID not in allowed
        assert allowed and all(b"<tool_call>".startswith(token_bytes[t][:11]) for t in allowed)
        assert not feed(lib, g, encode(lib, model, "Hi"))  # no text before the call
        lib.baseRT_grammar_reset(g)
        assert feed(lib, g, encode(lib, model, call_text("get_time", '{"tz":"x"}')))
        rc, allowed = fill(lib, g)
        assert rc == 1 and EOS_ID in allowed and IM_START not in allowed and max(allowed) < 3  # end tokens only
        assert not feed(lib, g, encode(lib, model, "\n"))  # nothing but an end token after the one call
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 1 and lib.baseRT_grammar_is_terminated(g) == 1
    with grammar(lib, model, tag_doc(at_least_one=True)) as g:  # alone: a call first, then text and more calls
        assert feed(
            lib,
            g,
            encode(lib, model, call_text("get_time", '{"tz":"x"}') + " and " + call_text("get_time", '{"tz":"y"}')),
        )
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 1


@pytest.mark.parametrize(
    ("at_least_one", "stop_after_first", "text", "ok", "may_end"),
    [
        (True, False, "", True, False),  # at least one call
        (False, False, "", True, True),  # or none at all
        (True, False, "Hi", False, False),  # tags only: no text
        (True, False, call_text("get_time", '{"tz":"x"}'), True, True),
        (True, False, call_text("get_time", '{"tz":"x"}') + "\n" + call_text("get_time", '{"tz":"y"}'), True, True),
        (True, False, call_text("get_time", '{"tz":"x"}') + "\n", True, False),  # after a separator: a call
        (True, False, call_text("get_time", '{"tz":"x"}') + " ", False, False),
        (True, True, call_text("get_time", '{"tz":"x"}'), True, True),
        (True, True, call_text("get_time", '{"tz":"x"}') + "\n", False, False),  # one call only
    ],
)
def test_tags_with_separator(
    lib: Library, model: int, at_least_one: bool, stop_after_first: bool, text: str, ok: bool, may_end: bool
) -> None:
    doc = tag_doc(at_least_one=at_least_one, stop_after_first=stop_after_first, separator="\n")
    with grammar(lib, model, doc) as g:
        assert feed(lib, g, encode(lib, model, text) if text else []) == ok, error(lib)
        if ok:
            rc, allowed = fill(lib, g)
            assert rc == 1 and (EOS_ID in allowed) == may_end
            assert lib.baseRT_grammar_is_completed(g) == 0


def test_any_text_and_excludes(lib: Library, model: int, token_bytes: list[bytes]) -> None:
    with grammar(lib, model, {"type": "structural_tag", "format": {"type": "any_text", "excludes": [TRIGGER]}}) as g:
        rc, allowed = fill(lib, g)
        assert EOS_ID in allowed and IM_START in allowed
        assert feed(lib, g, encode(lib, model, "text <tool call> <tool_call"))
        assert lib.baseRT_grammar_is_completed(g) == 0
        rc, allowed = fill(lib, g)
        assert rc == 1 and not any(token_bytes[t].startswith(b">") for t in allowed)  # nothing completes it
        assert encode(lib, model, "xy>") and all(not feed(lib, g, [t]) for t in encode(lib, model, ">"))
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 1 and lib.baseRT_grammar_is_terminated(g) == 1
    doc = tag_doc()
    doc["format"]["excludes"] = ["zz"]  # free text around the calls must not contain it; a call's JSON may
    with grammar(lib, model, doc) as g:
        assert feed(lib, g, encode(lib, model, "ok z " + call_text("get_time", '{"tz":"zz"}') + " ok z"))
        assert not feed(lib, g, encode(lib, model, "zz"))


def test_bad_handles(lib: Library, model: int) -> None:
    g = create(lib, model, tag_doc())
    lib.baseRT_grammar_free(g)
    mask = np.zeros(64, dtype=np.int32)
    assert lib.baseRT_grammar_fill_bitmask(g, mask.ctypes.data) == 0 and error(lib)[0] == INVALID_ARGUMENT
    assert lib.baseRT_grammar_accept_token(g, 5) == 0 and error(lib)[0] == INVALID_ARGUMENT
    lib.baseRT_grammar_free(g)  # double free: an error, not a crash
    assert error(lib)[0] == INVALID_ARGUMENT
    g = create(lib, model, tag_doc())
    assert lib.baseRT_grammar_accept_token(g, 1 << 30) == 0 and error(lib)[0] == INVALID_ARGUMENT
    lib.baseRT_grammar_free(g)


# ---- property: whatever the masks let through is well-formed --------------------------------


def check_output(text: str, *, ended: bool, at_least_one: bool, stop_after_first: bool, tags_only: bool) -> int:
    """Walk `text` as the tag defines it; every completed call must be well-formed
    with schema-valid arguments; an ended output has no open call; tags_only
    (tags_with_separator): nothing but calls and the newlines between them. The
    number of calls."""
    pos, calls = 0, 0
    if (at_least_one or tags_only) and text:
        assert text.startswith(TRIGGER[: len(text)]), text
    while True:
        at = text.find(TRIGGER, pos)
        if tags_only:
            gap = text[pos:] if at < 0 else text[pos:at]
            lead = "\n" if calls else ""
            if at >= 0:
                assert gap == lead, text
            else:  # the end, or an unfinished separator / begin
                assert gap == "" if ended else any((lead + begin(n)).startswith(gap) for n in SCHEMAS), text
        if at < 0:
            assert not (at_least_one and ended and calls == 0), text
            return calls
        name = next((n for n in SCHEMAS if text.startswith(begin(n), at)), None)
        if name is None:  # only legal as an unfinished begin
            assert not ended and any(begin(n).startswith(text[at:]) for n in SCHEMAS), text
            return calls
        start = at + len(begin(name))
        try:
            value, stop = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            assert not ended, text  # an unfinished argument object
            return calls
        if not text.startswith(END, stop):
            assert not ended and END.startswith(text[stop:]), text
            return calls
        jsonschema.validate(value, SCHEMAS[name])
        calls += 1
        pos = stop + len(END)
        if stop_after_first:
            assert text[pos:] == "", text
            return calls


PREFERRED = ['"', "}", ",", "1", "true", "city", "days", "tz", ":", "<tool_call>", "\n", "{", "get_weather"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    choices=st.lists(st.floats(0, 1), min_size=1, max_size=120),
)
def test_walks_through_the_masks_stay_well_formed(
    lib: Library, model: int, token_bytes: list[bytes], flags: tuple[bool, bool, bool], choices: list[float]
) -> None:
    at_least_one, stop_after_first, tags_only = flags
    prefer = {t for s in PREFERRED for t in encode(lib, model, s)} | {EOS_ID}
    out = b""
    ended = False
    doc = tag_doc(at_least_one=at_least_one, stop_after_first=stop_after_first, separator="\n" if tags_only else None)
    with grammar(lib, model, doc) as g:
        for x in choices:
            rc, allowed = fill(lib, g)
            assert allowed, "the grammar dead-ended"
            if rc == 0:
                assert len(allowed) == len(token_bytes)  # nothing to apply means every token
            good = sorted(allowed & prefer) if x < 0.7 else []
            pool = good or sorted(allowed)
            t = pool[int(x * 1e6) % len(pool)]
            assert lib.baseRT_grammar_accept_token(g, t) == 1, error(lib)
            if lib.baseRT_is_eos_token(model, t):
                ended = True
                break
            out += token_bytes[t]
        assert lib.baseRT_grammar_is_completed(g) == 0
        assert lib.baseRT_grammar_is_terminated(g) == int(ended)
    check_output(
        out.decode("utf-8", "replace"),
        ended=ended,
        at_least_one=at_least_one,
        stop_after_first=stop_after_first,
        tags_only=tags_only,
    )


# ---- fuzz: any document is a handle or an error, never a crash (ASan in test_sanitizers) ----

_KEYS = [
    "type",
    "format",
    "triggers",
    "tags",
    "begin",
    "end",
    "content",
    "json_schema",
    "schema",
    "structures",
    "at_least_one",
    "stop_after_first",
    "excludes",
    "properties",
    "required",
    "additionalProperties",
]
_WORDS = [
    "structural_tag",
    "triggered_tags",
    "tag",
    "json_schema",
    "object",
    "string",
    "integer",
    "<a",
    "<ab",
    "a",
    "",
    "}",
]
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2) | st.sampled_from(_WORDS) | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=3), inner, max_size=5)
    ),
    max_leaves=24,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_json, raw=st.binary(max_size=40), steps=st.lists(st.integers(0, 10**6), max_size=12))
def test_fuzz_documents(lib: Library, model: int, doc: Any, raw: bytes, steps: list[int]) -> None:
    for text in (json.dumps(doc).encode(), raw.replace(b"\0", b" ")):
        with grammar_or_refusal(lib, model, text) as g:
            if not g:  # refused, with a typed code
                continue
            for k in steps:
                allowed = sorted(fill(lib, g)[1])
                assert allowed  # never a dead end
                assert lib.baseRT_grammar_accept_token(g, allowed[k % len(allowed)]) == 1


_schemas = st.sampled_from(
    [
        True,
        {},
        {"type": "object"},
        {"type": "string"},
        {"type": "array"},
        {"type": "null"},
        {"type": "integer"},
        WEATHER,
        TIME,
        {"properties": {"a": {}, "b": {"type": "number"}}, "required": ["b"]},
    ]
)


@st.composite
def _tag_docs(draw: st.DrawFn) -> dict[str, Any]:
    triggers = draw(st.lists(st.text("<ab>x", min_size=1, max_size=3), min_size=1, max_size=3, unique=True))
    tags = [
        {
            "begin": draw(st.sampled_from(triggers)) + draw(st.text('ab{x"', max_size=3)),
            "content": {"type": "json_schema", "json_schema": draw(_schemas)},
            "end": draw(st.text("}>x\n", max_size=3)),
        }
        for _ in range(draw(st.integers(1, 3)))
    ]
    flags = {"at_least_one": draw(st.booleans()), "stop_after_first": draw(st.booleans())}
    excludes = draw(st.lists(st.text("<>x", min_size=1, max_size=2), max_size=2, unique=True))
    if draw(st.integers(0, 5)) == 0:
        return {"type": "any_text", "excludes": excludes}
    if draw(st.booleans()):
        return {"type": "tags_with_separator", "tags": tags, "separator": draw(st.text("\n,x", max_size=2)), **flags}
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "excludes": excludes, **flags}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_tag_docs(), steps=st.lists(st.integers(0, 10**6), max_size=40))
def test_fuzz_well_shaped_tags_never_dead_end(
    lib: Library, model: int, token_bytes: list[bytes], doc: Any, steps: list[int]
) -> None:
    """Accepted documents step without a dead end, and the mask agrees with accept."""
    with grammar_or_refusal(lib, model, json.dumps(doc).encode()) as g:
        if not g:  # refused, with a typed code
            return
        for k in steps:
            rc, allowed = fill(lib, g)
            assert allowed and (rc == 1 or len(allowed) == len(token_bytes))  # 0: nothing to apply, every token
            pick = sorted(allowed)[k % len(allowed)]
            outside = k % 2000  # a token the mask refuses is refused by accept as well
            if outside not in allowed and outside < lib.baseRT_grammar_bitmask_size(g) * 32:
                assert lib.baseRT_grammar_accept_token(g, outside) == 0
            assert lib.baseRT_grammar_accept_token(g, pick) == 1

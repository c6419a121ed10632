"""The reference engine's JSON grammar (native/src/grammar.c): token masks checked
against a Python reference of "is this a viable compact-JSON prefix", stepping,
completion and eos, schema refusals, handle checks; then the SDK's engine-grammar
path (EngineGrammarConstraint) end to end under asyncio and trio."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from raw_abi import coded_error as error
from raw_abi import encode

from aiobasert import Engine
from aiobasert._ffi import Library
from aiobasert.models.bundle import read_bundle
from aiobasert.models.tiny import EOS_ID

INVALID_ARGUMENT, UNSUPPORTED = 2, 5
CONTROL = 3


@pytest.fixture
def vocab_info(lib: Library, model: int, tiny_model_path: Path) -> tuple[int, list[bytes], list[int]]:
    header = read_bundle(tiny_model_path)
    vocab = int(header.config["vocab_size"])
    types = list(header.tokenizer["tokenizer.ggml.token_type"])
    raw: list[bytes] = []
    buf = ctypes.create_string_buffer(256)
    for t in range(vocab):
        n = lib.baseRT_decode_token_raw(model, t, buf, 256)
        assert 0 <= n <= 256
        raw.append(buf.raw[:n])
    types += [0] * (vocab - len(types))
    return vocab, raw, types


@pytest.fixture
def eos_ids(lib: Library, model: int, vocab_info: Any) -> set[int]:
    """The model's end ids: what a completed grammar allows (every one a control token)."""
    g = lib.baseRT_grammar_create_json(model)
    for t in encode(lib, model, "[]"):
        assert lib.baseRT_grammar_accept_token(g, t) == 1
    ends = mask_of(lib, g)
    lib.baseRT_grammar_free(g)
    assert EOS_ID in ends and all(vocab_info[2][t] == CONTROL for t in ends)
    return ends


def mask_of(lib: Library, g: int) -> set[int]:
    words = lib.baseRT_grammar_bitmask_size(g)
    mask = np.zeros(words, dtype=np.int32)
    assert lib.baseRT_grammar_fill_bitmask(g, mask.ctypes.data) == 1
    return {int(i) for i in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))}


# ---- the Python reference ------------------------------------------------------------

# Completions that finish any viable prefix's pending token (escape, \u digits, key,
# literal, number part); the scanner's stack then supplies the closers.
PIECES = ["", "0", '"', ":0", '"a":0', "e", "ue", "rue", "lse", "alse", "se", "l", "ll", "ull"]
PIECES += [esc + '"' + key for esc in ("", "n", "0", "00", "000", "0000") for key in ("", ":0")]
UTF8_TAILS = [b"", b"\x80", b"\x80\x80", b"\x80\x80\x80", b"\xa0\x80", b"\x90\x80\x80"]


def scan(s: str) -> tuple[list[str], bool, bool]:
    """(open containers, ends inside a string, whitespace outside strings)."""
    stack: list[str] = []
    in_str = ws = False
    i = 0
    while i < len(s):
        c = s[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            stack.append(c)
        elif c in "]}" and stack:
            stack.pop()
        elif c in " \t\r\n":
            ws = True
        i += 1
    return stack, in_str, ws


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def parses(text: str, top: str | None) -> bool:
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return False
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if top in kinds:
        return isinstance(value, kinds[top])
    if top == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if top == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return True


def viable(prefix: bytes, top: str | None = None) -> bool:
    """Whether some text continues `prefix` into exactly one compact JSON value."""
    for tail in UTF8_TAILS:
        try:
            s = (prefix + tail).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if scan(s)[2]:
            return False
        for piece in PIECES:
            stack, in_str, ws = scan(s + piece)
            if in_str or ws:
                continue
            closers = "".join("}" if c == "{" else "]" for c in reversed(stack))
            if parses(s + piece + closers, top):
                return True
    return False


def expected_mask(
    prefix: bytes, info: tuple[int, list[bytes], list[int]], ends: set[int], top: str | None = None
) -> set[int]:
    vocab, raw, types = info
    allowed = {t for t in range(vocab) if types[t] != CONTROL and raw[t] and viable(prefix + raw[t], top)}
    text = prefix.decode("utf-8", "replace")
    complete = parses(text, top) and not scan(text)[2]
    if complete:  # (only a top-level number has byte continuations then)
        allowed |= ends
    return allowed


def test_reference_itself() -> None:
    for good in [b"", b"{", b'{"a', b'{"a"', b'{"a":', b"[1,", b'"\\u0', b"-", b"1.", b"1e+", b"tr", b'"\xe6\x97']:
        assert viable(good), good
    for bad in [b"{}}", b"[,", b"01", b"{1", b'{"a" :', b"-a", b"NaN", b'"\x01', b"[]0", b"\xff", b"[ ]", b"1 "]:
        assert not viable(bad), bad


# ---- masks against the reference -----------------------------------------------------

STATES = [
    "",
    "{",
    '{"a',
    '{"ab"',
    '{"a":',
    '{"a":[1',
    '{"a":[1,',
    '{"a":[1],',
    '["x\\',
    '["x\\u0',
    "-",
    "12",
    "1.5e",
    "t",
    "[true",
    "[null,false,",
    '"he',
    "[[[",
    '{"k":"v"}',
    "[]",
    "0",
    "-0.5",
    '{"a":{"b":"c\\n"',
]


@pytest.mark.parametrize("prefix", STATES)
def test_mask_matches_reference(lib: Library, model: int, vocab_info: Any, eos_ids: set[int], prefix: str) -> None:
    g = lib.baseRT_grammar_create_json(model)
    assert g, error(lib)
    try:
        assert lib.baseRT_grammar_bitmask_size(g) == (vocab_info[0] + 31) // 32
        for t in encode(lib, model, prefix):
            assert lib.baseRT_grammar_accept_token(g, t) == 1, (prefix, t, error(lib))
        got = mask_of(lib, g)
        assert got == expected_mask(prefix.encode(), vocab_info, eos_ids), (
            prefix,
            sorted(got ^ expected_mask(prefix.encode(), vocab_info, eos_ids))[:20],
        )
        assert got, prefix  # never an empty mask on a viable prefix
    finally:
        lib.baseRT_grammar_free(g)


@pytest.mark.parametrize(
    ("top", "prefix"),
    [
        ("object", ""),
        ("array", ""),
        ("string", ""),
        ("number", ""),
        ("integer", ""),
        ("integer", "12"),
        ("number", "12"),
        ("boolean", ""),
        ("null", ""),
        ("array", "[{"),
        ("integer", "-"),
    ],
)
def test_typed_masks(lib: Library, model: int, vocab_info: Any, eos_ids: set[int], top: str, prefix: str) -> None:
    g = lib.baseRT_grammar_create_from_schema(model, json.dumps({"type": top}).encode())
    assert g, error(lib)
    try:
        for t in encode(lib, model, prefix):
            assert lib.baseRT_grammar_accept_token(g, t) == 1
        assert mask_of(lib, g) == expected_mask(prefix.encode(), vocab_info, eos_ids, top)
    finally:
        lib.baseRT_grammar_free(g)


# ---- stepping, completion, eos ----------------------------------------------------------


def test_accept_reject_complete_and_reset(lib: Library, model: int, vocab_info: Any, eos_ids: set[int]) -> None:
    vocab, raw, types = vocab_info
    g = lib.baseRT_grammar_create_json(model)
    try:
        assert lib.baseRT_grammar_is_completed(g) == 0 and lib.baseRT_grammar_is_terminated(g) == 0
        # eos before any value, a control token and an out-of-range id are rejected
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 0
        assert error(lib)[0] == INVALID_ARGUMENT
        control = next(t for t in range(vocab) if types[t] == CONTROL and t != EOS_ID)
        assert lib.baseRT_grammar_accept_token(g, control) == 0
        assert lib.baseRT_grammar_accept_token(g, vocab) == 0 and error(lib)[0] == INVALID_ARGUMENT
        # a token that cannot start a value is rejected and leaves the state unchanged
        bad = next(t for t in range(vocab) if raw[t][:1] == b"}")
        before = mask_of(lib, g)
        assert lib.baseRT_grammar_accept_token(g, bad) == 0 and "rejected" in error(lib)[1]
        assert mask_of(lib, g) == before
        for t in encode(lib, model, '{"a":[1,2.5,"x"],"b":null}'):
            assert lib.baseRT_grammar_is_completed(g) == 0
            assert lib.baseRT_grammar_accept_token(g, t) == 1, error(lib)
        assert lib.baseRT_grammar_is_completed(g) == 1 and lib.baseRT_grammar_is_terminated(g) == 0
        assert mask_of(lib, g) == eos_ids  # complete: only the eos ids
        assert lib.baseRT_grammar_accept_token(g, encode(lib, model, "}")[0]) == 0
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 1
        assert lib.baseRT_grammar_is_terminated(g) == 1 and lib.baseRT_grammar_is_completed(g) == 1
        reset = ctypes.CDLL(lib.path).baseRT_grammar_reset
        reset.restype, reset.argtypes = None, [ctypes.c_void_p]
        reset(g)
        assert lib.baseRT_grammar_is_completed(g) == 0 and lib.baseRT_grammar_is_terminated(g) == 0
        assert mask_of(lib, g) == expected_mask(b"", vocab_info, eos_ids)
    finally:
        lib.baseRT_grammar_free(g)


def test_top_level_number_ends_on_eos(lib: Library, model: int) -> None:
    g = lib.baseRT_grammar_create_from_schema(model, b'{"type": "integer"}')
    try:
        for t in encode(lib, model, "42"):
            assert lib.baseRT_grammar_accept_token(g, t) == 1
        assert lib.baseRT_grammar_is_completed(g) == 0  # a number can always continue
        assert EOS_ID in mask_of(lib, g)
        assert lib.baseRT_grammar_accept_token(g, encode(lib, model, ".")[0]) == 0  # integer: no fraction
        assert lib.baseRT_grammar_accept_token(g, EOS_ID) == 1
        assert lib.baseRT_grammar_is_terminated(g) == 1
    finally:
        lib.baseRT_grammar_free(g)


def test_depth_limit(lib: Library, model: int) -> None:
    g = lib.baseRT_grammar_create_json(model)
    bracket = encode(lib, model, "[")
    assert len(bracket) == 1
    try:
        for _ in range(64):
            assert lib.baseRT_grammar_accept_token(g, bracket[0]) == 1
        assert lib.baseRT_grammar_accept_token(g, bracket[0]) == 0
        assert bracket[0] not in mask_of(lib, g)
    finally:
        lib.baseRT_grammar_free(g)


def test_invalid_utf8_and_escapes_rejected(lib: Library, model: int, vocab_info: Any) -> None:
    vocab, raw, _ = vocab_info
    g = lib.baseRT_grammar_create_json(model)
    try:
        for t in encode(lib, model, '"'):
            assert lib.baseRT_grammar_accept_token(g, t) == 1
        allowed = mask_of(lib, g)
        for t in range(vocab):
            if raw[t] and (raw[t][:1] in (b"\x80", b"\xff", b"\xc0", b"\n", b"\t")):
                assert t not in allowed
    finally:
        lib.baseRT_grammar_free(g)


# ---- creation and handle checks -----------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}, "properties"),
        ({"enum": [1, 2]}, "enum"),
        ({"type": "object", "required": ["a"]}, "required"),
        ({"type": "object", "properties": {"a": {"minimum": 1}}}, "minimum"),
        ({"type": "object", "properties": {}, "additionalProperties": True}, "additionalProperties"),
        ({"type": "string", "properties": {}}, "non-object"),
        ({"type": "object", "properties": {'a"b': {}}}, "property names"),
        ({"type": "object", "x-guidance": {"whitespace_flexible": True}}, "x-guidance"),  # the host honours it
        ({"type": ["string", "null"]}, "type"),
        ({"type": "foo"}, "type"),
        (False, "false"),
        (3, "not an object"),
    ],
)
def test_schema_refusals(lib: Library, model: int, schema: Any, needle: str) -> None:
    assert not lib.baseRT_grammar_create_from_schema(model, json.dumps(schema).encode())
    code, msg = error(lib)
    assert code == UNSUPPORTED and needle in msg, msg


def test_schema_accepts_and_errors(lib: Library, model: int) -> None:
    for text in [
        b"{}",
        b"true",
        b'{"type": "array"}',
        b'{ "type" : "null" }',
        b'{"type": "object", "x-guidance": {"whitespace_flexible": false}, "description": "d"}',
    ]:
        g = lib.baseRT_grammar_create_from_schema(model, text)
        assert g, (text, error(lib))
        assert error(lib)[0] == 0
        lib.baseRT_grammar_free(g)
    assert not lib.baseRT_grammar_create_from_schema(model, b'{"type": ')
    assert error(lib)[0] == INVALID_ARGUMENT and "not valid JSON" in error(lib)[1]
    assert not lib.baseRT_grammar_create_from_schema(model, None)
    assert error(lib)[0] == INVALID_ARGUMENT
    assert not lib.baseRT_grammar_create_from_schema(None, b"{}")
    assert error(lib)[0] == INVALID_ARGUMENT
    assert not lib.baseRT_grammar_create_json(None)
    assert error(lib)[0] == INVALID_ARGUMENT
    raw = ctypes.CDLL(lib.path)
    raw.baseRT_grammar_create.restype = ctypes.c_void_p
    raw.baseRT_grammar_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    assert not raw.baseRT_grammar_create(model, b'root ::= "a"')
    assert error(lib)[0] == UNSUPPORTED


def test_bad_handles(lib: Library, model: int) -> None:
    g = lib.baseRT_grammar_create_json(model)
    lib.baseRT_grammar_free(g)
    mask = np.zeros(64, dtype=np.int32)
    for handle in (None, g):
        assert lib.baseRT_grammar_bitmask_size(handle) == 0 and error(lib)[0] == INVALID_ARGUMENT
        assert lib.baseRT_grammar_fill_bitmask(handle, mask.ctypes.data) == 0
        assert error(lib)[0] == INVALID_ARGUMENT
        assert lib.baseRT_grammar_accept_token(handle, 0) == 0 and error(lib)[0] == INVALID_ARGUMENT
        assert lib.baseRT_grammar_is_completed(handle) == 0 and lib.baseRT_grammar_is_terminated(handle) == 0
        lib.baseRT_grammar_free(handle)  # double free: an error, not a crash
        assert error(lib)[0] == INVALID_ARGUMENT
    g = lib.baseRT_grammar_create_json(model)
    assert lib.baseRT_grammar_fill_bitmask(g, None) == 0 and error(lib)[0] == INVALID_ARGUMENT
    lib.baseRT_grammar_free(g)


# ---- through the SDK -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("schema", "kind"),
    [(True, None), ({"type": "array"}, list), ({"type": "object"}, dict), ({"type": "integer"}, int)],
)
async def test_sdk_engine_grammar(untied_model_path: Path, schema: Any, kind: Any) -> None:
    async with Engine.open(untied_model_path, max_batch_size=4) as engine:
        assert engine.capabilities.grammar_compiler  # the engine compiles and steps the schema itself
        closers = {(await engine.encode(s))[0]: 5.0 for s in ('"', "]", "}")}
        closers[EOS_ID] = 5.0
        for i in range(4):
            sampled: dict[str, Any] = dict(temperature=1.0, seed=i) if i else {}
            done = await engine.generate(
                f"prompt {i}", max_tokens=96, json_schema=schema, logit_bias=closers, **sampled
            )
            assert done.finish_reason == "stop", done
            value = json.loads(done.text)
            if kind is not None:
                assert isinstance(value, kind) and not isinstance(value, bool), done.text
            assert not any(c in done.text for c in "\n\t") or isinstance(value, str)


@pytest.mark.anyio
async def test_sdk_falls_back_to_host_for_properties(untied_model_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    async with Engine.open(untied_model_path, max_batch_size=2) as engine:
        done = await engine.generate("x", max_tokens=32, json_schema=schema)
        assert done.finish_reason == "stop", done
        value = json.loads(done.text)
        assert set(value) == {"n"} and 0 <= value["n"] <= 9

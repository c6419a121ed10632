"""Greedy speculative verification and the speculation flag of the reference engine (baseRT.h:
baseRT_batch_step_fused_rows_argmax, baseRT_set_speculation, baseRT_get_speculation).

rows_argmax is the multi-row forward of baseRT_batch_step_fused_logits_rows with every requested
row argmaxed in the engine: its tokens must be, token for token, what baseRT_argmax_logits_row
picks from the rows the logits variant leaves (ties included: the lowest index wins), for any
feed. Also run under ASan + UBSan by tests/native/test_sanitizers.py."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Sequence
from ctypes import c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_abi import coded_error, error, ints, load, u32

from aiobasert._ffi import TOKEN_CALLBACK, BaseRTSamplingConfig, Library
from aiobasert.models.tiny import build_tiny_model

OK, INVALID_ARGUMENT, UNSUPPORTED = 0, 2, 5
N_LAYERS, DIM, CHUNK, MAX_BATCH, CONTEXT = 2, 64, 16, 4, 256


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("spec") / "tiny.base", dim=DIM, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False
    )


@pytest.fixture(scope="module")
def model_options() -> dict[str, int]:
    return {"max_context": CONTEXT, "max_batch_size": MAX_BATCH, "prefix_cache": 0, "prefill_chunk": CHUNK}


def seqs_of(values: Sequence[int]) -> ctypes.Array[c_void_p]:
    return (c_void_p * max(len(values), 1))(*values)


def new_seq(lib: Library, m: int) -> int:
    s = lib.baseRT_sequence_create(m)
    assert s, error(lib)
    return int(s)


def rows_argmax(
    lib: Library,
    m: int,
    seqs: Sequence[int],
    feeds: Sequence[Sequence[int]],
    out_rows: Sequence[int],
    taps: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[int, list[int]]:
    """One rows_argmax step; (rc, the sum(out_rows) tokens)."""
    flat = [t for f in feeds for t in f]
    n_out = sum(out_rows)
    out = u32([0xDEADBEEF] * (n_out + 1))  # one past the end: must stay untouched
    layers, tap_rows = taps if taps is not None else ((), ())
    rc = int(
        lib.baseRT_batch_step_fused_rows_argmax(
            m,
            seqs_of(seqs),
            len(seqs),
            u32(flat),
            ints([len(f) for f in feeds]),
            ints(out_rows),
            ints(layers) if taps is not None else None,
            len(layers),
            ints(tap_rows) if taps is not None else None,
            out,
        )
    )
    assert out[n_out] == 0xDEADBEEF
    return rc, [int(t) for t in out[:n_out]]


def logits_rows(
    lib: Library, m: int, seqs: Sequence[int], feeds: Sequence[Sequence[int]], out_rows: Sequence[int]
) -> np.ndarray[Any, np.dtype[np.float16]]:
    """One baseRT_batch_step_fused_logits_rows step; its rows read back."""
    flat = [t for f in feeds for t in f]
    rc = lib.baseRT_batch_step_fused_logits_rows(
        m, seqs_of(seqs), len(seqs), u32(flat), ints([len(f) for f in feeds]), ints(out_rows)
    )
    assert rc == OK, error(lib)
    return read_rows(lib, m, sum(out_rows))


def read_rows(lib: Library, m: int, n: int) -> np.ndarray[Any, np.dtype[np.float16]]:
    vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
    out = np.empty((n, vocab), dtype=np.float16)
    assert lib.baseRT_read_batch_logits(m, n, out.ctypes.data_as(c_void_p)) == vocab, error(lib)
    return out


def host_argmax(lib: Library, m: int, rows: np.ndarray[Any, np.dtype[np.float16]]) -> list[int]:
    """What the SDK's host path picks from each row (baseRT_argmax_logits_row)."""
    return [int(lib.baseRT_argmax_logits_row(m, rows[i].ctypes.data_as(c_void_p))) for i in range(rows.shape[0])]


def prefill(lib: Library, m: int, prompts: Sequence[Sequence[int]]) -> list[int]:
    """A sequence per prompt, its prompt fed (one plain step)."""
    seqs = [new_seq(lib, m) for _ in prompts]
    rc = lib.baseRT_batch_step_fused_logits(
        m, seqs_of(seqs), len(seqs), u32([t for p in prompts for t in p]), ints([len(p) for p in prompts])
    )
    assert rc == OK, error(lib)
    return seqs


def free(lib: Library, seqs: Sequence[int]) -> None:
    for s in seqs:
        lib.baseRT_sequence_free(s)


TOKEN = st.integers(3, 250)


@st.composite
def verify_steps(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """1-MAX_BATCH lanes: each a prompt, then a feed of 1 to 8 tokens (a decode row, or its pending
    token and up to 7 drafts: a k+1 verify) and how many of its last rows it asks for (all of them,
    a verify, or fewer)."""
    n = draw(st.integers(1, MAX_BATCH))
    prompts = [draw(st.lists(TOKEN, min_size=1, max_size=20)) for _ in range(n)]
    feeds = [draw(st.lists(TOKEN, min_size=1, max_size=8)) for _ in range(n)]
    out_rows = [draw(st.one_of(st.just(len(f)), st.integers(1, len(f)))) for f in feeds]
    return prompts, feeds, out_rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=verify_steps())
def test_rows_argmax_is_the_argmax_of_the_logits_rows(
    lib: Library, model: int, step: tuple[list[list[int]], list[list[int]], list[int]]
) -> None:
    """Any multi-lane feed: rows_argmax's tokens are the host argmax of the rows the logits
    variant leaves on sequences with the same history; both leave the same lengths."""
    prompts, feeds, out_rows = step
    a, b = prefill(lib, model, prompts), prefill(lib, model, prompts)
    try:
        want = host_argmax(lib, model, logits_rows(lib, model, a, feeds, out_rows))
        rc, got = rows_argmax(lib, model, b, feeds, out_rows)
        assert rc == OK, error(lib)
        assert got == want
        # the rows stay readable, as after the logits variant (lanes in order, rows ascending)
        assert host_argmax(lib, model, read_rows(lib, model, sum(out_rows))) == got
        # the lanes advanced by their whole feed, as with the logits variant
        more = [[3]] * len(prompts)
        after_a = logits_rows(lib, model, a, more, [1] * len(a))
        assert after_a.tobytes() == logits_rows(lib, model, b, more, [1] * len(b)).tobytes()
    finally:
        free(lib, a + b)


def test_row_i_is_the_greedy_choice_after_the_ith_fed_token(lib: Library, model: int) -> None:
    """A k+1 verify feed (pending token + 4 drafts): row i is what a plain greedy decode step
    would pick after fed token i, so drafts are accepted while they equal the rows."""
    prompt, feed = [5, 17, 42, 9], [77, 3, 120, 64, 8]
    [v] = prefill(lib, model, [prompt])
    rc, got = rows_argmax(lib, model, [v], [feed], [len(feed)])
    assert rc == OK, error(lib)
    [s] = prefill(lib, model, [prompt])
    plain = []
    for t in feed:
        out = u32([0])
        assert lib.baseRT_batch_step_fused(model, seqs_of([s]), 1, u32([t]), ints([1]), out) == OK, error(lib)
        plain.append(int(out[0]))
    assert got == plain
    # out_rows < fed rows: the LAST rows, still after the same fed tokens
    [w] = prefill(lib, model, [prompt])
    rc, tail = rows_argmax(lib, model, [w], [feed], [2])
    assert rc == OK and tail == plain[-2:], error(lib)
    free(lib, [v, s, w])


def test_taps_are_optional_and_served(lib: Library, model: int) -> None:
    """n_tap_layers 0 with NULL taps works (above); a tapped call taps what the _taps variant taps."""
    prompt, feed = [11, 12, 13], [14, 15, 16]
    [a] = prefill(lib, model, [prompt])
    rc, got = rows_argmax(lib, model, [a], [feed], [3], taps=([N_LAYERS], [3]))
    assert rc == OK, error(lib)
    tapped = np.empty((3, DIM), dtype=np.float16)
    assert lib.baseRT_read_tap_rows(model, 0, 3, tapped.ctypes.data_as(c_void_p)) == DIM, error(lib)
    [b] = prefill(lib, model, [prompt])
    rc = lib.baseRT_batch_step_fused_logits_rows_taps(
        model, seqs_of([b]), 1, u32(feed), ints([3]), ints([3]), ints([N_LAYERS]), 1, ints([3])
    )
    assert rc == OK, error(lib)
    want = np.empty((3, DIM), dtype=np.float16)
    assert lib.baseRT_read_tap_rows(model, 0, 3, want.ctypes.data_as(c_void_p)) == DIM
    assert tapped.tobytes() == want.tobytes()
    assert got == host_argmax(lib, model, read_rows(lib, model, 3))
    free(lib, [a, b])


@pytest.fixture(scope="module")
def tied_logits_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A final softcap of 1e-3 saturates every clearly positive logit to the same value: rows full
    of ties at their maximum."""
    return build_tiny_model(
        tmp_path_factory.mktemp("ties") / "ties.base", arch="gemma3", final_logit_softcapping=1e-3, seed=4
    )


def test_ties_break_as_the_host_argmax(lib: Library, tied_logits_path: Path) -> None:
    m = load(lib, tied_logits_path, CONTEXT, max_batch_size=2, prefill_chunk=CHUNK)
    try:
        feeds = [[5, 6, 7, 8, 9], [30, 31]]
        a, b = prefill(lib, m, [[3, 4], [40]]), prefill(lib, m, [[3, 4], [40]])
        rows = logits_rows(lib, m, a, feeds, [5, 2])
        top = rows.max(axis=1, keepdims=True)
        assert ((rows == top).sum(axis=1) > 1).all(), "the fixture must tie every row at its maximum"
        want = host_argmax(lib, m, rows)
        assert want == [int(np.flatnonzero(r == r.max())[0]) for r in rows]  # the lowest index wins
        rc, got = rows_argmax(lib, m, b, feeds, [5, 2])
        assert rc == OK, error(lib)
        assert got == want
        free(lib, a + b)
    finally:
        lib.baseRT_free_model(m)


def test_bad_arguments_are_refused_and_change_nothing(lib: Library, model: int) -> None:
    fn = lib.baseRT_batch_step_fused_rows_argmax
    [s] = prefill(lib, model, [[5, 6, 7]])
    seqs, toks, counts, rows, out = seqs_of([s]), u32([8, 9]), ints([2]), ints([2]), u32([0, 0])
    bad: list[tuple[str, tuple[Any, ...]]] = [
        ("NULL model", (None, seqs, 1, toks, counts, rows, None, 0, None, out)),
        ("a model that is not one", (12345, seqs, 1, toks, counts, rows, None, 0, None, out)),
        ("NULL out_tokens", (model, seqs, 1, toks, counts, rows, None, 0, None, None)),
        ("NULL seqs", (model, None, 1, toks, counts, rows, None, 0, None, out)),
        ("NULL in_tokens", (model, seqs, 1, None, counts, rows, None, 0, None, out)),
        ("NULL counts", (model, seqs, 1, toks, None, rows, None, 0, None, out)),
        ("NULL out_rows", (model, seqs, 1, toks, counts, None, None, 0, None, out)),
        ("no lanes", (model, seqs, 0, toks, counts, rows, None, 0, None, out)),
        ("too many lanes", (model, seqs, MAX_BATCH + 1, toks, counts, rows, None, 0, None, out)),
        ("out_rows 0", (model, seqs, 1, toks, counts, ints([0]), None, 0, None, out)),
        ("out_rows > fed", (model, seqs, 1, toks, counts, ints([3]), None, 0, None, out)),
        ("a token past the vocabulary", (model, seqs, 1, u32([8, 1 << 30]), counts, rows, None, 0, None, out)),
        ("taps without layers", (model, seqs, 1, toks, counts, rows, None, 1, ints([1]), out)),
        ("taps without tap_rows", (model, seqs, 1, toks, counts, rows, ints([1]), 1, None, out)),
        ("a tap layer past the stack", (model, seqs, 1, toks, counts, rows, ints([N_LAYERS + 1]), 1, ints([1]), out)),
        ("negative tap layers", (model, seqs, 1, toks, counts, rows, None, -1, None, out)),
    ]
    for what, args in bad:
        out[0] = out[1] = 0xDEADBEEF
        rc = fn(*args)
        code, msg = coded_error(lib)
        assert rc == INVALID_ARGUMENT == code, (what, rc, msg)
        assert msg, what
        assert out[0] == out[1] == 0xDEADBEEF, what  # nothing written
    # the sequence is where it was: the same step now gives what it gives on a fresh one
    rc, got = rows_argmax(lib, model, [s], [[8, 9]], [2])
    assert rc == OK, error(lib)
    [t] = prefill(lib, model, [[5, 6, 7]])
    rc, want = rows_argmax(lib, model, [t], [[8, 9]], [2])
    assert rc == OK and got == want
    free(lib, [s, t])


def test_a_model_without_paged_kv_refuses_it(lib: Library, model_path: Path) -> None:
    m = lib.baseRT_load_model(os.fsencode(model_path), None, 0)
    assert m, error(lib)
    try:
        out = u32([0])
        rc = lib.baseRT_batch_step_fused_rows_argmax(
            m, seqs_of([0]), 1, u32([5]), ints([1]), ints([1]), None, 0, None, out
        )
        assert rc == UNSUPPORTED == coded_error(lib)[0], error(lib)
    finally:
        lib.baseRT_free_model(m)


def test_the_speculation_flag_is_per_handle(lib: Library, model: int, model_path: Path) -> None:
    other = load(lib, model_path, CONTEXT, max_batch_size=2)
    try:
        assert lib.baseRT_get_speculation(model) is False and lib.baseRT_get_speculation(other) is False
        lib.baseRT_set_speculation(model, True)
        assert lib.baseRT_get_error_code() == OK
        assert lib.baseRT_get_speculation(model) is True and lib.baseRT_get_speculation(other) is False
        lib.baseRT_set_speculation(other, True)
        lib.baseRT_set_speculation(model, False)
        assert lib.baseRT_get_speculation(model) is False and lib.baseRT_get_speculation(other) is True
    finally:
        lib.baseRT_free_model(other)


def test_the_speculation_flag_does_not_change_generation(lib: Library, model: int) -> None:
    """The reference engine predicts no drafts of its own: generate's tokens are the same with it on."""
    prompt = [5, 17, 42, 9]
    greedy = BaseRTSamplingConfig(temperature=0.0, top_p=1.0, repeat_penalty=1.0)

    def generate() -> list[int]:
        got: list[int] = []

        def collect(tok: int, text: bytes | None, _: Any) -> bool:
            got.append(tok)
            return True

        lib.baseRT_reset(model)
        lib.baseRT_generate(model, u32(prompt), len(prompt), 12, greedy, TOKEN_CALLBACK(collect), None)
        assert lib.baseRT_get_error_code() == OK, error(lib)
        assert got
        return got

    plain = generate()
    lib.baseRT_set_speculation(model, True)
    assert generate() == plain
    assert lib.baseRT_get_speculation(model) is True  # generating leaves the flag as it was


def test_bad_handles_are_refused(lib: Library, model_path: Path) -> None:
    lib.baseRT_set_speculation(None, True)
    assert coded_error(lib)[0] == INVALID_ARGUMENT
    assert lib.baseRT_get_speculation(None) is False
    assert coded_error(lib)[0] == INVALID_ARGUMENT
    lib.baseRT_set_speculation(12345, True)
    assert coded_error(lib)[0] == INVALID_ARGUMENT
    t = lib.baseRT_load_tokenizer_only(os.fsencode(model_path))
    assert t, error(lib)
    try:  # a tokenizer-only handle generates nothing: it has no flag to set
        lib.baseRT_set_speculation(t, True)
        assert coded_error(lib)[0] == INVALID_ARGUMENT
        assert lib.baseRT_get_speculation(t) is False
    finally:
        lib.baseRT_free_model(t)


def test_the_descriptor_lists_them(lib: Library, model: int) -> None:
    """The descriptor's `implemented` (what the library exports) names the three, and its "speculation"
    says what the reference engine does and does not do (no drafts of its own; verification served)."""
    d = json.loads(lib.baseRT_capability_descriptor(model))
    names = {"baseRT_batch_step_fused_rows_argmax", "baseRT_set_speculation", "baseRT_get_speculation"}
    assert names <= set(d["implemented"])
    caps = d["capabilities"]
    assert (
        caps["speculation"].startswith("unsupported") and "baseRT_batch_step_fused_rows_argmax" in caps["speculation"]
    )
    assert caps["verify_rows"] is True

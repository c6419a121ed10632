"""Multi-row logits and hidden-state taps of the reference engine (baseRT.h:
baseRT_batch_step_fused_logits_rows[_taps], baseRT_read_tap_rows,
baseRT_tap_rows_capacity, baseRT_model_supports_taps): what the rows and taps
hold, every bound the header states, and that a refused call changes nothing.
Also run under ASan + UBSan by tests/native/test_sanitizers.py."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from ctypes import byref, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from raw_abi import error, ints, u32

from aiobasert._ffi import BaseRTLoadOptions, BaseRTMemoryStats, Library
from aiobasert.models.bundle import read_bundle
from aiobasert.models.tiny import build_tiny_model

OK, INVALID_ARGUMENT, UNSUPPORTED = 0, 2, 5
N_LAYERS, DIM, CHUNK = 2, 64, 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("taps") / "tiny.base", dim=DIM, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False
    )


def load(lib: Library, path: Path, **opts: int) -> int:
    options = dict(paged_kv=1, max_batch_size=4, prefix_cache=0, prefill_chunk=CHUNK) | opts
    o = BaseRTLoadOptions(struct_size=ctypes.sizeof(BaseRTLoadOptions), **options)
    m = lib.baseRT_load_model_ex(os.fsencode(path), None, 256, byref(o))
    assert m, error(lib)
    return int(m)


@pytest.fixture(scope="module")
def model_options() -> dict[str, int]:
    return {"max_context": 256, "max_batch_size": 4, "prefix_cache": 0, "prefill_chunk": CHUNK}  # as `load`


def seqs_of(values: Sequence[int]) -> ctypes.Array[c_void_p]:
    return (c_void_p * max(len(values), 1))(*values)


def tapped(
    lib: Library,
    m: int,
    seqs: Sequence[int],
    feeds: Sequence[Sequence[int]],
    out_rows: Sequence[int],
    layers: Sequence[int],
    tap_rows: Sequence[int],
) -> int:
    flat = [t for f in feeds for t in f]
    return int(
        lib.baseRT_batch_step_fused_logits_rows_taps(
            m,
            seqs_of(seqs),
            len(seqs),
            u32(flat),
            ints([len(f) for f in feeds]),
            ints(out_rows),
            ints(layers),
            len(layers),
            ints(tap_rows),
        )
    )


def logits(lib: Library, m: int, n: int) -> np.ndarray[Any, np.dtype[np.float16]]:
    vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
    out = np.empty((n, vocab), dtype=np.float16)
    assert lib.baseRT_read_batch_logits(m, n, out.ctypes.data_as(c_void_p)) == vocab, error(lib)
    return out


def tap(lib: Library, m: int, index: int, n: int) -> np.ndarray[Any, np.dtype[np.float16]]:
    out = np.empty((max(n, 1), DIM), dtype=np.float16)
    assert lib.baseRT_read_tap_rows(m, index, n, out.ctypes.data_as(c_void_p)) == DIM, error(lib)
    return out[:n]


def new_seq(lib: Library, m: int) -> int:
    s = lib.baseRT_sequence_create(m)
    assert s, error(lib)
    return int(s)


def blocks_used(lib: Library, m: int) -> int:
    st = BaseRTMemoryStats()
    assert lib.baseRT_model_memory_stats(m, byref(st)), error(lib)
    return int(st.kv_cache_blocks_used)


TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 200, size=40)]


def one_at_a_time(lib: Library, m: int, tokens: Sequence[int]) -> np.ndarray[Any, np.dtype[np.float16]]:
    """Each position's logits from single-token steps: what row j of a multi-row step must equal."""
    s = new_seq(lib, m)
    out = []
    for t in tokens:
        rc = lib.baseRT_batch_step_fused_logits(m, seqs_of([s]), 1, u32([t]), ints([1]))
        assert rc == OK, error(lib)
        out.append(logits(lib, m, 1)[0])
    lib.baseRT_sequence_free(s)
    return np.stack(out)


def test_rows_are_each_positions_logits(lib: Library, model: int) -> None:
    a, b = new_seq(lib, model), new_seq(lib, model)
    feeds = [TOKENS[:12], TOKENS[20:23]]
    rc = lib.baseRT_batch_step_fused_logits_rows(
        model, seqs_of([a, b]), 2, u32(feeds[0] + feeds[1]), ints([12, 3]), ints([5, 3])
    )
    assert rc == OK, error(lib)
    got = logits(lib, model, 8)
    want_a = one_at_a_time(lib, model, feeds[0])[-5:]
    want_b = one_at_a_time(lib, model, feeds[1])
    assert got[:5].tobytes() == want_a.tobytes()
    assert got[5:].tobytes() == want_b.tobytes()
    # only 8 rows exist
    assert (
        lib.baseRT_batch_step_fused_logits_rows(model, seqs_of([a, b]), 2, u32([5, 6]), ints([1, 1]), ints([1, 1]))
        == OK
    )
    buf = np.empty((3, got.shape[1]), dtype=np.float16)
    assert lib.baseRT_read_batch_logits(model, 3, buf.ctypes.data_as(c_void_p)) < 0  # only 2 rows now
    for s in (a, b):
        lib.baseRT_sequence_free(s)


def test_rows_beyond_the_batch_grow_the_scratch(lib: Library, model: int) -> None:
    """sum(out_rows) may reach max_batch_size x 8 (here 32), more than one row per lane."""
    s = new_seq(lib, model)
    rc = lib.baseRT_batch_step_fused_logits_rows(model, seqs_of([s]), 1, u32(TOKENS[:32]), ints([32]), ints([32]))
    assert rc == OK, error(lib)
    assert logits(lib, model, 32).tobytes() == one_at_a_time(lib, model, TOKENS[:32]).tobytes()
    lib.baseRT_sequence_free(s)


def test_taps_are_the_residual_stream(lib: Library, model: int, model_path: Path) -> None:
    """Tap 0 is the embedding row; tap n_layers pooled through the final norm is baseRT_embed;
    a tapped step's logits equal an untapped one's."""
    s = new_seq(lib, model)
    n = 14
    assert tapped(lib, model, [s], [TOKENS[:n]], [1], [0, N_LAYERS, 1], [n]) == OK, error(lib)
    rows0, final, mid = tap(lib, model, 0, n), tap(lib, model, 1, n), tap(lib, model, 2, n)
    with read_bundle(model_path) as bundle:
        emb = bundle.tensor("embed_tokens.weight")
        w = bundle.tensor("final_norm.weight")
        eps = float(bundle.config["rms_norm_eps"]) if "rms_norm_eps" in bundle.config else None
    assert rows0.tobytes() == emb[TOKENS[:n]].astype(np.float16).tobytes()
    assert not np.array_equal(mid, rows0) and not np.array_equal(mid, final)
    x = final.astype(np.float32)
    cfg_eps = eps if eps is not None else 1e-5
    scale = (1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1) + cfg_eps)).astype(np.float32)
    pooled = ((x * scale[:, None]) * w).astype(np.float64).mean(axis=0)
    ref = np.zeros(DIM, dtype=np.float32)
    assert lib.baseRT_embed(model, u32(TOKENS[:n]), n, ref.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), DIM) == DIM
    assert np.linalg.norm(pooled - ref) <= 2e-3 * np.linalg.norm(ref)
    assert logits(lib, model, 1).tobytes() == one_at_a_time(lib, model, TOKENS[:n])[-1:].tobytes()
    lib.baseRT_sequence_free(s)


def test_tapped_rows_do_not_depend_on_the_batch(lib: Library, model: int) -> None:
    """A lane's tapped rows are the same alone or packed after other lanes (slices then cut across it)."""
    a = new_seq(lib, model)
    assert tapped(lib, model, [a], [TOKENS[:10]], [1], [N_LAYERS], [10]) == OK, error(lib)
    alone = tap(lib, model, 0, 10)
    lib.baseRT_sequence_free(a)
    x, y, b = new_seq(lib, model), new_seq(lib, model), new_seq(lib, model)
    feeds = [TOKENS[30:39], [TOKENS[39]], TOKENS[:10]]  # 9 + 1 rows first: b straddles the 16-row slice
    assert tapped(lib, model, [x, y, b], feeds, [1, 1, 1], [N_LAYERS], [2, 0, 10]) == OK, error(lib)
    both = tap(lib, model, 0, 12)
    assert both[2:].tobytes() == alone.tobytes()
    for s in (x, y, b):
        lib.baseRT_sequence_free(s)


def test_capacity_and_support(lib: Library, model: int, model_path: Path) -> None:
    assert lib.baseRT_tap_rows_capacity(model) == CHUNK
    assert lib.baseRT_model_supports_taps(model) == 1
    assert lib.baseRT_tap_rows_capacity(0) < 0 and lib.baseRT_model_supports_taps(0) < 0
    big = load(lib, model_path, prefill_chunk=2048)
    assert lib.baseRT_tap_rows_capacity(big) == 1024
    lib.baseRT_free_model(big)
    flat = load(lib, model_path, paged_kv=0)
    assert lib.baseRT_model_supports_taps(flat) == 0
    s = ints([0])
    assert (
        lib.baseRT_batch_step_fused_logits_rows_taps(
            flat, seqs_of([0]), 1, u32([5]), s, ints([1]), ints([0]), 1, ints([1])
        )
        != OK
    )
    lib.baseRT_free_model(flat)
    # a freed model's handle is refused, not reused
    assert lib.baseRT_tap_rows_capacity(big) < 0 and lib.baseRT_model_supports_taps(big) < 0
    out = np.empty(DIM, dtype=np.float16)
    assert lib.baseRT_read_tap_rows(big, 0, 0, out.ctypes.data_as(c_void_p)) < 0


def test_read_is_bounded_by_the_last_tapped_step(lib: Library, model: int) -> None:
    out = np.empty((CHUNK + 1, DIM), dtype=np.float16)
    ptr = out.ctypes.data_as(c_void_p)
    assert lib.baseRT_read_tap_rows(model, 0, 1, ptr) == -INVALID_ARGUMENT  # nothing tapped yet
    s = new_seq(lib, model)
    assert tapped(lib, model, [s], [TOKENS[:6]], [1], [1, 2], [4]) == OK, error(lib)
    assert lib.baseRT_read_tap_rows(model, 1, 4, ptr) == DIM
    assert lib.baseRT_read_tap_rows(model, 1, 0, ptr) == DIM
    for index, n in ((2, 1), (-1, 1), (0, 5), (0, -1)):
        assert lib.baseRT_read_tap_rows(model, index, n, ptr) == -INVALID_ARGUMENT, (index, n)
    assert lib.baseRT_read_tap_rows(model, 0, 1, None) == -INVALID_ARGUMENT
    # an untapped multi-row step leaves the last tapped step's rows readable
    assert lib.baseRT_batch_step_fused_logits_rows(model, seqs_of([s]), 1, u32([7]), ints([1]), ints([1])) == OK
    assert lib.baseRT_read_tap_rows(model, 1, 4, ptr) == DIM
    lib.baseRT_sequence_free(s)


@pytest.mark.parametrize(
    ("feed", "out_rows", "layers", "tap_rows", "what"),
    [
        (12, 0, [2], 1, "out_rows 0"),
        (12, 13, [2], 1, "out_rows"),
        (12, 1, [3], 1, "tap_layers[0] 3"),
        (12, 1, [-1], 1, "tap_layers[0] -1"),
        (12, 1, [0] * 9, 1, "n_tap_layers 9"),
        (12, 1, [2], 13, "tap_rows 13"),
        (12, 1, [2], -1, "tap_rows -1"),
        (20, 1, [2], 5, "rows of its last prefill chunk"),  # 20 rows = chunks of 16 + 4
    ],
)
def test_bad_arguments_are_refused_and_change_nothing(
    lib: Library, model: int, feed: int, out_rows: int, layers: list[int], tap_rows: int, what: str
) -> None:
    s = new_seq(lib, model)
    before = blocks_used(lib, model)
    rc = tapped(lib, model, [s], [TOKENS[:feed]], [out_rows], layers, [tap_rows])
    assert rc == INVALID_ARGUMENT and what in error(lib), error(lib)
    assert blocks_used(lib, model) == before
    # the sequence is still empty: a 1-row step at position 0 gives the cold logits
    assert tapped(lib, model, [s], [TOKENS[:1]], [1], [2], [1]) == OK, error(lib)
    assert logits(lib, model, 1).tobytes() == one_at_a_time(lib, model, TOKENS[:1]).tobytes()
    lib.baseRT_sequence_free(s)


def test_totals_are_bounded(lib: Library, model: int) -> None:
    a, b = new_seq(lib, model), new_seq(lib, model)
    # 10 + 10 tapped rows > capacity 16
    assert tapped(lib, model, [a, b], [TOKENS[:10], TOKENS[10:20]], [1, 1], [2], [10, 10]) == INVALID_ARGUMENT
    assert "capacity" in error(lib)
    for null in ("out_rows", "tap_layers", "tap_rows"):
        args: dict[str, Any] = dict(out_rows=ints([1]), tap_layers=ints([2]), tap_rows=ints([1]))
        args[null] = None
        rc = lib.baseRT_batch_step_fused_logits_rows_taps(
            model, seqs_of([a]), 1, u32([5]), ints([1]), args["out_rows"], args["tap_layers"], 1, args["tap_rows"]
        )
        assert rc == INVALID_ARGUMENT and f"{null} is NULL" in error(lib)
    # n_tap_layers 0: tap arguments may be NULL (the plain multi-row step)
    rc = lib.baseRT_batch_step_fused_logits_rows_taps(
        model, seqs_of([a]), 1, u32([5]), ints([1]), ints([1]), None, 0, None
    )
    assert rc == OK, error(lib)
    # a freed sequence is refused
    lib.baseRT_sequence_free(b)
    assert tapped(lib, model, [b], [TOKENS[:2]], [1], [2], [2]) == INVALID_ARGUMENT
    lib.baseRT_sequence_free(a)
    assert blocks_used(lib, model) == 0


def test_a_failed_step_leaves_no_stale_taps(lib: Library, model: int) -> None:
    s = new_seq(lib, model)
    assert tapped(lib, model, [s], [TOKENS[:4]], [1], [2], [4]) == OK
    assert lib.baseRT_ref_inject_fault(1, 1) == OK  # the next step fails
    assert tapped(lib, model, [s], [TOKENS[4:8]], [1], [2], [4]) != OK
    out = np.empty((4, DIM), dtype=np.float16)
    assert lib.baseRT_read_tap_rows(model, 0, 4, out.ctypes.data_as(c_void_p)) == -INVALID_ARGUMENT
    lib.baseRT_sequence_free(s)

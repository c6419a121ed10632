"""Weight storage of the reference engine: f16 matrices stay f16 and are widened in registers.

Widening f16 to f32 is exact, so keeping f16 in memory must not change a single
bit of any output: the logits of a batched run over an f16 bundle are compared
byte for byte with the same run after the loader widened every matrix to f32
(BASERT_REF_WIDEN_F16=1, the engine's previous behaviour). Shapes with tails
(row lengths that are not a multiple of the vector width) exercise the scalar
tail of every kernel.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from ctypes import byref, c_int, c_uint32, c_void_p
from pathlib import Path

import numpy as np
import pytest

from aiobasert._ffi import BaseRTLoadOptions, BaseRTMemoryStats, Library
from aiobasert.models.tiny import build_tiny_model


def load(lib: Library, path: Path, *, widen: bool) -> int:
    o = BaseRTLoadOptions(struct_size=ctypes.sizeof(BaseRTLoadOptions), paged_kv=1, max_batch_size=4, prefill_chunk=16)
    old = os.environ.get("BASERT_REF_WIDEN_F16")
    os.environ["BASERT_REF_WIDEN_F16"] = "1" if widen else "0"
    try:
        m = lib.baseRT_load_model_ex(os.fsencode(path), None, 256, byref(o))
    finally:
        if old is None:
            del os.environ["BASERT_REF_WIDEN_F16"]
        else:
            os.environ["BASERT_REF_WIDEN_F16"] = old
    assert m, (lib.baseRT_get_error() or b"").decode()
    return int(m)


def run(lib: Library, m: int, prompts: Sequence[Sequence[int]], steps: int) -> list[bytes]:
    """Prefill every prompt in one batched step (chunked by prefill_chunk), then greedy-decode together;
    the f16 logits rows of every step, as bytes."""
    n = len(prompts)
    seqs = [int(lib.baseRT_sequence_create(m)) for _ in range(n)]
    vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
    out: list[bytes] = []
    feeds: list[list[int]] = [list(p) for p in prompts]
    for _ in range(steps):
        flat = [t for f in feeds for t in f]
        arr = (c_void_p * n)(*seqs)
        rc = lib.baseRT_batch_step_fused_logits(
            m, arr, n, (c_uint32 * len(flat))(*flat), (c_int * n)(*[len(f) for f in feeds])
        )
        assert rc == 0, (lib.baseRT_get_error() or b"").decode()
        rows = np.empty((n, vocab), dtype=np.float16)
        assert lib.baseRT_read_batch_logits(m, n, rows.ctypes.data_as(c_void_p)) == vocab
        out.append(rows.tobytes())
        feeds = [[int(lib.baseRT_argmax_logits_row(m, rows[i].ctypes.data_as(c_void_p)))] for i in range(n)]
    for s in seqs:
        lib.baseRT_sequence_free(s)
    return out


def weight_bytes(lib: Library, m: int) -> int:
    st = BaseRTMemoryStats()
    assert lib.baseRT_model_memory_stats(m, byref(st))
    return int(st.runtime_allocated_bytes - st.kv_cache_capacity_bytes)


@pytest.mark.parametrize(
    ("dim", "n_heads", "n_kv_heads", "ffn_dim", "tied"),
    [(64, 4, 2, 96, False), (72, 4, 1, 100, True), (128, 2, 2, 200, False)],
    ids=["dim64", "dim72-tails-tied", "dim128"],
)
def test_f16_kept_equals_f16_widened_bit_for_bit(
    lib: Library, tmp_path: Path, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, tied: bool
) -> None:
    path = build_tiny_model(
        tmp_path / "f16.base",
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        dtype="f16",
        tied=tied,
        seed=3,
    )
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 200, size=k)] for k in (1, 5, 23, 40)]
    kept = load(lib, path, widen=False)
    widened = load(lib, path, widen=True)
    try:
        a, b = run(lib, kept, prompts, 6), run(lib, widened, prompts, 6)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x == y, f"step {i}: f16-in-registers logits differ from widened-at-load logits"
        # Every matrix is resident at 2 bytes per element instead of 4 (norms stay f32).
        vocab = int(lib.baseRT_batch_logits_stride(kept)) // 2
        kv_dim = dim // n_heads * n_kv_heads
        per_layer = dim * (dim + 2 * kv_dim) + dim * dim + 3 * dim * ffn_dim
        elems = vocab * dim * (1 if tied else 2) + 2 * per_layer  # build_tiny_model: 2 layers
        assert weight_bytes(lib, widened) - weight_bytes(lib, kept) == 2 * elems
    finally:
        lib.baseRT_free_model(kept)
        lib.baseRT_free_model(widened)

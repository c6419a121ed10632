"""KV cache element width: the exact f32 pool (kv_bits 0), f16 (16) and Q8_0 (8).

An f16 pool rounds every stored K and V value to f16 and widens it in registers
when attention reads it back; a Q8_0 pool stores blocks of 32 int8 with an f16
scale and widens a page at a time. The runtime's invariants must hold for them
exactly as for f32 (batched == unbatched, prefix-seeded == cold, bit for bit),
their logits must stay close to the f32 pool's, they must take fewer bytes, and
baseRT_kv_bits_effective must say what was allocated (Q4_0 is not implemented:
4 and 84 get Q8_0; a head_dim that is not a multiple of 32 gets f16).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from ctypes import byref, c_int, c_uint32, c_void_p
from pathlib import Path

import numpy as np
import pytest
import raw_abi
from raw_abi import step_logits

from aiobasert._ffi import BaseRTLoadOptions, BaseRTMemoryStats, Library

OK, INVALID_ARGUMENT = 0, 2


@pytest.fixture(scope="module")
def kv_bits_effective(lib: Library) -> ctypes._CFuncPtr:
    fn = ctypes.CDLL(lib.path).baseRT_kv_bits_effective
    fn.restype, fn.argtypes = c_int, [c_void_p]
    return fn


def load(lib: Library, path: Path, kv_bits: int) -> int:
    return raw_abi.load(lib, path, 256, max_batch_size=4, prefix_cache=1, prefill_chunk=16, kv_bits=kv_bits)


@pytest.fixture(params=[16, 8], ids=["f16", "q8_0"])
def f16(
    request: pytest.FixtureRequest, lib: Library, head16_model_path: Path, head32_model_path: Path
) -> Iterator[int]:
    """A model with a reduced-precision pool: f16 (head_dim 16) or Q8_0 (head_dim 32)."""
    m = load(lib, head16_model_path if request.param == 16 else head32_model_path, request.param)
    yield m
    lib.baseRT_free_model(m)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 200, size=n)]


def test_kv_bits_effective_is_what_was_allocated(
    lib: Library, head16_model_path: Path, head32_model_path: Path, kv_bits_effective: ctypes._CFuncPtr
) -> None:
    h16, h32 = head16_model_path, head32_model_path
    cases = [
        (h16, 0, 32),
        (h16, 16, 16),
        (h16, 8, 16),
        (h16, 4, 16),
        (h16, 84, 16),
        (h32, 0, 32),
        (h32, 16, 16),
        (h32, 8, 8),
        (h32, 4, 8),
        (h32, 84, 8),
    ]
    for p, asked, got in cases:
        m = load(lib, p, asked)
        try:
            assert kv_bits_effective(m) == got, (p, asked)
            st = BaseRTMemoryStats()
            assert lib.baseRT_model_memory_stats(m, byref(st))
            per_block = st.kv_cache_capacity_bytes // st.kv_cache_blocks_total
            kv_dim = 32 if p == h16 else 64
            row = {32: kv_dim * 4, 16: kv_dim * 2, 8: kv_dim // 32 * 34}[got]
            assert per_block == 2 * 2 * 16 * row  # 2 layers x (K + V) x 16 tokens x one row
        finally:
            lib.baseRT_free_model(m)
    o = BaseRTLoadOptions(struct_size=ctypes.sizeof(BaseRTLoadOptions), paged_kv=1, kv_bits=32)
    assert not lib.baseRT_load_model_ex(os.fsencode(head16_model_path), None, 256, byref(o))
    assert lib.baseRT_get_error_code() == INVALID_ARGUMENT and "kv_bits" in (lib.baseRT_get_error() or b"").decode()


def test_f16_pool_batched_equals_unbatched(lib: Library, f16: int) -> None:
    prompts = [prompt(n, 20 + n) for n in (3, 17, 40)]
    batched = [int(lib.baseRT_sequence_create(f16)) for _ in prompts]
    single = [int(lib.baseRT_sequence_create(f16)) for _ in prompts]
    rows = step_logits(lib, f16, batched, prompts)
    for i, p in enumerate(prompts):
        assert step_logits(lib, f16, [single[i]], [p])[0].tobytes() == rows[i].tobytes()
    for _ in range(6):
        nxt = [[int(np.argmax(r))] for r in rows]
        rows = step_logits(lib, f16, batched, nxt)
        for i in range(len(prompts)):
            assert step_logits(lib, f16, [single[i]], nxt[i : i + 1])[0].tobytes() == rows[i].tobytes()
    for s in batched + single:
        lib.baseRT_sequence_free(s)


def test_f16_pool_prefix_seeded_equals_cold(lib: Library, f16: int) -> None:
    p = prompt(45, 9)
    warm = int(lib.baseRT_sequence_create(f16))
    step_logits(lib, f16, [warm], [p])
    assert lib.baseRT_prefix_insert(f16, (c_uint32 * len(p))(*p), len(p), warm) == OK
    cold = int(lib.baseRT_sequence_create(f16))
    want = step_logits(lib, f16, [cold], [p])[0]
    match = lib.baseRT_prefix_match(f16, (c_uint32 * len(p))(*p), len(p))
    assert match.matched_tokens == 32
    seeded = int(lib.baseRT_sequence_create(f16))
    rc = lib.baseRT_sequence_seed_prefix(seeded, match.blocks, match.n_blocks, match.matched_tokens)
    assert rc == OK
    got = step_logits(lib, f16, [seeded], [p[32:]])[0]
    lib.baseRT_prefix_unlock(f16, match.handle)
    assert got.tobytes() == want.tobytes()
    # A rollback into a shared block copies it (copy-on-write of an f16 block).
    assert lib.baseRT_sequence_rollback(seeded, 20) == OK
    again = step_logits(lib, f16, [seeded], [p[20:]])[0]
    assert again.tobytes() == want.tobytes()
    for s in (warm, cold, seeded):
        lib.baseRT_sequence_free(s)


def test_f16_pool_stays_close_to_f32(
    lib: Library, head16_model_path: Path, head32_model_path: Path, f16: int, kv_bits_effective: ctypes._CFuncPtr
) -> None:
    exact = load(lib, head16_model_path if kv_bits_effective(f16) == 16 else head32_model_path, 0)
    try:
        p = prompt(60, 3)
        a, b = int(lib.baseRT_sequence_create(exact)), int(lib.baseRT_sequence_create(f16))
        ra, rb = step_logits(lib, exact, [a], [p])[0], step_logits(lib, f16, [b], [p])[0]
        ref = ra.astype(np.float64)
        err = np.abs(rb.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert 0 < err < 2e-2, err  # f16 / Q8_0 K/V: different bits, the same answer within their precision
        assert int(np.argmax(ra)) == int(np.argmax(rb))
    finally:
        lib.baseRT_free_model(exact)

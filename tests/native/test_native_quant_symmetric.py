"""Symmetric q4 / q5 (GGML Q4_0 / Q5_0, carried by `convert --dtype auto` as symmetric base_q4 / base_q5):
their panels store no per-block offset m (it is -8 d / -16 d), so they stay at GGML's own size (Q4_0 18,
Q5_0 22 bytes per row and 32 values), and compute exactly what the asymmetric panels compute from the
stored m. The reference is the same bundle with the implied biases written out (tests/quantized.py's
asymmetric_twin): same values, the asymmetric layout and kernels."""

from __future__ import annotations

import math
from ctypes import byref
from pathlib import Path

import gguf
import numpy as np
import pytest
import raw_abi
from quantized import asymmetric_twin
from raw_abi import step_logits

from aiobasert._ffi import BaseRTMemoryStats, Library
from aiobasert.models.bundle import read_bundle
from aiobasert.models.convert import convert_gguf
from tests.tiny_gguf import write_gguf

PANEL, GROUP = 16, 32
SYMMETRIC_TYPES = {"Q4_0": "base_q4", "Q5_0": "base_q5"}


@pytest.fixture(scope="module", params=sorted(SYMMETRIC_TYPES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(GGML type, its `auto` bundle (symmetric), the asymmetric twin) of a tiny GGUF whose every matrix,
    the embedding and LM head included, is of that type (k / v: 32 rows; the vocabulary ends in a
    partial panel)."""
    qtype = str(request.param)
    tmp = tmp_path_factory.mktemp(qtype)
    src = write_gguf(tmp / f"{qtype}.gguf", matrices=gguf.GGMLQuantizationType[qtype], seed=13)
    sym = convert_gguf(src, tmp / "sym.base", dtype="auto", progress=False)
    quant = [i for i in read_bundle(sym).tensors.values() if i.dtype == SYMMETRIC_TYPES[qtype]]
    assert quant and all(i.symmetric and i.scale_dtype == "f16" for i in quant)
    return qtype, sym, asymmetric_twin(sym, tmp / "asym.base")


def load(lib: Library, path: Path) -> int:
    return raw_abi.load(lib, path, 256, max_batch_size=8, prefill_chunk=64)


def run(lib: Library, path: Path) -> list[bytes]:
    """Logit rows of a batched prefill (prompts covering the 8- and 4-row tiles' remainders and one longer
    than a prefill chunk), then two batched decode steps, and one prompt alone."""
    m = load(lib, path)
    try:
        rng = np.random.default_rng(4)
        vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
        prompts = [[int(t) for t in rng.integers(3, vocab, size=n)] for n in (1, 2, 3, 5, 7, 9, 70)]
        seqs = [int(lib.baseRT_sequence_create(m)) for _ in prompts]
        rows = step_logits(lib, m, seqs, prompts)
        out = [rows.tobytes()]
        for _ in range(2):
            rows = step_logits(lib, m, seqs, [[int(np.argmax(r))] for r in rows])
            out.append(rows.tobytes())
        out.append(step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], prompts[-1:]).tobytes())
        return out
    finally:
        lib.baseRT_free_model(m)


def test_symmetric_panels_compute_the_asymmetric_logits_bit_for_bit(lib: Library, pair: tuple[str, Path, Path]) -> None:
    """The kernels form m = d * -8 (-16), exact in f32, and run the asymmetric arithmetic on it; embedding
    rows (rt_qweight_row) likewise. (The kernel sets against each other: test_native_isa.)"""
    _, sym, asym = pair
    got, ref = run(lib, sym), run(lib, asym)
    assert len(got) == len(ref) and all(a == b for a, b in zip(got, ref, strict=True))
    assert np.isfinite(np.frombuffer(got[0], np.float16)).all()


def runtime_bytes(lib: Library, path: Path) -> int:
    m = load(lib, path)
    try:
        st = BaseRTMemoryStats()
        assert lib.baseRT_model_memory_stats(m, byref(st))
        return int(st.runtime_allocated_bytes)
    finally:
        lib.baseRT_free_model(m)


def test_symmetric_panels_omit_the_offsets(lib: Library, pair: tuple[str, Path, Path]) -> None:
    """The symmetric bundle's engine holds exactly the twin's bytes less the m arrays: one f16 per panel
    row (16 per panel, padding rows included) and block of 32, so each matrix is GGML's own size per row
    and 32 values (Q4_0 18 bytes, Q5_0 22) where the asymmetric panels take 20 / 24."""
    qtype, sym, asym = pair
    dtype = SYMMETRIC_TYPES[qtype]
    m_arrays = 0
    for info in read_bundle(sym).tensors.values():
        if info.dtype == dtype:
            rows, cols = info.shape
            m_arrays += math.ceil(rows / PANEL) * PANEL * cols // GROUP * 2
    saved = runtime_bytes(lib, asym) - runtime_bytes(lib, sym)
    assert saved == m_arrays, (saved, m_arrays)

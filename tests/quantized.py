"""Quantized copies of the suite's tiny bundles (shared by the native quantization and kernel-set tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aiobasert.models.bundle import BundleWriter, QuantizedTensor, TensorEntry, read_bundle
from aiobasert.models.convert import quantize_groups


def quantize_bundle(src: Path, dst: Path, dtype: str, *, group_size: int = 32, symmetric: bool = False) -> Path:
    """A copy of `src` with every matrix stored as `dtype` (norms stay as they are)."""
    b = read_bundle(src)
    header = {k: v for k, v in b.header.items() if k != "tensors"}
    header["quant_scheme"] = dtype
    header["target_backend"] = "cpu_avx2"
    entries = []
    for name, info in b.tensors.items():
        if len(info.shape) == 2:
            entries.append(
                TensorEntry(name, info.shape, dtype, info.compute_region, group_size=group_size, symmetric=symmetric)
            )
        else:
            entries.append(TensorEntry(name, info.shape, info.dtype, info.compute_region))
    with BundleWriter(dst, header, entries) as w:
        for e in entries:
            if e.dtype == dtype:
                w.write(
                    e.name,
                    quantize_groups(np.asarray(b.tensor(e.name)), dtype, symmetric=symmetric, group_size=group_size),
                )
            else:
                w.write(e.name, b.raw(e.name))
    return dst


def asymmetric_twin(src: Path, dst: Path) -> Path:
    """A copy of `src` whose symmetric base_q4 / base_q5 tensors carry their implied biases (-2^(bits-1) *
    scale, stored in the scales' own dtype) as an explicit bias region: the same values, taken by the engine
    as an asymmetric matrix (a stored m per block)."""
    b = read_bundle(src)
    header = {k: v for k, v in b.header.items() if k != "tensors"}
    blob = src.read_bytes()
    entries: list[TensorEntry] = []
    data: list[Any] = []
    for name, info in b.tensors.items():
        twin = info.dtype in ("base_q4", "base_q5") and bool(info.symmetric)
        if info.dtype in ("base_q4", "base_q5", "base_q8"):
            assert info.symmetric and info.scale_dtype in ("f16", "f32"), name
            sdt = np.dtype("<f4" if info.scale_dtype == "f32" else "<f2")
            scales = np.frombuffer(
                blob, sdt, (info.scale_length or 0) // sdt.itemsize, b.blob_start + (info.scale_offset or 0)
            )
            implied = -float(16 if info.dtype == "base_q5" else 8) * scales.astype(np.float32)
            biases = implied.astype(sdt)
            assert np.array_equal(biases.astype(np.float32), implied), f"{name}: a bias the scale dtype cannot hold"
            data.append(QuantizedTensor(np.asarray(b.raw(name)), scales, biases if twin else None))
            entries.append(
                TensorEntry(
                    name,
                    info.shape,
                    info.dtype,
                    info.compute_region,
                    group_size=info.group_size or 32,
                    symmetric=not twin,
                    scale_dtype=info.scale_dtype or "f16",
                )
            )
        else:
            data.append(b.raw(name))
            entries.append(TensorEntry(name, info.shape, info.dtype, info.compute_region))
    with BundleWriter(dst, header, entries) as w:
        for e, d in zip(entries, data, strict=True):
            w.write(e.name, d)
    return dst

"""Quantized copies of the suite's tiny bundles (shared by the native quantization and kernel-set tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aiobasert.models.bundle import BundleWriter, TensorEntry, read_bundle
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
            entries.append(TensorEntry(name, info.shape, dtype, info.compute_region, group_size=group_size,
                                       symmetric=symmetric))
        else:
            entries.append(TensorEntry(name, info.shape, info.dtype, info.compute_region))
    with BundleWriter(dst, header, entries) as w:
        for e in entries:
            if e.dtype == dtype:
                w.write(e.name, quantize_groups(np.asarray(b.tensor(e.name)), dtype, symmetric=symmetric,
                                                group_size=group_size))
            else:
                w.write(e.name, b.raw(e.name))
    return dst

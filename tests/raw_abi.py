"""Raw C-ABI calls shared by the native tests (the engine driven as a foreign binding
would drive it, without the SDK): load with options, one fused step's logit rows."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from ctypes import byref, c_int, c_uint32, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from aiobasert._ffi import BaseRTLoadOptions, Library

OK = 0


def error(lib: Library) -> str:
    return (lib.baseRT_get_error() or b"").decode()


def u32(values: Sequence[int]) -> ctypes.Array[c_uint32]:
    return (c_uint32 * max(len(values), 1))(*values)


def ints(values: Sequence[int]) -> ctypes.Array[c_int]:
    return (c_int * max(len(values), 1))(*values)


def load(lib: Library, path: Path, max_context: int, **options: Any) -> int:
    """baseRT_load_model_ex with paged KV and the given BaseRTLoadOptions fields."""
    o = BaseRTLoadOptions(struct_size=ctypes.sizeof(BaseRTLoadOptions), paged_kv=1, **options)
    m = lib.baseRT_load_model_ex(os.fsencode(path), None, max_context, byref(o))
    assert m, error(lib)
    return int(m)


def step_logits(lib: Library, m: int, seqs: Sequence[int], feeds: Sequence[Sequence[int]]) -> npt.NDArray[np.float16]:
    """One baseRT_batch_step_fused_logits over `seqs` fed `feeds`; each lane's logit row."""
    n = len(seqs)
    flat = [t for f in feeds for t in f]
    rc = lib.baseRT_batch_step_fused_logits(
        m, (c_void_p * n)(*seqs), n, (c_uint32 * len(flat))(*flat), (c_int * n)(*[len(f) for f in feeds])
    )
    assert rc == OK, error(lib)
    vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
    rows = np.empty((n, vocab), dtype=np.float16)
    assert lib.baseRT_read_batch_logits(m, n, rows.ctypes.data_as(c_void_p)) == vocab
    return rows


def coded_error(lib: Library) -> tuple[int, str]:
    """The thread's last error: (code, message)."""
    return int(lib.baseRT_get_error_code()), error(lib)


def encode(lib: Library, m: int, text: str) -> list[int]:
    buf = (c_uint32 * 4096)()
    n = lib.baseRT_encode(m, text.encode(), buf, 4096)
    assert n >= 0, coded_error(lib)
    return list(buf[:n])

"""Loading the model: the questions asked of the library once, at load.

The engine thread loads the model and reads back what the engine took effect with; the helpers
that ask the library (`lib.has` and the optional queries) live here.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidConfigError
from . import ffi as _ffi

TAP_FUNCTIONS = (
    "baseRT_batch_step_fused_logits_rows_taps",
    "baseRT_read_tap_rows",
    "baseRT_tap_rows_capacity",
    "baseRT_model_supports_taps",
)
"""What the tapped embedding path calls (`embed.Embedder`, `step.StepRunner`)."""

# Engine.open's kv_cache_dtype -> BaseRTLoadOptions.kv_bits, and baseRT_kv_bits_effective's answer -> a name
# (the reference engine reports its exact f32 pool as 32). "auto" and "f32": see kv_bits.
_KV_BITS = {"f16": 16, "q8": 8}
_KV_NAMES = {32: "f32", 16: "f16", 8: "q8", 4: "q4", 84: "q8/q4"}


def kv_bits(lib: _ffi.Library, dtype: str) -> int:
    """BaseRTLoadOptions.kv_bits for `dtype`. "auto" is f16 on the reference engine (as
    llama.cpp's default: half its exact f32 pool, which is its library default, kv_bits 0)
    and the library's own default elsewhere (BaseRT: Q8_0 where head_dim allows). "f32",
    the exact pool, only the reference engine has."""
    reference = lib.has("baseRT_ref_kernels")  # a symbol only the reference engine exports
    if dtype == "auto":
        return 16 if reference else 0
    if dtype == "f32":
        if not reference:
            raise InvalidConfigError(
                f"kv_cache_dtype='f32' is the reference engine's exact KV pool; {lib.path} has none "
                "(use 'auto', 'f16' or 'q8')"
            )
        return 0
    return _KV_BITS[dtype]


def kv_cache_dtype(lib: _ffi.Library, handle: int) -> str:
    """What the engine allocated (it may override the request: a head_dim Q8_0 cannot split)."""
    if not lib.has("baseRT_kv_bits_effective"):
        return ""
    return _KV_NAMES.get(int(lib.baseRT_kv_bits_effective(handle)), "")


def engine_threads(lib: _ffi.Library) -> int:
    """The reference engine's compute threads (its shared pool, sized at load, the calling thread
    included); 0 for a library that does not say."""
    if not lib.has("baseRT_ref_counter"):
        return 0
    return max(0, int(lib.baseRT_ref_counter(b"pool_threads")))


def descriptor(lib: _ffi.Library, handle: int) -> dict[str, Any]:
    if not lib.has("baseRT_capability_descriptor"):
        return {}
    raw = lib.baseRT_capability_descriptor(handle)
    try:
        desc = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return desc if isinstance(desc, dict) else {}


def static_str(lib: _ffi.Library, handle: int, fn: str) -> str:
    if not lib.has(fn):
        return ""
    raw = getattr(lib, fn)(handle)
    return (raw or b"").decode("utf-8", "replace")

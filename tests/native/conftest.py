"""Fixtures of the native tests (the C ABI driven without the SDK): one home each.

A module changes what `model` loads by overriding `model_path` and `model_options`."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Any

import pytest
from raw_abi import error, load

from aiobasert._ffi import BaseRTModelConfig, Library

# Entry points the SDK's mirror does not declare, with their C signatures.
_U32P, _INTP = POINTER(c_uint32), POINTER(c_int)
RAW_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "baseRT_get_config": (BaseRTModelConfig, [c_void_p]),
    "baseRT_weights_identity": (c_uint64, [c_void_p]),
    "baseRT_kv_bits_effective": (c_int, [c_void_p]),
    "baseRT_model_memory": (c_size_t, [c_void_p]),
    "baseRT_decode_token": (c_char_p, [c_void_p, c_uint32]),
    "baseRT_chat_template": (c_char_p, [c_void_p]),
    "baseRT_device_memory_budget": (c_size_t, []),
    "baseRT_batch_decode_step": (c_int, [c_void_p, POINTER(c_void_p), c_int, _U32P, _U32P]),
    "baseRT_batch_step": (c_int, [c_void_p, POINTER(c_void_p), c_int, _U32P, _INTP, _U32P]),
    "baseRT_batch_step_fused_pads": (c_int, [c_void_p, POINTER(c_void_p), c_int, _U32P, _INTP, _INTP, _U32P]),
    "baseRT_get_position": (c_int, [c_void_p]),
    "baseRT_prefix_discard": (None, [c_void_p, c_uint64]),
    "baseRT_ref_inject_fault": (c_int, [c_int, c_int]),
    "baseRT_get_error": (c_char_p, []),
    "baseRT_get_error_code": (c_int, []),
}


@pytest.fixture(scope="module")
def raw(lib: Library) -> ctypes.CDLL:
    """The same library through a plain CDLL, for functions the SDK mirror does not declare."""
    c = ctypes.CDLL(lib.path)
    for name, (restype, argtypes) in RAW_SIGNATURES.items():
        fn = getattr(c, name)
        fn.restype, fn.argtypes = restype, argtypes
    return c


@pytest.fixture(scope="module")
def model_path(tiny_model_path: Path) -> Path:
    """The bundle `model` loads: the tiny model, unless a module overrides this fixture."""
    return tiny_model_path


@pytest.fixture(scope="module")
def model_options() -> dict[str, int] | None:
    """How `model` loads: None is `baseRT_load_model` with its defaults; a dict is
    `baseRT_load_model_ex` with paged KV, its `max_context` (default 0) and the other
    BaseRTLoadOptions fields it names. A module overrides this fixture."""
    return None


@pytest.fixture
def model(lib: Library, model_path: Path, model_options: dict[str, int] | None) -> Iterator[int]:
    """A native model handle, fresh for each test and freed after it."""
    if model_options is None:
        m = lib.baseRT_load_model(os.fsencode(model_path), None, 0)
        assert m, error(lib)
    else:
        options = dict(model_options)
        m = load(lib, model_path, options.pop("max_context", 0), **options)
    yield int(m)
    lib.baseRT_free_model(m)

"""The ctypes mirror of the baseRT C ABI (ABI 1).

Everything that touches libbaseRT lives here: finding and loading the library,
struct layouts (shared/ABI-FACTS.md), argtypes/restype of every function the
SDK calls, copying runtime-owned strings at once, and turning failures into
typed exceptions. Nothing here is thread-safe by design: the model handle is
single-owner, and the engine thread is the only caller (debug mode checks it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from ctypes import (
    POINTER,
    Structure,
    c_bool,
    c_char,
    c_char_p,
    c_float,
    c_int,
    c_int32,
    c_long,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import AbiMismatchError, EngineError, LibraryError, ThreadAffinityError, engine_error

SUPPORTED_ABI = 1
LIB_ENV = "BASERT_LIB_PATH"
THREAD_CHECK_ENV = "AIOBASERT_DEBUG_THREADS"

CAP_PAGED_KV = 1 << 0
CAP_SEQUENCES = 1 << 1
CAP_HOST_LOGITS = 1 << 2
CAP_PREFIX_CACHE = 1 << 3


# ---- struct mirrors (field order and C types are the ABI) ---------------------------


class BaseRTSamplingConfig(Structure):
    _fields_ = [
        ("temperature", c_float),
        ("top_k", c_int),
        ("top_p", c_float),
        ("min_p", c_float),
        ("repeat_penalty", c_float),
        ("presence_penalty", c_float),
        ("frequency_penalty", c_float),
        ("seed", c_uint32),
        ("n_logit_bias", c_int32),
        ("logit_bias_tokens", POINTER(c_int32)),
        ("logit_bias_values", POINTER(c_float)),
    ]


class BaseRTGenerationStats(Structure):
    _fields_ = [
        ("prompt_tokens", c_int),
        ("generated_tokens", c_int),
        ("prefill_time_ms", c_float),
        ("decode_time_ms", c_float),
        ("prefill_tokens_per_sec", c_float),
        ("decode_tokens_per_sec", c_float),
    ]


class BaseRTLoadOptions(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("kv_bits", c_int),
        ("paged_kv", c_int),
        ("max_batch_size", c_int),
        ("prefix_cache", c_int),
        ("prefill_chunk", c_int),
        ("paged_weights_mode", c_int),
    ]


class BaseRTModelConfig(Structure):
    """The documented prefix only; read with baseRT_get_config_into by size."""

    _fields_ = [
        ("dim", c_uint32),
        ("n_layers", c_uint32),
        ("n_heads", c_uint32),
        ("n_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("q_dim", c_uint32),
        ("kv_dim", c_uint32),
        ("ffn_dim", c_uint32),
        ("vocab_size", c_uint32),
        ("max_seq_len", c_uint32),
        ("norm_eps", c_float),
        ("rope_theta", c_float),
        ("sliding_window_pattern", c_uint32),
        ("sliding_window", c_uint32),
        ("rope_local_theta", c_float),
        ("architecture", c_char * 32),
    ]


class BaseRTMemoryStats(Structure):
    _fields_ = [
        ("runtime_allocated_bytes", c_uint64),
        ("kv_cache_capacity_bytes", c_uint64),
        ("kv_cache_used_bytes", c_uint64),
        ("kv_cache_blocks_total", c_uint64),
        ("kv_cache_blocks_used", c_uint64),
        ("kv_cache_tokens_used", c_uint64),
        ("kv_cache_layout", c_int),
        ("reserved", c_uint32),
    ]


class BaseRTRowSampling(Structure):
    _fields_ = [
        ("temperature", c_float),
        ("top_p", c_float),
        ("min_p", c_float),
        ("top_k", c_int32),
        ("seed", c_uint32),
        ("repeat_penalty", c_float),
        ("presence_penalty", c_float),
        ("frequency_penalty", c_float),
        ("history", POINTER(c_uint32)),
        ("history_count", c_uint32),
    ]


class BaseRTPrefixMatch(Structure):
    _fields_ = [
        ("matched_tokens", c_int),
        ("n_blocks", c_int),
        ("blocks", POINTER(c_int)),
        ("handle", c_uint64),
    ]


TOKEN_CALLBACK = ctypes.CFUNCTYPE(c_bool, c_uint32, c_char_p, c_void_p)

_u32p = POINTER(c_uint32)
_intp = POINTER(c_int)

# name: (restype, argtypes, required). Optional functions may be absent from a
# library; `_core.loaded` asks `lib.has(name)` once at load, and the SDK relies on its answers.
_SIGNATURES: dict[str, tuple[Any, list[Any], bool]] = {
    "baseRT_version_string": (c_char_p, [], True),
    "baseRT_abi_version": (c_uint, [], True),
    "baseRT_get_error": (c_char_p, [], True),
    "baseRT_get_error_code": (c_int, [], True),
    "baseRT_strerror": (c_char_p, [c_int], True),
    "baseRT_load_model": (c_void_p, [c_char_p, c_char_p, c_int], True),
    "baseRT_load_model_ex": (c_void_p, [c_char_p, c_char_p, c_int, POINTER(BaseRTLoadOptions)], True),
    "baseRT_load_tokenizer_only": (c_void_p, [c_char_p], False),
    "baseRT_free_model": (None, [c_void_p], True),
    "baseRT_get_config_into": (c_size_t, [c_void_p, c_void_p, c_size_t], True),
    "baseRT_model_config_sizeof": (c_size_t, [], False),
    "baseRT_capabilities": (c_uint32, [c_void_p], True),
    "baseRT_capability_descriptor": (c_char_p, [c_void_p], False),
    "baseRT_model_memory_stats": (c_bool, [c_void_p, POINTER(BaseRTMemoryStats)], True),
    "baseRT_model_memory": (c_size_t, [c_void_p], True),  # resident weights + the KV pool's capacity
    "baseRT_suggest_max_context": (c_int, [c_char_p, c_int, c_int, c_int], False),
    "baseRT_kv_bits_effective": (c_int, [c_void_p], False),
    # tokenizer
    "baseRT_encode": (c_int, [c_void_p, c_char_p, _u32p, c_int], True),
    "baseRT_encode_plain": (c_int, [c_void_p, c_char_p, _u32p, c_int], True),
    "baseRT_encode_pieces": (c_int, [c_void_p, POINTER(c_char_p), _intp, c_int, _u32p, c_int], True),
    "baseRT_token_count": (c_int, [c_void_p, c_char_p], True),
    "baseRT_decode_token_raw": (c_int, [c_void_p, c_uint32, ctypes.c_char_p, c_int], True),
    "baseRT_decode_token_static": (c_char_p, [c_void_p, c_uint32], True),
    "baseRT_decode_stream_create": (c_void_p, [c_void_p], True),
    "baseRT_decode_stream_reset": (None, [c_void_p], True),
    "baseRT_decode_stream_reset_for_prompt": (None, [c_void_p, _u32p, c_int], True),
    "baseRT_decode_stream_token": (c_char_p, [c_void_p, c_uint32], True),
    "baseRT_decode_stream_free": (None, [c_void_p], True),
    "baseRT_bos_id": (c_uint32, [c_void_p], True),
    "baseRT_add_bos": (c_int, [c_void_p], False),
    "baseRT_eos_token_id": (c_uint32, [c_void_p], True),
    "baseRT_is_eos_token": (c_int32, [c_void_p, c_uint32], True),
    "baseRT_special_token_count": (c_int, [c_void_p], False),
    "baseRT_special_token": (c_char_p, [c_void_p, c_int, _u32p], False),
    "baseRT_bos_token": (c_char_p, [c_void_p], False),
    "baseRT_eos_token": (c_char_p, [c_void_p], False),
    "baseRT_chat_template_jinja": (c_char_p, [c_void_p], False),
    # sequences and batched steps
    "baseRT_sequence_create": (c_void_p, [c_void_p], True),
    "baseRT_sequence_free": (None, [c_void_p], True),
    "baseRT_sequence_rollback": (c_int, [c_void_p, c_int], True),
    "baseRT_page_size": (c_int, [c_void_p], True),
    "baseRT_max_prefill_chunk": (c_int, [c_void_p], True),
    "baseRT_batch_step_fused": (c_int, [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp, _u32p], True),
    "baseRT_batch_step_fused_logits": (c_int, [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp], True),
    "baseRT_batch_step_fused_sample": (
        c_int,
        [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp, POINTER(BaseRTRowSampling), _u32p],
        False,
    ),
    "baseRT_sample_logits_rows": (c_int, [c_void_p, c_int, c_int, POINTER(BaseRTRowSampling), _u32p], False),
    "baseRT_read_batch_logits": (c_int, [c_void_p, c_int, c_void_p], True),
    "baseRT_batch_logits_stride": (c_size_t, [c_void_p], True),
    "baseRT_sample_logits_row": (
        c_uint32,
        [c_void_p, c_void_p, POINTER(BaseRTSamplingConfig), _u32p, c_int, c_int, c_uint32],
        True,
    ),
    "baseRT_argmax_logits_row": (c_uint32, [c_void_p, c_void_p], True),
    "baseRT_logits_row_logprobs": (
        c_int,
        [c_void_p, c_void_p, c_uint32, c_int, POINTER(c_float), _u32p, POINTER(c_float)],
        True,
    ),
    "baseRT_mask_logits_row": (c_int, [c_void_p, c_void_p, POINTER(c_int32)], False),
    # multi-row steps and hidden-state taps (chunked embeddings pool tapped rows)
    "baseRT_batch_step_fused_logits_rows": (c_int, [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp, _intp], False),
    "baseRT_batch_step_fused_logits_rows_taps": (
        c_int,
        [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp, _intp, _intp, c_int, _intp],
        False,
    ),
    "baseRT_read_tap_rows": (c_int, [c_void_p, c_int, c_int, c_void_p], False),
    "baseRT_tap_rows_capacity": (c_int, [c_void_p], False),
    "baseRT_model_supports_taps": (c_int, [c_void_p], False),
    # speculative decoding's entry points (`loaded.Capabilities` says which a library has): greedy verify
    # steps run rows_argmax (`step.StepRunner`); the speculator heads are named and refused, not driven yet
    "baseRT_batch_step_fused_rows_argmax": (
        c_int,
        [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp, _intp, _intp, c_int, _intp, _u32p],
        False,
    ),
    "baseRT_set_speculation": (None, [c_void_p, c_bool], False),
    "baseRT_get_speculation": (c_bool, [c_void_p], False),
    "baseRT_has_speculator": (c_int, [c_void_p], False),
    "baseRT_speculator_kind": (c_int, [c_void_p, c_char_p, c_int], False),
    "baseRT_load_speculator_head": (c_void_p, [c_void_p], False),
    "baseRT_mtp_chain": (c_int, [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp, c_void_p, c_int, _u32p], False),
    "baseRT_load_drafter": (c_void_p, [c_void_p, c_char_p], False),
    "baseRT_drafter_step": (c_int, [c_void_p, c_void_p, c_void_p, c_int, _u32p, c_int], False),
    "baseRT_eagle3_chain": (c_int, [c_void_p, POINTER(c_void_p), c_int, _u32p, _intp, c_void_p, c_int, _u32p], False),
    # prefix cache
    "baseRT_prefix_match": (BaseRTPrefixMatch, [c_void_p, _u32p, c_int], False),
    "baseRT_sequence_seed_prefix": (c_int, [c_void_p, _intp, c_int, c_int], False),
    "baseRT_prefix_insert": (c_int, [c_void_p, _u32p, c_int, c_void_p], False),
    "baseRT_prefix_unlock": (None, [c_void_p, c_uint64], False),
    "baseRT_prefix_release": (None, [c_void_p, c_uint64], False),
    "baseRT_prefix_evict": (c_int, [c_void_p, c_int], False),
    "baseRT_prefix_cache_stats": (
        None,
        [c_void_p, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_uint64), _intp],
        False,
    ),
    # single-sequence path and embeddings
    "baseRT_generate": (
        BaseRTGenerationStats,
        [c_void_p, _u32p, c_int, c_int, BaseRTSamplingConfig, TOKEN_CALLBACK, c_void_p],
        False,
    ),
    "baseRT_reset": (None, [c_void_p], False),
    "baseRT_prefill": (c_uint32, [c_void_p, _u32p, c_int], False),
    "baseRT_read_logits": (c_int, [c_void_p, POINTER(c_float), c_int], False),
    "baseRT_embed": (c_int, [c_void_p, _u32p, c_int, POINTER(c_float), c_int], False),
    # grammar-constrained decoding (engines with a grammar backend: JSON, schemas, structural tags)
    "baseRT_grammar_create_from_schema": (c_void_p, [c_void_p, c_char_p], False),
    "baseRT_grammar_create_from_structural_tag": (c_void_p, [c_void_p, c_char_p], False),
    "baseRT_grammar_reset": (None, [c_void_p], False),
    "baseRT_grammar_create_json": (c_void_p, [c_void_p], False),
    "baseRT_grammar_free": (None, [c_void_p], False),
    "baseRT_grammar_bitmask_size": (c_int, [c_void_p], False),
    "baseRT_grammar_fill_bitmask": (c_int, [c_void_p, c_void_p], False),
    "baseRT_grammar_accept_token": (c_int, [c_void_p, c_uint32], False),
    "baseRT_grammar_is_terminated": (c_int, [c_void_p], False),
    "baseRT_grammar_is_completed": (c_int, [c_void_p], False),
    # reference-engine extra (not in the real engine): fault injection for tests
    "baseRT_ref_inject_fault": (c_int, [c_int, c_int], False),
    # reference-engine extras for tests: KV pool consistency check, process-wide counters
    "baseRT_ref_check_kv": (c_int, [c_void_p], False),
    "baseRT_ref_counter": (c_long, [c_char_p], False),
    "baseRT_ref_kernels": (c_char_p, [], False),
}

# Functions that never touch a model handle's state (pure queries, error state).
_THREAD_FREE = {"baseRT_version_string", "baseRT_abi_version", "baseRT_strerror", "baseRT_ref_kernels"}


def bundled_library_path() -> Path:
    """The reference engine built into this package by `pip install`."""
    name = "libbaseRT.dylib" if sys.platform == "darwin" else "libbaseRT.so"
    return Path(__file__).resolve().parent / "_native" / name


def _candidates(explicit: str | os.PathLike[str] | None) -> list[tuple[str, str]]:
    """(origin, path) in search order: argument, env, platform places, bundled."""
    out: list[tuple[str, str]] = []
    if explicit is not None:
        return [("argument", os.fspath(explicit))]
    env = os.environ.get(LIB_ENV)
    if env:
        return [(LIB_ENV, env)]
    found = ctypes.util.find_library("baseRT")
    if found:
        out.append(("system", found))
    name = "libbaseRT.dylib" if sys.platform == "darwin" else "libbaseRT.so"
    for d in ("/usr/local/lib", "/opt/homebrew/lib", "/usr/lib"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            out.append(("system", p))
    out.append(("bundled reference engine", str(bundled_library_path())))
    return out


if TYPE_CHECKING:
    from ._ffi_api import LibraryFunctions
else:
    LibraryFunctions = object


class Library(LibraryFunctions):
    """A loaded libbaseRT with every signature declared.

    Attribute access (`lib.baseRT_encode`) returns the ctypes function, wrapped
    with a thread-affinity check in debug mode (`AIOBASERT_DEBUG_THREADS=1` or
    `thread_check=True`): once `bind_thread()` is called, any call from another
    thread raises `ThreadAffinityError` and is counted in `violations`.
    """

    def __init__(self, path: str, origin: str, *, thread_check: bool | None = None) -> None:
        try:
            self._cdll = ctypes.CDLL(path)
        except OSError as exc:
            raise LibraryError(f"cannot load libbaseRT from {path} ({origin}): {exc}") from exc
        self.path = path
        self.origin = origin
        # The ABI number first: a library of another ABI gets that diagnosis, not a symbol list.
        try:
            abi_fn = self._cdll.baseRT_abi_version
        except AttributeError:
            raise LibraryError(
                f"{path} ({origin}) has no baseRT_abi_version: not libbaseRT, or an engine older than 0.3.1"
            ) from None
        abi_fn.restype, abi_fn.argtypes = c_uint, []
        abi = int(abi_fn())
        if abi != SUPPORTED_ABI:
            raise AbiMismatchError(f"{path} ({origin}) speaks baseRT ABI {abi}; aiobasert supports ABI {SUPPORTED_ABI}")
        self._present: set[str] = set()
        for name, (restype, argtypes, required) in _SIGNATURES.items():
            try:
                fn = getattr(self._cdll, name)
            except AttributeError:
                if required:
                    raise LibraryError(
                        f"{path} ({origin}) lacks required symbol {name}: not a baseRT ABI 1 library"
                    ) from None
                continue
            fn.restype = restype
            fn.argtypes = argtypes
            self._present.add(name)
        self.abi_version = abi
        self.version = (self._cdll.baseRT_version_string() or b"").decode("utf-8", "replace")
        if thread_check is None:
            thread_check = os.environ.get(THREAD_CHECK_ENV, "") not in ("", "0")
        self.thread_check = thread_check
        self._owner: int | None = None
        self.violations = 0
        self.calls = 0
        self._wrapped: dict[str, Callable[..., Any]] = {}

    def has(self, name: str) -> bool:
        """The library exports `name` (an optional function). Asked once, at load, by
        `_core.loaded` (its `Capabilities`); everything else reads those."""
        return name in self._present

    def special_tokens(self, handle: int | None) -> list[bytes]:
        """The text of every special (control / user-defined) token of `handle`; [] for a library
        that cannot list them."""
        if not (self.has("baseRT_special_token_count") and self.has("baseRT_special_token")):
            return []
        count = int(self.baseRT_special_token_count(handle))
        return [self.baseRT_special_token(handle, i, None) or b"" for i in range(count)]

    def bind_thread(self) -> None:
        """Declare the calling thread the only one allowed into the library."""
        self._owner = threading.get_ident()

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("baseRT_"):
            raise AttributeError(name)
        if name not in self._present:
            raise AttributeError(f"{self.path} does not export {name}")
        fn = getattr(self._cdll, name)
        if not self.thread_check or name in _THREAD_FREE:
            return fn
        wrapped = self._wrapped.get(name)
        if wrapped is None:

            def wrapped(*args: Any, _fn: Any = fn, _name: str = name) -> Any:
                self.calls += 1
                owner = self._owner
                if owner is not None and threading.get_ident() != owner:
                    self.violations += 1
                    raise ThreadAffinityError(f"{_name} called off the engine thread")
                return _fn(*args)

            self._wrapped[name] = wrapped
        return wrapped

    # ---- error handling ----------------------------------------------------------

    def last_error(self, function: str, fallback: str = "call failed") -> EngineError:
        """The typed exception for the error pending on this thread."""
        code = int(self.baseRT_get_error_code())
        msg = (self.baseRT_get_error() or b"").decode("utf-8", "replace")
        if code == 0:
            code = 1  # the call failed but set no code: UNKNOWN, never "OK"
        return engine_error(code, msg or fallback, function)

    def check(self, rc: int, function: str) -> None:
        """Raise the pending engine error when an int-status call failed."""
        if rc != 0:
            raise self.last_error(function, f"returned {rc}")


_default_lock = threading.Lock()


def load_library(path: str | os.PathLike[str] | None = None, *, thread_check: bool | None = None) -> Library:
    """Find and load libbaseRT: `path`, else $BASERT_LIB_PATH, else the platform's
    usual places, else the reference engine bundled with this package."""
    errors: list[str] = []
    with _default_lock:
        for origin, candidate in _candidates(path):
            if origin in ("argument", LIB_ENV) and not os.path.exists(candidate):
                raise LibraryError(f"libbaseRT not found at {candidate} (from {origin})")
            if not os.path.exists(candidate) and os.sep in candidate:
                errors.append(f"{candidate}: missing")
                continue
            try:
                return Library(candidate, origin, thread_check=thread_check)
            except AbiMismatchError:
                raise
            except LibraryError as exc:
                if origin in ("argument", LIB_ENV):
                    raise
                errors.append(str(exc))
    hint = "reinstall aiobasert (`pip install -e .` builds the reference engine) or set BASERT_LIB_PATH"
    raise LibraryError("no usable libbaseRT found: " + "; ".join(errors) + f". {hint}")


# ---- small marshalling helpers ------------------------------------------------------


def u32_array(values: Sequence[int]) -> ctypes.Array[c_uint32]:
    return (c_uint32 * len(values))(*values)


def c_str(text: str) -> bytes:
    """UTF-8 bytes for a C string; NUL cannot be represented and is refused."""
    data = text.encode("utf-8")  # lone surrogates raise UnicodeEncodeError (a ValueError)
    if b"\x00" in data:
        raise ValueError("text contains a NUL character, which a C string cannot carry")
    return data


# ---- the typed stub of the functions (aiobasert/_ffi_api.pyi) -----------------------

_INT_TYPES = (c_int, c_uint, c_int32, c_uint32, c_long, c_size_t, c_uint64)


def _stub_type(ctype: Any, *, result: bool = False) -> str:
    if ctype is None:
        return "None"
    if ctype in _INT_TYPES:
        return "int"
    if ctype is c_float:
        return "float"
    if ctype is c_bool:
        return "bool"
    if ctype is c_char_p:
        return "bytes | None" if result else "_Text"
    if ctype is c_void_p:
        return "int | None" if result else "_Pointer"
    if isinstance(ctype, type) and issubclass(ctype, Structure):
        return f"_ffi.{ctype.__name__}"
    return "Any"  # pointers, arrays, callbacks: ctypes checks them against argtypes at the call


def render_stub() -> str:
    """The text of aiobasert/_ffi_api.pyi: one typed method per entry of _SIGNATURES, so mypy
    checks every `lib.baseRT_*` call (the runtime object is `Library`, through __getattr__)."""
    lines = [
        '"""Typed signatures of every libbaseRT function the SDK declares: a stub generated from',
        "`aiobasert._ffi._SIGNATURES` by its `write_stub()` (tests/_core/test_ffi.py checks it is current).",
        'Pointers, arrays and callbacks are `Any` here: ctypes checks them against argtypes at the call."""',
        "",
        "from _ctypes import _CArgObject, _CData",
        "from ctypes import Array, c_char",
        "from typing import Any",
        "",
        "from . import _ffi",
        "",
        "# a handle (int or None), or a buffer (a ctypes object, byref) where C takes a void *",
        "_Pointer = int | None | _CData | _CArgObject",
        "# a NUL-terminated string, or a buffer C writes one into",
        "_Text = bytes | None | Array[c_char]",
        "",
        "class LibraryFunctions:",
    ]
    for name, (restype, argtypes, _required) in _SIGNATURES.items():
        params = ", ".join(f"a{i}: {_stub_type(t)}" for i, t in enumerate(argtypes))
        params = f"self, {params}, /" if params else "self"
        lines.append(f"    def {name}({params}) -> {_stub_type(restype, result=True)}: ...")
    return "\n".join(lines) + "\n"


STUB_PATH = Path(__file__).with_name("_ffi_api.pyi")


def write_stub() -> None:
    """Regenerate aiobasert/_ffi_api.pyi after a change to _SIGNATURES."""
    STUB_PATH.write_text(render_stub())

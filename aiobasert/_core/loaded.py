"""The model loaded, and what it can do, asked once (`load` -> `LoadedModel`).

The engine thread calls `load` (on itself: the handle is that thread's from then on) and serves the
`LoadedModel` it gets: the handle, the intake workers, the limits the engine took effect with, and
`Capabilities`. Every "does this library / model have X" is asked here, once, at load (the only
module besides `_ffi` that calls `lib.has`: tests/_core/test_loaded.py checks it), so an optional
function missing from a library decides its fallback in one place, and a user can ask the same
question (`engine.capabilities`).
"""

from __future__ import annotations

import json
import os
import threading
from ctypes import byref, create_string_buffer, sizeof
from dataclasses import dataclass
from typing import Any

from .. import _ffi
from ..config import EngineConfig
from ..errors import AioBaseRTError, EngineClosedError, InvalidConfigError
from ..types import Capabilities, ModelInfo
from .intake import Intake
from .memory import available_memory

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


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A loaded model as the engine thread serves it: built once by `load`, never changed.

    The engine thread owns `handle` (and frees it); `intake` is None for a library without
    tokenizer-only handles (requests are then prepared on the engine thread)."""

    lib: _ffi.Library
    handle: int
    intake: Intake | None
    info: ModelInfo
    """What the loaded model is, its effective limits included (`engine.info`)."""
    caps: Capabilities
    page_size: int
    """KV tokens per page."""
    kv_blocks: int | None
    """The KV pool's blocks (`baseRT_model_memory_stats`; None where the engine reports none):
    they bound the KV paused requests may keep (`Batcher`)."""
    logits_stride: int
    """Bytes between two host logits rows (`baseRT_batch_logits_stride`)."""
    norm_eps: float
    chat_template: str
    """The bundle's own Jinja chat template; "" where it has none (or the library cannot say)."""
    special_tokens: tuple[str, ...]
    """The text of every special token (a template-less model's family is told by them)."""
    prefix_stats: bool
    """`baseRT_prefix_cache_stats` is there (`EngineStats.prefix_blocks_cached`)."""
    prefix_evict: bool
    """`baseRT_prefix_evict` is there (`Engine.evict_prefix_cache`)."""
    prefix_bound: int | None
    """The most blocks the prefix cache keeps at rest (`EngineConfig.prefix_cache_mb`); None: no
    bound can be held (no cache, or an engine without the stats / evict calls)."""
    grammar_reset: bool
    """An engine grammar can be reset for the next request (`baseRT_grammar_reset`): the grammar
    cache keeps it instead of freeing it."""

    @property
    def path(self) -> str:
        return self.info.path

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_context(self) -> int:
        return self.info.max_context

    @property
    def max_batch_size(self) -> int:
        return self.info.max_batch_size

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens prefilled per step: the requested chunk capped by the engine's."""
        return self.info.prefill_chunk


def probe(lib: _ffi.Library, handle: int) -> Capabilities:
    """What `handle` (a loaded model, or a tokenizer-only load) can do with `lib`. A handle that
    steps no sequences gets none of the stepping abilities (calling those functions on it is
    undefined); its grammar compiler is the library's (the intake workers compile on such handles)."""
    has = lib.has
    flags = int(lib.baseRT_capabilities(handle))
    steps = bool(flags & _ffi.CAP_SEQUENCES)
    taps = steps and all(has(fn) for fn in TAP_FUNCTIONS) and lib.baseRT_model_supports_taps(handle) == 1
    capacity = max(0, int(lib.baseRT_tap_rows_capacity(handle))) if taps else 0
    bitmask = has("baseRT_grammar_fill_bitmask")
    drafters = has("baseRT_load_drafter")
    return Capabilities(
        flags=flags,
        sequences=steps,
        tokenizer_handles=has("baseRT_load_tokenizer_only"),
        fused_sample=steps and has("baseRT_batch_step_fused_sample"),
        row_sampler=steps and has("baseRT_sample_logits_rows"),
        mask_row=steps and has("baseRT_mask_logits_row"),
        taps=taps and capacity > 0,
        tap_capacity=capacity,
        multi_row_verify=steps and has("baseRT_batch_step_fused_logits_rows"),
        rows_argmax=steps and has("baseRT_batch_step_fused_rows_argmax"),
        speculation_switch=steps and has("baseRT_set_speculation") and has("baseRT_get_speculation"),
        prefix_cache=steps and bool(flags & _ffi.CAP_PREFIX_CACHE) and has("baseRT_prefix_match"),
        grammar_compiler=has("baseRT_grammar_create_from_schema") and bitmask,
        structural_tag=has("baseRT_grammar_create_from_structural_tag") and bitmask,
        speculator=_speculator_kind(lib, handle) if steps else "",
        speculator_head=steps and has("baseRT_load_speculator_head") and has("baseRT_mtp_chain"),
        drafter=steps and drafters and has("baseRT_drafter_step"),
        eagle3=steps and drafters and has("baseRT_eagle3_chain"),
    )


def load(lib: _ffi.Library, path: str, cfg: EngineConfig, cancelled: threading.Event | None = None) -> LoadedModel:
    """Load the bundle at `path` on the calling thread (the engine thread: it owns the handle from
    now on) and read back what the engine took effect with. Stops between phases once `cancelled`
    is set (its open was cancelled: nobody will hold the engine), freeing what it built; refuses a
    KV pool that, with the weights, is more than the memory available (`_check_memory`)."""
    opts = _ffi.BaseRTLoadOptions(
        struct_size=sizeof(_ffi.BaseRTLoadOptions),
        kv_bits=kv_bits(lib, cfg.kv_cache_dtype),
        paged_kv=1,
        max_batch_size=cfg.max_batch_size,
        prefix_cache=int(cfg.prefix_cache),
        prefill_chunk=cfg.prefill_chunk,
    )
    # The intake's tokenizer handles first (tokenization and grammar compiles run there): their
    # loads parse the bundle's header while no weights are resident, and the model's own load then
    # shares their tokenizer, so the process peaks at the weights, not the weights plus a header.
    available = available_memory()  # before the load: what the weights and the pool may take
    intake = Intake(lib, path) if lib.has("baseRT_load_tokenizer_only") else None
    try:
        if intake is not None:
            intake.wait_loaded()
        check_cancelled(cancelled, "the tokenizer")
        handle = lib.baseRT_load_model_ex(os.fsencode(path), None, cfg.max_context, byref(opts))
        if not handle:
            raise lib.last_error("baseRT_load_model_ex", f"cannot load {path}")
        try:
            _check_memory(lib, handle, cfg, available)
            check_cancelled(cancelled, "the weights and the KV pool")
            return _describe(lib, handle, path, cfg, intake)
        except BaseException:
            lib.baseRT_free_model(handle)
            raise
    except BaseException:
        if intake is not None:
            intake.close()
        raise


def check_cancelled(cancelled: threading.Event | None, phase: str) -> None:
    """Between two phases of the load: stop here when its open was cancelled (the phase that ran is
    not undone by raising; the callers free what it built)."""
    if cancelled is not None and cancelled.is_set():
        raise EngineClosedError(f"the open was cancelled (after {phase})")


def _check_memory(lib: _ffi.Library, handle: int, cfg: EngineConfig, available: tuple[int, str] | None) -> None:
    """Refuse a KV pool that, with the weights, is more than the memory available before the load.

    The engine says what it reserved (`kv_cache_capacity_bytes`: the reference engine sizes its
    pool as max_batch_size + 1 full-context sequences of blocks; another engine sizes its own).
    Until its blocks are written the reservation costs nothing (untouched pages), so it would
    open and then be killed for memory later, under load; refused here instead."""
    if available is None:
        return
    ms = _ffi.BaseRTMemoryStats()
    if not lib.baseRT_model_memory_stats(handle, byref(ms)):
        return
    pool = int(ms.kv_cache_capacity_bytes)
    need = max(int(ms.runtime_allocated_bytes), pool)  # the weights, the pool and the engine's scratch
    free, source = available
    if need <= free:
        return
    raise InvalidConfigError(
        f"the KV pool for max_batch_size={cfg.max_batch_size} x max_context={cfg.max_context} "
        f"({_gib(pool)}) plus the weights and scratch ({_gib(need - pool)}) needs {_gib(need)}, more than the "
        f"{_gib(free)} available ({source}); lower max_batch_size or max_context (or kv_cache_dtype)"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def prefix_upkeep(lib: _ffi.Library, caps: Capabilities) -> tuple[bool, bool]:
    """(stats, evict): a handle with `caps` can count its prefix cache's blocks
    (`baseRT_prefix_cache_stats`) and evict them (`baseRT_prefix_evict`); the target's and a
    draft model's handle alike."""
    on = caps.prefix_cache
    return on and lib.has("baseRT_prefix_cache_stats"), on and lib.has("baseRT_prefix_evict")


def _prefix_bound(lib: _ffi.Library, handle: int, cfg: EngineConfig, caps: Capabilities, evict: bool) -> int | None:
    """The most blocks the prefix cache keeps (`EngineConfig.prefix_cache_mb`, in the engine's block
    size; default a quarter of the pool), or None where it cannot be held to one (no cache, or an
    engine without the calls)."""
    if not (caps.prefix_cache and evict):
        return None
    ms = _ffi.BaseRTMemoryStats()
    if not lib.baseRT_model_memory_stats(handle, byref(ms)) or ms.kv_cache_blocks_total <= 0:
        return None
    total = int(ms.kv_cache_blocks_total)
    if cfg.prefix_cache_mb is None:
        return total // 4
    block_bytes = max(1, int(ms.kv_cache_capacity_bytes) // total)
    return int(min(total, cfg.prefix_cache_mb * 2**20 // block_bytes))


def _describe(lib: _ffi.Library, handle: int, path: str, cfg: EngineConfig, intake: Intake | None) -> LoadedModel:
    """The loaded model's limits, as the engine took effect, and its capabilities."""
    caps = probe(lib, handle)
    stats, evict = prefix_upkeep(lib, caps)
    if not caps.sequences:
        raise AioBaseRTError(
            f"{path}: the engine cannot create sequences for this model "
            "(no continuous batching); aiobasert needs BASERT_CAP_SEQUENCES"
        )
    mc = _ffi.BaseRTModelConfig()
    lib.baseRT_get_config_into(handle, byref(mc), sizeof(mc))
    vocab_size = int(mc.vocab_size)
    max_context = int(mc.max_seq_len) or cfg.max_context
    engine_chunk = int(lib.baseRT_max_prefill_chunk(handle)) or cfg.prefill_chunk
    # The engine may serve fewer lanes than asked (the reference engine caps
    # them at its prefill chunk): its descriptor says how many; plan with that.
    max_batch_size = cfg.max_batch_size
    engine_batch = _descriptor(lib, handle).get("max_batch_size")
    if isinstance(engine_batch, int) and not isinstance(engine_batch, bool) and engine_batch > 0:
        max_batch_size = min(cfg.max_batch_size, engine_batch)
    stride = int(lib.baseRT_batch_logits_stride(handle))
    if stride < 2 * vocab_size:
        raise AioBaseRTError(f"engine reports a logits stride of {stride} bytes for vocab {vocab_size}")
    template = b""
    if lib.has("baseRT_chat_template_jinja"):
        template = lib.baseRT_chat_template_jinja(handle) or b""
    info = ModelInfo(
        path=path,
        architecture=mc.architecture.decode("utf-8", "replace"),
        vocab_size=vocab_size,
        dim=int(mc.dim),
        n_layers=int(mc.n_layers),
        n_heads=int(mc.n_heads),
        n_kv_heads=int(mc.n_kv_heads),
        max_context=max_context,
        max_batch_size=max_batch_size,
        prefix_cache=caps.prefix_cache,
        library_path=lib.path,
        library_version=lib.version,
        capabilities=caps,
        prefill_chunk=max(1, min(cfg.prefill_chunk, engine_chunk)),
        kv_cache_dtype=_kv_cache_dtype(lib, handle),
        bos_token=_static_str(lib, handle, "baseRT_bos_token"),
        eos_token=_static_str(lib, handle, "baseRT_eos_token"),
        engine_threads=_engine_threads(lib),
    )
    return LoadedModel(
        lib=lib,
        handle=handle,
        intake=intake,
        info=info,
        caps=caps,
        page_size=int(lib.baseRT_page_size(handle)) or 16,
        kv_blocks=_kv_blocks(lib, handle),
        logits_stride=stride,
        norm_eps=float(mc.norm_eps),
        chat_template=template.decode("utf-8", "replace"),
        special_tokens=tuple(t.decode("utf-8", "replace") for t in lib.special_tokens(handle)),
        prefix_stats=stats,
        prefix_evict=evict,
        prefix_bound=_prefix_bound(lib, handle, cfg, caps, stats and evict),
        grammar_reset=lib.has("baseRT_grammar_reset"),
    )


def _kv_blocks(lib: _ffi.Library, handle: int) -> int | None:
    ms = _ffi.BaseRTMemoryStats()
    if not lib.baseRT_model_memory_stats(handle, byref(ms)):
        return None
    return int(ms.kv_cache_blocks_total) or None


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


def _kv_cache_dtype(lib: _ffi.Library, handle: int) -> str:
    """What the engine allocated (it may override the request: a head_dim Q8_0 cannot split)."""
    if not lib.has("baseRT_kv_bits_effective"):
        return ""
    return _KV_NAMES.get(int(lib.baseRT_kv_bits_effective(handle)), "")


def _engine_threads(lib: _ffi.Library) -> int:
    """The reference engine's compute threads (its shared pool, sized at load, the calling thread
    included); 0 for a library that does not say."""
    if not lib.has("baseRT_ref_counter"):
        return 0
    return max(0, int(lib.baseRT_ref_counter(b"pool_threads")))


def _descriptor(lib: _ffi.Library, handle: int) -> dict[str, Any]:
    if not lib.has("baseRT_capability_descriptor"):
        return {}
    raw = lib.baseRT_capability_descriptor(handle)
    try:
        desc = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return desc if isinstance(desc, dict) else {}


def _static_str(lib: _ffi.Library, handle: int, fn: str) -> str:
    if not lib.has(fn):
        return ""
    raw = getattr(lib, fn)(handle)
    return (raw or b"").decode("utf-8", "replace")


def _speculator_kind(lib: _ffi.Library, handle: int) -> str:
    """The kind of the bundle's embedded speculator ("mtp", ...), "" for none."""
    if not (lib.has("baseRT_has_speculator") and lib.has("baseRT_speculator_kind")):
        return ""
    if lib.baseRT_has_speculator(handle) != 1:
        return ""
    buf = create_string_buffer(64)
    n = int(lib.baseRT_speculator_kind(handle, buf, len(buf)))
    return buf.raw[: max(0, min(n, len(buf)))].decode("utf-8", "replace").rstrip("\0")

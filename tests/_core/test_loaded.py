"""What the loaded engine can do (`_core.loaded`): `Capabilities` is asked of the library once, at
open, and says what the library and the model report through plain ctypes; nothing else in the
package asks the library whether it has a function."""

from __future__ import annotations

import ast
import ctypes
import os
from pathlib import Path

import pytest
from test_layering import parse_python

import aiobasert
from aiobasert import Capabilities, Engine, _ffi
from aiobasert._core.loaded import TAP_FUNCTIONS, probe
from aiobasert._ffi import Library

PACKAGE = Path(aiobasert.__file__).parent
ASKERS = {"_core/loaded.py", "_ffi.py"}  # the modules that may call `lib.has(...)`


def _raw(lib: Library) -> ctypes.CDLL:
    """The same library through a plain CDLL, declared here, not by the SDK's mirror."""
    raw = ctypes.CDLL(lib.path)
    for name in ("baseRT_capabilities", "baseRT_model_supports_taps", "baseRT_tap_rows_capacity"):
        fn = getattr(raw, name)
        fn.restype, fn.argtypes = (
            (ctypes.c_uint32 if name == "baseRT_capabilities" else ctypes.c_int),
            [ctypes.c_void_p],
        )
    return raw


@pytest.mark.anyio
@pytest.mark.parametrize("prefix_cache", [True, False])
async def test_capabilities_are_what_the_library_reports(
    lib: Library, tiny_model_path: Path, prefix_cache: bool
) -> None:
    raw = _raw(lib)

    def exports(*names: str) -> bool:
        return all(hasattr(raw, n) for n in names)

    async with Engine.open(tiny_model_path, max_batch_size=2, prefix_cache=prefix_cache) as engine:
        handle = engine._thread._model  # private on purpose: the raw C probes on the engine's own handle (C boundary)
        flags, taps_ok, capacity = await engine._call(
            lambda: (
                raw.baseRT_capabilities(handle),
                raw.baseRT_model_supports_taps(handle),
                raw.baseRT_tap_rows_capacity(handle),
            )
        )
        caps = engine.capabilities
        assert engine.info.capabilities is caps
        taps = exports(*TAP_FUNCTIONS) and taps_ok == 1 and capacity > 0
        assert caps == Capabilities(
            flags=flags,
            sequences=bool(flags & _ffi.CAP_SEQUENCES),
            tokenizer_handles=exports("baseRT_load_tokenizer_only"),
            fused_sample=exports("baseRT_batch_step_fused_sample"),
            row_sampler=exports("baseRT_sample_logits_rows"),
            mask_row=exports("baseRT_mask_logits_row"),
            taps=taps,
            tap_capacity=capacity if taps else 0,
            multi_row_verify=exports("baseRT_batch_step_fused_logits_rows"),
            rows_argmax=exports("baseRT_batch_step_fused_rows_argmax"),
            speculation_switch=exports("baseRT_set_speculation", "baseRT_get_speculation"),
            prefix_cache=bool(flags & _ffi.CAP_PREFIX_CACHE) and exports("baseRT_prefix_match"),
            grammar_compiler=exports("baseRT_grammar_create_from_schema", "baseRT_grammar_fill_bitmask"),
            structural_tag=exports("baseRT_grammar_create_from_structural_tag", "baseRT_grammar_fill_bitmask"),
            speculator="",  # the reference engine has no speculator heads (baseRT_has_speculator)
            speculator_head=exports("baseRT_load_speculator_head", "baseRT_mtp_chain"),
            drafter=exports("baseRT_load_drafter", "baseRT_drafter_step"),
            eagle3=exports("baseRT_load_drafter", "baseRT_eagle3_chain"),
        )
        # the reference engine's own facts, pinned: a probe that always said False would match a CDLL above
        # only if the library lacked them too
        assert caps.sequences and caps.fused_sample and caps.row_sampler and caps.mask_row and caps.taps
        assert caps.multi_row_verify and caps.grammar_compiler and caps.structural_tag and caps.tokenizer_handles
        assert caps.rows_argmax and caps.speculation_switch
        assert caps.prefix_cache is prefix_cache is engine.info.prefix_cache
        assert not (caps.speculator_head or caps.drafter or caps.eagle3)


def test_a_tokenizer_only_load_has_the_tokenizer_only_capabilities(lib: Library, tiny_model_path: Path) -> None:
    """A tokenizer-only handle steps nothing (its flags are 0): it tokenizes, and compiles grammars
    where the library can (the intake workers compile on such handles), and nothing else."""
    raw = _raw(lib)
    handle = lib.baseRT_load_tokenizer_only(os.fsencode(tiny_model_path))
    assert handle, lib.last_error("baseRT_load_tokenizer_only")
    try:
        caps = probe(lib, handle)
    finally:
        lib.baseRT_free_model(handle)
    assert caps == Capabilities(
        tokenizer_handles=True,
        grammar_compiler=hasattr(raw, "baseRT_grammar_create_from_schema"),
        structural_tag=hasattr(raw, "baseRT_grammar_create_from_structural_tag"),
    )


@pytest.mark.anyio
async def test_a_function_the_library_lacks_is_a_capability_it_lacks(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked at open, once: an engine whose library cannot sample in the fused step says so, and
    serves the same greedy tokens from host logits rows."""
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        fused = await engine.generate("a cat", max_tokens=8)
    has = Library.has
    monkeypatch.setattr(Library, "has", lambda self, name: name != "baseRT_batch_step_fused_sample" and has(self, name))
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        assert not engine.capabilities.fused_sample and engine.capabilities.row_sampler
        host = await engine.generate("a cat", max_tokens=8)
    assert host.token_ids == fused.token_ids


def _askers(root: Path) -> set[str]:
    """The modules under `root` that call `<something>.has(...)`."""
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(parse_python(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "has":
                found.add(path.relative_to(root).as_posix())
    return found


def test_only_the_loaded_model_asks_the_library_what_it_has(tmp_path: Path) -> None:
    """Capabilities are asked once, at load (`_core/loaded.py`; `ffi` defines `has`): every other module
    reads `Capabilities` / `LoadedModel`, so what a missing function falls back to is decided in one place."""
    assert _askers(PACKAGE) <= ASKERS, sorted(_askers(PACKAGE) - ASKERS)
    # the check finds a probe where one is written (else it could never fail)
    (tmp_path / "step.py").write_text("def f(lib):\n    return lib.has('baseRT_mask_logits_row')\n")
    assert _askers(tmp_path) == {"step.py"}

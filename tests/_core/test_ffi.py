"""Finding and refusing libraries, and refusing bad model files, with clear errors."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from aiobasert import AbiMismatchError, Engine, InvalidFormatError, LibraryError, ModelFileNotFoundError, _ffi

pytestmark = pytest.mark.anyio


def _build(tmp_path: Path, name: str, source: str) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed"
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return out


def test_missing_library_names_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASERT_LIB_PATH", "/nonexistent/libbaseRT.so")
    with pytest.raises(LibraryError, match=re.escape("/nonexistent/libbaseRT.so")):
        _ffi.load_library()


def test_library_of_another_abi_is_refused(tmp_path: Path) -> None:
    lib = _build(tmp_path, "abi2", "unsigned int baseRT_abi_version(void) { return 2; }\n")
    with pytest.raises(AbiMismatchError, match=r"ABI 2; aiobasert supports ABI 1") as err:
        _ffi.load_library(lib)
    assert str(lib) in str(err.value)


def test_library_without_the_abi_is_refused(tmp_path: Path) -> None:
    lib = _build(tmp_path, "other", "int something_else(void) { return 0; }\n")
    with pytest.raises(LibraryError, match="no baseRT_abi_version"):
        _ffi.load_library(lib)
    half = _build(tmp_path, "half", "unsigned int baseRT_abi_version(void) { return 1; }\n")
    with pytest.raises(LibraryError, match="lacks required symbol"):
        _ffi.load_library(half)


def test_bundled_library_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BASERT_LIB_PATH", raising=False)
    lib = _ffi.load_library()
    assert lib.abi_version == 1 and lib.version


async def test_bad_model_files_raise_typed_errors_naming_the_file(tmp_path: Path, tiny_model_path: Path) -> None:
    missing = tmp_path / "missing.base"
    with pytest.raises(ModelFileNotFoundError, match=re.escape("missing.base")):
        await Engine.open(missing)
    truncated = tmp_path / "truncated.base"
    truncated.write_bytes(tiny_model_path.read_bytes()[:5000])
    with pytest.raises(InvalidFormatError, match=re.escape("truncated.base")):
        await Engine.open(truncated)
    foreign = tmp_path / "foreign.base"
    foreign.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(InvalidFormatError, match=re.escape("foreign.base")):
        await Engine.open(foreign)


def test_the_typed_stub_is_current() -> None:
    """mypy checks every lib.baseRT_* call against aiobasert/_ffi_api.pyi: it must say what _SIGNATURES says."""
    regenerate = "python -c 'from aiobasert._ffi import write_stub; write_stub()'"
    assert _ffi.STUB_PATH.read_text() == _ffi.render_stub(), f"run: {regenerate}"

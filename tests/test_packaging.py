"""The package as a user gets it: `python -m build` makes an sdist holding everything the build reads,
the wheel built from that sdist is tagged for what it holds (py3-none plus the manylinux tag of the glibc
versions libbaseRT uses, as auditwheel reads them), installs into a fresh virtualenv with no C compiler
on PATH and generates text from any folder; a source build without a compiler stops with one line."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pip's words when the build requirements (setuptools, pyelftools) cannot be fetched at all
_OFFLINE = ("No matching distribution found", "Could not find a version that satisfies")


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> \
        subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _build(args: list[str], source: Path, out: Path, env: dict[str, str] | None = None) -> \
        subprocess.CompletedProcess[str]:  # fmt: skip
    """`python -m build ARGS --outdir OUT SOURCE` (isolated: the build requirements come from the index)."""
    proc = _run([sys.executable, "-m", "build", *args, "--outdir", str(out), str(source)], cwd=source, env=env)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and any(word in output for word in _OFFLINE):
        pytest.skip(f"the build requirements cannot be fetched here: {output.strip()[-300:]}")
    return proc


def _without_compiler(path: str) -> dict[str, str]:
    """The environment with PATH = `path` alone (no cc / gcc / clang on it) and no $CC."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PYTHONPATH", "BASERT_LIB_PATH")}
    env["PATH"] = path
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    proc = _build(["--sdist"], ROOT, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (archive,) = out.glob("aiobasert-*.tar.gz")
    return archive


@pytest.fixture(scope="module")
def unpacked(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist's tree, where the wheel is built from (as pip builds an sdist)."""
    into = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    (tree,) = into.iterdir()
    return tree


@pytest.fixture()
def no_compiler_bin(tmp_path: Path) -> Iterator[Path]:
    """An empty folder: as PATH, it has no C compiler (python is always called by its full path)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    yield folder


def test_sdist_holds_every_native_file_the_build_reads(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    native = {str(p.relative_to(ROOT)) for p in (ROOT / "native").rglob("*.[ch]")}
    headers = {n for n in native if n.endswith(".h")}
    assert len(headers) >= 26 and any(n.startswith("native/include/") for n in headers)
    assert native <= names, sorted(native - names)
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"} <= names
    assert not any(n.endswith((".so", ".pyc")) for n in names)


def test_source_build_without_a_compiler_fails_with_one_line(unpacked: Path, tmp_path: Path,
                                                             no_compiler_bin: Path) -> None:  # fmt: skip
    proc = _build(["--wheel"], unpacked, tmp_path / "out", env=_without_compiler(str(no_compiler_bin)))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-5000:]
    said = [line for line in output.splitlines() if "C compiler" in line]
    assert len(said) == 1, output[-5000:]
    assert "aiobasert: building the reference engine needs a C compiler" in said[0]
    assert "apt-get install gcc" in said[0] and "BASERT_LIB_PATH" in said[0]
    assert not list((tmp_path / "out").glob("*.whl"))


def test_source_build_without_a_compiler_but_basert_lib_path_is_pure_python(unpacked: Path, tmp_path: Path,
                                                                            no_compiler_bin: Path) -> None:  # fmt: skip
    """The real libbaseRT's users (Mac, GB10) install without compiling the reference engine."""
    from aiobasert._ffi import load_library

    env = _without_compiler(str(no_compiler_bin)) | {"BASERT_LIB_PATH": str(load_library().path)}
    proc = _build(["--wheel"], unpacked, tmp_path / "out", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "out").glob("*.whl")
    assert wheel.name == f"{unpacked.name}-py3-none-any.whl"
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith((".so", ".dylib"))]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_wheel_from_the_sdist_installs_and_runs_without_a_compiler(unpacked: Path, tmp_path: Path,
                                                                   no_compiler_bin: Path,
                                                                   tiny_model_path: Path) -> None:  # fmt: skip
    # sdist -> wheel (compiling the reference engine), as pip or a CI job builds it
    proc = _build(["--wheel"], unpacked, tmp_path / "dist")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    _, version, python, abi, plat = wheel.stem.split("-")
    assert (python, abi) == ("py3", "none"), wheel.name  # a ctypes library: no Python ABI
    members = zipfile.ZipFile(wheel).namelist()
    assert "aiobasert/_native/libbaseRT.so" in members or "aiobasert/_native/libbaseRT.dylib" in members
    if platform.libc_ver()[0] == "glibc":
        assert re.fullmatch(r"manylinux_\d+_\d+_\w+", plat), plat
        shown = _run([sys.executable, "-m", "auditwheel", "show", str(wheel)], cwd=tmp_path)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        words = " ".join(shown.stdout.split())
        assert f'is consistent with the following platform tag: "{plat}"' in words, shown.stdout
    else:
        assert plat != "any", wheel.name

    # a fresh virtualenv (no system site-packages); the install and the run see no compiler
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    env = _without_compiler(f"{venv / 'bin'}{os.pathsep}{no_compiler_bin}")
    installed = _run([str(venv / "bin" / "python"), "-m", "pip", "install", str(wheel)], cwd=tmp_path, env=env)
    output = installed.stdout + installed.stderr
    if installed.returncode != 0 and any(word in output for word in _OFFLINE):
        pytest.skip(f"the dependencies cannot be fetched here: {output.strip()[-300:]}")
    assert installed.returncode == 0, output[-3000:]
    assert "Building wheel" not in output, output[-3000:]  # nothing compiled: every dependency is a wheel too

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(venv / "bin" / "python"), "-c", "import aiobasert; print(aiobasert.__file__)"],
                 cwd=elsewhere, env=env)  # fmt: skip
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    told = _run([str(venv / "bin" / "aiobasert"), "--version"], cwd=elsewhere, env=env)
    assert told.stdout == f"aiobasert {version}\n", told.stdout + told.stderr
    ran = _run(
        [
            str(venv / "bin" / "aiobasert"),
            "run",
            "Once upon a time",
            "-m",
            str(tiny_model_path),
            "-n",
            "6",
            "--ignore-eos",
            "--json",
        ],
        cwd=elsewhere,
        env=env | {"AIOBASERT_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert '"finish_reason":"length"' in ran.stdout and '"completion_tokens":6' in ran.stdout, ran.stdout

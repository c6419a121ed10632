"""Build the reference engine (native/) into aiobasert/_native/libbaseRT.so.

The library is a plain C shared object loaded through ctypes, not a Python
extension module: we reuse setuptools' Extension machinery only so that both
`pip install .` and `pip install -e .` compile it, and override the output
name so the file is `libbaseRT.so`, as the real engine's is.

So the wheel is tagged for what it holds: no Python ABI (``py3-none``), a platform, and on
glibc Linux the manylinux tag of the newest glibc symbol version the library uses (what
auditwheel checks). Without a C compiler the build stops with one line saying what to
install; where BASERT_LIB_PATH names an engine library (the real libbaseRT), the reference
engine is not built at all and the wheel is pure Python.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shlex
import shutil
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.errors import PlatformError

try:  # setuptools >= 70.1 (what pyproject.toml's build requirements install)
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # an older setuptools (`setup.py build_ext --inplace` in an old venv): the wheel package's
    try:
        from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]
    except ImportError:
        bdist_wheel = None  # type: ignore[assignment,misc]

NATIVE_SOURCES = sorted(glob.glob(os.path.join("native", "src", "*.c")))
LIB_ENV = "BASERT_LIB_PATH"  # aiobasert._ffi.LIB_ENV: the engine library used at run time


def c_compiler() -> str | None:
    """The C compiler build_ext would run ($CC, else the one Python was built with), if it is on PATH."""
    command = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    words = shlex.split(command)
    return shutil.which(words[0]) if words else None


def use_given_library() -> bool:
    """No compiler, but BASERT_LIB_PATH names a library (the real libbaseRT): skip the reference engine."""
    given = os.environ.get(LIB_ENV)
    return c_compiler() is None and bool(given) and os.path.isfile(str(given))


def require_compiler() -> None:
    """One line naming what to install, instead of distutils' traceback deep inside the compile step."""
    if c_compiler() is None:
        command = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        raise PlatformError(
            f"aiobasert: building the reference engine needs a C compiler ({command!r} is not on PATH): install "
            f"one (e.g. apt-get install gcc, dnf install gcc, xcode-select --install), or set {LIB_ENV} to an "
            "existing libbaseRT to install without it"
        )


class Build(build):
    def run(self) -> None:
        if self.distribution.ext_modules:
            require_compiler()  # before build_py's file list, so the failure is the last line pip shows
        super().run()


class BuildSharedLib(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        parts = fullname.split(".")
        suffix = ".dylib" if sys.platform == "darwin" else ".so"
        return os.path.join(*parts[:-1], parts[-1] + suffix)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # no PyInit_*: this is a C library, not a module

    def run(self) -> None:
        if self.extensions:
            require_compiler()
        super().run()

    def build_extension(self, ext: Extension) -> None:
        # -O3 everywhere; ASan/UBSan build when AIOBASERT_SANITIZE=1 (issue 5).
        if os.environ.get("AIOBASERT_SANITIZE") == "1":
            # float-cast-overflow is not part of "undefined": a NaN reaching (int) is UB all the same
            san = "-fsanitize=address,undefined,float-cast-overflow"
            ext.extra_compile_args += ["-O1", "-g", san, "-fno-omit-frame-pointer"]
            ext.extra_link_args += [san]
        # the output folder holds no tracked source, so make sure it exists (editable installs copy into it)
        os.makedirs(os.path.dirname(self.get_ext_fullpath(ext.name)), exist_ok=True)
        os.makedirs(os.path.join("aiobasert", "_native"), exist_ok=True)
        _compile_in_parallel(self.compiler)
        super().build_extension(ext)


def _compile_in_parallel(compiler: Any) -> None:
    """One compiler process per source file, as many at once as this process may use
    cores: distutils compiles them one by one, the longest part of a first install."""
    serial = compiler.compile
    if getattr(serial, "parallel", False):
        return
    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def compile(sources: list[str], *args: Any, **kwargs: Any) -> list[str]:
        if jobs < 2 or len(sources) < 2:
            return list(serial(sources, *args, **kwargs))
        with ThreadPoolExecutor(jobs) as pool:
            return [obj for objs in pool.map(lambda src: serial([src], *args, **kwargs), sources) for obj in objs]

    compile.parallel = True  # type: ignore[attr-defined]
    compiler.compile = compile


libbasert = Extension(
    "aiobasert._native.libbaseRT",
    sources=NATIVE_SOURCES,
    include_dirs=[os.path.join("native", "include"), os.path.join("native", "src")],
    extra_compile_args=["-std=c11", "-O3", "-fPIC", "-Wall", "-Wextra", "-fvisibility=default", "-D_GNU_SOURCE"],
    extra_link_args=["-lm", "-lpthread"],
    language="c",
)


def glibc_versions(library: str) -> set[tuple[int, ...]]:
    """The GLIBC_x.y symbol versions `library` needs (its .gnu.version_r section)."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    found: set[tuple[int, ...]] = set()
    with open(library, "rb") as file:
        for section in ELFFile(file).iter_sections():
            if isinstance(section, GNUVerNeedSection):
                for _, aux in section.iter_versions():
                    for version in aux:
                        match = re.fullmatch(r"GLIBC_(\d+(?:\.\d+)+)", version.name)
                        if match:
                            found.add(tuple(int(n) for n in match.group(1).split(".")))
    return found


def manylinux_platform(plat: str, libraries: list[str]) -> str:
    """linux_<arch> -> manylinux_<major>_<minor>_<arch>, the newest glibc version the libraries use
    (at least 2.17, the oldest manylinux pip still targets); other platforms stay as they are."""
    if not plat.startswith("linux_") or platform.libc_ver()[0] != "glibc" or not libraries:
        return plat
    newest = max((v for lib in libraries for v in glibc_versions(lib)), default=(2, 17))
    major, minor = max((newest[0], newest[1] if len(newest) > 1 else 0), (2, 17))
    return f"manylinux_{major}_{minor}_{plat.removeprefix('linux_')}"


cmdclass: dict[str, Any] = {"build": Build, "build_ext": BuildSharedLib}

if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):  # type: ignore[valid-type,misc]
        """`py3-none-<platform>`: the library needs a platform but no Python ABI or version."""

        def get_tag(self) -> tuple[str, str, str]:
            impl, abi, plat = super().get_tag()
            if self.root_is_pure:  # BASERT_LIB_PATH install: no library inside
                return impl, abi, plat
            if not self.plat_name_supplied:  # an explicit --plat-name is the builder's word
                outputs = self.get_finalized_command("build_ext").get_outputs()
                plat = manylinux_platform(plat, [lib for lib in outputs if os.path.isfile(lib)])
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = PlatformWheel

if use_given_library():
    print(f"aiobasert: no C compiler; not building the reference engine, {LIB_ENV}={os.environ[LIB_ENV]} "
          "is the engine", file=sys.stderr)  # fmt: skip

setup(ext_modules=[] if use_given_library() else [libbasert], cmdclass=cmdclass)

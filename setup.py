"""Build the reference engine (native/) into aiobasert/_native/libbaseRT.so.

The library is a plain C shared object loaded through ctypes, not a Python
extension module: we reuse setuptools' Extension machinery only so that both
`pip install .` and `pip install -e .` compile it, and override the output
name so the file is `libbaseRT.so`, as the real engine's is.
"""

from __future__ import annotations

import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE_SOURCES = sorted(glob.glob(os.path.join("native", "src", "*.c")))


class BuildSharedLib(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        parts = fullname.split(".")
        suffix = ".dylib" if sys.platform == "darwin" else ".so"
        return os.path.join(*parts[:-1], parts[-1] + suffix)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # no PyInit_*: this is a C library, not a module

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
    extra_compile_args=["-std=c11", "-O3", "-fPIC", "-Wall", "-Wextra",
                        "-fvisibility=default", "-D_GNU_SOURCE"],
    extra_link_args=["-lm", "-lpthread"],
    language="c",
)

setup(ext_modules=[libbasert], cmdclass={"build_ext": BuildSharedLib})

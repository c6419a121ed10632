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
            ext.extra_compile_args += ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
            ext.extra_link_args += ["-fsanitize=address,undefined"]
        # the output folder holds no tracked source, so make sure it exists (editable installs copy into it)
        os.makedirs(os.path.dirname(self.get_ext_fullpath(ext.name)), exist_ok=True)
        os.makedirs(os.path.join("aiobasert", "_native"), exist_ok=True)
        super().build_extension(ext)


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

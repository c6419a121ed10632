"""Every kernel set of the reference engine, not only the one this CPU picks.

The engine chooses its float and integer kernels once per process from the CPU
(AVX-512 / AVX-512 VNNI, AVX2 + FMA, portable C); $BASERT_REF_SIMD caps the
choice. The default set runs in the main suite; here the kernel suites (their
tiny-model tests: the SmolLM2 ones run on the default set) run again in a
subprocess under each lower cap, after checking that the process
really chose the set the cap and the CPU call for (a cap the CPU cannot honour
falls back, which this test states instead of skipping).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNEL_SUITES = ["tests/test_native_quant.py", "tests/test_native_weights.py", "tests/test_native_runtime.py",
                 "tests/test_native_kv.py"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def expected_kernels(cap: str | None, flags: set[str]) -> str:
    """What the engine must report under `cap` on a CPU with `flags` (x86-64 Linux; others run generic)."""
    if cap == "generic" or not {"avx2", "fma", "f16c"} <= flags:
        return "float=generic quant=generic"
    if cap == "avx2" or "avx512f" not in flags:
        return "float=avx2-fma quant=avx2"
    vnni = {"avx512bw", "avx512vl", "avx512_vnni"} <= flags
    return f"float=avx512 quant={'avx512-vnni' if vnni else 'avx2'}"


def chosen_kernels(env: dict[str, str]) -> str:
    code = "from aiobasert._ffi import load_library; print(load_library().baseRT_ref_kernels().decode())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_default_kernels_are_the_best_this_cpu_has() -> None:
    env = {k: v for k, v in os.environ.items() if k != "BASERT_REF_SIMD"}
    assert chosen_kernels(env) == expected_kernels(None, cpu_flags())


@pytest.mark.parametrize("cap", ["avx2", "generic"])
def test_kernel_suites_pass_under_each_cap(cap: str) -> None:
    env = dict(os.environ, BASERT_REF_SIMD=cap)
    assert chosen_kernels(env) == expected_kernels(cap, cpu_flags())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", *KERNEL_SUITES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    report = f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"kernel suites under BASERT_REF_SIMD={cap}:\n{report}"
    assert " passed" in proc.stdout

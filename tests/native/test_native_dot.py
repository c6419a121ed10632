"""The float kernels' dot product, value for value against its definition (mathops.c).

The AVX-512 and AVX2 sets compute one 16-lane fused multiply-add accumulator over the first n - n % 16
elements, lanes j and j + 8 added, the 8-lane horizontal sum (l0+l4 + l2+l6) + (l1+l5 + l3+l7), then the
tail fused in order: bit for bit the same values, so an AVX2 machine follows the AVX-512 one's greedy path
(the llama.cpp parity tests' near-ties were measured on AVX-512). The portable set: 8 lanes, multiply then
add. Checked through rt_dots (the attention scores' entry point, the matmul's tiles) on every tile shape of
every set, f32 and f16 weights; test_native_isa.py runs this file again under each lower kernel cap.
"""

from __future__ import annotations

import ctypes
from fractions import Fraction

import numpy as np
import numpy.typing as npt
import pytest

from aiobasert._ffi import Library

F32, F16 = 0, 1  # weight.h's RT_W_F32 / RT_W_F16


class Weight(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("type", ctypes.c_int), ("flags", ctypes.c_int)]


def fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to float32 (nearest, ties to even), from the exact rational value."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    return min(candidates, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.uint32)) & 1))


def hsum8(v: list[np.float32]) -> np.float32:
    return np.float32(
        np.float32(np.float32(v[0] + v[4]) + np.float32(v[2] + v[6]))
        + np.float32(np.float32(v[1] + v[5]) + np.float32(v[3] + v[7]))
    )


def dot_fma16(x: npt.NDArray[np.float32], w: npt.NDArray[np.float32]) -> np.float32:
    n, acc = len(x), [np.float32(0)] * 16
    nv = n - n % 16
    for i in range(0, nv, 16):
        acc = [fma32(x[i + j], w[i + j], acc[j]) for j in range(16)]
    s = hsum8([np.float32(acc[j] + acc[j + 8]) for j in range(8)])
    for i in range(nv, n):
        s = fma32(x[i], w[i], s)
    return s


def dot_generic8(x: npt.NDArray[np.float32], w: npt.NDArray[np.float32]) -> np.float32:
    n, acc = len(x), [np.float32(0)] * 8
    nv = n - n % 8
    for i in range(0, nv, 8):
        acc = [np.float32(acc[j] + np.float32(x[i + j] * w[i + j])) for j in range(8)]
    s = hsum8(acc)
    for i in range(nv, n):
        s = np.float32(s + np.float32(x[i] * w[i]))
    return s


def float_kernels(lib: Library) -> str:
    return (lib.baseRT_ref_kernels() or b"").decode().split()[0].removeprefix("float=")


def rt_dots(
    lib: Library, x: npt.NDArray[np.float32], w: npt.NDArray[np.float32], wtype: int
) -> npt.NDArray[np.float32]:
    raw = ctypes.CDLL(lib.path).rt_dots
    raw.restype = None
    raw.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.POINTER(Weight),
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
    ]
    (rows, n), out = x.shape, w.shape[0]
    stored = np.ascontiguousarray(w.astype(np.float16) if wtype == F16 else w)
    y = np.full((rows, out), np.nan, dtype=np.float32)
    weight = Weight(stored.ctypes.data, wtype, 0)
    raw(x.ctypes.data, n, rows, ctypes.byref(weight), n, out, y.ctypes.data, out, n)
    return y


def operands(rows: int, out: int, n: int, seed: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Values across 16 binades, so the order of the additions shows in the last bits."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * 2.0 ** rng.integers(-8, 8, (rows, n))).astype(np.float32)
    w = rng.standard_normal((out, n)).astype(np.float16).astype(np.float32)  # exact in f16 as well
    return x, w


# Rows and outputs past every set's main tile (AVX-512 4x6, AVX2 2x3, portable 3x4) so each tile shape
# runs; lengths below, at and past one and two 16-lane steps.
SHAPES = [(5, 7, 100), (4, 6, 33), (3, 4, 16), (2, 3, 31), (1, 1, 17), (1, 2, 15), (2, 1, 8), (1, 1, 1)]


@pytest.mark.parametrize("wtype", [F32, F16], ids=["f32", "f16"])
def test_dots_follow_the_kernel_sets_definition(lib: Library, wtype: int) -> None:
    kernels = float_kernels(lib)
    definition = dot_generic8 if kernels == "generic" else dot_fma16
    for k, (rows, out, n) in enumerate(SHAPES):
        x, w = operands(rows, out, n, seed=k)
        y = rt_dots(lib, x, w, wtype)
        want = np.array([[definition(x[r], w[o]) for o in range(out)] for r in range(rows)], dtype=np.float32)
        assert y.tobytes() == want.tobytes(), (kernels, rows, out, n, y - want)


def test_the_definitions_differ_on_these_operands() -> None:
    """The check above can tell the orders apart: 8 fused lanes (the AVX2 set before it followed AVX-512's
    16) give other bits on the same operands."""

    def dot_fma8(x: npt.NDArray[np.float32], w: npt.NDArray[np.float32]) -> np.float32:
        acc = [np.float32(0)] * 8
        for i in range(0, len(x) - len(x) % 8, 8):
            acc = [fma32(x[i + j], w[i + j], acc[j]) for j in range(8)]
        s = hsum8(acc)
        for i in range(len(x) - len(x) % 8, len(x)):
            s = fma32(x[i], w[i], s)
        return s

    x, w = operands(5, 7, 100, seed=0)
    pairs = [(x[r], w[o]) for r in range(5) for o in range(7)]
    assert sum(dot_fma16(a, b) != dot_fma8(a, b) for a, b in pairs) > 5
    assert sum(dot_fma16(a, b) != dot_generic8(a, b) for a, b in pairs) > 5

"""The reference engine's fault switch (a process-global, test-only symbol), for tests whose
engine runs in this process behind a server: armed for a block, always disarmed after."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

from aiobasert._ffi import load_library

FAULT_STEP = 1
"""`baseRT_ref_inject_fault`'s kind: the n-th engine step from now fails."""


@contextlib.contextmanager
def failing_step(n: int) -> Iterator[None]:
    """The n-th engine step (of any engine in this process) from now fails."""
    lib = load_library()  # the same loaded libbaseRT as the server's engines: one fault switch
    assert lib.has("baseRT_ref_inject_fault")
    assert lib._cdll.baseRT_ref_inject_fault(ctypes.c_int(FAULT_STEP), ctypes.c_int(n)) == 0
    try:
        yield
    finally:
        lib._cdll.baseRT_ref_inject_fault(ctypes.c_int(FAULT_STEP), ctypes.c_int(0))

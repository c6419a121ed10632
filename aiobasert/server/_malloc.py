"""glibc's malloc arenas in the `aiobasert serve` process.

glibc gives a thread that allocates an arena of its own (up to 8 per core) and an arena keeps
its freed memory resident for reuse. A server's threads (the engine thread, its tokenizer and
grammar workers, the compute pool, the event loop's resolver pool) are few and allocate little
once the model is loaded, so most of what their arenas hold is held, not used: two arenas keep
~3-4 MiB less resident on SmolLM2 at 1-32 streams, with the same tok/s
(bench/vs_llama_server.py; docs/benchmarks.md). Only the CLI's server applies this, before it
starts a thread: a library call never changes its host process's allocator. MALLOC_ARENA_MAX in
the environment (glibc's own knob, read at startup) wins.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["SERVER_ARENAS", "limit_malloc_arenas"]

SERVER_ARENAS = 2
_M_ARENA_MAX = -8  # malloc.h


def limit_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Cap this process's glibc malloc arenas at `arenas` (True), unless the environment sets
    MALLOC_ARENA_MAX or the C library is not glibc (False: nothing changed)."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  # glibc only: musl's mallopt is a no-op
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))

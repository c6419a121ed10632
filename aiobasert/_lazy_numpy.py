"""numpy, imported on first use and only ever seen whole.

A server that only generates text never imports numpy (~15 MiB resident): embeddings
and host-side grammars import it when they first need it, on a worker thread. Code
that merely asks "is this value a numpy scalar / array?" must therefore never import
it, and must never look at it while another thread is still importing it: during an
import, `sys.modules["numpy"]` already holds the module object, half initialized, and
`numpy.generic` raises AttributeError ("partially initialized module") in whichever
thread reads it. `loaded()` answers None until the import has completed; a value can
only be a numpy value once numpy's import has completed, so None is the right answer
for every value that exists.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

_lock = threading.Lock()
_numpy: ModuleType | None = None  # set once an import has completed; never unset


def loaded() -> ModuleType | None:
    """numpy if its import has completed (by this package or anyone), else None. Never imports,
    never blocks, never returns a partially initialized module. Any thread."""
    global _numpy
    if _numpy is not None:
        return _numpy
    module = sys.modules.get("numpy")
    if module is None:
        return None
    # importlib marks a module's spec `_initializing` from before it enters sys.modules until its
    # body has run (CPython's own "partially initialized module" check reads the same flag)
    spec = getattr(module, "__spec__", None)
    if spec is None or getattr(spec, "_initializing", False):
        return None
    _numpy = module
    return module


def load() -> ModuleType:
    """numpy, imported now if it was not yet (once: other callers wait for the first import).
    Blocks for the import (~0.1 s): call it on a worker thread, never on the event loop or the
    engine thread."""
    global _numpy
    if _numpy is not None:
        return _numpy
    with _lock:
        module = importlib.import_module("numpy")
        _numpy = module
    return module

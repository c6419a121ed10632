"""The model's bundle as the host reads it: one `ModelFile` per engine, made at configure time.

The engine reads the weights itself (libbaseRT); the host needs two things of the same file: the
tokenizer's fields (llguidance's vocabulary: `grammar.GrammarBackend.for_tokenizer`) and the final
norm weight (embeddings pooled from hidden-state taps: `embed.Embedder`). Both are handed this one
object, which parses the bundle's header once, on first use, instead of each reopening the file by
its path. First use, not configure time: parsing imports numpy and, for a 262k vocabulary, builds a
~25 MB tree, which an engine that serves neither host grammars nor tapped embeddings never pays.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy: the bundle reader imports it, on first use only
    from ..models.bundle import Bundle


class ModelFile:
    """The engine's `.base` bundle, parsed at most once (any thread: a grammar worker and the engine
    thread may ask at the same time)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._bundle: Bundle | None = None
        self.reads = 0  # headers parsed (tests count them)

    def bundle(self) -> Bundle:
        """The parsed bundle (its tensors are mapped only when one is read). Raises what
        `models.bundle.read_bundle` raises (BundleError, OSError)."""
        with self._lock:
            if self._bundle is None:
                from ..models.bundle import read_bundle

                self._bundle = read_bundle(self.path)
                self.reads += 1
            return self._bundle

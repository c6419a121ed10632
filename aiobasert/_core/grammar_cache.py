"""Compiled grammars by the digest of their source, so the same schema or tool set is
compiled once per engine, not once per request (`prepare.Preparer.grammar_of`).

Kept apart from `grammar` (which imports llguidance): the engine thread holds a cache
from the start, and a process that never constrains output never imports llguidance.
"""

from __future__ import annotations

import collections
import copy
import threading
from typing import Any, Protocol

from ..errors import AioBaseRTError


class HostGrammar(Protocol):
    """A host (llguidance) constraint: copied for each request (grammar.JsonSchemaConstraint)."""

    def copy(self) -> Any: ...


class EngineGrammar(Protocol):
    """An engine grammar handle: reset and reused (grammar.EngineGrammarConstraint)."""

    def reset(self) -> bool: ...

    def close(self) -> None: ...


class GrammarCache:
    """Compiled grammars by the digest of their source (`RequestSpec.grammar_key`), so the same
    schema or tool set is compiled once, not once per request. Bounded LRU (`entries` keys).

    * host (llguidance) grammars: a never-stepped prototype; each request gets a deep copy;
    * engine grammars (a C handle, no copy in the ABI): a finished lane's handle is reset and
      kept (`give_back`, at most `idle` per key) for the next request with that key;
    * refusals (a compile error, a compile over its time budget): the error, raised again at
      once, so a refused grammar is never compiled twice.

    `take` (intake workers) and `remember` / `refuse` (workers) and `give_back` / `close`
    (the engine thread, the only thread that frees engine handles) are thread-safe.
    """

    def __init__(self, entries: int = 64, idle: int = 4) -> None:
        self._lock = threading.Lock()
        self._entries = entries
        self._idle = idle
        self._known: collections.OrderedDict[bytes, HostGrammar | AioBaseRTError] = collections.OrderedDict()
        self._handles: collections.OrderedDict[bytes, list[EngineGrammar]] = collections.OrderedDict()

    def __contains__(self, key: bytes | None) -> bool:
        if key is None:
            return False
        with self._lock:
            return key in self._known or bool(self._handles.get(key))

    def take(self, key: bytes) -> Any:
        """A ready constraint for `key`, or None (compile it); raises the error a refused key got."""
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
                if isinstance(known, AioBaseRTError):
                    raise copy.copy(known)  # raised in several threads: one instance each
                return known.copy()
            idle = self._handles.get(key)
            if idle:
                self._handles.move_to_end(key)
                return idle.pop()
        return None

    def remember(self, key: bytes, constraint: Any) -> None:
        """After a compile: a host constraint's prototype (a copy, never stepped) is kept."""
        if hasattr(constraint, "copy"):
            self._put(key, constraint.copy())

    def refuse(self, key: bytes, error: AioBaseRTError) -> None:
        self._put(key, error)

    def _put(self, key: bytes, value: HostGrammar | AioBaseRTError) -> None:
        with self._lock:
            self._known[key] = value
            self._known.move_to_end(key)
            while len(self._known) > self._entries:
                self._known.popitem(last=False)

    def give_back(self, key: bytes, constraint: Any) -> bool:
        """Engine thread: keep a finished lane's engine grammar for the next request with `key`
        (reset to its start); False when it is not kept (the caller frees it)."""
        if not hasattr(constraint, "reset"):
            return False
        evicted: list[EngineGrammar] = []
        with self._lock:
            idle = self._handles.setdefault(key, [])
            self._handles.move_to_end(key)
            if len(idle) >= self._idle:
                return False
            if not constraint.reset():
                return False
            idle.append(constraint)
            while len(self._handles) > self._entries:
                evicted += self._handles.popitem(last=False)[1]
        for old in evicted:
            old.close()
        return True

    def close(self) -> None:
        """Engine thread: free every kept engine grammar (before the workers' handles go)."""
        with self._lock:
            handles = [h for idle in self._handles.values() for h in idle]
            self._handles.clear()
            self._known.clear()
        for handle in handles:
            handle.close()

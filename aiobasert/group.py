"""`EngineGroup`: several models in one process, one engine thread each, looked up by name.

```python
async with aiobasert.EngineGroup.open(["a.base", "chat=b.base"], keep_alive=300) as group:
    async with group.lease("chat") as engine:      # loads "chat" again if it was unloaded
        print(await engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32))
```

Each model keeps its own engine (its own thread, lanes, KV pool and prefix
cache): models never share a batch, so one model's long prompt cannot stall
another's decode. With `keep_alive` a model that has had no lease for that many
seconds is unloaded (its engine closed, memory freed) and loaded again by the
next lease, as Ollama does; a lease is a reference count, so a model is never
unloaded while a request holds it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import msgspec

from .engine import Engine
from .errors import EngineClosedError, InvalidConfigError, InvalidRequestError, UnknownModelError
from .types import EngineStats

if sys.version_info < (3, 11):  # anyio's dependency on older Pythons
    from exceptiongroup import BaseExceptionGroup

__all__ = ["EngineGroup", "ModelStats", "UnknownModelError"]

logger = logging.getLogger("aiobasert")

ModelSource = str | os.PathLike[str]


class ModelStats(msgspec.Struct, frozen=True, kw_only=True):
    """One model of a group: its load state, its traffic and, while loaded, its engine's stats."""

    name: str
    path: str
    loaded: bool
    leases: int
    """Requests holding the model now (a loaded model with leases is never unloaded)."""
    requests: int
    """Leases granted since the group opened."""
    loads: int
    unloads: int
    idle_s: float | None
    """Seconds since the last lease ended or the model loaded (None while leased or never loaded)."""
    engine: EngineStats | None
    """The engine's own stats while the model is loaded."""


class _Slot:
    """One model's state. Only touched from the group's event loop, so the plain
    counters need no lock; `lock` serializes loading and unloading."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.engine: Engine | None = None
        self.leases = 0
        self.requests = 0
        self.loads = 0
        self.unloads = 0
        self.last_release: float | None = None
        self.lock = anyio.Lock()


def _model_path(value: object) -> str:
    """A model entry's path as text; InvalidConfigError (a ValueError) for anything but str / PathLike."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidConfigError(f"a model must be a path (str or os.PathLike), not {type(value).__name__}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise InvalidConfigError(f"a model path must be text, not {type(path).__name__}")
    return path


def _parse_models(
    models: Mapping[str, ModelSource] | Iterable[ModelSource | tuple[str, ModelSource]],
) -> list[tuple[str, str]]:
    """Names for the models: the mapping's keys, `name=path` strings, (name, path) pairs or file stems."""
    pairs: list[tuple[str, str]] = []
    if isinstance(models, Mapping):
        pairs = [(str(k), _model_path(v)) for k, v in models.items()]
    else:
        if isinstance(models, (str, os.PathLike)):
            raise InvalidConfigError("models must be a list of paths (or a mapping of name -> path), not one path")
        if isinstance(models, (bytes, bytearray)) or not isinstance(models, Iterable):
            raise InvalidConfigError(
                f"models must be a list of paths (or a mapping of name -> path), not {type(models).__name__}"
            )
        for item in models:
            if isinstance(item, tuple):
                if len(item) != 2 or not isinstance(item[0], str):
                    raise InvalidConfigError(f"a (name, path) model entry needs a str name and a path, got {item!r}")
                pairs.append((item[0], _model_path(item[1])))
                continue
            text = _model_path(item)
            name, sep, path = text.partition("=")
            # "name=path"; a path that itself contains "=" can be given as (name, path)
            if sep and name and "/" not in name and os.sep not in name:
                pairs.append((name, path))
            else:
                pairs.append((Path(text).stem, text))
    if not pairs:
        raise InvalidConfigError("an EngineGroup needs at least one model")
    seen: set[str] = set()
    for name, path in pairs:
        if not name:
            raise InvalidConfigError(f"model {path!r} has an empty name")
        if name in seen:
            raise InvalidConfigError(f"two models are named {name!r}: give one an alias (name=path)")
        seen.add(name)
    return pairs


class EngineGroup:
    """Several models, one `Engine` (and engine thread) each, looked up by name.

    Open it with `async with EngineGroup.open(models, ...)`; `lease(name)`
    yields the named model's engine for the duration of a request. The first
    model is the default (`lease(None)`).
    """

    def __init__(self, slots: list[_Slot], keep_alive: float | None, engine_options: dict[str, Any]) -> None:
        self._slots = {s.name: s for s in slots}
        self._default = slots[0].name
        self._keep_alive = keep_alive
        self._options = engine_options
        self._closed = False
        self._released = anyio.Event()  # set when a lease ends: the reaper re-plans
        self._unloading: set[Engine] = set()  # engines the reaper is closing (draining) now

    @classmethod
    def open(
        cls,
        models: Mapping[str, ModelSource] | Iterable[ModelSource | tuple[str, ModelSource]],
        *,
        keep_alive: float | None = None,
        preload: bool = True,
        **engine_options: Any,
    ) -> contextlib.AbstractAsyncContextManager[EngineGroup]:
        """Open a group; use as `async with EngineGroup.open(...) as group`.

        models: paths (named by their file stem), `"name=path"` strings,
            `(name, path)` pairs, or a mapping of name -> path. Paths go to
            `Engine.open` unchanged.
        keep_alive: unload a model after this many idle seconds (no lease) and
            load it again on the next lease; None (default) keeps every model loaded.
        preload: load every model now (a bad path fails here); False loads each on first lease.
        engine_options: `Engine.open` keywords (max_batch_size, max_context, ...), for every model.
        """
        if keep_alive is not None and (
            isinstance(keep_alive, bool) or not isinstance(keep_alive, (int, float)) or not keep_alive >= 0
        ):
            raise InvalidConfigError(f"keep_alive must be None or a number of seconds >= 0, got {keep_alive!r}")
        if not isinstance(preload, bool):
            raise InvalidConfigError(f"preload must be a bool, got {preload!r}")
        # The options are checked now, not at a model's first load (which preload=False or keep_alive
        # puts off until a lease): Engine.open validates everything before anything is loaded.
        try:
            Engine.open(None, **engine_options)
        except TypeError as exc:  # an unknown keyword
            raise InvalidConfigError(f"engine option: {exc}") from None
        return cls._run(_parse_models(models), keep_alive, preload, engine_options)

    @classmethod
    @contextlib.asynccontextmanager
    async def _run(
        cls, models: list[tuple[str, str]], keep_alive: float | None, preload: bool, engine_options: dict[str, Any]
    ) -> AsyncIterator[EngineGroup]:
        slots = [_Slot(name, path) for name, path in models]  # in the event loop: anyio primitives
        group = cls(slots, keep_alive, engine_options)
        abort = True  # leaving on an error (or a cancellation) aborts in-flight streams
        body_error: BaseException | None = None
        try:
            if preload:
                for slot in slots:
                    await group._load(slot)
            async with anyio.create_task_group() as tg:
                if keep_alive is not None:
                    tg.start_soon(group._reap_idle)
                try:
                    yield group
                    abort = False
                except BaseException as exc:
                    body_error = exc
                    raise
                finally:
                    tg.cancel_scope.cancel()
                    # Close before the task group waits for the reaper: an abort also
                    # ends an unload's drain in progress, so leaving on a timeout is
                    # bounded by the engines' in-flight steps, never by a drain.
                    with anyio.CancelScope(shield=True):
                        await group.aclose(abort=abort)
        except BaseExceptionGroup as group_error:
            # The body's own exception, not wrapped by the reaper's task group.
            if body_error is not None and list(group_error.exceptions) == [body_error]:
                raise body_error from None
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await group.aclose(abort=abort)

    # ---- lookup and leases ------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Every model's name, the default first."""
        return list(self._slots)

    @property
    def default(self) -> str:
        """The model used when a request names none."""
        return self._default

    @property
    def keep_alive(self) -> float | None:
        """Idle seconds before a model is unloaded (None: never)."""
        return self._keep_alive

    @property
    def closed(self) -> bool:
        """True once `aclose()` has begun."""
        return self._closed

    def _slot(self, name: str | None) -> _Slot:
        if name is not None and not isinstance(name, str):
            kind = type(name).__name__
            raise InvalidRequestError(f"a model name must be a str (or None for the default), not {kind}")
        slot = self._slots.get(self._default if name is None else name)
        if slot is None:
            raise UnknownModelError(name, self._slots)
        return slot

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def loaded(self, name: str | None) -> Engine | None:
        """The model's engine if it is loaded now, else None (raises `UnknownModelError`)."""
        engine = self._slot(name).engine
        return engine if engine is not None and not engine.closed else None

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None = None) -> AsyncIterator[Engine]:
        """Hold model `name` (None: the default) for one request, loading it if needed.

        While any lease is held the model is not unloaded; finish the request's
        streams inside the block. Raises `UnknownModelError` for a name the
        group does not serve and `EngineClosedError` once the group is closing.
        """
        slot = self._slot(name)
        if self._closed:
            raise EngineClosedError("the engine group is closed")
        # Count the lease before any await, so the reaper never unloads a model
        # between this check and the load below.
        slot.leases += 1
        try:
            engine = slot.engine
            if engine is None or engine.closed:
                engine = await self._load(slot)
            slot.requests += 1
            yield engine
        finally:
            slot.leases -= 1
            slot.last_release = time.monotonic()
            self._released.set()

    async def _load(self, slot: _Slot) -> Engine:
        async with slot.lock:
            if self._closed:
                raise EngineClosedError("the engine group is closed")
            if slot.engine is None or slot.engine.closed:
                slot.engine = await Engine.open(slot.path, **self._options)
                slot.loads += 1
                # Idle from now: a preloaded model nobody asks for unloads after keep_alive too.
                slot.last_release = time.monotonic()
                self._released.set()
            return slot.engine

    # ---- idle unload ------------------------------------------------------------------

    async def _reap_idle(self) -> None:
        """Unload models idle for keep_alive seconds; sleeps until the next deadline or release."""
        keep_alive = self._keep_alive
        assert keep_alive is not None
        while True:
            # A fresh event before the scan: a lease ending during it wakes the sleep below.
            self._released = anyio.Event()
            now = time.monotonic()
            next_due = math.inf
            for slot in self._slots.values():
                if slot.engine is None or slot.leases or slot.last_release is None:
                    continue
                due = slot.last_release + keep_alive
                if due <= now:
                    try:
                        await self._unload(slot)
                    except Exception:  # a failed close must not take the group (and its server) down
                        logger.exception("unloading model %r failed", slot.name)
                else:
                    next_due = min(next_due, due)
            with anyio.move_on_after(next_due - time.monotonic() if next_due < math.inf else math.inf):
                await self._released.wait()

    async def _unload(self, slot: _Slot) -> None:
        if slot.leases or slot.engine is None:
            return
        with anyio.CancelScope(shield=True):  # a half-closed engine must not outlive the group
            async with slot.lock:
                # Checked again after the lock's checkpoint: a lease that came meanwhile
                # keeps the engine. Detached and closed with no await in between, so
                # nobody sees it unloaded yet open; a lease arriving later sees no engine
                # and waits on the lock for this close to finish, then loads afresh.
                if slot.leases or slot.engine is None:
                    return
                engine, slot.engine = slot.engine, None
                slot.unloads += 1
                self._unloading.add(engine)  # the group's aclose(abort=True) reaches it too
                try:
                    await engine.aclose()
                finally:
                    self._unloading.discard(engine)

    # ---- introspection and closing ----------------------------------------------------

    async def stats(self) -> dict[str, ModelStats]:
        """Per-model stats, by name (a loaded model's engine stats are read on its thread)."""
        out: dict[str, ModelStats] = {}
        now = time.monotonic()
        for slot in self._slots.values():
            engine = slot.engine
            engine_stats: EngineStats | None = None
            if engine is not None and not engine.closed:
                with contextlib.suppress(EngineClosedError):
                    engine_stats = await engine.stats()
            idle = None if slot.leases or slot.last_release is None else now - slot.last_release
            out[slot.name] = ModelStats(
                name=slot.name,
                path=slot.path,
                loaded=engine_stats is not None,
                leases=slot.leases,
                requests=slot.requests,
                loads=slot.loads,
                unloads=slot.unloads,
                idle_s=idle,
                engine=engine_stats,
            )
        return out

    async def aclose(self, *, abort: bool = False) -> None:
        """Close every engine (in-flight streams finish first unless `abort`). Idempotent."""
        self._closed = True
        for engine in [s.engine for s in self._slots.values()] + list(self._unloading):
            if engine is not None:
                await engine.aclose(abort=abort)  # on an engine an unload drains: escalates the drain

    async def __aenter__(self) -> EngineGroup:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose(abort=exc_type is not None)

    def __repr__(self) -> str:
        state = ", ".join(f"{s.name}{'' if s.engine else ' (unloaded)'}" for s in self._slots.values())
        return f"<aiobasert.EngineGroup {state}>"

"""Where engines come from and which one serves a request.

The app never opens an engine itself: it asks an `EngineProvider`, which owns
the engines' lifetimes (`lifespan`) and resolves each request's `model` field
(`resolve`) to a `ServedModel`. `SingleEngineProvider` serves one engine under
one name; a multi-model or remote provider plugs in at the same two seams.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import anyio

from ..config import EngineConfig, config_from
from ..engine import Engine
from ..errors import EngineClosedError
from .logprobs import TokenTexts

logger = logging.getLogger("aiobasert.server")

EngineFactory = Callable[[], AbstractAsyncContextManager[Engine]]
"""A zero-argument callable returning `async with`-able that yields an open Engine,
e.g. `functools.partial(Engine.open, "model.base", max_batch_size=4)`."""


class ServedModel:
    """One model as the server serves it: its public name, its engine, and the
    per-model caches the endpoints keep (token texts for logprobs)."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine
        self.texts = TokenTexts()


class EngineProvider(abc.ABC):
    """The engines behind an app. Subclass it to serve several models, or
    engines that live elsewhere; `create_app` accepts an instance."""

    @abc.abstractmethod
    def lifespan(self) -> AbstractAsyncContextManager[None]:
        """Open the engines for the app's lifetime; close (abort) them on exit."""

    @abc.abstractmethod
    def resolve(self, model: str | None) -> ServedModel:
        """The model serving a request whose `model` field is `model`. Raise
        `APIError(404, ..., param="model", code="model_not_found")` for a name
        this provider does not serve, `EngineClosedError` when it is not running."""

    @abc.abstractmethod
    def served(self) -> Sequence[ServedModel]:
        """Every model currently served (for /v1/models); empty when not running."""

    @abc.abstractmethod
    async def abort(self) -> None:
        """End every in-flight generation now and refuse new ones (shutdown has begun)."""

    @property
    def ready(self) -> bool:
        """True while every engine runs (/health)."""
        models = self.served()
        return bool(models) and not any(m.engine.closed for m in models)


class SingleEngineProvider(EngineProvider):
    """One engine from `factory`, served as `model_name` (default: the bundle's
    file stem). A request's `model` field is accepted whatever it names."""

    def __init__(self, factory: EngineFactory, *, model_name: str | None = None) -> None:
        self._factory = factory
        self._model_name = model_name
        self._model: ServedModel | None = None

    @classmethod
    def from_path(
        cls,
        model: str | os.PathLike[str] | None,
        *,
        model_name: str | None = None,
        max_batch_size: int = 8,
        max_context: int = 2048,
        config: EngineConfig | None = None,
    ) -> SingleEngineProvider:
        """Open `model` (a `.base` path; None = the default model) with these limits, or with
        `config` (then leave the limits out). The options are checked now, not at startup."""
        options = config_from(config, dict(max_batch_size=max_batch_size, max_context=max_context))
        return cls(functools.partial(Engine.open, model, config=options), model_name=model_name)

    @contextlib.asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[None]:
        async with self._factory() as engine:
            name = self._model_name or Path(engine.info.path).stem or "aiobasert"
            self._model = ServedModel(name, engine)
            logger.info("serving %s as %r", engine.info.path, name)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await engine.aclose(abort=True)

    def lifespan(self) -> AbstractAsyncContextManager[None]:
        return self._lifespan()

    def resolve(self, model: str | None) -> ServedModel:
        served = self._model
        if served is None or served.engine.closed:
            raise EngineClosedError("the engine is not running")
        return served

    def served(self) -> Sequence[ServedModel]:
        return [] if self._model is None else [self._model]

    async def abort(self) -> None:
        if self._model is not None:
            await self._model.engine.aclose(abort=True)

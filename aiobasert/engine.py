"""`Engine`: the async surface over one model served by one engine thread."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import anyio
import numpy as np

from . import _ffi
from ._wakeup import LoopWaker
from .chat import render_chat
from .engine_thread import Call, Close, Constraint, EngineConfig, EngineThread, Message, Prompt, RequestSpec
from .errors import EngineClosedError, InvalidRequestError, InvalidSamplingParamsError
from .streams import TokenStream, new_request_id
from .types import ChatMessage, Completion, EngineStats, ModelInfo, SamplingParams

if TYPE_CHECKING:
    from .tools import ChatStream, Tool, ToolChoice

T = TypeVar("T")


async def _wait_future(fut: concurrent.futures.Future[T], waker: LoopWaker) -> T:
    """Await a concurrent Future without blocking the loop or a worker thread."""
    if not fut.done():
        event = anyio.Event()
        fut.add_done_callback(lambda _f: waker.call_soon(event.set))
        await event.wait()
    return fut.result()


class Engine:
    """One model, many concurrent streams, continuous batching.

    ```python
    async with aiobasert.Engine.open("model.base") as engine:
        async for tok in engine.stream("Once upon a time", max_tokens=64):
            print(tok.text, end="")
    ```

    Every call into libbaseRT runs on the engine's own thread; the methods here
    only post messages to it and await the answers, so they never block the
    event loop. An engine belongs to the event loop that opened it.
    """

    def __init__(self, thread: EngineThread, waker: LoopWaker, info: ModelInfo) -> None:
        self._thread = thread
        self._waker = waker
        self.info = info
        self._closed = False
        self._close_lock = threading.Lock()
        self._grammar: Any = None  # aiobasert.grammar.GrammarBackend, engine thread only

    # ---- lifecycle --------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        max_batch_size: int = 8,
        max_context: int = 2048,
        prefill_chunk: int = 256,
        prefix_cache: bool = True,
        max_queue: int = 1024,
        max_buffered_tokens: int = 256,
        library: str | os.PathLike[str] | None = None,
        thread_check: bool | None = None,
    ) -> _EngineOpener:
        """Load a model; use as `async with Engine.open(...) as engine` or `await Engine.open(...)`.

        model: a `.base` bundle; None = the default model (SmolLM2-135M-Instruct,
            converted and cached on first use; see `aiobasert.models`).
        max_batch_size: concurrent lanes (sequences decoded together each step).
        max_context: tokens per lane (prompt + output), clamped to the model's window.
        prefill_chunk: prompt tokens prefilled per step across all lanes, so a long
            prompt never stalls running streams for more than one chunk.
        prefix_cache: reuse the KV of shared prompt prefixes across requests.
        max_queue: requests waiting for a lane before `EngineOverloadedError`.
        max_buffered_tokens: unread tokens per stream before its lane pauses.
        library: libbaseRT to use (default: $BASERT_LIB_PATH, the system's, the bundled one).
        thread_check: debug mode asserting that only the engine thread enters the library.
        """
        for name, value, low in (
            ("max_batch_size", max_batch_size, 1),
            ("max_context", max_context, 2),
            ("prefill_chunk", prefill_chunk, 1),
            ("max_queue", max_queue, 1),
            ("max_buffered_tokens", max_buffered_tokens, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        return _EngineOpener(
            model,
            dict(
                max_batch_size=max_batch_size,
                max_context=max_context,
                prefill_chunk=prefill_chunk,
                prefix_cache=prefix_cache,
                max_queue=max_queue,
                max_buffered_tokens=max_buffered_tokens,
            ),
            library,
            thread_check,
        )

    @classmethod
    async def _start(
        cls,
        model: str | os.PathLike[str] | None,
        limits: dict[str, Any],
        library: str | os.PathLike[str] | None,
        thread_check: bool | None,
    ) -> Engine:
        if model is None:
            from .models import default_model_path

            path = os.fspath(await anyio.to_thread.run_sync(default_model_path))
        else:
            path = os.fspath(model)
        lib = _ffi.load_library(library, thread_check=thread_check)
        waker = LoopWaker()
        thread = EngineThread(lib, EngineConfig(model_path=path, **limits), waker.call_soon)
        thread.start()
        info = await _wait_future(thread.ready, waker)
        return cls(thread, waker, info)

    async def aclose(self, *, abort: bool = False) -> None:
        """Close the engine: with `abort=False` in-flight streams finish first;
        with `abort=True` they end at once with finish_reason "aborted". Then the
        model is freed and the thread exits. A second call is a no-op."""
        with self._close_lock:
            first = not self._closed
            self._closed = True
        if first:
            self._thread.post(Close(abort=abort))
        await _wait_future(self._thread.stopped, self._waker)
        await anyio.to_thread.run_sync(self._thread.join)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Leaving on an error (or a cancellation) aborts in-flight streams.
        with anyio.CancelScope(shield=True):
            await self.aclose(abort=exc_type is not None)

    @property
    def closed(self) -> bool:
        """True once `aclose()` has been called."""
        return self._closed

    # ---- requests ---------------------------------------------------------------------

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, special: bool = True, **kwargs: Any
    ) -> TokenStream:
        """Stream a completion of `prompt` (text or token ids).

        Sampling parameters come as a `SamplingParams` or as keywords
        (`max_tokens=64, temperature=0.7, stop=["\\n\\n"]`, ...). With
        `special=True` (default) marker strings in a text prompt become control
        tokens, as in a rendered chat prompt; `special=False` keeps them text.
        """
        if not isinstance(prompt, str):
            if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
                raise InvalidRequestError(f"prompt must be str or a list of token ids, not {type(prompt).__name__}")
            prompt = [*prompt]
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.info.vocab_size:
                    raise InvalidRequestError(
                        f"prompt token {i} is {t!r}: not a token id of this model (vocab {self.info.vocab_size})"
                    )
        return self._new_stream(prompt, self._params(params, kwargs), special)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        """The whole completion at once (same arguments as `stream`)."""
        return await self.stream(prompt, params, **kwargs)

    @overload
    def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: None = None,
        tool_choice: None = None,
        parallel_tool_calls: bool = True,
        **kwargs: Any,
    ) -> TokenStream: ...

    @overload
    def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Tool | Mapping[str, Any]],
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        **kwargs: Any,
    ) -> ChatStream: ...

    def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        **kwargs: Any,
    ) -> TokenStream | ChatStream:
        """Stream the assistant's reply to `messages` with the model's chat template.

        Message contents are encoded as plain text (`baseRT_encode_pieces`), so a
        message that quotes `<|im_start|>` cannot forge a turn. `await` the
        returned stream for a `Completion`.

        With `tools` (see `aiobasert.tools`) the result is a `ChatStream` of text
        and tool-call deltas instead, awaitable for a `ChatReply` with typed
        `ToolCall`s; `tool_choice` ("auto", "none", "required" or a function name)
        and `parallel_tool_calls` are enforced by the output grammar.
        """
        if tools is not None or tool_choice is not None:
            return self.stream_chat(
                messages,
                params,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                **kwargs,
            )
        pieces = render_chat(
            self.chat_template,
            cast("Sequence[ChatMessage | Mapping[str, str]]", messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._thread.bos_token,
            eos_token=self._thread.eos_token,
        )
        return self._new_stream(pieces, self._params(params, kwargs), True)

    def stream_chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        **kwargs: Any,
    ) -> ChatStream:
        """Like `chat`, always as a `ChatStream` (text deltas, tool-call deltas);
        messages may include `tool` turns and assistant turns with `tool_calls`."""
        from .tools import open_chat_stream

        return open_chat_stream(
            self,
            messages,
            self._params(params, kwargs),
            tools=tools,
            tool_choice=tool_choice,
            parallel=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt,
        )

    @property
    def chat_template(self) -> str:
        """The model's Jinja chat template ("" when the bundle has none: ChatML is used)."""
        return self._thread.chat_template

    def _params(self, params: SamplingParams | None, kwargs: dict[str, Any]) -> SamplingParams:
        if params is not None and kwargs:
            raise InvalidSamplingParamsError("pass either a SamplingParams or keyword parameters, not both")
        if params is None:
            try:
                params = SamplingParams(**kwargs)
            except TypeError as exc:
                raise InvalidSamplingParamsError(str(exc)) from None
        elif not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(f"params must be a SamplingParams, not {type(params).__name__}")
        params.validate(self.info.vocab_size)
        return params

    def _new_stream(
        self,
        prompt: Prompt,
        params: SamplingParams,
        special: bool,
        constraint: Callable[[], Constraint] | None = None,
    ) -> TokenStream:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        spec = RequestSpec(rid=new_request_id(), prompt=prompt, params=params, parse_special=special,
                           constraint=constraint or self._constraint_for(params))
        return TokenStream(self, spec)

    def _lark_constraint(self, lark: str) -> Callable[[], Constraint]:
        """The builder of a host (llguidance) grammar constraint from a Lark grammar;
        it runs on the engine thread at intake, like `_constraint_for`'s."""

        def build() -> Constraint:
            if self._grammar is None:
                from .grammar import GrammarBackend

                self._grammar = GrammarBackend.for_bundle(self.info.path, vocab_size=self.info.vocab_size)
            constraint: Constraint = self._grammar.compile_lark(lark)
            return constraint

        return build

    def _constraint_for(self, params: SamplingParams) -> Callable[[], Constraint] | None:
        """The grammar builder of a structured-output request; it runs on the engine
        thread at intake, so a bad schema fails that request in its caller only."""
        schema = params.json_schema
        if schema is None:
            return None

        def build() -> Constraint:
            lib, model = self._thread.lib, self._thread._model
            assert model is not None  # runs on the engine thread while the model is loaded
            if lib.has("baseRT_grammar_create_from_schema") and lib.has("baseRT_grammar_fill_bitmask"):
                from .grammar import EngineGrammarConstraint

                native = EngineGrammarConstraint.create(lib, model, schema)
                if native is not None:  # the engine's own grammar where it has one
                    return native
            if self._grammar is None:  # the host backend, built once per engine, on first use
                from .grammar import GrammarBackend

                self._grammar = GrammarBackend.for_bundle(self.info.path, vocab_size=self.info.vocab_size)
            constraint: Constraint = self._grammar.compile(schema)
            return constraint

        return build

    # ---- plumbing used by streams -------------------------------------------------------

    def _submit(self, msg: Message) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        self._thread.post(msg)

    def _post(self, msg: Message) -> None:
        """Fire-and-forget (cancel, resume): fine after close too."""
        if self._thread.alive:
            self._thread.post(msg)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps and await its result."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        self._thread.post(Call(fn, done))
        return await _wait_future(fut, self._waker)

    # ---- tokenizer, embeddings, introspection ---------------------------------------------

    async def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of `text` (`special=True`: marker strings become control ids)."""
        return await self._call(lambda: self._thread.encode_text(text, special=special))

    async def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (invalid UTF-8 across the whole sequence becomes U+FFFD)."""
        ids = list(ids)
        return await self._call(lambda: self._thread.decode_ids(ids))

    async def embed(self, text: str | Sequence[int]) -> np.ndarray:
        """Mean-pooled final hidden state of `text` (float32, length dim)."""
        dim = self.info.dim

        def run() -> np.ndarray:
            ids = self._thread.encode_text(text, special=False) if isinstance(text, str) else list(text)
            if not ids:
                raise InvalidRequestError("cannot embed an empty input")
            if len(ids) > self.info.max_context:
                raise InvalidRequestError(f"input of {len(ids)} tokens exceeds the context of {self.info.max_context}")
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.info.vocab_size:
                    raise InvalidRequestError(f"{t!r} is not a token id of this model")
            return self._thread.embed(ids, dim)

        return await self._call(run)

    async def stats(self) -> EngineStats:
        """Lanes, queue and KV-pool occupancy, read on the engine thread."""
        return await self._call(self._thread.stats)

    async def evict_prefix_cache(self) -> int:
        """Drop every unlocked cached prefix; returns the KV blocks freed."""
        return await self._call(self._thread.evict_prefix_cache)

    @property
    def engine_thread_id(self) -> int | None:
        """`threading.get_ident()` of the thread that owns the model handle."""
        return self._thread.thread_id

    @property
    def models_freed(self) -> int:
        """How many times this engine freed its model handle (1 after close)."""
        return self._thread.models_freed

    def __repr__(self) -> str:
        return f"<aiobasert.Engine {self.info.path!r} lanes={self.info.max_batch_size} closed={self._closed}>"


class _EngineOpener:
    """What `Engine.open` returns: an async context manager, or awaitable."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None,
        limits: dict[str, Any],
        library: str | os.PathLike[str] | None,
        thread_check: bool | None,
    ) -> None:
        self._args = (model, limits, library, thread_check)
        self._engine: Engine | None = None

    def __await__(self) -> Generator[Any, None, Engine]:
        return Engine._start(*self._args).__await__()

    async def __aenter__(self) -> Engine:
        self._engine = await Engine._start(*self._args)
        return self._engine

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._engine is not None
        await self._engine.__aexit__(exc_type, exc, tb)

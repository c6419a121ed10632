"""`Engine`: the async surface over one model served by one engine thread."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import anyio

from . import _ffi
from . import _lazy_numpy as lazy_numpy
from ._core.cost import MAX_DECODE_IDS, measure
from ._core.intake import Tokenizer
from ._core.protocol import (
    Ask,
    Call,
    Cancel,
    Close,
    Decode,
    Embed,
    Encode,
    EvictPrefixCache,
    Prompt,
    Query,
    Release,
    RequestSpec,
    Reserve,
    Stats,
    Submit,
    ThoughtSpec,
)
from ._core.wakeup import LoopWaker
from .batcher import current_client
from .chat import render_chat
from .config import EngineConfig, SpeculationConfig, SpeculationMethod, config_from, speculation_from
from .engine_thread import EngineThread
from .errors import (
    ContextLengthExceededError,
    EngineClosedError,
    InvalidConfigError,
    InvalidRequestError,
    InvalidSamplingParamsError,
)
from .streams import TokenStream, new_request_id
from .types import (
    CONSTRAINT_FIELDS,
    Capabilities,
    ChatMessage,
    Completion,
    Dtype,
    EngineStats,
    KVCacheDtype,
    ModelInfo,
    SamplingParams,
)

if TYPE_CHECKING:
    import numpy as np

    from .choices import Choices
    from .reasoning import ReasoningFormat, Thinking
    from .tools import ChatReply, ChatStream, ChatTurn, Tool, ToolChoice, ToolFormat

T = TypeVar("T")


_CANCELLED_OPEN_WAIT = 120.0
"""Seconds a cancelled or failed Engine.open waits for its load to stop: one phase of it (a large model's
weights are the longest), which cannot be interrupted mid-way."""


async def _wait_future(fut: concurrent.futures.Future[T], waker: LoopWaker) -> T:
    """Await a concurrent Future without blocking the loop or a worker thread."""
    if not fut.done():
        event = anyio.Event()
        fut.add_done_callback(lambda _f: waker.call_soon(event.set))
        await event.wait()
    return fut.result()


class _Port:
    """The narrow `StreamHost` a stream talks to: its engine's thread, loop and state."""

    __slots__ = ("closed", "thread", "waker")

    def __init__(self, thread: EngineThread, waker: LoopWaker) -> None:
        self.thread = thread
        self.waker = waker
        self.closed = False

    def submit(self, msg: Submit) -> None:
        self.waker.check("this engine's stream")
        if self.closed:
            raise EngineClosedError("the engine is closed")
        self.thread.post(msg)

    def cancel(self, rid: str) -> None:
        if self.thread.alive:
            self.thread.post(Cancel(rid))

    def check_loop(self) -> None:
        self.waker.check("this engine's stream")


def _output_constraint(params: SamplingParams) -> dict[str, Any]:
    """`check_schema_and_tools`'s arguments for the output constraint `params` sets, if any."""
    for name in CONSTRAINT_FIELDS:
        if getattr(params, name) is not None:
            return {"json_schema": getattr(params, name), "field": name}
    return {"json_schema": None}


def _reclaim(thread: EngineThread) -> None:
    """Finalizer of an Engine dropped without aclose(): end its thread and free
    its model. Only posts to the thread's queue (no loop calls: a finalizer may
    run in any thread, or after the loop is gone)."""
    if thread.alive:
        thread.post(Close(abort=True))


class _QueueReservation:
    """Queue places held for requests about to be submitted together (`Engine._reserve`).

    `submit(streams)` gives back as many places and queues the streams in the same breath
    (no other request can be posted in between), so none of them is refused for want of
    room; `release()` (or leaving a `with` block) gives back the places not used."""

    __slots__ = ("__weakref__", "_finalizer", "_left", "_thread")

    def __init__(self, thread: EngineThread, count: int) -> None:
        self._thread = thread
        self._left = [count]  # shared with the finalizer, which must not hold self
        self._finalizer = weakref.finalize(self, _QueueReservation._give_back, thread, self._left)

    @property
    def left(self) -> int:
        """Places held and not used yet."""
        return self._left[0]

    @staticmethod
    def _give_back(thread: EngineThread, left: list[int], count: int | None = None) -> None:
        count = left[0] if count is None else min(count, left[0])
        if count > 0 and thread.alive:
            left[0] -= count
            thread.post(Release(count))

    def take(self, count: int) -> None:
        """Give back `count` places for requests the caller posts right after, before its
        next `await` (e.g. `await engine.embed(x)` posts before it first waits)."""
        self._give_back(self._thread, self._left, count)

    def submit(self, streams: Sequence[TokenStream]) -> None:
        """Queue `streams` into held places (those beyond them are queued as any request)."""
        self.take(len(streams))
        for stream in streams:
            stream.submit()

    def release(self) -> None:
        """Give back every place not used (idempotent)."""
        self._give_back(self._thread, self._left)

    def __enter__(self) -> _QueueReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Engine:
    """One model, many concurrent streams, continuous batching.

    ```python
    async with aiobasert.Engine.open("model.base") as engine:
        async for tok in engine.stream("Once upon a time", max_tokens=64):
            print(tok.text, end="")
    ```

    Every call into libbaseRT runs on the engine's own thread; the methods here
    only post messages to it and await the answers, so they never block the
    event loop. An engine belongs to the event loop that opened it: from any
    other loop or thread it raises `WrongEventLoopError` at once. An engine
    dropped without `aclose()` is reclaimed (thread ended, model freed) when
    it is garbage-collected.
    """

    def __init__(self, thread: EngineThread, waker: LoopWaker, info: ModelInfo) -> None:
        self._thread = thread
        self._waker = waker
        self._port = _Port(thread, waker)
        self.info = info
        self._abort_posted = False
        self._close_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _reclaim, thread)

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
        prefix_cache_mb: int | None = None,
        max_queue: int = 1024,
        library: str | os.PathLike[str] | None = None,
        thread_check: bool | None = None,
        dtype: Dtype = "auto",
        kv_cache_dtype: KVCacheDtype = "auto",
        grammar_backend_at_open: bool = True,
        chat_template: str | None = None,
        speculation: SpeculationConfig | SpeculationMethod | None = None,
        config: EngineConfig | None = None,
    ) -> _EngineOpener:
        """Load a model; use as `async with Engine.open(...) as engine` or `await Engine.open(...)`.

        model: a `.base` bundle, a `.gguf` of a family the engine runs (converted into the cache on
            first use, then reused), or a cached model's name (`aiobasert list`);
            None = the default model (SmolLM2-135M-Instruct, fetched, converted and
            cached on first use; see `aiobasert.models.cache`).
        max_batch_size, max_context, prefill_chunk, prefix_cache, prefix_cache_mb, max_queue, library, thread_check,
            dtype, kv_cache_dtype, grammar_backend_at_open, chat_template: the engine's options, as the fields
            of `EngineConfig` (which documents each); `library` may be any path.
        speculation: speculative decoding (docs/speculative.md): a `SpeculationConfig` (a draft
            model: `SpeculationConfig(method="draft", draft_model=PATH)`), "ngram" (its defaults),
            or None (off).
        config: all of those in one `EngineConfig` (then leave the keywords out: one given as
            well is refused). `engine.config` is the config the engine was opened with.

        Every option is checked before anything is loaded (`InvalidConfigError` naming it).
        """
        for name, path in (("model", model), ("library", library)):
            if path is not None and not isinstance(path, (str, os.PathLike)):
                kind = type(path).__name__
                raise InvalidConfigError(f"{name} must be a path (str or os.PathLike) or None, not {kind}")
            if path is not None and not isinstance(os.fspath(path), str):
                raise InvalidConfigError(f"{name} must be a text path, not {type(os.fspath(path)).__name__}")
        options = dict(
            max_batch_size=max_batch_size,
            max_context=max_context,
            prefill_chunk=prefill_chunk,
            prefix_cache=prefix_cache,
            prefix_cache_mb=prefix_cache_mb,
            max_queue=max_queue,
            library=library,
            thread_check=thread_check,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            grammar_backend_at_open=grammar_backend_at_open,
            chat_template=chat_template,
            speculation=speculation_from(speculation),
        )
        return _EngineOpener(model, config_from(config, options))

    @classmethod
    async def _start(cls, model: str | os.PathLike[str] | None, config: EngineConfig) -> Engine:
        from .models.cache import resolve_model  # None = the demo model; a GGUF is converted into the cache once

        path = os.fspath(await anyio.to_thread.run_sync(lambda: resolve_model(model, dtype=config.dtype)))
        lib = _ffi.load_library(config.library, thread_check=config.thread_check)
        waker = LoopWaker()
        thread = EngineThread(lib, path, config, waker.call_soon)
        thread.start()
        try:
            info = await _wait_future(thread.ready, waker)
        except BaseException:
            # Cancelled (or failed) while loading: nobody will ever hold this engine. The load stops at
            # its next phase and frees what it built; the open waits for that (shielded: a retry loop
            # must not stack loads, nor trio's work outlive its scope), within a bound, past which the
            # thread still ends alone.
            thread.cancel_load()
            thread.post(Close(abort=True))
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCELLED_OPEN_WAIT):
                await _wait_future(thread.stopped, waker)
                await anyio.to_thread.run_sync(thread.join)
            raise
        return cls(thread, waker, info)

    async def aclose(self, *, abort: bool = False) -> None:
        """Close the engine and wait until its thread has exited and the model is freed.

        `abort=False` (drain): no new requests; running and queued requests run
        to their own end (stop, length or EOS). A drain never waits on a reader:
        lanes whose stream is gone or closed are cancelled, and no lane ever
        pauses for a slow reader (its tokens are buffered). `abort=True`: every
        in-flight stream ends at once with finish_reason "aborted". Calling
        `aclose(abort=True)` after (or during) a drain escalates it; other
        repeated calls just wait for the close. Must be awaited in the engine's
        own event loop.
        """
        self._waker.check()
        with self._close_lock:
            post = not self._port.closed or (abort and not self._abort_posted)
            self._port.closed = True
            self._abort_posted = self._abort_posted or abort
        if post:
            self._thread.post(Close(abort=abort))
        await _wait_future(self._thread.stopped, self._waker)
        self._finalizer.detach()
        await anyio.to_thread.run_sync(self._thread.join)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Leaving normally drains; leaving on an error aborts in-flight streams.
        # A drain interrupted by a cancellation (a timeout around the block)
        # escalates to an abort, which ends promptly: close always returns.
        if exc_type is None:
            try:
                await self.aclose()
                return
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.aclose(abort=True)
                raise
        with anyio.CancelScope(shield=True):
            await self.aclose(abort=True)

    @property
    def capabilities(self) -> Capabilities:
        """What this engine can do (`info.capabilities`): asked of the library and the model once,
        at open."""
        return self.info.capabilities

    @property
    def config(self) -> EngineConfig:
        """The options this engine was opened with (`info` says what it serves)."""
        return self._thread.cfg

    @property
    def closed(self) -> bool:
        """True once `aclose()` has been called."""
        return self._port.closed

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
            prompt = self._token_ids(prompt, "prompt", self.info.max_context)
        return self._new_stream(prompt, self._params(params, kwargs), special)

    def _token_ids(self, ids: object, what: str, limit: int | None = None) -> list[int]:
        """A list of this model's token ids (numpy integers accepted), or InvalidRequestError; more
        than `limit` ids are refused before any of them is read (ContextLengthExceededError for a prompt)."""
        ids = self._id_sequence(ids, what, limit)
        numpy = lazy_numpy.loaded()
        out = [int(t) if numpy is not None and isinstance(t, numpy.integer) else t for t in ids]
        vocab = self.info.vocab_size
        for i, t in enumerate(out):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"{what} token {i} is {t!r}: not a token id of this model (vocab {vocab})")
        return out  # type: ignore[return-value]  # every item was checked to be an int

    @staticmethod
    def _id_sequence(ids: object, what: str, limit: int | None) -> Sequence[object]:
        """`ids` if it is a sequence of at most `limit` items (not read yet), or InvalidRequestError."""
        numpy = lazy_numpy.loaded()  # numpy values exist only once it is imported (types.is_numpy_scalar)
        sequences = (Sequence,) if numpy is None else (Sequence, numpy.ndarray)
        if isinstance(ids, (str, bytes, bytearray, memoryview)) or not isinstance(ids, sequences):
            raise InvalidRequestError(f"{what} must be str or a list of token ids, not {type(ids).__name__}")
        if limit is not None and len(ids) > limit:
            if what == "prompt":
                raise ContextLengthExceededError(len(ids), 1, limit)
            if what == "embed input":  # as the engine thread words it for a tokenized text
                raise InvalidRequestError(f"input of {len(ids)} tokens exceeds the context window of {limit} tokens")
            raise InvalidRequestError(f"{what} of {len(ids)} token ids exceeds the limit of {limit}")
        return ids

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
        continue_final_message: bool = False,
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
        continue_final_message: bool = False,
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
        continue_final_message: bool = False,
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

        Either way the reply reads the same: `.text` (a `ChatReply`'s `content`),
        `.finish_reason`, `.usage`, `.timing`, `.request_id`, and what the stream
        yields has `.text` too (a `Token`, a `TextDelta`).

        `continue_final_message`: the last message is an assistant turn the model goes on
        writing (a prefill, as vLLM's option and Anthropic's final assistant turn): no generation
        prompt, the prompt cut right after its text; the reply holds only what follows.
        """
        if tools is not None or tool_choice is not None:
            return self.stream_chat(
                messages,
                params,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                **kwargs,
            )
        pieces = render_chat(
            self.chat_template,
            cast("Sequence[ChatMessage | Mapping[str, str]]", messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.info.bos_token,
            eos_token=self.info.eos_token,
            continue_final_message=continue_final_message,
        )
        return self._new_stream(pieces, self._params(params, kwargs), True)

    def stream_chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        thinking: bool | Thinking | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ChatStream:
        """Like `chat`, always as a `ChatStream` (text deltas, tool-call deltas, and a reasoning
        model's thought as `ReasoningDelta`s: aiobasert.reasoning); messages may include `tool`
        turns, assistant turns with `tool_calls`, and their `reasoning_content` (given to the
        template, which renders or drops it).

        thinking: True / False (the template's `enable_thinking`), or a `Thinking` (with a token
            budget, and whether stop strings match inside the thought); None: the template's default.
            Refused (`InvalidRequestError`) for a model that does not reason or a template without the knob.
            With a `json_schema` or tools the thought runs free and the grammar starts after it.
        chat_template_kwargs: more variables for the chat template (each one it reads; others are refused)."""
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
            raise InvalidRequestError(f"tools must be a list of tools, not {type(tools).__name__}")
        from .tools import check_schema_and_tools

        checked = self._params(params, kwargs)
        check_schema_and_tools(bool(tools), **_output_constraint(checked))  # refused before the render is paid
        turn = self._prepare_chat(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            thinking=thinking,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self._stream_turn(turn, checked)

    def _prepare_chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        thinking: bool | Thinking | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatTurn:
        """`messages` rendered and constrained once, as `stream_chat` does, into a `ChatTurn` that
        `_stream_turn` streams any number of times: n replies to one conversation render it once.

        With this model's chat template, tokens and tool-call format (`tool_format`); `tools`,
        `tool_choice` and `parallel_tool_calls` as in `chat`. This is the request-sized part of a
        chat (every message and tool is rendered, the call grammar written), and it touches no
        engine state and no event loop: a server runs it in a worker thread, where it delays only
        its own request. Raises `InvalidRequestError` for a bad message, tool or `tool_choice`, or
        a `thinking` / `chat_template_kwargs` the model's template cannot take."""
        from .reasoning import Thinking
        from .tools import prepare_chat_turn

        if not isinstance(parallel_tool_calls, bool):  # "no" is truthy: it would have allowed several calls
            raise InvalidRequestError(f"parallel_tool_calls must be a bool, not {type(parallel_tool_calls).__name__}")
        return prepare_chat_turn(
            self.chat_template,
            messages,
            tool_format=self.tool_format,
            tools=tools,
            tool_choice=tool_choice,
            parallel=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.info.bos_token,
            eos_token=self.info.eos_token,
            reasoning=self.reasoning_format,
            thinking=Thinking.of(thinking),
            template_kwargs=chat_template_kwargs,
            special_tokens=self._thread.loaded.special_tokens,
            continue_final_message=continue_final_message,
        )

    def _stream_turn(self, turn: ChatTurn, params: SamplingParams | None = None, **kwargs: Any) -> ChatStream:
        """A new stream of the reply to a prepared `turn` (`_prepare_chat`), under `params` or
        keyword parameters (as `chat`; checked here): a `ChatStream`, queued when it is first
        iterated or awaited (or at once with `.tokens.submit()`). Call it once per reply wanted.
        A turn with tools cannot also take an output constraint (`json_schema`, `regex`, `choice`, `grammar`:
        `InvalidRequestError`)."""
        from .tools import ChatStream, check_schema_and_tools

        checked = self._params(params, kwargs)
        check_schema_and_tools(turn.lark is not None, **_output_constraint(checked))  # a turn with tools has a grammar
        thought = turn.thought
        if thought is not None and not (
            turn.lark is not None
            or checked.constrained
            or thought.budget is not None
            or (checked.stop and not thought.stop_in_thought)
        ):
            thought = None  # nothing to gate: the thought runs as any text (no grammar path to pay)
        tokens = self._new_stream(turn.pieces, checked, True, turn.lark, turn.structural_tag, thought)
        return ChatStream(
            tokens,
            parse_calls=turn.parse_calls,
            forced=turn.forced,
            tool_format=turn.tool_format,
            reasoning=turn.reasoning,
            open_at_start=turn.open_at_start,
        )

    def stream_n(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None, *, n: int = 1, **kwargs: Any
    ) -> Choices[Completion]:
        """n samples of each of `prompts` (texts or token-id lists) as one request: a `Choices`
        (`aiobasert.choices`) whose `async for` yields every choice's tokens with its index (prompt
        p's sample i is choice `p * n + i`) and whose `await` gives the `Completion`s. Every
        choice's queue place is reserved at once (all or none), each prompt prefilled once, sample i
        seeded `seed + i`; the first choice that fails cancels the others and raises. Parameters as
        in `stream`, checked here."""
        from .choices import Choices, check_n

        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts must be a non-empty list of prompts (texts or token-id lists)")
        checked = self._params(params, kwargs)
        check_n(n)
        texts = [p if isinstance(p, str) else self._token_ids(p, "prompt", self.info.max_context) for p in prompts]
        return Choices(
            lambda p, sample: self._new_stream(texts[p], sample, True), len(texts), checked, n, **self._choices_host()
        )

    async def generate_n(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, n: int, **kwargs: Any
    ) -> list[Completion]:
        """n completions of `prompt` (`stream_n` of one prompt, awaited whole)."""
        return await self.stream_n([prompt], params, n=n, **kwargs)

    def stream_chat_n(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        n: int,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        thinking: bool | Thinking | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Choices[ChatReply]:
        """n replies to `messages` as one request, as `stream_n` does for a prompt: a `Choices` whose
        events carry each reply's text and tool-call deltas and whose `await` gives the `ChatReply`s.
        The conversation is rendered and its tool grammar written once, here, in the caller (every
        message and tool: request-sized, touching no engine state and no event loop, so a server
        may call this in a worker thread); tools, `thinking` and `chat_template_kwargs` as in `stream_chat`."""
        from .choices import Choices, check_n
        from .tools import check_schema_and_tools

        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
            raise InvalidRequestError(f"tools must be a list of tools, not {type(tools).__name__}")
        checked = self._params(params, kwargs)
        check_n(n)
        check_schema_and_tools(bool(tools), **_output_constraint(checked))  # refused before the render is paid
        turn = self._prepare_chat(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            thinking=thinking,
            chat_template_kwargs=chat_template_kwargs,
        )
        return Choices(lambda _p, sample: self._stream_turn(turn, sample), 1, checked, n, **self._choices_host())

    async def chat_n(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        n: int,
        continue_final_message: bool = False,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        thinking: bool | Thinking | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[ChatReply]:
        """n replies to `messages` (`stream_chat_n`, awaited whole)."""
        choices = self.stream_chat_n(
            messages,
            params,
            n=n,
            continue_final_message=continue_final_message,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            thinking=thinking,
            chat_template_kwargs=chat_template_kwargs,
            **kwargs,
        )
        return await choices

    def _choices_host(self) -> dict[str, Any]:
        """What a `Choices` needs of this engine: its reservation, how many requests it holds at
        once (lanes and queue), and whether a prefill lands in a prefix cache."""
        return {
            "reserve": self._reserve,
            "room": self.info.max_batch_size + self.config.max_queue,
            "prefix_cache": self.info.prefix_cache,
        }

    @property
    def chat_template(self) -> str:
        """The Jinja chat template chats are rendered with: `EngineConfig.chat_template` where given,
        else the model's own; for a bundle without one, its family's (Gemma, Llama 3,
        else ChatML: aiobasert.chat.default_template), known by the vocabulary's special tokens."""
        return self._thread.chat_template

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        """How this model marks its thought, known from its chat template and special tokens
        (aiobasert.reasoning: `<think>` tags for Qwen3, QwQ, DeepSeek-R1, SmolLM3); None: it does not reason."""
        from .reasoning import reasoning_format_for

        return reasoning_format_for(self.chat_template, self._thread.loaded.special_tokens)

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls, chosen from its chat template
        (aiobasert.tools: Hermes `<tool_call>` by default, Llama 3's bare JSON)."""
        from .tools import tool_format_for

        return tool_format_for(self.chat_template)

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
        params = params.normalized()
        params.validate(self.info.vocab_size)
        return params

    def _new_stream(
        self,
        prompt: Prompt,
        params: SamplingParams,
        special: bool,
        lark: str | None = None,
        structural_tag: str | None = None,
        thought: ThoughtSpec | None = None,
    ) -> TokenStream:
        """lark: a Lark grammar (llguidance's dialect) constraining the output, e.g.
        the tool-call grammar of `aiobasert.tools`; structural_tag: the same contract
        as an xgrammar structural tag (JSON text), which the engine's own grammar
        backend builds where it can (else `lark` is used). Both are compiled while
        the request is prepared (`_core/prepare.py`, on the intake workers, off the engine
        thread), so a bad grammar fails this request in its caller only. thought: a
        reasoning model's thought, gated on the engine thread (`_core/thought.py`)."""
        if self._port.closed:
            raise EngineClosedError("the engine is closed")
        spec = RequestSpec(
            rid=new_request_id(),
            prompt=prompt,
            params=params,
            parse_special=special,
            lark=lark,
            structural_tag=structural_tag,
            thought=thought,
            client=current_client(),
            cost=measure(prompt, params, lark, structural_tag),
        )
        return TokenStream(self._port, spec, self)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps and await its result."""
        result: T = await self._round_trip(lambda done: Call(fn, done))
        return result

    async def _ask(self, query: Query) -> Any:
        """Ask the engine thread `query` between two steps and await the answer."""
        return await self._round_trip(lambda done: Ask(query, done))

    async def _round_trip(self, message: Callable[[Callable[[Any, BaseException | None], None]], Call | Ask]) -> Any:
        """Post message(done) to the engine thread and await what `done` is given."""
        self._waker.check()
        if self._port.closed:
            raise EngineClosedError("the engine is closed")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        self._thread.post(message(done))
        return await _wait_future(fut, self._waker)

    # ---- tokenizer, embeddings, introspection ---------------------------------------------

    async def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of `text` (`special=True`: marker strings become control ids); a text of more
        than 1,048,576 tokens is refused with `InvalidRequestError` (its ids would cost ~36 bytes each)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"encode takes a str, not {type(text).__name__}")
        # On a tokenizer worker, never the engine thread: a huge text must not pause the streams; the
        # list this returns is built there (the C call fills an array)
        ids: list[int] = await self._on_worker(
            lambda tok: tok.encode_list(text, special=special), len(text), Encode(text, special)
        )
        return ids

    async def _on_worker(self, job: Callable[[Tokenizer], T], cost: int, fallback: Query) -> T:
        """job(tokenizer) on an intake worker, in the lane for `cost` (never on the engine thread); an
        engine without a tokenizer-only handle answers `fallback` between two steps instead."""
        self._waker.check()
        if self._port.closed:
            raise EngineClosedError("the engine is closed")
        intake = self._thread.intake
        if intake is None:
            answer: T = await self._ask(fallback)
            return answer
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        intake.submit(job, done, grammar=False, cost=cost)
        return await _wait_future(fut, self._waker)

    async def count_chat_tokens(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> int:
        """The prompt tokens `stream_chat` would prefill for this chat (rendered with its tools and
        `tool_choice`, as it would be), without running it: Anthropic's `count_tokens`. The render
        runs in a worker thread (it is request-sized), the tokenizing on a tokenizer worker."""
        import anyio.to_thread

        def render() -> list[tuple[str, bool]]:
            return self._prepare_chat(
                messages,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            ).pieces

        pieces = await anyio.to_thread.run_sync(render)
        if self._thread.intake is None:  # an engine without a tokenizer-only handle: piece by piece
            counts = [len(await self._ask(Encode(text, not content))) for text, content in pieces]
            return sum(counts)
        count: int = await self._on_worker(  # counted whole, past the context window too
            lambda tok: len(tok.encode_pieces(pieces)), sum(len(t) for t, _ in pieces), Encode("", False)
        )
        return count

    async def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (invalid UTF-8 across the whole sequence becomes U+FFFD).

        A stream's text is exactly this decode of its token ids (when no stop
        string or stop token cut it)."""
        if self._thread.intake is None:  # an engine without a tokenizer-only handle: between two steps
            text: str = await self._ask(Decode(self._token_ids(ids, "decode input", MAX_DECODE_IDS)))
            return text
        # Counted here, before any id is read; read, checked and decoded on a tokenizer worker (a costly
        # lane for a long one), never on the loop or the engine thread: a million ids pause no stream.
        counted = self._id_sequence(ids, "decode input", MAX_DECODE_IDS)
        tolist = getattr(counted, "tolist", None)  # a numpy array: its Python ints in one C call
        snapshot = tolist() if callable(tolist) else list(counted)  # the caller may change ids meanwhile
        text = await self._on_worker(
            lambda tok: tok.decode(self._token_ids(snapshot, "decode input")), len(snapshot), Decode([])
        )
        return text

    async def embed(self, text: str | Sequence[int]) -> np.ndarray:
        """Mean-pooled final hidden state of `text` (float32, length dim): `baseRT_embed`'s result.

        The input is fed in chunks within the per-step prefill budget, next to
        the running streams (which keep getting a token every step), and the
        final-normed hidden state is pooled from the engine's hidden-state taps;
        the result matches `baseRT_embed` up to the taps' f16 rounding. An engine
        without taps (or `AIOBASERT_EMBED_TAPS=0`) runs one `baseRT_embed` call
        between two steps instead. An embedding takes a lane and is admitted like
        any request (docs/fairness.md; `EngineOverloadedError` past `max_queue`).
        Cancelling the call frees its lane; closing the engine with `abort=True`
        ends it with `EngineClosedError`, a drain lets it finish."""
        if isinstance(text, str):
            source: str | list[int] = text
        else:
            source = self._token_ids(text, "embed input", self.info.max_context)
        self._waker.check()
        if self._port.closed:
            raise EngineClosedError("the engine is closed")
        if lazy_numpy.loaded() is None:  # the pooling needs it: imported here, not on the engine thread
            await anyio.to_thread.run_sync(lazy_numpy.load)  # (~0.1 s there stalls every stream)
        fut: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()

        def done(result: Any, error: BaseException | None) -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        rid = new_request_id()
        self._thread.post(Embed(rid, source, done, current_client()))
        try:
            return await _wait_future(fut, self._waker)
        except BaseException:
            self._port.cancel(rid)  # cancelled or timed out: free its lane (a no-op once it ended)
            raise

    async def embed_batch(self, inputs: Sequence[str | Sequence[int]]) -> list[np.ndarray]:
        """`embed` of each of `inputs`, as one request: the queue's room for all of them is taken
        at once (all or none: `EngineOverloadedError` before any is queued), they are queued
        together, and the first that fails cancels the others and raises (as `Choices` does)."""
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence) or not inputs:
            raise InvalidRequestError("inputs must be a non-empty list of texts or token-id lists")
        vectors: list[np.ndarray | None] = [None] * len(inputs)
        errors: list[Exception] = []
        places = await self._reserve(len(inputs)) if len(inputs) > 1 else None

        async def one(i: int, scope: anyio.CancelScope) -> None:
            try:
                if places is not None:
                    places.take(1)  # its place goes back just as `embed` posts it (before it first waits)
                vectors[i] = await self.embed(inputs[i])
            except Exception as exc:
                errors.append(exc)
                scope.cancel()  # the others' `embed` calls are cancelled: their lanes are freed

        with places if places is not None else contextlib.nullcontext():
            async with anyio.create_task_group() as tg:
                for i in range(len(inputs)):
                    tg.start_soon(one, i, tg.cancel_scope)
        if errors:
            raise errors[0]
        return [v for v in vectors if v is not None]

    async def _reserve(self, count: int) -> _QueueReservation:
        """Hold `count` queue places for requests about to be submitted together (n choices of
        one prompt, a batch), all or none: `EngineOverloadedError` at once, before anything is
        queued or paid for, when the queue has no room for all of them now. Submit the streams
        with `_QueueReservation.submit`; release the rest (`with` block) when done."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidRequestError(f"count must be a positive int, got {count!r}")
        self._waker.check()
        if self._port.closed:
            raise EngineClosedError("the engine is closed")
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        thread, waiting = self._thread, [True]

        def done(result: Any, error: BaseException | None) -> None:  # on the loop
            if error is not None:
                fut.set_exception(error)
            elif not waiting[0]:  # the caller left (cancelled) before the places came: give them back
                thread.post(Release(count))
            else:
                fut.set_result(result)

        thread.post(Ask(Reserve(count), done))
        try:
            await _wait_future(fut, self._waker)
        except BaseException:
            waiting[0] = False
            if fut.done() and fut.exception() is None:
                thread.post(Release(count))
            raise
        return _QueueReservation(thread, count)

    async def stats(self) -> EngineStats:
        """Lanes, queue and KV-pool occupancy, read on the engine thread."""
        stats: EngineStats = await self._ask(Stats())
        return stats

    async def evict_prefix_cache(self) -> int:
        """Drop every unlocked cached prefix; returns the KV blocks freed (the target's: a draft
        model's cache, speculation method="draft", is emptied too, its blocks not counted)."""
        evicted: int = await self._ask(EvictPrefixCache())
        return evicted

    def __repr__(self) -> str:
        return f"<aiobasert.Engine {self.info.path!r} lanes={self.info.max_batch_size} closed={self._port.closed}>"


class _EngineOpener:
    """What `Engine.open` returns: an async context manager, or awaitable."""

    def __init__(self, model: str | os.PathLike[str] | None, config: EngineConfig) -> None:
        self._model = model
        self._config = config
        self._engine: Engine | None = None

    def __await__(self) -> Generator[Any, None, Engine]:
        return Engine._start(self._model, self._config).__await__()

    async def __aenter__(self) -> Engine:
        self._engine = await Engine._start(self._model, self._config)
        return self._engine

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._engine is not None
        await self._engine.__aexit__(exc_type, exc, tb)

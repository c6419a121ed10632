"""`Choices`: the n samples of each of a request's prompts, run as one request.

OpenAI's `n` (and a completions prompt list) as one parent request with a child stream per
choice, in the spirit of vLLM's `ParentRequest` and llama.cpp's parent/child slots. One
`Choices`:

- reserves queue places for every child at once, all or none (`EngineOverloadedError` when
  the queue has no room for all of them now; nothing is queued then);
- prefills each prompt once: the engine publishes a finished lane's KV to its prefix cache,
  so a one-token greedy request runs the prompt first and the n samples, submitted together
  right after, each seed their sequence from it (a prefix match always leaves the last prompt
  token to prefill). With the prefix cache off, or a prompt of one page or less, the samples
  simply prefill the prompt each;
- starts sample i of a prompt with seed `seed + i` (sample 0 keeps the request's seed; with no
  seed, each sample draws its own);
- merges the children's events as they come, each with its choice index (prompt-major:
  prompt p's sample i is choice `p * n + i`), and sums their usage, each prompt counted once;
- has one failure rule: the first child that fails cancels its siblings (their lanes and queue
  places are freed at once) and that error is raised, as itself, to the reader. Cancelling
  the reader (or closing the `Choices`) cancels every child.

```python
replies = await engine.chat_n(messages, SamplingParams(max_tokens=32, seed=1), n=4)
async for event in engine.stream_n(["Once upon a time"], max_tokens=32, n=4):
    print(event.index, event.token.text if event.token else "<end>")
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

import anyio
import msgspec

from .batcher import client_scope, current_client
from .errors import InvalidRequestError, StreamBusyError
from .streams import TokenStream, new_request_id
from .tools import ChatDelta, ChatStream
from .types import SamplingParams, Token, Usage

__all__ = ["MAX_N", "ChoiceEvent", "Choices", "sample_params"]

R = TypeVar("R")

MAX_N = 16
"""The most samples of one prompt a request may ask for."""


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample i's parameters: its own seed stream (`seed + i`; sample 0 keeps the request's)."""
    if params.seed is None or i == 0:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + i) % 2**63)


def check_n(n: object) -> int:
    """`n`, or InvalidRequestError when it is not an int in [1, MAX_N]."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    return n


def _warm(params: SamplingParams) -> SamplingParams:
    """The prefill request's parameters: one greedy token, nothing that could refuse or slow it."""
    return msgspec.structs.replace(
        params, max_tokens=1, temperature=0.0, logprobs=False, top_logprobs=0, stop=None, logit_bias=None
    )


class Places(Protocol):
    """Queue places held for the children (the engine's reservation)."""

    def submit(self, streams: Sequence[TokenStream]) -> None: ...

    def release(self) -> None: ...


class ChoiceEvent(msgspec.Struct, frozen=True):
    """One event of a `Choices`: choice `index` produced `token`, or ended (`token` None)."""

    index: int
    """The choice: prompt p's sample i is `p * n + i`."""
    token: Token | None
    """The token; None: the choice has ended (`Choices.streams[index].final` says how)."""
    deltas: list[ChatDelta] = []
    """A chat choice's text and tool-call deltas that this token completed (at its end: those held
    back until then); empty for a completion."""


class _Iteration:
    """What `async for` iterates: cancels every choice when the loop is left early (as a
    `TokenStream`'s iteration does). The loop holds this object, not the `Choices`, so a `break` or
    an exception out of the loop body, or a cancel of the reader, drops it at once and its
    `__del__` cancels the children; a failure of a child cancels its siblings before it is raised."""

    __slots__ = ("__weakref__", "_choices", "_done")

    def __init__(self, choices: Choices[Any]) -> None:
        self._choices = choices
        self._done = False

    def __aiter__(self) -> _Iteration:
        return self

    async def __anext__(self) -> ChoiceEvent:
        try:
            return await self._choices._next()
        except StopAsyncIteration:
            self._done = True
            raise
        except StreamBusyError:  # a second reader: nothing to cancel for the rightful one
            self._done = True
            raise
        except BaseException:
            self._done = True
            self._choices._cancel()  # the first failure (or a cancel while waiting): every sibling goes
            raise

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # a finalizer must not raise
                self._choices._cancel()


class Choices(Generic[R]):
    """The n samples of each of a request's prompts, run as one request (see `aiobasert.choices`).

    Made by `Engine.stream_n` (completions) and `Engine.stream_chat_n` (chat replies). `async for`
    yields `ChoiceEvent`s of every choice as they come; `await choices` gives every choice's
    result (`Completion`s, or `ChatReply`s), in choice order. The children are reserved and
    queued on first iteration or await (or by `start()`). One reader at a time; iterate or await,
    not both (an await after a whole iteration returns the results).

    Failure: the first child that fails cancels the others and its error is raised; cancelling
    the reader, breaking out of the loop or `aclose()` cancels every child."""

    def __init__(
        self,
        start: Callable[[int, SamplingParams], TokenStream | ChatStream],
        prompts: int,
        params: SamplingParams,
        n: int,
        *,
        reserve: Callable[[int], Awaitable[Places]],
        room: int,
        prefix_cache: bool,
    ) -> None:
        self._start = start
        self._prompts = prompts
        self._params = params
        self._n = check_n(n)
        self._reserve = reserve
        self._room = room
        self._prefix_cache = prefix_cache
        self._children: list[TokenStream | ChatStream] = []
        self.streams: list[TokenStream] = []
        """Each choice's `TokenStream`, in choice order (empty until started)."""
        self._started = False
        self._ended = False
        self._live: list[int] | None = None  # the choices not ended yet, once started
        self._cursor = 0  # where the next round of `_next` starts in `_live`
        self._prefill_cached = 0
        self._event: anyio.Event | None = None
        self._results: list[R] | None = None

    @property
    def n(self) -> int:
        """Samples per prompt."""
        return self._n

    def __len__(self) -> int:
        """The number of choices (prompts x n)."""
        return self._prompts * self._n

    async def start(self) -> None:
        """Reserve every child's queue place (all or none), prefill each prompt once, and queue the
        children together; idempotent. Raises as a request does (`EngineOverloadedError`,
        `ContextLengthExceededError`, ...) with nothing left queued."""
        if self._started:
            return
        self._started = True
        count = len(self)
        if count > self._room:
            raise InvalidRequestError(
                f"this request fans out into {count} generations; the engine holds at most {self._room} "
                "(lanes + queue) at once"
            )
        with self._one_client():
            places: Places | None = None
            if count > 1:  # one Submit is atomic by itself
                warms = self._prompts if self._n > 1 and self._prefix_cache else 0
                places = await self._reserve(min(count + warms, self._room))
            with contextlib.ExitStack() as stack:
                if places is not None:
                    stack.callback(places.release)  # the places not used (a failed prefill) go back
                children: list[TokenStream | ChatStream] = []
                for p in range(self._prompts):
                    if self._n > 1:
                        self._prefill_cached += await self._prefill(p, places)
                    children += [self._start(p, sample_params(self._params, i)) for i in range(self._n)]
                streams = [c.tokens if isinstance(c, ChatStream) else c for c in children]
                self._children, self.streams = children, streams
                if places is not None:
                    places.submit(streams)  # queued one after the other, so admitted together
                else:
                    for stream in streams:
                        stream.submit()

    async def _prefill(self, prompt: int, places: Places | None) -> int:
        """Run prompt `prompt` once (one greedy token) so its KV lands in the prefix cache; the
        prompt tokens that request itself found cached (0 without a prefix cache)."""
        if not self._prefix_cache:
            return 0
        child = self._start(prompt, _warm(self._params))
        stream = child.tokens if isinstance(child, ChatStream) else child
        if places is not None:
            places.submit([stream])
        done = await stream
        return done.usage.cached_prompt_tokens

    def _one_client(self) -> contextlib.AbstractContextManager[None]:
        """The children are one client's requests for fair admission (docs/fairness.md): they share
        its lanes instead of taking lanes back from each other; the caller's key when it set one."""
        return contextlib.nullcontext() if current_client() is not None else client_scope(f"n-{new_request_id()}")

    def __aiter__(self) -> _Iteration:
        return _Iteration(self)

    async def _next(self) -> ChoiceEvent:
        """The next event of any choice (a token of each choice in turn, so none holds back the
        others); StopAsyncIteration once every choice has ended. The first failure raises here."""
        if self._live is None:
            await self.start()
            self._live = [i for i, s in enumerate(self.streams) if not s.closed]
            for stream in self.streams:
                stream._listen(self._wake)
        live = self._live
        while live:
            for k in range(len(live)):
                at = (self._cursor + k) % len(live)
                i = live[at]
                try:
                    tok = self.streams[i]._take()
                except StopAsyncIteration:
                    del live[at]
                    self._cursor = at
                    return ChoiceEvent(i, None, self._close_parser(i))
                if tok is not None:
                    self._cursor = at + 1
                    child = self._children[i]
                    return ChoiceEvent(i, tok, child.feed(tok) if isinstance(child, ChatStream) else [])
            if self._event is not None:
                raise StreamBusyError("these choices are already being read by another task")
            self._event = anyio.Event()
            try:
                await self._event.wait()
            finally:
                self._event = None
        self._ended = True
        raise StopAsyncIteration

    def _wake(self) -> None:
        """A child got tokens or ended (called on the loop when the engine delivers)."""
        if self._event is not None:
            self._event.set()

    def _close_parser(self, i: int) -> list[ChatDelta]:
        child = self._children[i]
        return child.close_parser() if isinstance(child, ChatStream) else []

    def _cancel(self) -> None:
        """Cancel every child still running (a no-op for those that ended): lanes freed before the next step."""
        for stream in self.streams:
            stream._abandon()

    async def collect(self) -> list[R]:
        """Every choice's result, in choice order (`await choices` does the same)."""
        if self._results is None:
            if not self._ended:
                async for _ in self:
                    pass
            self._results = [cast("R", await child) for child in self._children]
        return self._results

    def __await__(self) -> Generator[Any, None, list[R]]:
        return self.collect().__await__()

    @property
    def usage(self) -> Usage:
        """The request's usage (OpenAI's rule): completion tokens summed over the choices that
        ended, each prompt's tokens counted once; cached prompt tokens: those the prefill found
        (n > 1), else those each choice found; reasoning tokens: those of every chat choice's thought."""
        finals = [s.final for s in self.streams]
        prompt = sum(f.usage.prompt_tokens for f in finals[:: self._n] if f is not None)
        completion = sum(f.usage.completion_tokens for f in finals if f is not None)
        if self._n > 1:
            cached = self._prefill_cached
        else:
            cached = sum(f.usage.cached_prompt_tokens for f in finals if f is not None)
        thought = sum(c.reasoning_tokens for c in self._children if isinstance(c, ChatStream))
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_prompt_tokens=cached,
            reasoning_tokens=thought,
            draft_tokens=sum(f.usage.draft_tokens for f in finals if f is not None),
            accepted_draft_tokens=sum(f.usage.accepted_draft_tokens for f in finals if f is not None),
        )

    async def aclose(self) -> None:
        """Cancel every choice still running (idempotent; never waits for the engine)."""
        self._cancel()

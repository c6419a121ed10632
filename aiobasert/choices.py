"""n samples of one prompt, prefilled once.

The engine publishes a finished lane's KV (prompt and output) to its prefix
cache. So `prefill_once` first runs the prompt as a one-token greedy request;
when it ends, its KV is in the cache and the n samples, submitted together,
each seed their sequence from it and prefill only the last prompt token (a
prefix match always leaves one). Each sample gets its own seed stream
(`seed + i`, or a random seed each when `seed` is None).

```python
completions = await generate_n(engine, "Once upon a time", SamplingParams(max_tokens=32, seed=1), n=4)
replies = await chat_n(engine, messages, SamplingParams(max_tokens=32), n=4, tools=[...])
```

With the prefix cache off (or a prompt of one page or less, which the cache
does not match) the samples simply prefill the prompt each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from .batcher import client_scope, current_client
from .engine import Engine, QueueReservation
from .errors import InvalidRequestError
from .streams import TokenStream, new_request_id
from .tools import ChatReply, ChatStream, Tool, ToolChoice
from .types import ChatMessage, Completion, SamplingParams

__all__ = ["MAX_N", "chat_n", "generate_n", "prefill_once", "sample_params"]

T = TypeVar("T")

MAX_N = 16
"""The most samples one request may ask for."""


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample i's parameters: its own seed stream."""
    if params.seed is None or i == 0:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + i) % 2**63)


async def prefill_once(
    engine: Engine,
    start: Callable[[SamplingParams], TokenStream],
    params: SamplingParams,
    places: QueueReservation | None = None,
) -> int:
    """Run the prompt once (one greedy token) so its KV lands in the prefix cache;
    returns the prompt tokens that request itself found cached. No-op (0) when
    the engine has no prefix cache. `places`: queue places held for the fan-out
    (`Engine.reserve`), one of which this request takes."""
    if not engine.info.prefix_cache:
        return 0
    warm = msgspec.structs.replace(
        params, max_tokens=1, temperature=0.0, logprobs=False, top_logprobs=0, stop=None, logit_bias=None
    )
    stream = start(warm)
    if places is not None:
        places.submit([stream])
    done = await stream
    return done.usage.cached_prompt_tokens


def _one_client() -> contextlib.AbstractContextManager[None]:
    """The n samples are one client's requests for fair admission (docs/fairness.md): they share
    its lanes instead of taking lanes back from each other; the caller's key when it set one."""
    return contextlib.nullcontext() if current_client() is not None else client_scope(f"n-{new_request_id()}")


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")


async def gather_all(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run `calls` concurrently, results in order; the first failure is re-raised as itself."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    async def one(i: int) -> None:
        try:
            results[i] = await calls[i]()
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    if errors:
        raise errors[0]
    return results


async def generate_n(engine: Engine, prompt: str | Sequence[int], params: SamplingParams, n: int) -> list[Completion]:
    """n completions of `prompt`, the prompt prefilled once."""
    _check_n(n)
    with _one_client():
        if n > 1:
            await prefill_once(engine, lambda p: engine.stream(prompt, p), params)

        def run(i: int) -> Callable[[], Awaitable[Completion]]:
            async def go() -> Completion:
                return await engine.stream(prompt, sample_params(params, i))

            return go

        return await gather_all([run(i) for i in range(n)])


async def chat_n(
    engine: Engine,
    messages: Sequence[ChatMessage | Mapping[str, Any]],
    params: SamplingParams,
    n: int,
    *,
    tools: Sequence[Tool | Mapping[str, Any]] | None = None,
    tool_choice: ToolChoice | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
) -> list[ChatReply]:
    """n replies to `messages` (tools as in `Engine.stream_chat`), the conversation rendered and its
    grammar set up once (`Engine.prepare_chat`), the prompt prefilled once."""
    _check_n(n)
    turn = engine.prepare_chat(messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)

    def start(p: SamplingParams) -> ChatStream:
        return engine.stream_turn(turn, p)

    with _one_client():
        if n > 1:
            await prefill_once(engine, lambda p: start(p).tokens, params)

        def run(i: int) -> Callable[[], Awaitable[ChatReply]]:
            async def go() -> ChatReply:
                return await start(sample_params(params, i))

            return go

        return await gather_all([run(i) for i in range(n)])

"""The engine-core contract: what crosses between the event loop and the engine thread.

Only plain data and two small protocols live here (in the spirit of vLLM v1's
`EngineCoreRequest` / `EngineCoreOutputs` module): the loop side (`Engine`,
`TokenStream`) builds these messages and the engine thread consumes them, so
neither side needs the other's internals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..types import FinishReason, SamplingParams, Timing, Token, Usage
from .cost import NO_COST, Measure

if TYPE_CHECKING:
    import numpy as np


Prompt = str | Sequence[int] | Sequence[tuple[str, bool]]
"""Text, token ids, or (text, is_content) pieces of a rendered chat."""


class Constraint(Protocol):
    """A per-request token grammar (structured output), stepped on the engine thread."""

    def fill_bitmask(self, out: np.ndarray) -> bool:
        """Write the allowed-token bitmask (int32 words, bit set = allowed) for
        the next token; False when every token is allowed (nothing to apply)."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it."""
        ...

    def is_finished(self) -> bool:
        """The output is complete: the lane stops."""
        ...

    @property
    def error(self) -> str | None:
        """Why the grammar rejected a token (its message), else None."""
        ...

    def adopt(self, lib: Any) -> None:
        """Step (and free) through `lib` from now on: a grammar is built on an intake worker through
        that worker's own library view, then handed to the engine thread (a host grammar holds no
        engine handle: nothing to do)."""
        ...

    def close(self) -> None:
        """Free what the grammar holds in the engine (a host grammar holds nothing: nothing to do)."""
        ...


@dataclass(frozen=True)
class ThoughtSpec:
    """A reasoning model's thought in one request, as the engine thread gates it (`thought.ThoughtGate`).

    The thought runs free between `open_tag` and `close_tag` (each one token of the vocabulary, or
    Harmony's headers of several: the rest of a tag is forced once its first token is taken);
    the request's grammar, if any, starts after the close tag, and the turn may not end inside
    the thought when a grammar follows it (its answer must come)."""

    open_tag: str
    close_tag: str
    starts_open: bool
    """The prompt left the thought open (its first token is already inside it)."""
    budget: int | None = None
    """Past this many thought tokens only the close tag (then `answer_tag`) may follow."""
    stop_in_thought: bool = False
    """Stop strings match inside the thought too (by default only after it)."""
    answer_tag: str = ""
    """What the engine writes after the close tag where it closes the thought (Harmony's final header:
    the answer's channel), or where the model closes it and a grammar follows."""
    reopens: bool = False
    """The thought is one channel among a turn's messages (Harmony): without a grammar after it, its
    open tag is recognised where the model writes it whole (never forced), a close the model writes
    itself forces nothing after it, and a later message may open it again (the budget counts them all)."""


@dataclass
class RequestSpec:
    rid: str
    prompt: Prompt
    params: SamplingParams
    parse_special: bool = True
    """Text prompts: marker strings become control ids (baseRT_encode)."""
    lark: str | None = None
    """A Lark grammar (llguidance) constraining the output; else `params.json_schema`'s, if any."""
    structural_tag: str | None = None
    """An xgrammar structural tag (JSON text) for the same contract as `lark`: the engine's own
    grammar backend builds it where it can (`baseRT_grammar_create_from_structural_tag`);
    `lark` is the host fallback when it cannot."""
    thought: ThoughtSpec | None = None
    """A reasoning model's thought: gated (budget, grammar after it, stop strings outside it)."""
    client: str | None = None
    """Whose request it is, for fair admission (`aiobasert.client_scope`); None: its own."""
    submitted_at: float = field(default_factory=time.monotonic)
    cost: Measure = NO_COST
    """What its preparation may cost (characters of text and grammar source, the grammar's cache
    key), measured by the caller before any work: which intake lane prepares it."""


class Ticket:
    """Counters shared by a stream and its lane.

    The engine thread writes `delivered`; the consumer writes `consumed`. Each
    int is written by one side only, so no lock is needed. Nothing waits on
    them (a lane never pauses for its reader): they make `TokenStream.unread`,
    which counts the tokens still on their way to the loop too, and by which
    the server bounds a streamed response's unsent backlog.
    """

    __slots__ = ("consumed", "delivered")

    def __init__(self) -> None:
        self.delivered = 0
        self.consumed = 0


@dataclass(frozen=True)
class Final:
    """How a request ended; delivered with (or after) its last token."""

    finish_reason: FinishReason
    usage: Usage
    timing: Timing


class Sink(Protocol):
    """The consumer side of one request; `deliver` is called on the event loop only."""

    def deliver(self, tokens: list[Token], final: Final | None, error: BaseException | None) -> None: ...

    def alive(self) -> bool:
        """False once the consumer is gone (its lane serves nobody); any thread."""
        ...


@dataclass(frozen=True, slots=True)
class StreamOutput:
    """One stream's part of one engine step, handed to the loop (`Sink.deliver`): what the thread's
    step produced for it, all streams of a step in one wake-up."""

    sink: Sink
    tokens: list[Token]
    """The tokens it produced in this step, in order (none when it only ended)."""
    final: Final | None
    """How it ended, when it finished in this step."""
    error: BaseException | None
    """Why it failed, when it failed in this step."""

    def deliver(self) -> None:
        """Runs on the event loop."""
        self.sink.deliver(self.tokens, self.final, self.error)


@dataclass(slots=True)
class EmbedOutput:
    """An embedding's end, handed to the loop with the rest of its step (`Done`)."""

    done: Done
    result: Any
    """The float32 vector (a numpy array), or None when it failed."""
    error: BaseException | None

    def deliver(self) -> None:
        """Runs on the event loop."""
        self.done(self.result, self.error)


@dataclass
class Submit:
    spec: RequestSpec
    sink: Sink
    ticket: Ticket

    @property
    def rid(self) -> str:
        return self.spec.rid

    def answer(self, error: BaseException) -> None:
        """Runs on the event loop: the request ends with `error` before it had a lane (refused,
        or the engine closed while it was prepared)."""
        self.sink.deliver([], None, error)


@dataclass
class Cancel:
    rid: str


Done = Callable[[Any, BaseException | None], None]
"""Gets a thread-side job's result or its error; runs on the event loop."""


class Notify(Protocol):
    """How the engine thread reaches the event loop: schedule fn(*args) there,
    fire-and-forget, from any thread (`wakeup.LoopWaker.call_soon`)."""

    def __call__(self, fn: Callable[..., object], /, *args: Any) -> None: ...


@dataclass(frozen=True)
class Stats:
    """Query: the engine's `EngineStats`."""


@dataclass(frozen=True)
class EvictPrefixCache:
    """Query: drop the prefix cache's unused blocks; answers how many."""


@dataclass(frozen=True)
class Decode:
    """Query: the text of checked token ids."""

    ids: Sequence[int]


@dataclass(frozen=True)
class Encode:
    """Query: token ids of a text (engines without a tokenizer-only handle)."""

    text: str
    special: bool


@dataclass(frozen=True)
class Reserve:
    """Query: hold `count` queue places for requests about to be submitted together (a
    fan-out), or EngineOverloadedError at once when the queue has no room for all of them."""

    count: int


Query = Stats | EvictPrefixCache | Decode | Encode | Reserve


@dataclass
class Ask:
    """Answer `query` on the engine thread between two steps; `done` gets the answer (on the loop)."""

    query: Query
    done: Done


@dataclass
class Call:
    """Run fn on the engine thread between steps; report through done (on the loop).
    A debugging hook (tests look at the thread's state between two steps with it);
    the SDK itself asks typed `Ask` queries."""

    fn: Callable[[], Any]
    done: Done


@dataclass
class Embed:
    """Embed `source` (text, or checked token ids): a lane the scheduler feeds in
    chunks within the prefill budget, pooling hidden-state taps; `done` gets the
    float32 vector or the error (on the loop). `Cancel(rid)` frees its lane."""

    rid: str
    source: str | list[int]
    done: Done
    client: str | None = None
    """Whose request it is, for fair admission (as `RequestSpec.client`)."""

    def answer(self, error: BaseException) -> None:
        """Runs on the event loop: as `Submit.answer`."""
        self.done(None, error)


@dataclass
class Close:
    """Stop taking requests; `abort=False` drains running lanes, `abort=True` ends them now.

    A drain always ends (no lane waits for its reader); a later `Close(abort=True)` escalates a drain in progress."""

    abort: bool


@dataclass
class Prepared:
    """Engine-internal: a request's preparation (tokens, grammar) is done off the
    engine thread; `result` is what the preparation returned, else `error`."""

    msg: Submit | Embed
    result: Any
    error: BaseException | None


@dataclass(frozen=True)
class Release:
    """Give back `count` places held by `Reserve`: unused ones, or those of the requests
    posted right after this message (so that nothing can take them in between)."""

    count: int


Message = Submit | Cancel | Ask | Call | Embed | Close | Prepared | Release


class StreamHost(Protocol):
    """The narrow interface a `TokenStream` uses to reach its engine."""

    def submit(self, msg: Submit) -> None:
        """Queue a request (raises EngineClosedError / WrongEventLoopError)."""
        ...

    def cancel(self, rid: str) -> None:
        """Free a request's lane; fire-and-forget, from any thread, also after close."""
        ...

    def check_loop(self) -> None:
        """Raise WrongEventLoopError unless called in the event loop that opened the engine."""
        ...

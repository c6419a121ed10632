"""The thought gate: a reasoning model's thought runs free, the request's grammar starts after it.

Structured output and forced tool calls on a reasoning model (docs/reasoning.md): the grammar
must not forbid the thought (nothing but JSON from the first token would skip it) nor constrain
it. `ThoughtGate` is the lane's `Constraint` around the request's own (or none), by phase:

- before the thought (a prompt that did not open one): the inner grammar's tokens, and the
  open tag;
- inside it: every token, except the end tokens when a grammar follows (the answer must come);
  past `budget` thought tokens only the close tag (llama-server's `--reasoning-budget`);
- after the close tag: the inner grammar, from its start.

A tag may be several tokens (Harmony's thought opens with `<|channel|>analysis<|message|>` and
closes, the answer's header included, with `<|end|><|start|>assistant<|channel|>final<|message|>`):
its first token is the model's choice as above, the rest is then forced token by token.

A thought that is one channel among a turn's messages (Harmony, `ThoughtSpec.reopens`) with no
grammar after it forces nothing the model chose: its open tag is only recognised when the model
writes it whole (`<|channel|>` may start any channel's header), a close the model writes itself
leaves the next message to the model (another thought, a call, the answer), and the budget counts
every analysis message. Only past the budget does the gate write: the close tag and the answer's
header, so the final channel follows.

So the answer is the inner grammar's every time, whatever the thought was. The gate also says
whether the token just accepted belonged to the thought (`in_thought`), for the stop-string
matcher: a stop string only ends the turn in the answer unless the request asks otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .protocol import Constraint, ThoughtSpec

if TYPE_CHECKING:
    import numpy as np

_BEFORE, _THOUGHT, _AFTER = 0, 1, 2


class ThoughtGate:
    """A `Constraint` that runs `inner` (or nothing) only after the thought closes (see module)."""

    __slots__ = ("_budget", "_close", "_end_ids", "_forced", "_matched", "_open", "_phase", "_reopens", "_spent",
                 "in_thought", "inner", "stop_in_thought")  # fmt: skip

    def __init__(
        self,
        inner: Constraint | None,
        spec: ThoughtSpec,
        *,
        open_id: int | Sequence[int],
        close_id: int | Sequence[int],
        end_ids: Sequence[int],
    ) -> None:
        self.inner = inner
        self._open = _tag(open_id, "open")
        self._close = _tag(close_id, "close")
        self._end_ids = tuple(end_ids) if inner is not None else ()  # free text may end in its thought
        self._budget = spec.budget
        self._phase = _THOUGHT if spec.starts_open else _BEFORE
        self._spent = 0
        self._forced: tuple[int, ...] = ()
        """The rest of a tag whose first token was taken, forced in order (then `_phase` is where it leads)."""
        self._reopens = spec.reopens and inner is None
        """The open tag is recognised, not forced, and the thought may open again (see module)."""
        self._matched = 0
        """Where `_reopens`: how many of the open tag's tokens the output ends in (before the thought)."""
        self.stop_in_thought = spec.stop_in_thought
        self.in_thought = False
        """The token last accepted was the thought's (its tags included)."""

    @property
    def thought_tokens(self) -> int:
        """Tokens of the thought so far (without its tags)."""
        return self._spent

    def fill_bitmask(self, out: np.ndarray[Any, Any]) -> bool:
        if self._forced:
            _only(out, self._forced[0])
            return True
        if self._phase == _AFTER:
            return self.inner.fill_bitmask(out) if self.inner is not None else False
        if self._phase == _THOUGHT:
            if self._budget is not None and self._spent >= self._budget:
                _only(out, self._close[0])
                return True
            if not self._end_ids:
                return False
            out[:] = -1
            for e in self._end_ids:
                _clear(out, e)
            return True
        if self.inner is None or not self.inner.fill_bitmask(out):
            return False  # every token may come: the open tag too
        _set(out, self._open[0])
        return True

    def accept(self, token: int) -> bool:
        if self._forced:
            self.in_thought = True  # a tag's token: the thought's
            if token != self._forced[0]:
                return False  # only under a mask that was not applied: the tag is broken
            self._forced = self._forced[1:]
            return True
        if self._phase == _AFTER:
            self.in_thought = False
            return self.inner.accept(token) if self.inner is not None else True
        if self._phase == _THOUGHT:
            self.in_thought = True
            if self._reopens and self._forced_close:
                self._phase, self._forced = _BEFORE, self._close[1:]  # the engine's close: the answer follows
            elif self._reopens and token == self._close[0]:
                self._phase = _BEFORE  # the model's own close: what comes next is the model's
            elif token == self._close[0]:
                self._phase, self._forced = _AFTER, self._close[1:]
            else:
                self._spent += 1
            return True
        if self._reopens:
            return self._match_open(token)
        if token == self._open[0]:
            self._phase, self._forced, self.in_thought = _THOUGHT, self._open[1:], True
            return True
        self._phase, self.in_thought = _AFTER, False  # no thought: the answer starts here
        return self.inner.accept(token) if self.inner is not None else True

    @property
    def _forced_close(self) -> bool:
        """The budget is spent: the token being accepted is the close tag's first, under the gate's mask."""
        return self._budget is not None and self._spent >= self._budget

    def _match_open(self, token: int) -> bool:
        """Before a thought that reopens: the open tag is the thought's only once written whole."""
        opening, m = self._open, self._matched
        m = m + 1 if token == opening[m] else int(token == opening[0])
        if m == len(opening):
            self._phase, m = _THOUGHT, 0
        self._matched, self.in_thought = m, self._phase == _THOUGHT
        return True

    def is_finished(self) -> bool:
        return not self._forced and self._phase == _AFTER and self.inner is not None and self.inner.is_finished()

    @property
    def error(self) -> str | None:
        return self.inner.error if self.inner is not None else None

    def adopt(self, lib: Any) -> None:
        if self.inner is not None:
            self.inner.adopt(lib)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def _tag(ids: int | Sequence[int], which: str) -> tuple[int, ...]:
    tag = (ids,) if isinstance(ids, int) else tuple(ids)
    if not tag:
        raise ValueError(f"the thought's {which} tag has no tokens")
    return tag


def _words(out: np.ndarray[Any, Any]) -> Any:
    return out.view("uint32")  # bit 31 of an int32 word, without a sign


def _set(out: np.ndarray[Any, Any], token: int) -> None:
    words = _words(out)
    words[token >> 5] |= 1 << (token & 31)


def _clear(out: np.ndarray[Any, Any], token: int) -> None:
    words = _words(out)
    if (token >> 5) < len(words):
        words[token >> 5] &= ~(1 << (token & 31)) & 0xFFFFFFFF


def _only(out: np.ndarray[Any, Any], token: int) -> None:
    out[:] = 0
    _set(out, token)

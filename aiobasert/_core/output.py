"""Output processing (engine thread): a sampled token becomes stream output.

Detokenise (each token's exact bytes through the lane's incremental UTF-8
decoder), apply stop conditions (EOS / stop ids, stop strings held back until
they can no longer match, the grammar's end, the length budget) and build how
the request finished. No engine state is touched here except read-only
tokenizer queries, and no lane's lifecycle is written: `process` returns a
`TokenOutput` that the engine thread applies, so the lifecycle stays in one place.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

from .. import _ffi
from ..errors import InvalidRequestError
from ..types import FinishReason, Timing, Token, TopLogprob, Usage
from .protocol import Final
from .step import Lane
from .thought import ThoughtGate


class Detokenizer:
    """Token id -> exact bytes, cached (the vocabulary is fixed for a model handle)."""

    def __init__(self, lib: _ffi.Library, model: int) -> None:
        self._lib = lib
        self._model = model
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, tok: int) -> bytes:
        raw = self._cache.get(tok)
        if raw is not None:
            return raw
        lib = self._lib
        buf = ctypes.create_string_buffer(64)
        n = lib.baseRT_decode_token_raw(self._model, tok, buf, 64)
        if n > 64:
            buf = ctypes.create_string_buffer(n)
            n = lib.baseRT_decode_token_raw(self._model, tok, buf, n)
        if n < 0:
            raise lib.last_error("baseRT_decode_token_raw")
        raw = buf.raw[:n]
        self._cache[tok] = raw
        return raw

    def token_text(self, tok: int) -> str:
        return self.token_bytes(tok).decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """What one sampled token changed: the stream's next `Token`, and how the lane
    finished if that token was its last. The engine thread applies it."""

    token: Token
    finish: FinishReason | None


class OutputProcessor:
    """Turns one lane's sampled token into a `Token` and says whether the lane ends."""

    def __init__(self, lib: _ffi.Library, model: int, detok: Detokenizer) -> None:
        self._lib = lib
        self._model = model
        self._detok = detok
        self._eos: dict[int, bool] = {}

    def is_eos(self, tok: int) -> bool:
        hit = self._eos.get(tok)
        if hit is None:
            hit = self._eos[tok] = bool(self._lib.baseRT_is_eos_token(self._model, tok))
        return hit

    def process(self, lane: Lane, tok: int, logprob: float | None, tops: list[TopLogprob] | None) -> TokenOutput:
        """The token as the stream yields it, and the finish reason if it is the last.

        Advances the lane's text state (decoder, stop matcher, grammar); its
        lifecycle (generated ids, counts, finish) is the engine thread's to apply.
        Raises InvalidRequestError when the lane's grammar rejects the token."""
        p, st = lane.spec.params, lane.state
        count = st.generated + 1  # this token included
        if lane.constraint is not None and not lane.constraint.accept(tok):
            why = lane.constraint.error or "rejected"
            raise InvalidRequestError(f"token {tok} was sampled outside the output grammar: {why}")
        finish: FinishReason | None = None
        if tok in lane.stop_ids or (not p.ignore_eos and self.is_eos(tok)):
            # an end token: its own bytes are not output; what is pending is released
            text, finish = self._tail(lane)[0], "stop"
        else:
            text = lane.decoder.decode(self._detok.token_bytes(tok))
            gate = lane.constraint
            if isinstance(gate, ThoughtGate) and gate.in_thought and not gate.stop_in_thought:
                hit = False  # a reasoning model's thought: stop strings match only in its answer
            else:
                text, hit = lane.stopper.feed(text)
            if hit:
                finish = "stop"  # the stop string and everything after it are dropped
            elif lane.constraint is not None and lane.constraint.is_finished():
                text += self._tail(lane)[0]
                finish = "stop"
            elif count >= st.max_new_tokens:
                tail, hit = self._tail(lane)
                text += tail
                finish = "stop" if hit else "length"
        token = Token(id=tok, text=text, index=count - 1, logprob=logprob, top_logprobs=tops, finish_reason=finish)
        return TokenOutput(token, finish)

    @staticmethod
    def _tail(lane: Lane) -> tuple[str, bool]:
        """Generation ends: bytes still pending become U+FFFD and held text is
        released, unless that completes a stop string (then True)."""
        text, hit = lane.stopper.feed(lane.decoder.decode(b"", final=True))
        return (text, True) if hit else (text + lane.stopper.flush(), False)

    @staticmethod
    def final(lane: Lane, reason: FinishReason, step: int) -> Final:
        now = time.monotonic()
        submitted = lane.spec.submitted_at
        admitted = lane.admitted_at or now
        return Final(
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=lane.state.prompt_len,
                completion_tokens=len(lane.generated),
                cached_prompt_tokens=lane.cached,
                draft_tokens=lane.speculation.drafted if lane.speculation is not None else 0,
                accepted_draft_tokens=lane.speculation.accepted if lane.speculation is not None else 0,
            ),
            timing=Timing(
                queued_s=admitted - submitted,
                time_to_first_token_s=(lane.first_token_at or now) - submitted,
                total_s=now - submitted,
                submitted_step=lane.submitted_step,
                admitted_step=lane.admitted_step,
                finished_step=step,
                first_token_step=lane.first_token_step,
                pauses=lane.state.pauses,
                longest_pause_steps=lane.state.longest_pause,
            ),
        )

"""Public request/response structs (msgspec: typed, validated, JSON-ready)."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from .errors import InvalidSamplingParamsError

FinishReason = Literal["stop", "length", "aborted", "error"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one request samples and when it stops.

    Defaults are greedy decoding until EOS or the context is full.
    `validate()` (called by the engine on every request) raises
    `InvalidSamplingParamsError` naming the bad field.
    """

    max_tokens: int | None = None
    """Tokens to generate at most; None = until EOS or the context is full."""
    temperature: float = 0.0
    """0 = greedy (argmax, lowest id wins ties)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    min_p: float = 0.0
    """Drop tokens below min_p * p(max); 0 = off."""
    repeat_penalty: float = 1.0
    """Divide positive / multiply negative logits of recent tokens; 1 = off."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_window: int = 64
    """How many recent tokens (prompt tail + output) the penalties look at."""
    seed: int | None = None
    """Same seed + same prompt = same tokens, whatever else is batched. None = random."""
    logit_bias: dict[int, float] | None = None
    """Additive bias per token id (forces the host-logits path for this lane)."""
    stop: list[str] | None = None
    """Stop strings: generation ends before them; they never reach the output."""
    stop_token_ids: list[int] | None = None
    """Extra token ids that end generation (besides the model's EOS ids)."""
    ignore_eos: bool = False
    logprobs: bool = False
    """Report each sampled token's log-probability."""
    top_logprobs: int = 0
    """Also report this many most likely alternatives per token (0..20)."""
    json_schema: dict[str, Any] | bool | None = None
    """Constrain the output to JSON matching this JSON Schema (`True`: any JSON
    value). The lane masks its logits with a grammar every step."""

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidSamplingParamsError` naming the first bad field; token ids
        (logit_bias, stop_token_ids) are checked against `vocab_size` when given."""
        def bad(field: str, why: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"invalid sampling parameter {field}: {why}")

        def finite(field: str, value: float) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(field, f"{value!r} is not a finite number")

        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"{self.max_tokens!r} must be an integer >= 1")
        finite("temperature", self.temperature)
        if self.temperature < 0:
            raise bad("temperature", f"{self.temperature} must be >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"{self.top_k!r} must be an integer >= 0")
        finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"{self.top_p} must be in (0, 1]")
        finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"{self.min_p} must be in [0, 1]")
        finite("repeat_penalty", self.repeat_penalty)
        if self.repeat_penalty <= 0:
            raise bad("repeat_penalty", f"{self.repeat_penalty} must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"{value} must be in [-2, 2]")
        if isinstance(self.penalty_window, bool) or not 0 <= self.penalty_window <= 4096:
            raise bad("penalty_window", f"{self.penalty_window!r} must be in [0, 4096]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise bad("seed", f"{self.seed!r} must be an integer in [0, 2**63)")
        if self.logit_bias is not None:
            for tok, value in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or (
                    vocab_size is not None and tok >= vocab_size
                ):
                    raise bad("logit_bias", f"token id {tok!r} is not in the vocabulary")
                finite(f"logit_bias[{tok}]", value)
                if not -100.0 <= value <= 100.0:
                    raise bad(f"logit_bias[{tok}]", f"{value} must be in [-100, 100]")
        if self.stop is not None:
            if len(self.stop) > 16:
                raise bad("stop", "at most 16 stop strings")
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    raise bad("stop", f"{s!r} must be a non-empty string")
        if self.stop_token_ids is not None:
            for tok in self.stop_token_ids:
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or (
                    vocab_size is not None and tok >= vocab_size
                ):
                    raise bad("stop_token_ids", f"token id {tok!r} is not in the vocabulary")
        if isinstance(self.top_logprobs, bool) or not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", f"{self.top_logprobs!r} must be in [0, 20]")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise bad("json_schema", "must be a JSON Schema object, or True for any JSON value")
        if self.json_schema is False:
            raise bad("json_schema", "False admits no output")

    @property
    def needs_host_logits(self) -> bool:
        """True when this lane must read its logits row back to the host."""
        return bool(self.logit_bias) or self.logprobs or self.top_logprobs > 0 or self.json_schema is not None


class TopLogprob(msgspec.Struct, frozen=True):
    """One alternative token and its log-probability."""

    id: int
    logprob: float
    text: str


class Token(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token, as a stream yields it.

    `text` is the text this token releases: possibly "" (a multi-byte character
    still incomplete, a control token, or text held back because it may begin a
    stop string) and possibly more than the token's own bytes (held text
    released). Concatenating every `text` of a stream gives the completion.
    """

    id: int
    text: str
    index: int
    """0-based position among the generated tokens."""
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    finish_reason: FinishReason | None = None
    """Set on the last token only."""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache instead of prefilled."""

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


class Timing(msgspec.Struct, frozen=True, kw_only=True):
    """Wall-clock seconds measured by the SDK and engine steps counted."""

    queued_s: float
    """From submission to admission into a lane."""
    time_to_first_token_s: float
    total_s: float
    submitted_step: int
    """Engine step counter when the engine thread first saw the request."""
    admitted_step: int
    """Engine step in which the request got its lane (prefill began)."""
    finished_step: int


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A whole generation: `await engine.generate(...)` or `await stream`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    logprobs: list[float] | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One chat turn. `content` is client text: it can never forge turn markers."""

    role: str
    content: str


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot taken on the engine thread between steps."""

    steps: int
    active_lanes: int
    waiting_requests: int
    live_sequences: int
    """Sequences the SDK holds in the engine (created and not yet freed)."""
    live_decode_streams: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_blocks_cached: int
    requests_finished: int
    requests_cancelled: int
    requests_failed: int


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the loaded model and library are."""

    path: str
    architecture: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    max_context: int
    max_batch_size: int
    prefix_cache: bool
    library_path: str
    library_version: str
    capabilities: int

"""Public request/response structs (msgspec: typed, validated, JSON-ready)."""

from __future__ import annotations

import json
import math
import struct
import threading
from typing import Any, Literal, get_args

import msgspec

from . import _lazy_numpy as lazy_numpy
from .errors import InvalidSamplingParamsError

FinishReason = Literal["stop", "length", "aborted"]
KVCacheDtype = Literal["auto", "f16", "q8", "f32"]
"""How the engine stores the KV cache (`Engine.open(kv_cache_dtype=...)`): "auto" = f16 on the
reference engine (llama.cpp's default), the library's per-model default elsewhere (BaseRT: Q8_0
where head_dim allows); "f16"; "q8" (Q8_0 blocks of 32, as llama.cpp's `-ctk q8_0 -ctv q8_0`);
"f32" (the reference engine's exact pool, twice f16's memory)."""
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
Dtype = Literal["auto", "f16", "f32", "q8", "q4"]
"""How a GGUF model's matrices are stored in its cached bundle (`Engine.open(dtype=...)`, `--dtype`):
"auto" = each tensor as the GGUF stores it (see the quantized-output section of
`aiobasert.models.convert`); "f16" / "f32" dequantize; "q8" / "q4" quantize group-wise."""
DTYPES: tuple[str, ...] = get_args(Dtype)

_INT32_MAX = 2**31 - 1
_FLT_MAX: float = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]  # 3.4028234663852886e38


def _as_float32(x: float) -> float:
    """x rounded to the nearest float32, as the engine will store it (x within +-_FLT_MAX)."""
    rounded: float = struct.unpack("<f", struct.pack("<f", x))[0]
    return rounded


def is_numpy_scalar(value: Any) -> bool:
    """A numpy scalar (np.float32(1), np.int64(3), ...), recognised without importing numpy: a
    value can only be one once numpy is imported, and a server that only generates text never
    imports it (~15 MiB of resident memory; embeddings and grammars import it when first used)."""
    np = lazy_numpy.loaded()  # never a module another thread is still importing
    return np is not None and isinstance(value, np.generic)


_MOST_ITEMS: dict[str, tuple[int, str]] = {
    "logit_bias": (1024, "at most 1024 entries"),
    "stop": (16, "at most 16 stop strings"),
    "stop_token_ids": (1024, "at most 1024 token ids"),
    "choice": (1024, "at most 1024 choices"),
}

CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")
"""The SamplingParams fields that constrain the output with a grammar: at most one per request."""

MAX_CONSTRAINT_CHARS = 1 << 20
"""Characters a regex, the choices together or a grammar may have (a json_schema is bounded by
its values: MAX_SCHEMA_NODES); the compile's own work is bounded by the grammar limits and budget."""
"""The container fields' sizes, checked before anything walks them (normalized, validate)."""

_walked = threading.local()  # .schema: the json_schema normalized() has just walked on this thread

MAX_SCHEMA_DEPTH = 64
"""Nesting levels (objects and arrays) a json_schema may have: real schemas use a
dozen; the grammar compilers recurse per level."""
MAX_SCHEMA_REFS = 1024
"""`$ref`s a json_schema may hold: llguidance recurses once per chained `$ref`
(~8-32 kB of stack each), so this bounds the stack a compile needs (the
grammar workers have 256 MiB: aiobasert._core.intake)."""
MAX_SCHEMA_NODES = 250_000
"""Values (keys' values, items, scalars) in a json_schema: bounds the compile's work."""


def schema_problem(schema: Any) -> str | None:
    """Why `schema` cannot be compiled safely (not JSON, too deep, too many `$ref`s
    or values), or None. Iterative, so any depth is measured without recursing."""
    return _measure_schema(schema)[0]


def _measure_schema(schema: Any) -> tuple[str | None, bool]:
    """(schema_problem, whether `_plain` would change anything: a numpy scalar or a tuple in it)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    nodes = refs = 0
    converts = False
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"has more than {MAX_SCHEMA_NODES} values", converts
        if isinstance(value, dict):
            if depth >= MAX_SCHEMA_DEPTH:
                return f"is nested more than {MAX_SCHEMA_DEPTH} levels deep", converts
            for key, item in value.items():
                if not isinstance(key, str):
                    return f"has a non-string key {key!r}", converts
                if key == "$ref":
                    refs += 1
                    if refs > MAX_SCHEMA_REFS:
                        return f"has more than {MAX_SCHEMA_REFS} $refs", converts
                stack.append((item, depth + 1))
        elif isinstance(value, (list, tuple)):
            if depth >= MAX_SCHEMA_DEPTH:
                return f"is nested more than {MAX_SCHEMA_DEPTH} levels deep", converts
            converts = converts or isinstance(value, tuple)
            stack.extend((item, depth + 1) for item in value)
        elif not (value is None or isinstance(value, (str, int, float, bool))):
            if not is_numpy_scalar(value):
                return f"holds a {type(value).__name__}, which is not JSON", converts
            converts = True
    return None, converts


def _plain(value: Any) -> Any:
    """numpy scalars -> Python values, tuples -> lists (recursively); anything else as is."""
    if is_numpy_scalar(value):
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        items = [_plain(v) for v in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if isinstance(value, dict):
        pairs = [(_plain(k), _plain(v)) for k, v in value.items()]
        changed = any(a is not k or b is not v for (a, b), (k, v) in zip(pairs, value.items(), strict=True))
        return dict(pairs) if changed else value
    return value


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
    stop: str | list[str] | None = None
    """Stop strings: generation ends before them; they never reach the output.
    A single string is one stop string."""
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
    regex: str | None = None
    """Constrain the output to match this regular expression, whole (Rust `regex` syntax,
    as llguidance reads it). At most one of json_schema, regex, choice and grammar."""
    choice: list[str] | None = None
    """Constrain the output to exactly one of these strings (1..1024 non-empty strings)."""
    grammar: str | None = None
    """Constrain the output to this grammar: Lark (llguidance's dialect, `start` its start rule),
    or llama.cpp's GBNF (`root ::= ...`), converted to Lark; a GBNF the converter cannot read is
    refused naming `grammar`. Every grammar compiles under the same budget as a json_schema."""
    speculation: bool = True
    """Speculative decoding for this request where the engine has it on
    (`EngineConfig.speculation`); False opts out. The tokens are the same either way."""

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidSamplingParamsError` naming the first bad field; token ids
        (logit_bias, stop_token_ids) are checked against `vocab_size` when given.

        Types are strict (an int field takes an int, never a float or a bool; a
        bool field takes a bool) and every value must fit the C field it goes
        into (float32, int32), so nothing is silently rounded or wrapped. The
        engine validates `normalized()` params: numpy scalars are accepted as
        their Python values and a single `stop` string is one stop string."""

        def bad(field: str, why: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"invalid sampling parameter {field}: {why}")

        def number(field: str, value: Any, low: float, high: float, *, open_low: bool = False) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(field, f"{value!r} is not a finite number")
            if value < low or value > high or (open_low and value <= low):
                span = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
                raise bad(field, f"{value!r} must be in {span}")
            if open_low and _as_float32(value) <= low:
                raise bad(field, f"{value!r} is too small for a float32 (it would be {low:g})")

        def integer(field: str, value: Any, low: int, high: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(field, f"{value!r} must be an integer, not {type(value).__name__}")
            if not low <= value <= high:
                raise bad(field, f"{value!r} must be in [{low}, {high}]")

        def flag(field: str, value: Any) -> None:
            if not isinstance(value, bool):
                raise bad(field, f"{value!r} must be a bool, not {type(value).__name__}")

        def token_id(field: str, tok: Any) -> None:
            if (
                isinstance(tok, bool)
                or not isinstance(tok, int)
                or tok < 0
                or tok > _INT32_MAX
                or (vocab_size is not None and tok >= vocab_size)
            ):
                raise bad(field, f"token id {tok!r} is not in the vocabulary")

        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, 1, _INT32_MAX)
        number("temperature", self.temperature, 0.0, _FLT_MAX)
        integer("top_k", self.top_k, 0, _INT32_MAX)
        number("top_p", self.top_p, 0.0, 1.0, open_low=True)
        number("min_p", self.min_p, 0.0, 1.0)
        number("repeat_penalty", self.repeat_penalty, 0.0, _FLT_MAX, open_low=True)
        number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        integer("penalty_window", self.penalty_window, 0, 4096)
        if self.seed is not None:
            integer("seed", self.seed, 0, 2**63 - 1)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", f"must be a dict of token id -> bias, not {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > _MOST_ITEMS["logit_bias"][0]:
                raise bad("logit_bias", _MOST_ITEMS["logit_bias"][1])
            for tok, value in self.logit_bias.items():
                token_id("logit_bias", tok)
                number(f"logit_bias[{tok}]", value, -100.0, 100.0)
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list):
                raise bad("stop", f"must be a string or a list of strings, not {type(self.stop).__name__}")
            if len(stops) > _MOST_ITEMS["stop"][0]:
                raise bad("stop", _MOST_ITEMS["stop"][1])
            for s in stops:
                if not isinstance(s, str) or not s:
                    raise bad("stop", f"{s!r} must be a non-empty string")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                raise bad("stop_token_ids", f"must be a list of token ids, not {type(self.stop_token_ids).__name__}")
            if len(self.stop_token_ids) > _MOST_ITEMS["stop_token_ids"][0]:
                raise bad("stop_token_ids", _MOST_ITEMS["stop_token_ids"][1])
            for tok in self.stop_token_ids:
                token_id("stop_token_ids", tok)
        flag("ignore_eos", self.ignore_eos)
        flag("logprobs", self.logprobs)
        flag("speculation", self.speculation)
        integer("top_logprobs", self.top_logprobs, 0, 20)
        if self.json_schema is not None:
            if not isinstance(self.json_schema, (dict, bool)):
                raise bad("json_schema", "must be a JSON Schema object, or True for any JSON value")
            if self.json_schema is False:
                raise bad("json_schema", "False admits no output")
            if self.json_schema is not getattr(_walked, "schema", None):  # normalized() walked it just now
                problem = schema_problem(self.json_schema)
                if problem is not None:
                    raise bad("json_schema", problem)
                try:
                    json.dumps(self.json_schema)
                except (TypeError, ValueError, RecursionError) as exc:
                    raise bad("json_schema", f"is not JSON-serialisable: {exc}") from None
            _walked.schema = None
        for name in ("regex", "grammar"):
            text = getattr(self, name)
            if text is not None:
                if not isinstance(text, str) or not text:
                    raise bad(name, f"{text!r} must be a non-empty string")
                if len(text) > MAX_CONSTRAINT_CHARS:
                    raise bad(name, f"is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise bad("choice", "must be a non-empty list of strings")
            if len(self.choice) > _MOST_ITEMS["choice"][0]:
                raise bad("choice", _MOST_ITEMS["choice"][1])
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise bad("choice", f"{c!r} must be a non-empty string")
            if sum(len(c) for c in self.choice) > MAX_CONSTRAINT_CHARS:
                raise bad("choice", f"the choices hold more than {MAX_CONSTRAINT_CHARS} characters")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise bad(given[1], f"cannot be combined with {given[0]}: one output constraint per request")

    def normalized(self) -> SamplingParams:
        """These params with numpy scalars as Python values, a single `stop` string
        as a one-element list and tuples as lists (what `validate` expects)."""
        changes: dict[str, Any] = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            cap = _MOST_ITEMS.get(name)
            if cap is not None and isinstance(value, (list, tuple, dict)) and len(value) > cap[0]:
                raise InvalidSamplingParamsError(f"invalid sampling parameter {name}: {cap[1]}")  # before any walk
            if name == "json_schema":  # bounded before the recursive walk below, walked once
                problem, converts = _measure_schema(value)
                if problem is not None:
                    raise InvalidSamplingParamsError(f"invalid sampling parameter json_schema: {problem}")
                if not converts:  # a plain JSON schema is used as it is (no copy, no second walk)
                    _walked.schema = value  # validate() right after need not walk it again
                    continue
            try:
                fixed = _plain(value)
            except RecursionError:  # any other field nested past Python's limit
                raise InvalidSamplingParamsError(f"invalid sampling parameter {name}: nested too deeply") from None
            if name == "stop" and isinstance(fixed, str):
                fixed = [fixed]
            if fixed is not value:
                changes[name] = fixed
        return msgspec.structs.replace(self, **changes) if changes else self

    @property
    def needs_host_logits(self) -> bool:
        """True when this lane must read its logits row back to the host."""
        return bool(self.logit_bias) or self.logprobs or self.top_logprobs > 0 or self.constrained

    @property
    def constrained(self) -> bool:
        """True when a grammar constrains the output (json_schema, regex, choice or grammar)."""
        return any(getattr(self, name) is not None for name in CONSTRAINT_FIELDS)


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
    reasoning_tokens: int = 0
    """Of the completion tokens, those of a reasoning model's thought (its tags included):
    counted by a chat turn that separates the thought (`ChatReply.usage`); 0 elsewhere."""
    draft_tokens: int = 0
    """Speculative decoding: draft tokens this request verified (docs/speculative.md)."""
    accepted_draft_tokens: int = 0
    """Of those, the ones accepted (each one a token made without a step of its own)."""

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
    first_token_step: int = -1
    """Engine step that produced its first token (-1: none). `first_token_step - submitted_step`
    is its time to first token in steps, what fair admission bounds (docs/fairness.md)."""
    pauses: int = 0
    """Times it was paused for a shorter request or another client's (docs/fairness.md)."""
    longest_pause_steps: int = 0
    """Its longest pause, in engine steps: what fair admission bounds for a started request."""


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
    """Requests waiting for a lane: new ones and paused ones (`paused_requests`)."""
    live_sequences: int
    """Sequences the SDK holds in the engine (created and not yet freed)."""
    live_grammars: int = 0
    """Structured-output grammars held (engine grammar handles or host matchers)."""
    kv_blocks_total: int
    kv_blocks_used: int
    """Blocks allocated, the prefix cache's included (at idle, once the cache fills, close to
    `kv_blocks_total`); what live requests hold is `kv_blocks_used - prefix_blocks_cached`."""
    prefix_blocks_cached: int
    """Blocks the prefix cache holds (evictable); a block a live request shares with it counts here."""
    requests_finished: int
    requests_cancelled: int
    requests_failed: int
    kv_cache_bytes: int = 0
    """The KV pool's capacity in bytes (`kv_blocks_total` blocks at `ModelInfo.kv_cache_dtype`);
    pages the engine has not yet written take no memory."""
    engine_bytes: int = 0
    """What the engine holds: resident weights, the KV pool's capacity and its runtime buffers."""
    requests_preempted: int = 0
    """Lanes taken back for a shorter request or another client's (docs/fairness.md); each
    paused request kept its KV and resumed (or resumes) where it stopped."""
    paused_requests: int = 0
    """Requests paused now: out of their lane, waiting for a free one (their KV kept)."""
    requests_recomputed: int = 0
    """Paused requests whose KV was released to make room for a resume, each recomputed
    (prompt + output, mostly from the prefix cache) when it resumed (docs/fairness.md)."""
    spec_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified, all requests (vLLM's num_draft_tokens)."""
    spec_accepted_tokens: int = 0
    """Of those, the ones accepted (vLLM's num_accepted_tokens)."""
    draft_live_sequences: int = 0
    """Sequences of the draft model held (speculation with method="draft"): one a lane that
    drafts, freed with the lane's own sequence (0 when there is no draft model)."""
    draft_cached_tokens: int = 0
    """Tokens the draft model's sequences took from its own prefix cache instead of prefilling them
    (speculation with method="draft" and `EngineConfig.prefix_cache`): a prompt, or a chat's history,
    served again catches up on the draft from there (docs/speculative.md)."""


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What the loaded engine can do: asked of the library and the model once, when the engine
    opens (`aiobasert._core.loaded`), and never again (`engine.capabilities`,
    `ModelInfo.capabilities`). A library lacking an optional function says False here, and the
    engine takes its fallback (docs/architecture.md, "What the loaded engine can do").

    A handle that steps no sequences (a tokenizer-only load) has none of the stepping abilities:
    it tokenizes, and compiles grammars where the library can."""

    flags: int = 0
    """The `BASERT_CAP_*` bits `baseRT_capabilities` reports (paged KV 1, sequences 2, host
    logits 4, prefix cache 8, ...)."""
    sequences: bool = False
    """The handle steps sequences (`BASERT_CAP_SEQUENCES`): continuous batching. False for a
    tokenizer-only load; an engine refuses to open a model without it."""
    tokenizer_handles: bool = False
    """The library loads tokenizer-only handles (`baseRT_load_tokenizer_only`): prompts are
    tokenized and grammars compiled on the intake workers, each with a handle of its own; without
    it they are prepared on the engine thread, between two steps."""
    fused_sample: bool = False
    """The engine samples inside the fused step (`baseRT_batch_step_fused_sample`): no logits row
    is read back for a lane that needs nothing on the host."""
    row_sampler: bool = False
    """The engine's row sampler runs on host logits rows (`baseRT_sample_logits_rows`): a sampled
    lane that needs host rows gets the same tokens as in the fused path (else the CPU pipeline)."""
    mask_row: bool = False
    """The engine masks a logits row with a grammar's bitmask (`baseRT_mask_logits_row`); else
    the host masks it."""
    taps: bool = False
    """Hidden-state taps, on this model (`baseRT_batch_step_fused_logits_rows_taps` and
    `baseRT_model_supports_taps`): embeddings are pooled from tapped chunks within the steps."""
    tap_capacity: int = 0
    """Rows one tapped step may cover (`baseRT_tap_rows_capacity`); 0 without taps."""
    multi_row_verify: bool = False
    """Several logits rows per lane from one forward (`baseRT_batch_step_fused_logits_rows`):
    what a speculative verify needs."""
    rows_argmax: bool = False
    """Greedy multi-row verify without a logits read-back (`baseRT_batch_step_fused_rows_argmax`):
    a verify step whose lanes are all greedy with no host needs runs it (else, or where the engine
    refuses it, the logits-rows path)."""
    speculation_switch: bool = False
    """The per-handle speculation flag can be set and read back (`baseRT_set_speculation`,
    `baseRT_get_speculation`): the engine's own speculation inside its generate calls."""
    prefix_cache: bool = False
    """Prompt KV shared between requests (`BASERT_CAP_PREFIX_CACHE` and `baseRT_prefix_match`),
    as the engine was opened (`prefix_cache=False` turns it off)."""
    grammar_compiler: bool = False
    """The engine compiles JSON Schemas itself (`baseRT_grammar_create_from_schema`, stepped by
    bitmask); else, and for what it refuses, the host's llguidance backend."""
    structural_tag: bool = False
    """The engine builds tool-call grammars from xgrammar structural tags
    (`baseRT_grammar_create_from_structural_tag`); else the host's Lark grammar."""
    speculator: str = ""
    """The kind of speculator head the model's bundle carries (`baseRT_speculator_kind`: "mtp",
    ...); "" for none."""
    speculator_head: bool = False
    """The library runs a bundle's embedded speculator head (`baseRT_load_speculator_head`,
    `baseRT_mtp_chain`)."""
    drafter: bool = False
    """The library runs block-drafter sidecars (`baseRT_load_drafter`, `baseRT_drafter_step`:
    DFlash / DSpark)."""
    eagle3: bool = False
    """The library runs EAGLE-3 sidecar heads (`baseRT_load_drafter`, `baseRT_eagle3_chain`)."""


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
    """Lanes actually served: the requested value capped by the engine's own limit."""
    prefix_cache: bool
    library_path: str
    library_version: str
    capabilities: Capabilities
    """What the engine can do, asked once at open (`Capabilities.flags`: the raw `BASERT_CAP_*` bits)."""
    prefill_chunk: int = 0
    """Prompt tokens prefilled per step (the requested value capped by the engine's)."""
    kv_cache_dtype: str = ""
    """The KV cache's element type as the engine allocated it: "f32", "f16", "q8" (Q8_0 blocks),
    "q4", or "q8/q4" (K at Q8_0, V at Q4_0); "" where the library cannot say."""
    bos_token: str = ""
    """The text of the model's beginning-of-sequence token, as its chat template prints
    `bos_token` ("" where the library cannot say)."""
    eos_token: str = ""
    """The text of the model's end-of-sequence token, as its chat template prints `eos_token`
    ("" where the library cannot say)."""
    engine_threads: int = 0
    """The threads the engine computes a step with (the reference engine's shared pool, the
    engine thread included), as the library said at open; 0 where it cannot say."""

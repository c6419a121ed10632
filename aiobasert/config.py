"""`EngineConfig`: the options an engine is opened with, validated once, on construction."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from .errors import InvalidConfigError
from .types import DTYPES, KV_CACHE_DTYPES, Dtype, KVCacheDtype

__all__ = ["EngineConfig", "SpeculationConfig", "config_from"]

_INT32_MAX = 2**31 - 1

SpeculationMethod = Literal["ngram", "draft", "mtp", "eagle3", "dflash", "dspark"]
SPECULATION_METHODS: tuple[str, ...] = ("ngram", "draft", "mtp", "eagle3", "dflash", "dspark")
"""`SpeculationConfig.method`: prompt lookup, a draft model, and the engine's own speculators."""


class SpeculationConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding (docs/speculative.md): draft tokens verified inside the fused step.

    The output is token for token what the engine makes without speculation (greedy and seeded
    requests alike); only its speed changes. A decode lane feeds its pending token and up to
    `num_speculative_tokens` drafts as rows of one step, and keeps the drafts the model itself
    would have chosen.

    method: where drafts come from: "ngram" (prompt lookup: what followed the latest earlier
        occurrence of the lane's last n tokens in its prompt and output; no model); "draft" (a
        smaller model with the target's vocabulary, `draft_model`, run beside it: vLLM's draft
        model, llama.cpp's `-md`); "mtp", "eagle3", "dflash", "dspark" (the engine's own
        speculators: refused at open by an engine without them, `UnsupportedError` naming what
        it lacks).
    draft_model: the draft model for method="draft" (or an engine speculator's sidecar): the path (a
        str or `os.PathLike`, kept as a str) of a `.base` bundle or a GGUF (converted into the cache
        once), or a cached model's name; its vocabulary
        must be the target's (refused at open otherwise, naming this field).
    num_speculative_tokens: drafts a lane verifies in one step at most (1..7).
    prompt_lookup_min, prompt_lookup_max: the n-gram sizes matched, longest first (1..16).
    adaptive: choose each lane's draft count per step from its acceptance so far and what a
        row costs the step (measured), down to none where drafts do not pay; False verifies
        every proposal at full length (for tests and measurements).
    """

    method: SpeculationMethod = "ngram"
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATION_METHODS:
            raise InvalidConfigError(f"speculation.method must be one of {SPECULATION_METHODS}, got {self.method!r}")
        if isinstance(self.draft_model, os.PathLike):  # a Path, as Engine.open takes the model's
            msgspec.structs.force_setattr(self, "draft_model", os.fspath(self.draft_model))
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise InvalidConfigError(
                f"speculation.draft_model must be a non-empty path (str or os.PathLike), got {self.draft_model!r}"
            )
        if self.method == "draft" and self.draft_model is None:
            raise InvalidConfigError("speculation.draft_model is required with method='draft' (the draft model's path)")
        if self.method == "ngram" and self.draft_model is not None:
            raise InvalidConfigError(
                "speculation.draft_model is a draft model's path: use it with method='draft' (method is 'ngram')"
            )
        for name, low, high in (
            ("num_speculative_tokens", 1, 7),
            ("prompt_lookup_min", 1, 16),
            ("prompt_lookup_max", 1, 16),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidConfigError(f"speculation.{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidConfigError(
                f"speculation.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if not isinstance(self.adaptive, bool):
            raise InvalidConfigError(f"speculation.adaptive must be a bool, got {self.adaptive!r}")


def speculation_from(value: Any) -> SpeculationConfig | None:
    """`Engine.open`'s `speculation`: a `SpeculationConfig`, a method's name ("ngram"; "mtp" etc.
    with their defaults) or None (off)."""
    if value is None or isinstance(value, SpeculationConfig):
        return value
    if isinstance(value, str):
        return SpeculationConfig(method=value)  # type: ignore[arg-type]  # checked by the config
    raise InvalidConfigError(
        f"speculation must be a SpeculationConfig, a method name ('ngram') or None, not {type(value).__name__}"
    )


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an engine is opened: its serving limits, its KV cache, and where its library is.

    `Engine.open(model, config=EngineConfig(...))`, `create_app(model, config=...)` and the CLI's
    flags all come down to one of these; `Engine.open(model, max_batch_size=4, ...)` builds it
    from the keywords. Every field is checked on construction: a value out of range or of the
    wrong type raises `InvalidConfigError` naming the field, before anything is loaded.
    `engine.config` is the config an engine was opened with; `engine.info` says what it serves
    (the limits below capped by the engine's and the model's own).

    max_batch_size: concurrent lanes (sequences decoded together each step); capped by the
        engine's own limit (`info.max_batch_size` is what is served).
    max_context: tokens per lane (prompt + output), clamped to the model's window.
    prefill_chunk: prompt tokens prefilled per step across all lanes, so a long prompt never
        stalls running streams for more than one chunk.
    prefix_cache: reuse the KV of shared prompt prefixes across requests.
    prefix_cache_mb: the most KV the prefix cache keeps for later requests, MiB (None = a quarter of
        the KV pool; 0 = none kept once its request ends). Past it, the least recently used cached
        prefixes are evicted after each request, so an idle engine holds at most this much KV beyond
        its running lanes' (docs/fairness.md, "Memory stays bounded"). KV that running lanes share
        with the cache is not counted against it until they end.
    max_queue: requests waiting for a lane before `EngineOverloadedError`.
    library: the libbaseRT to load (a path; None = $BASERT_LIB_PATH, the system's, the bundled one).
    thread_check: debug mode asserting that only the engine thread enters the library
        (None = on when $AIOBASERT_DEBUG_THREADS is set to anything but 0).
    dtype: how a GGUF model is stored in its cached bundle (one bundle per dtype): "auto" keeps
        what the GGUF has (quantized blocks carried exactly where the engine's integer kernels
        can hold them, see docs/models.md), "f16" / "f32" dequantize, "q8" / "q4" quantize
        group-wise. Ignored for a `.base` bundle or a cached name.
    kv_cache_dtype: how the KV cache is stored: "auto" (f16 on the reference engine, as
        llama.cpp; the library's default elsewhere: Q8_0 on BaseRT where head_dim allows),
        "f16", "q8" (Q8_0 blocks, about half of f16; a head_dim that is not a multiple of 32
        falls back to f16), "f32" (the reference engine's exact pool, twice f16: for results
        bit-equal to an f32 reference). `info.kv_cache_dtype` says what was allocated.
    grammar_backend_at_open: build the host grammar backend (llguidance's view of the model's
        vocabulary) while the engine opens, before any stream runs. llguidance builds it holding
        the GIL, which pauses every running stream: ~1 s for a 49k vocabulary, several for a 262k
        one. The backend compiles the schemas and tool grammars the engine's own compiler does not
        take (every one, on an engine without a compiler). False builds it on first use instead,
        which saves its memory (~70 MiB for a 49k vocabulary, ~340 MiB for 262k, numpy's
        included) where no request needs it, at the price of that one pause mid-service
        (docs/fairness.md).
    chat_template: a Jinja chat template (its text) used instead of the model's own (`--chat-template
        FILE` reads one from a file); None: the model's, or its family's where it has none.
    speculation: speculative decoding (`SpeculationConfig`, docs/speculative.md); None = off.
    """

    max_batch_size: int = 8
    max_context: int = 2048
    prefill_chunk: int = 256
    prefix_cache: bool = True
    prefix_cache_mb: int | None = None
    max_queue: int = 1024
    library: str | None = None
    thread_check: bool | None = None
    dtype: Dtype = "auto"
    kv_cache_dtype: KVCacheDtype = "auto"
    grammar_backend_at_open: bool = True
    chat_template: str | None = None
    speculation: SpeculationConfig | None = None

    def __post_init__(self) -> None:
        for name, low in (("max_batch_size", 1), ("max_context", 2), ("prefill_chunk", 1), ("max_queue", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _INT32_MAX:
                raise InvalidConfigError(f"{name} must be an integer in [{low}, 2**31 - 1], got {value!r}")
        for name, choices in (("kv_cache_dtype", KV_CACHE_DTYPES), ("dtype", DTYPES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise InvalidConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        mb = self.prefix_cache_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or not 0 <= mb <= _INT32_MAX):
            raise InvalidConfigError(f"prefix_cache_mb must be None or an integer in [0, 2**31 - 1], got {mb!r}")
        for name in ("prefix_cache", "grammar_backend_at_open"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.library is not None and not isinstance(self.library, str):
            raise InvalidConfigError(f"library must be a path (str) or None, not {type(self.library).__name__}")
        if self.chat_template is not None:
            _check_template(self.chat_template)
        if self.thread_check is not None and not isinstance(self.thread_check, bool):
            raise InvalidConfigError(f"thread_check must be a bool or None, got {self.thread_check!r}")
        if self.speculation is not None and not isinstance(self.speculation, SpeculationConfig):
            raise InvalidConfigError(
                f"speculation must be a SpeculationConfig or None, not {type(self.speculation).__name__}"
            )


MAX_CHAT_TEMPLATE_CHARS = 1 << 20


def _check_template(template: object) -> None:
    """A chat template that is text, at most `MAX_CHAT_TEMPLATE_CHARS`, and compiles (Jinja's syntax
    error named now, not at the first chat)."""
    if not isinstance(template, str) or not template.strip():
        raise InvalidConfigError(f"chat_template must be the non-empty text of a Jinja template, got {template!r:.60}")
    if len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise InvalidConfigError(f"chat_template: {len(template)} characters; at most {MAX_CHAT_TEMPLATE_CHARS}")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(template)
    except TemplateSyntaxError as exc:
        raise InvalidConfigError(f"chat_template: not a Jinja template: {exc} (line {exc.lineno})") from None


_DEFAULTS = EngineConfig()


def config_from(config: EngineConfig | None, options: Mapping[str, Any]) -> EngineConfig:
    """`config`, or the config the keyword `options` describe (`Engine.open`'s, `create_app`'s).

    With `config` given, every option must be left at its default: one set as well would be
    silently dropped, so it is refused (`InvalidConfigError` naming it)."""
    library = options.get("library")
    if isinstance(library, os.PathLike):  # the keyword takes a Path; the config holds its text
        options = {**options, "library": os.fspath(library)}
    if config is None:
        return EngineConfig(**options)
    if not isinstance(config, EngineConfig):
        raise InvalidConfigError(f"config must be an EngineConfig or None, not {type(config).__name__}")
    given = [name for name, value in options.items() if not _is_default(name, value)]
    if given:
        raise InvalidConfigError(
            f"{', '.join(given)}: give the engine options either as keywords or in `config`, not both"
        )
    return config


def _is_default(name: str, value: object) -> bool:
    default = getattr(_DEFAULTS, name)
    return type(value) is type(default) and value == default

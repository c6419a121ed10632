"""Which GGUF tokenizers the reference engine runs exactly: checked when a GGUF is inspected, before
any tensor is converted, so a vocabulary the engine would tokenize differently from llama.cpp is
refused at once with one line naming it.

The names mirror native/src/tokenizer.c (bpe_supported); tests/models/test_tokenizer_native.py holds the two
lists to each other through the C code.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE",
    "bundle_tokenizer",
    "check_bundle_tokenizer",
    "rstrip_token_ids",
    "tokenizer_refusal",
]

_FLT_MAX: Final = 3.4028234663852886e38

#: tokenizer.ggml.model values: byte-level BPE and SentencePiece BPE (scores, byte fallback).
SUPPORTED_MODELS: Final = ("gpt2", "llama")

#: tokenizer.ggml.pre values of byte-level BPE vocabularies, by the regex llama.cpp runs for them.
SUPPORTED_PRE: Final[Mapping[str, tuple[str, ...]]] = {
    "GPT-2": ("gpt2", "gpt-2", "phi-2", "mpt", "olmo"),
    "digits, then GPT-2": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
    "Llama 3": ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
    "Qwen2": ("qwen2", "deepseek-r1-qwen", "stablelm2"),
}

_PRE_NAMES: Final = frozenset(name for names in SUPPORTED_PRE.values() for name in names)


def tokenizer_refusal(meta: Mapping[str, Any]) -> str | None:
    """None when the engine tokenizes this GGUF's vocabulary exactly, else the one-line reason."""
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        return (
            f"tokenizer model {model!r} (tokenizer.ggml.model) is not one the engine runs exactly "
            f"(it runs {', '.join(SUPPORTED_MODELS)})"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        bad = next((i for i, t in enumerate(tokens) if not isinstance(t, str) or not t or "\0" in t), None)
        if bad is not None:
            return f"tokenizer.ggml.tokens[{bad}] is {tokens[bad]!r}: the engine needs non-empty texts without NUL"
    scores = meta.get("tokenizer.ggml.scores")
    if isinstance(scores, list) and any(isinstance(x, float) and math.isnan(x) for x in scores):
        return "tokenizer.ggml.scores holds NaN: SentencePiece merges by score need ordered scores"
    if model == "gpt2":
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in _PRE_NAMES:
            named = "no pre-tokenizer (tokenizer.ggml.pre)" if pre is None else f"pre-tokenizer {pre!r}"
            return (
                f"{named} is not one the engine runs exactly (it runs llama-bpe, qwen2, smollm, gpt-2, "
                "starcoder and their aliases: docs/models.md)"
            )
    return None


def check_bundle_tokenizer(path: str | os.PathLike[str]) -> None:
    """Build only the bundle's tokenizer in the engine (no weights are read) and raise the engine's typed
    error when it refuses it: `serve` checks this before its server starts, so a bundle converted by an
    older aiobasert with a tokenizer the engine no longer runs is one line, not a failed startup."""
    from .._ffi import load_library

    lib = load_library()
    model = lib.baseRT_load_tokenizer_only(os.fsencode(path))
    if not model:
        raise lib.last_error("baseRT_load_tokenizer_only", f"cannot read the tokenizer of {path}")
    lib.baseRT_free_model(model)


def bundle_tokenizer(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The bundle header's `tokenizer` object: the GGUF's `tokenizer.*` keys as they are (docs/BUNDLE.md),
    except infinite scores, which JSON cannot hold: +-FLT_MAX keeps their order against every finite one."""
    fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    scores = fields.get("tokenizer.ggml.scores")
    if isinstance(scores, list):
        fields["tokenizer.ggml.scores"] = [
            math.copysign(_FLT_MAX, x) if isinstance(x, float) and math.isinf(x) else x for x in scores
        ]
    if ids := rstrip_token_ids(meta):
        fields["tokenizer.aiobasert.rstrip_token_ids"] = ids
    return {"tokenizer_type": "gguf"} | fields


def rstrip_token_ids(meta: Mapping[str, Any]) -> list[int]:
    """The added tokens after which llama.cpp drops whitespace in text it matches them in (its
    LLAMA_TOKEN_ATTR_RSTRIP, llama-vocab.cpp): for a model whose general.name holds "phi-3" or "phi3",
    every CONTROL / USER_DEFINED / UNKNOWN token and </s>, except <unk>, <s> and <|endoftext|>."""
    name = str(meta.get("general.name", "")).lower()
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    if not ("phi-3" in name or "phi3" in name) or not isinstance(tokens, list):
        return []
    types = types if isinstance(types, list) and len(types) == len(tokens) else [1] * len(tokens)
    last = {text: i for i, text in enumerate(tokens)}  # llama.cpp's token_to_id: the last id of a text
    strip = {i for i, ty in enumerate(types) if ty in (2, 3, 4)}  # UNKNOWN, CONTROL, USER_DEFINED
    strip |= {last[t] for t in ("</s>",) if t in last}
    strip -= {last[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in last}
    return sorted(strip)

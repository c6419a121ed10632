"""An HF ``tokenizers`` tokenizer.json equivalent to a bundle's GGUF-style tokenizer fields.

The reference engine's C tokenizer (native/src/tokenizer.c) encodes from the ``tokenizer`` object of a
.base header (docs/BUNDLE.md). The parity tests hand the JSON built here to HF ``tokenizers`` and compare
ids, so this mapping states what "equivalent" means:

- model: byte-level BPE over the vocabulary and merges as stored (GGUF keeps the GPT-2 byte-level text),
  no unk token, no byte fallback, merges applied even when a whole word is in the vocabulary (except for
  the Llama 3 names: ``ignore_merges``, as Llama 3's own tokenizer.json);
- pre-tokenizer, by llama.cpp's names (aiobasert.models._gguf_tokenizer): ``smollm`` and its aliases split every
  digit off, then apply the GPT-2 ByteLevel regex; ``gpt2`` / ``gpt-2`` / ``default`` ... only the regex;
  ``llama-bpe`` / ``qwen2`` ... Llama 3's / Qwen2's Split regex, then ByteLevel without its own regex;
- added tokens: every CONTROL (type 3) and UNKNOWN (type 2) token, special, and USER_DEFINED (type 4) token,
  not special, matched verbatim in the raw text (normalized=false, no lstrip/rstrip/single_word);
- decoder: ByteLevel.

A SentencePiece vocabulary (``tokenizer.ggml.model = llama``) becomes what HF's own Llama conversion
writes: BPE with byte fallback, the merges derived from the scores (HF's SentencePieceExtractor), spaces
replaced by U+2581 and, with ``add_space_prefix``, one prepended to every run of text.

BOS/EOS are not part of tokenizer.json (HF keeps them in tokenizer_config.json); nothing is added
around the encoded text, as in the engine, where the caller decides about BOS.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ._gguf_tokenizer import SUPPORTED_PRE

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNKNOWN = 2
_ADDED_TYPES: Final = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)

_BYTE_LEVEL: dict[str, Any] = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}


# Llama 3's and Qwen2's tokenizer.json regexes (they differ in \p{N}{1,3} / \p{N}).
_LLAMA3_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX: Final = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_bytes(regex: str) -> dict[str, Any]:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, dict(_BYTE_LEVEL, use_regex=False)]}


def _pre_tokenizer(pre: str) -> dict[str, Any]:
    if pre in SUPPORTED_PRE["digits, then GPT-2"]:
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}
    if pre in SUPPORTED_PRE["GPT-2"] or pre == "default":
        return dict(_BYTE_LEVEL)
    if pre in SUPPORTED_PRE["Llama 3"]:
        return _split_then_bytes(_LLAMA3_REGEX)
    if pre in SUPPORTED_PRE["Qwen2"]:
        return _split_then_bytes(_QWEN2_REGEX)
    raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}")


def _str_list(tok: Mapping[str, Any], key: str) -> list[str]:
    value = tok.get(key, [])
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of strings")
    return list(value)


def _spm_merges(tokens: list[str], types: list[int], scores: list[float], vocab: Mapping[str, int]) -> list[list[str]]:
    """SentencePiece BPE as HF BPE merges (HF's SentencePieceExtractor): every split of a piece into two
    pieces, ranked by the merged piece's score, highest first (so BPE by rank merges as by score). Added
    tokens are whole-text matches, never merge results (as in the engine and SentencePiece)."""
    merges: list[tuple[str, str, float]] = []
    for token_id, piece in enumerate(tokens):
        if vocab.get(piece) != token_id or types[token_id] in _ADDED_TYPES:
            continue
        local = [
            (piece[:k], piece[k:], scores[token_id])
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)
    return [[left, right] for left, right, _ in merges]


def _blank(text: str) -> bool:
    return not text.strip(" \t\n\r\v\f")


def hf_tokenizer_json(tok: Mapping[str, Any], *, content: bool = False) -> str:
    """Return the tokenizer.json text equivalent to the GGUF-style fields in ``tok``; with ``content``, the
    engine's encoding of client content: the only added tokens are the USER_DEFINED whitespace runs."""
    model = tok.get("tokenizer.ggml.model", "gpt2")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"tokenizer.ggml.model {model!r} is neither byte-level BPE (gpt2) nor SentencePiece (llama)")
    tokens = _str_list(tok, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("tokenizer.ggml.tokens is empty")
    merges: list[Any] = _str_list(tok, "tokenizer.ggml.merges")
    types_value = tok.get("tokenizer.ggml.token_type")
    types = [TOKEN_TYPE_NORMAL] * len(tokens) if types_value is None else [int(t) for t in types_value]
    if len(types) != len(tokens):
        raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
    pre = str(tok.get("tokenizer.ggml.pre", "default"))

    vocab: dict[str, int] = {}
    added_tokens: list[dict[str, Any]] = []
    for token_id, (text, token_type) in enumerate(zip(tokens, types, strict=True)):
        vocab.setdefault(text, token_id)  # the first id of a duplicated text wins, as in the engine
        if content and not (token_type == TOKEN_TYPE_USER_DEFINED and _blank(text)):
            continue
        if token_type in _ADDED_TYPES and text and vocab[text] == token_id:
            added_tokens.append(
                {
                    "id": token_id,
                    "content": text,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": token_type != TOKEN_TYPE_USER_DEFINED,
                }
            )

    if model == "llama":
        scores = [float(x) for x in tok.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        if len(scores) != len(tokens):
            raise ValueError(f"{len(scores)} scores for {len(tokens)} tokens")
        space_prefix = bool(tok.get("tokenizer.ggml.add_space_prefix", True))
        unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == TOKEN_TYPE_UNKNOWN), None)
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        normalizer: Any = {
            "type": "Sequence",
            "normalizers": [*([{"type": "Prepend", "prepend": "\u2581"}] if space_prefix else []), replace],
        }
        pre_tokenizer: Any = None
        decoder: Any = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if space_prefix else []),
            ],
        }
        merges = _spm_merges(tokens, types, scores, vocab)
    else:
        unk, normalizer, pre_tokenizer, decoder = None, None, _pre_tokenizer(pre), dict(_BYTE_LEVEL)
    document: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": decoder,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": model == "llama",
            "byte_fallback": model == "llama",
            "ignore_merges": pre in SUPPORTED_PRE["Llama 3"],
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(document, ensure_ascii=False)

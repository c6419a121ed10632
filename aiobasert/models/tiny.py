"""Tiny random bundles of each architecture the engine runs (llama, qwen2, qwen3,
gemma3, phi3) with a real byte-level BPE vocabulary, for tests.

The weights are random (seeded) but scaled so activations stay in a sane
range; the vocabulary is real: the 256 GPT-2 byte tokens plus merges learned
by a small deterministic BPE trainer over an embedded multilingual corpus,
pre-tokenized exactly as SmolLM2's "smollm" pre-tokenizer does (each digit on
its own, then the GPT-2 split), so the engine's tokenizer is exercised the
same way as with the real model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import math
import unicodedata
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from .bundle import f32_to_bf16, llama_header, write_bundle

__all__ = [
    "ARCHS",
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "TinyVocab",
    "build_tiny_model",
    "bytes_to_unicode",
    "llama3_rope_factors",
    "pretokenize",
    "tiny_vocab",
]

SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID: Final = 1
EOS_ID: Final = 2
TOKEN_NORMAL: Final = 1
TOKEN_CONTROL: Final = 3
EMBED_STD: Final = 0.25

#: SmolLM2-135M-Instruct's chat template (ChatML with a default system prompt).
CHATML_TEMPLATE: Final = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tiny vocabulary: English prose, code, a few other
# languages and scripts, numbers and emoji, so merges cover the usual cases
# (leading-space words, indentation runs, multi-byte UTF-8) without being big.
_CORPUS: Final = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the forest.
Once upon a time, there was a little model that wanted to talk. It read the text again and again,
and slowly it learned the words: the, and, of, to, in, is, that, it, was, for, on, with, as, this.
Streaming tokens one at a time lets the reader see the answer while the model is still thinking.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? It is Paris.
Please write a short story about a robot who learns to paint. The robot painted the sky blue.
In 2024 the team shipped version 3.14.159 with 42 fixes, 7 features and 1000 tests passing.
Call 555-0123 or write to support@example.com before 10:30 on 12/05/2025.
She said that the weather would be better tomorrow, so they planned a walk along the river.
When the session ends, the server closes the stream and returns the remaining tokens to the pool.
There are three things to remember: keep it simple, test everything, and never trust the input.
Question: Which planet is known as the red planet? Answer: Mars is known as the red planet.

def generate(model, prompt, max_tokens=128):
    tokens = model.encode(prompt)
    for step in range(max_tokens):
        logits = model.forward(tokens)
        next_token = int(logits.argmax())
        if next_token == model.eos_token_id:
            break
        tokens.append(next_token)
    return model.decode(tokens)

async def stream(session, text):
    async with session.generate(text) as events:
        async for event in events:
            print(event.text, end="", flush=True)

class Tokenizer:
    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
        self.vocab = vocab
        self.merges = {pair: rank for rank, pair in enumerate(merges)}

    def encode(self, text: str) -> list[int]:
        return [self.vocab[piece] for piece in self.split(text)]

for (int i = 0; i < n; i++) { sum += x[i] * w[i]; }
if (rc != 0) { fprintf(stderr, "error: %s\n", message); return -1; }
{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello! How can I help?"}

Le renard brun saute par-dessus le chien paresseux. C'est la vie, n'est-ce pas ? Où est la gare ?
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München und Köln!
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca? ¡Hola, mañana!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
敏捷的棕色狐狸跳过了懒狗。你好，世界！今天天气很好。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界！ありがとう。
빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 안녕하세요, 세계!
Γρήγορη καφέ αλεπού. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।
Emoji time: 😀 😂 🎉 👍 🚀 ❤️ 👨‍👩‍👧 🇫🇷 — the end… “quoted” ‘text’ «guillemets».
"""

_TARGET_VOCAB: Final = 768


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _is_space(ch: str) -> bool:
    # Unicode White_Space, as regex `\s` (str.isspace also accepts \x1c-\x1f).
    return ch.isspace() and not "\x1c" <= ch <= "\x1f"


_CONTRACTIONS: Final = ("s", "t", "re", "ve", "m", "ll", "d")
_LETTER, _NUMBER, _OTHER, _SPACE = range(4)


def _char_class(ch: str) -> int:
    if _is_space(ch):
        return _SPACE
    category = unicodedata.category(ch)
    if category.startswith("L"):
        return _LETTER
    return _NUMBER if category.startswith("N") else _OTHER


def _gpt2_split(text: str) -> Iterator[str]:
    """The GPT-2 pre-tokenizer regex, hand-written because `re` has no \\p{L}:
    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    n = len(text)
    i = 0
    while i < n:
        if text[i] == "'":
            suffix = next((s for s in _CONTRACTIONS if text.startswith(s, i + 1)), None)
            if suffix is not None:
                yield text[i : i + 1 + len(suffix)]
                i += 1 + len(suffix)
                continue
        start = i
        if text[i] == " " and i + 1 < n and not _is_space(text[i + 1]):
            i += 1  # the optional leading space of a letter / number / symbol run
        cls = _char_class(text[i])
        if cls == _SPACE:
            j = i
            while j < n and _is_space(text[j]):
                j += 1
            # \s+(?!\S): leave the last space to prefix the next word, unless
            # the run is a single character or reaches the end of the text.
            end = j if j == n or j - i == 1 else j - 1
            yield text[i:end]
            i = end
            continue
        i += 1
        while i < n and _char_class(text[i]) == cls:
            i += 1
        yield text[start:i]


def pretokenize(text: str) -> list[str]:
    """SmolLM2's "smollm" pre-tokenizer: every digit alone, then the GPT-2 split
    within the runs between digits."""
    pieces: list[str] = []
    run_start = 0
    for i, ch in enumerate(text):
        if unicodedata.category(ch).startswith("N"):
            pieces.extend(_gpt2_split(text[run_start:i]))
            pieces.append(ch)
            run_start = i + 1
    pieces.extend(_gpt2_split(text[run_start:]))
    return pieces


class TinyVocab:
    """A byte-level BPE vocabulary in GGUF form (tokens, token types, merges)."""

    def __init__(self, tokens: tuple[str, ...], token_types: tuple[int, ...], merges: tuple[str, ...]) -> None:
        self.tokens = tokens
        self.token_types = token_types
        self.merges = merges


def _train_merges(words: Counter[tuple[str, ...]], max_merges: int) -> list[tuple[str, str]]:
    """Deterministic BPE: repeatedly merge the most frequent adjacent pair (ties:
    the lexicographically smallest), counting pairs only inside pre-tokens."""
    symbols = [list(word) for word in words]
    freqs = list(words.values())
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}

    def account(index: int, sign: int) -> None:
        word = symbols[index]
        for pair in itertools.pairwise(word):
            pair_counts[pair] += sign * freqs[index]
            if sign > 0:
                where.setdefault(pair, set()).add(index)

    for index in range(len(symbols)):
        account(index, +1)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[str, str]] = []
    while heap and len(merges) < max_merges:
        neg_count, pair = heapq.heappop(heap)
        if -neg_count != pair_counts[pair]:
            continue  # stale entry; the current count was pushed separately
        if -neg_count < 2:
            break
        merges.append(pair)
        left, right = pair
        for index in sorted(where.pop(pair, ())):
            account(index, -1)
            word, merged = symbols[index], []
            k = 0
            while k < len(word):
                if k + 1 < len(word) and word[k] == left and word[k + 1] == right:
                    merged.append(left + right)
                    k += 2
                else:
                    merged.append(word[k])
                    k += 1
            symbols[index] = merged
            account(index, +1)
            for new_pair in itertools.pairwise(merged):
                heapq.heappush(heap, (-pair_counts[new_pair], new_pair))
        del pair_counts[pair]
    return merges


@functools.lru_cache(maxsize=4)
def tiny_vocab(kind: Literal["bpe", "bytes"] = "bpe") -> TinyVocab:
    """The tiny models' vocabulary: specials (ids 0..2), the 256 byte tokens in
    GPT-2 order, then (for "bpe") the merged tokens in merge order."""
    byte_chars = bytes_to_unicode()
    tokens = [*SPECIAL_TOKENS, *sorted(byte_chars.values())]
    merges: list[tuple[str, str]] = []
    if kind == "bpe":
        words: Counter[tuple[str, ...]] = Counter()
        for piece in pretokenize(_CORPUS):
            words[tuple(byte_chars[b] for b in piece.encode("utf-8"))] += 1
        merges = _train_merges(words, _TARGET_VOCAB - len(tokens))
        known = set(tokens)
        for left, right in merges:
            if left + right not in known:  # two merge paths can build the same string
                known.add(left + right)
                tokens.append(left + right)
    elif kind != "bytes":
        raise ValueError(f"unknown vocab kind {kind!r} (expected 'bpe' or 'bytes')")
    types = [TOKEN_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_NORMAL] * (len(tokens) - len(SPECIAL_TOKENS))
    return TinyVocab(tuple(tokens), tuple(types), tuple(f"{a} {b}" for a, b in merges))


_Tensor = tuple[str, npt.NDArray[Any], str, str]

Arch = Literal["llama", "qwen2", "qwen3", "gemma3", "phi3"]
ARCHS: Final[tuple[Arch, ...]] = ("llama", "qwen2", "qwen3", "gemma3", "phi3")


def llama3_rope_factors(
    head_dim: int,
    rope_theta: float,
    *,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context_length: int = 8192,
) -> npt.NDArray[np.float32]:
    """Llama 3.1's `llama3` RoPE scaling as the per-frequency divisors llama.cpp's converter
    stores in `rope_freqs.weight`: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = original_context_length / low_freq_factor
    high_wavelen = original_context_length / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _stored(name: str, values: npt.NDArray[np.float32], region: str, dtype: str) -> _Tensor:
    """A write_bundle entry holding `values` in bundle dtype `dtype`."""
    if dtype == "f16":
        return name, values.astype(np.float16), region, "f16"
    if dtype == "bf16":
        return name, f32_to_bf16(values), region, "bf16"
    return name, values, region, "f32"


def _check_arguments(
    arch: str,
    *,
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int | None,
    dtype: str,
    tied: bool,
    eos_bias: float,
    sliding: bool,
) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (expected one of {', '.join(ARCHS)})")
    if head_dim is None and (dim % n_heads or (dim // n_heads) % 2):
        raise ValueError(f"dim {dim} must split into {n_heads} heads of an even size")
    if head_dim is not None and head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even")
    if sliding and arch != "gemma3":
        raise ValueError("sliding-window layers are a gemma3 feature")
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
    if dtype not in ("f32", "f16", "bf16"):
        raise ValueError(f"dtype must be 'f32', 'f16' or 'bf16', got {dtype!r}")
    if eos_bias and tied:
        raise ValueError("eos_bias needs an untied lm_head (tied=False)")


def _vocabulary(vocab: Literal["bpe", "bytes"], extra_tokens: Sequence[tuple[str, int]]) -> TinyVocab:
    """The tiny vocabulary with `extra_tokens` appended."""
    words = tiny_vocab(vocab)
    if not extra_tokens:
        return words
    if any(text in words.tokens for text, _ in extra_tokens):
        raise ValueError("extra_tokens must not repeat a token of the vocabulary")
    return TinyVocab(
        words.tokens + tuple(t for t, _ in extra_tokens),
        words.token_types + tuple(ty for _, ty in extra_tokens),
        words.merges,
    )


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The shapes a tiny model's weights are drawn in."""

    arch: Arch
    n_layers: int
    dim: int
    head_dim: int
    q_dim: int
    kv_dim: int
    ffn_dim: int
    n_vocab: int


@dataclasses.dataclass(frozen=True)
class _Weights:
    """A tiny model's weights, as drawn (f32)."""

    embed: npt.NDArray[np.float32]
    lm_head: npt.NDArray[np.float32] | None
    final_norm: npt.NDArray[np.float32]
    layers: list[dict[str, npt.NDArray[np.float32]]]
    """Per layer: the stem of each tensor's name (a norm's ends in "norm", a bias's in ".bias") -> its values."""


def _draw_weights(sizes: _Sizes, seed: int, *, tied: bool) -> _Weights:
    """Random weights from `seed`, drawn in one fixed order (a recipe always builds the same bytes)."""
    rng = np.random.default_rng(seed)
    dim, q_dim, kv_dim, ffn_dim, head_dim = sizes.dim, sizes.q_dim, sizes.kv_dim, sizes.ffn_dim, sizes.head_dim

    def normal(shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(width: int = dim) -> npt.NDArray[np.float32]:
        return (1.0 + normal((width,), 0.1)).astype(np.float32)

    # Every projection reads an RMS-normalised input (rms ~1); std 1/sqrt(fan_in)
    # keeps its output at unit scale. Embeddings are small (logit std ~2 with
    # dim 64), so the layers, not the token's own embedding, dominate the final
    # residual, and a tied model does not just keep predicting its last token.
    embed = normal((sizes.n_vocab, dim), EMBED_STD)
    lm_head = None if tied else normal((sizes.n_vocab, dim), EMBED_STD)
    final_norm = norm_weight()
    layers: list[dict[str, npt.NDArray[np.float32]]] = []
    for _ in range(sizes.n_layers):
        layer = {
            "input_norm": norm_weight(),
            "self_attn.q_proj": normal((q_dim, dim), dim**-0.5),
            "self_attn.k_proj": normal((kv_dim, dim), dim**-0.5),
            "self_attn.v_proj": normal((kv_dim, dim), dim**-0.5),
            "self_attn.o_proj": normal((dim, q_dim), q_dim**-0.5),
            "post_attn_norm": norm_weight(),
            "mlp.gate_proj": normal((ffn_dim, dim), dim**-0.5),
            "mlp.up_proj": normal((ffn_dim, dim), dim**-0.5),
            "mlp.down_proj": normal((dim, ffn_dim), ffn_dim**-0.5),
        }
        if sizes.arch == "qwen2":
            for t, width in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                layer[f"self_attn.{t}_proj.bias"] = normal((width,), 0.5)
        if sizes.arch in ("qwen3", "gemma3"):
            layer["self_attn.q_norm"] = norm_weight(head_dim)
            layer["self_attn.k_norm"] = norm_weight(head_dim)
        if sizes.arch == "gemma3":
            # Output norms keep each residual update at unit scale, like the pre-norms.
            layer["self_attn.out_norm"] = norm_weight()
            layer["mlp.out_norm"] = norm_weight()
        layers.append(layer)
    return _Weights(embed=embed, lm_head=lm_head, final_norm=final_norm, layers=layers)


def _add_eos_channel(weights: _Weights, eos_bias: float, sizes: _Sizes) -> None:
    """Shift the EOS logit by about `eos_bias` nats at every position, through residual channel 0."""
    assert weights.lm_head is not None
    if sizes.arch != "llama":
        raise ValueError("eos_bias is implemented for the llama architecture")
    # Channel 0 holds a constant equal to the typical per-channel rms of the
    # final residual (each layer adds ~0.9, measured with tests/oracle.py),
    # so after the final rmsnorm it reads ~1 at every position.
    weights.embed[:, 0] = np.float32(math.sqrt(EMBED_STD**2 + 0.8 * sizes.n_layers))
    for layer in weights.layers:
        layer["input_norm"][0] = layer["post_attn_norm"][0] = 0.0
        layer["self_attn.o_proj"][0, :] = layer["mlp.down_proj"][0, :] = 0.0
    weights.final_norm[0] = 1.0
    weights.lm_head[:, 0] = 0.0
    weights.lm_head[EOS_ID, 0] = np.float32(eos_bias)


def _bundle_tensors(weights: _Weights, rope_freqs: npt.ArrayLike | None, dtype: str) -> list[_Tensor]:
    """The write_bundle entries: norms and biases f32 ("gpu" region); embeddings and projections in `dtype`."""
    tensors = [_stored("embed_tokens.weight", weights.embed, "gpu", dtype)]
    if rope_freqs is not None:
        tensors.append(_stored("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32), "gpu", "f32"))
    for i, layer in enumerate(weights.layers):
        for key, values in layer.items():
            if key.endswith(".bias"):
                tensors.append(_stored(f"layers.{i}.{key}", values, "gpu", "f32"))
            elif key.endswith("norm"):
                tensors.append(_stored(f"layers.{i}.{key}.weight", values, "gpu", "f32"))
            else:
                tensors.append(_stored(f"layers.{i}.{key}.weight", values, "accelerator", dtype))
    tensors.append(_stored("final_norm.weight", weights.final_norm, "gpu", "f32"))
    if weights.lm_head is not None:
        tensors.append(_stored("lm_head.weight", weights.lm_head, "gpu", dtype))
    return tensors


def _arch_config(
    n_layers: int,
    *,
    rope_scaling: dict[str, Any] | None,
    sliding_window: int | None,
    layer_types: list[str] | None,
    query_pre_attn_scalar: float | None,
    final_logit_softcapping: float | None,
) -> dict[str, Any]:
    """The config keys of the architectures beyond llama's (docs/models.md); {} for none."""
    arch_config: dict[str, Any] = {}
    if rope_scaling is not None:
        arch_config["rope_scaling"] = dict(rope_scaling)
    if sliding_window is not None:
        types = layer_types or ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(n_layers)]
        arch_config |= {"sliding_window": sliding_window, "layer_types": types, "rope_local_base_freq": 10000.0}
    if query_pre_attn_scalar is not None:
        arch_config["query_pre_attn_scalar"] = query_pre_attn_scalar
    if final_logit_softcapping is not None:
        arch_config["final_logit_softcapping"] = final_logit_softcapping
    return arch_config


# Only the newer models' recipes name the keys below: an old recipe keeps its identity hash.


def _vocabulary_recipe(
    extra_tokens: Sequence[tuple[str, int]], chat_template: str | None, tokenizer_keys: Mapping[str, Any] | None
) -> dict[str, Any]:
    if not (extra_tokens or chat_template != CHATML_TEMPLATE or tokenizer_keys):
        return {}
    return {
        "extra_tokens": [list(t) for t in extra_tokens],
        "chat_template": chat_template,
        "tokenizer_keys": dict(tokenizer_keys or {}),
    }


def _architecture_recipe(
    arch: Arch, head_dim: int, arch_config: dict[str, Any], rope_freqs: npt.ArrayLike | None
) -> dict[str, Any]:
    if arch == "llama" and not arch_config and rope_freqs is None:
        return {}
    keys: dict[str, Any] = {"arch": arch, "head_dim": head_dim, **arch_config}
    if rope_freqs is not None:
        keys["rope_freqs"] = [float(f) for f in np.asarray(rope_freqs, dtype=np.float32)]
    return keys


def _tokenizer_fields(words: TinyVocab) -> dict[str, Any]:
    """The header's tokenizer object for the tiny vocabulary (GGUF keys, SmolLM2's pre-tokenizer)."""
    return {
        "tokenizer_type": "gguf",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": list(words.tokens),
        "tokenizer.ggml.token_type": list(words.token_types),
        "tokenizer.ggml.merges": list(words.merges),
        "tokenizer.ggml.bos_token_id": BOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.padding_token_id": EOS_ID,
        "tokenizer.ggml.add_bos_token": False,
    }


def build_tiny_model(
    path: str | Path,
    *,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: Literal["f32", "f16", "bf16"] = "f32",
    tied: bool = True,
    vocab: Literal["bpe", "bytes"] = "bpe",
    eos_bias: float = 0.0,
    arch: Arch = "llama",
    head_dim: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    rope_freqs: npt.ArrayLike | None = None,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
    query_pre_attn_scalar: float | None = None,
    final_logit_softcapping: float | None = None,
    extra_tokens: Sequence[tuple[str, int]] = (),
    chat_template: str | None = CHATML_TEMPLATE,
    tokenizer_keys: Mapping[str, Any] | None = None,
) -> Path:
    """Write a random-weight bundle of `arch` to `path` and return the path.

    Each architecture gets its own tensors (qwen2: q/k/v biases; qwen3 and gemma3:
    q/k norms; gemma3: attention / FFN output norms) and config keys (docs/models.md):
    `head_dim` (default dim / n_heads), `rope_scaling` ({"rope_type": "linear" |
    "yarn", "factor", ...}), `rope_freqs` (divisors per frequency, e.g.
    llama3_rope_factors()), and for gemma3 `sliding_window` with `layer_types`
    (default: every 6th layer full attention), `query_pre_attn_scalar`,
    `final_logit_softcapping`.

    A model family's vocabulary: `extra_tokens` ((text, GGUF token type) pairs, e.g.
    ("<end_of_turn>", 3)) are appended after the tiny vocabulary (ids from
    len(tiny_vocab(vocab).tokens) on), `tokenizer_keys` added to the tokenizer fields
    (e.g. tokenizer.ggml.eot_token_id), and `chat_template` None leaves the template out.

    `eos_bias` (untied models only) shifts the EOS logit by roughly that many
    nats at every position: large positive values make generation stop almost
    at once, large negative ones make EOS practically never sampled. It works
    through a constant residual channel (channel 0) that attention and MLP do
    not read or write, which only `lm_head`'s EOS row looks at.
    """
    _check_arguments(
        arch,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        tied=tied,
        eos_bias=eos_bias,
        sliding=bool(sliding_window or layer_types),
    )
    path = Path(path)
    head_dim = head_dim or dim // n_heads
    words = _vocabulary(vocab, extra_tokens)
    sizes = _Sizes(
        arch=arch,
        n_layers=n_layers,
        dim=dim,
        head_dim=head_dim,
        q_dim=n_heads * head_dim,
        kv_dim=n_kv_heads * head_dim,
        ffn_dim=ffn_dim,
        n_vocab=len(words.tokens),
    )
    weights = _draw_weights(sizes, seed, tied=tied)
    if eos_bias:
        _add_eos_channel(weights, eos_bias, sizes)
    tensors = _bundle_tensors(weights, rope_freqs, dtype)

    arch_config = _arch_config(
        n_layers,
        rope_scaling=rope_scaling,
        sliding_window=sliding_window,
        layer_types=layer_types,
        query_pre_attn_scalar=query_pre_attn_scalar,
        final_logit_softcapping=final_logit_softcapping,
    )
    recipe: dict[str, Any] = dict(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        dtype=dtype,
        tied=tied,
        vocab=vocab,
        eos_bias=eos_bias,
    )
    recipe |= _vocabulary_recipe(extra_tokens, chat_template, tokenizer_keys)
    recipe |= _architecture_recipe(arch, head_dim, arch_config, rope_freqs)
    config: dict[str, Any] = {
        "hidden_size": dim,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": ffn_dim,
        "vocab_size": sizes.n_vocab,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "eos_token_ids": [],
    }
    template = {} if chat_template is None else {"tokenizer.chat_template": chat_template}
    header = llama_header(
        arch=arch,
        dtype=dtype,
        # A synthetic bundle's source is its recipe: hash that, so two builds
        # with the same parameters carry the same identity.
        source={
            "format": "synthetic",
            "sha256": hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest(),
            "filename": "aiobasert.models.tiny",
        },
        config=config | arch_config,
        tokenizer=_tokenizer_fields(words) | template | dict(tokenizer_keys or {}),
        metadata=template | {"aiobasert.models.tiny": recipe},
    )
    write_bundle(path, header, tensors)
    return path

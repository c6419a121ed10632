"""Parity of the reference engine's C tokenizer with HF tokenizers, on a small BPE trained here.

The vocabulary is trained with HF's BpeTrainer (byte-level, digits split, a few hundred merges) over the
test corpus, exported to the GGUF-style arrays a bundle carries, and then both sides tokenize the corpus:
the C code through native/tests/tok_driver.c, HF through the tokenizer.json that aiobasert.models._hf_tokenizer
builds from the same arrays.
"""

from __future__ import annotations

import ctypes
import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from raw_abi import load
from tiny_gguf import write_gguf
from tok_harness import (
    build_driver,
    hf_references,
    parity_mismatches,
    run_encode,
    run_token_bytes,
    run_utf8,
    write_vocab,
)
from tokenizer_corpus import corpus
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

import aiobasert.models.convert
from aiobasert._ffi import Library
from aiobasert.chat import render_chat
from aiobasert.models._gguf_tokenizer import SUPPORTED_PRE, tokenizer_refusal
from aiobasert.models._hf_tokenizer import hf_tokenizer_json
from aiobasert.models.cache import cache_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sep|>"]
USER_DEFINED_TOKENS = ["<tool_call>"]
N_MERGES = 600


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer_native")


@pytest.fixture(scope="module")
def driver(workdir: Path) -> Path:
    return build_driver(workdir)


@pytest.fixture(scope="module")
def strings() -> list[str]:
    return corpus()


@pytest.fixture(scope="module")
def trained(strings: list[str]) -> Tokenizer:
    return train_tokenizer(strings, across_pre_tokens=False)


@pytest.fixture(scope="module")
def trained_across(strings: list[str]) -> Tokenizer:
    return train_tokenizer(strings, across_pre_tokens=True)


def train_tokenizer(strings: list[str], across_pre_tokens: bool) -> Tokenizer:
    """A byte-level BPE with a few hundred merges, the special tokens and a user-defined token.

    Trained on the pre-tokens (the realistic case), no merge spans a pre-token boundary, so a pre-tokenizer
    that failed to split somewhere would still give the same ids. Trained on whole strings instead
    (across_pre_tokens), it learns merges such as "Ġ Ġ", "' S" or "a Ġ" that make every boundary the
    engine draws differently from HF visible in the ids."""
    tk = Tokenizer(models.BPE())
    if across_pre_tokens:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(alphabet) + N_MERGES,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tk.train_from_iterator(strings, trainer)
    tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in USER_DEFINED_TOKENS])
    return tk


def gguf_fields(tk: Tokenizer, pre: str) -> dict[str, Any]:
    """The trained tokenizer as the GGUF-style arrays of a .base header."""
    n = tk.get_vocab_size(with_added_tokens=True)
    tokens = [tk.id_to_token(i) for i in range(n)]
    types = [3 if t in SPECIAL_TOKENS else 4 if t in USER_DEFINED_TOKENS else 1 for t in tokens]
    merges = json.loads(tk.to_str())["model"]["merges"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
    }


@pytest.mark.parametrize("pre", ["smollm", "gpt2"])
@pytest.mark.parametrize("training", ["trained", "trained_across"])
def test_parity_with_hf(
    pre: str, training: str, request: pytest.FixtureRequest, driver: Path, workdir: Path, strings: list[str]
) -> None:
    fields = gguf_fields(request.getfixturevalue(training), pre)
    assert abs(len(fields["tokenizer.ggml.merges"]) - N_MERGES) <= 50
    vocab = workdir / f"vocab-{training}-{pre}.txt"
    write_vocab(vocab, fields)
    checks, mismatches = parity_mismatches(driver, vocab, fields, strings, workdir)
    assert checks == 5 * len(strings) >= 10_000
    assert not mismatches, f"{len(mismatches)} of {checks} differ:\n" + "\n".join(mismatches[:20])


def test_exported_json_matches_trained_tokenizer(trained: Tokenizer, strings: list[str]) -> None:
    # The tokenizer.json built from the GGUF-style arrays is the trained tokenizer: the parity reference
    # is not an artefact of the export.
    framing, _ = hf_references(gguf_fields(trained, "smollm"))
    for s in strings:
        assert framing.encode(s).ids == trained.encode(s).ids, repr(s)


def test_long_inputs_and_piece_boundaries(trained: Tokenizer, driver: Path, workdir: Path, strings: list[str]) -> None:
    fields = gguf_fields(trained, "smollm")
    vocab = workdir / "vocab-long.txt"
    write_vocab(vocab, fields)
    framing, plain = hf_references(fields)
    text = "".join(strings)
    data = text.encode()
    rng = random.Random(1)
    cuts = sorted(rng.sample(range(1, len(data)), 200))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    records = [
        [(False, data)],
        [(True, p) for p in pieces],  # byte-level cuts, UTF-8 sequences included
    ]
    (full_ids, full_bytes), (plain_ids, plain_bytes) = run_encode(driver, vocab, records, workdir)
    assert full_ids == framing.encode(text).ids
    assert plain_ids == plain.encode(text).ids
    assert full_bytes == plain_bytes == data


def test_utf8_assembler(driver: Path, workdir: Path, strings: list[str]) -> None:
    rng = random.Random(2)
    records: list[list[bytes]] = []
    for s in strings:
        data = s.encode()
        if len(data) != len(s):  # multi-byte text: byte-by-byte and random chunks
            records.append([data[i : i + 1] for i in range(len(data))])
            records.append(_random_chunks(rng, data))
    # Invalid and truncated sequences: lone continuation bytes, overlong and surrogate leads, bytes that
    # never occur in UTF-8, sequences cut by ASCII, and text ending in an incomplete character.
    odd = [
        b"\x80",
        b"\xbf",
        b"\xc0",
        b"\xc1",
        b"\xc2",
        b"\xe0",
        b"\xe0\x80",
        b"\xed",
        b"\xed\xa0",
        b"\xef\xbf",
        b"\xf0",
        b"\xf0\x8f",
        b"\xf0\x9f\x98",
        b"\xf4\x90",
        b"\xf5",
        b"\xff",
        b"A",
        b" ",
        "é".encode(),
        "中".encode(),
        "😀".encode(),
    ]
    for _ in range(600):
        data = b"".join(rng.choice(odd) for _ in range(rng.randint(1, 12)))
        records.append(_random_chunks(rng, data))
    results = run_utf8(driver, records, workdir)
    assert len(results) == len(records)
    for feeds, (outs, pending) in zip(records, results, strict=True):
        expected, emitted, prefix = [], b"", b""
        for f in feeds:
            prefix += f
            total, held = _assembled(prefix)
            assert total.startswith(emitted)
            expected.append(total[len(emitted) :])
            emitted = total
        assert outs == expected, feeds
        assert pending == held, feeds


def _assembled(data: bytes) -> tuple[bytes, int]:
    """All an assembler fed `data` should have emitted, and how many bytes it should hold: everything
    but a trailing incomplete (still completable) character, decoded with one U+FFFD per maximal invalid
    subpart. (CPython's incremental decoder is no oracle: it also holds ED A0..BF, a surrogate that can
    never complete.)"""
    for k in (3, 2, 1):
        tail = data[-k:]
        if len(tail) < k:
            continue
        try:
            tail.decode()
        except UnicodeDecodeError as e:
            if e.start == 0 and e.end == k and e.reason == "unexpected end of data":
                return data[:-k].decode(errors="replace").encode(), k
    return data.decode(errors="replace").encode(), 0


def _random_chunks(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted({rng.randint(0, len(data)) for _ in range(rng.randint(0, 6))})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.pre": "deepseek-llm"}, "unsupported pre-tokenizer"),
        ({"tokenizer.ggml.pre": "default"}, "unsupported pre-tokenizer"),
        ({"tokenizer.ggml.model": "t5"}, "unsupported tokenizer model"),
        ({"tokenizer.ggml.merges": ["a zzz_not_a_token"]}, "not in the vocabulary"),
        ({"tokenizer.ggml.merges": ["ab"]}, 'is not "left right"'),
        ({"tokenizer.ggml.token_type": [7, 1, 1]}, "not a GGUF token type"),
    ],
)
def test_invalid_vocabulary_is_rejected(change: dict[str, Any], message: str, driver: Path, workdir: Path) -> None:
    fields: dict[str, Any] = {
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.token_type": [1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
    }
    fields.update(change)
    vocab = workdir / "bad-vocab.txt"
    write_vocab(vocab, fields)
    with pytest.raises(AssertionError, match=message):
        run_encode(driver, vocab, [[(False, b"ab")]], workdir)


def test_invalid_arguments_fail_cleanly(trained: Tokenizer, driver: Path, workdir: Path) -> None:
    vocab = workdir / "vocab-misuse.txt"
    write_vocab(vocab, gguf_fields(trained, "smollm"))
    proc = subprocess.run([str(driver), "misuse", str(vocab)], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stdout + proc.stderr


def test_hf_json_rejects_unknown_pre_tokenizer() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        hf_tokenizer_json({"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.pre": "deepseek-llm"})


# ---- llama.cpp's own vocabulary test files ---------------------------------------------------------
#
# llama.cpp ships, per tokenizer, a GGUF with the vocabulary (no weights), input texts (.inp, separated by
# "\n__ggml_vocab_test__\n") and the ids its test-tokenizer-0 must produce (.out, one line per text; made
# by HF tokenizers with add_special_tokens=False and held by llama.cpp's tokenizer). Every vocabulary
# there is either tokenized to exactly those ids, or refused by the GGUF inspection before conversion.

LLAMA_CPP_SEPARATOR = b"\n__ggml_vocab_test__\n"
# The vocabularies of the files, by what the engine does with them (a new sdist may add files: the
# exhaustive test below then says which ones to place here).
EXACT_VOCABS = ("llama-spm", "llama-bpe", "qwen2", "gpt-2", "starcoder", "refact", "command-r", "mpt", "phi-3")
UNTESTED_VOCABS = ("baichuan",)  # SentencePiece, run as llama-spm is; llama.cpp ships no .inp / .out for it
REFUSED_VOCABS = (
    "aquila",
    "bert-bge",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-neox",
    "nomic-bert-moe",
    "qwen35",
)


def llama_cpp_meta(vocab_dir: Path, name: str) -> dict[str, Any]:
    _, meta = aiobasert.models.convert._read_gguf(vocab_dir / f"ggml-vocab-{name}.gguf")
    return meta


def llama_cpp_fields(vocab_dir: Path, name: str) -> dict[str, Any]:
    return {k: v for k, v in llama_cpp_meta(vocab_dir, name).items() if k.startswith("tokenizer.")}


def llama_cpp_cases(vocab_dir: Path, name: str) -> list[tuple[bytes, list[int]]]:
    """(text, expected ids) pairs, read as llama.cpp's test-tokenizer-0 reads them."""
    raw = (vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_bytes()
    texts = raw.split(LLAMA_CPP_SEPARATOR)
    if raw.endswith(LLAMA_CPP_SEPARATOR):
        texts.pop()  # the file ends with a separator, not with an empty text
    lines = (vocab_dir / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(lines) >= len(texts) >= 30
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=False)]


def test_every_llama_cpp_vocabulary_is_exact_or_refused(llama_cpp_vocab_dir: Path) -> None:
    names = sorted(
        p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in llama_cpp_vocab_dir.glob("ggml-vocab-*.gguf")
    )
    assert sorted((*EXACT_VOCABS, *UNTESTED_VOCABS, *REFUSED_VOCABS)) == names
    for name in names:
        refusal = tokenizer_refusal(llama_cpp_meta(llama_cpp_vocab_dir, name))
        assert (refusal is None) == (name not in REFUSED_VOCABS), (name, refusal)


@pytest.mark.parametrize("name", EXACT_VOCABS)
def test_llama_cpp_vocabulary_ids(name: str, llama_cpp_vocab_dir: Path, driver: Path, workdir: Path) -> None:
    fields = llama_cpp_fields(llama_cpp_vocab_dir, name)
    vocab = workdir / f"llama-cpp-{name}.txt"
    write_vocab(vocab, fields)
    cases = llama_cpp_cases(llama_cpp_vocab_dir, name)
    # llama.cpp's test tokenizes with parse_special=false; the texts hold no marker text, so framing (markers
    # matched) and content (none matched) must both give the ids.
    records = [[(plain, text)] for text, _ in cases for plain in (False, True)]
    results = run_encode(driver, vocab, records, workdir)
    spm = fields["tokenizer.ggml.model"] == "llama"
    prefix = b" " if spm and fields.get("tokenizer.ggml.add_space_prefix", True) else b""
    mismatches = []
    for (text, want), (ids, data) in zip([c for c in cases for _ in (0, 1)], results, strict=True):
        if ids != want:
            mismatches.append(f"{text[:50]!r}: engine {ids[:16]} != llama.cpp {want[:16]}")
        if data != (prefix + text if text else b""):  # the token bytes rebuild the text
            mismatches.append(f"{text[:50]!r}: token bytes {data[:50]!r}")
    assert not mismatches, f"{len(mismatches)} of {len(records)} differ:\n" + "\n".join(mismatches[:20])


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe"])
def test_llama_cpp_vocabulary_through_a_bundle(
    name: str, llama_cpp_vocab_dir: Path, tmp_path: Path, lib: Library
) -> None:
    """The vocabulary carried by a GGUF -> .base conversion (random weights) into the loader: the engine's
    own encode / decode entry points give llama.cpp's ids and the text back."""
    fields = llama_cpp_fields(llama_cpp_vocab_dir, name)
    bundle = aiobasert.models.convert.convert_gguf(
        write_gguf(tmp_path / f"{name}.gguf", tokenizer=fields), tmp_path / f"{name}.base", progress=False
    )
    m = load(lib, bundle, 64)
    try:
        spm = fields["tokenizer.ggml.model"] == "llama"
        assert lib.baseRT_add_bos(m) == (1 if spm else 0)  # llama.cpp's default per model, or the GGUF's key
        bos = [fields["tokenizer.ggml.bos_token_id"]] if spm else []
        buf = (ctypes.c_uint32 * 4096)()
        raw = ctypes.create_string_buffer(256)

        def token_bytes(t: int) -> bytes:
            n = lib.baseRT_decode_token_raw(m, t, raw, 256)
            return raw.raw[:n]

        for text, want in llama_cpp_cases(llama_cpp_vocab_dir, name):
            n = lib.baseRT_encode_plain(m, text, buf, 4096)
            assert list(buf[:n]) == bos + want, text
            data = b"".join(token_bytes(t) for t in want)
            assert data == (b" " + text if spm and text else text), text
    finally:
        lib.baseRT_free_model(m)


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "starcoder", "gpt-2", "llama-spm"])
def test_llama_cpp_vocabulary_parity_with_hf(
    name: str, llama_cpp_vocab_dir: Path, driver: Path, workdir: Path, strings: list[str]
) -> None:
    """The whole corpus (every pre-tokenizer branch, many scripts, whitespace runs, markers) on the real
    vocabularies against HF tokenizers with the tokenizer.json built from the same GGUF fields (Llama 3's
    and Qwen2's Split regexes run by HF's Oniguruma, not by the engine's hand-coded split)."""
    fields = llama_cpp_fields(llama_cpp_vocab_dir, name)
    vocab = workdir / f"llama-cpp-{name}.txt"
    write_vocab(vocab, fields)
    framing_tk, plain_tk = hf_references(fields)
    records = [[(plain, s.encode())] for s in strings for plain in (False, True)]
    results = run_encode(driver, vocab, records, workdir)
    mismatches = []
    for s, (got_framing, _), (got_plain, _) in zip(strings, results[0::2], results[1::2], strict=True):
        if got_framing != framing_tk.encode(s, add_special_tokens=False).ids:
            mismatches.append(f"framing {s!r}")
        if got_plain != plain_tk.encode(s, add_special_tokens=False).ids:
            mismatches.append(f"content {s!r}")
    assert not mismatches, f"{len(mismatches)} of {len(records)} differ:\n" + "\n".join(mismatches[:20])


@pytest.mark.parametrize(
    "pre",
    [
        *(n for names in SUPPORTED_PRE.values() for n in names),
        "default",
        "deepseek-llm",
        "deepseek-coder",
        "falcon",
        "qwen35",
        "gemma4",
        "GPT2",
    ],
)
def test_inspection_and_engine_agree_on_pre_tokenizers(pre: str, driver: Path, workdir: Path) -> None:
    # The GGUF inspection (Python) refuses exactly the names the C tokenizer cannot build.
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    vocab = workdir / "pre-vocab.txt"
    write_vocab(vocab, fields)
    refused = tokenizer_refusal(fields)
    if refused is None:
        assert run_encode(driver, vocab, [[(False, b"ab")]], workdir)[0][0] == [2]
    else:
        assert f"pre-tokenizer {pre!r}" in refused
        with pytest.raises(AssertionError, match="unsupported pre-tokenizer"):
            run_encode(driver, vocab, [[(False, b"ab")]], workdir)


def test_sentencepiece_space_prefix(llama_cpp_vocab_dir: Path, driver: Path, workdir: Path) -> None:
    """add_space_prefix as llama.cpp applies it: a space before the text and after every added token (Llama 2);
    none at all when the GGUF turns it off (Gemma's add_space_prefix = false)."""
    fields = llama_cpp_fields(llama_cpp_vocab_dir, "llama-spm")
    texts = [t for t, _ in llama_cpp_cases(llama_cpp_vocab_dir, "llama-spm") if t]
    on, off = workdir / "spm-on.txt", workdir / "spm-off.txt"
    write_vocab(on, fields)
    write_vocab(off, {**fields, "tokenizer.ggml.add_space_prefix": False})
    bos, eos = fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]
    with_prefix = run_encode(driver, on, [[(True, t)] for t in texts], workdir)
    spaced = run_encode(driver, off, [[(True, b" " + t)] for t in texts], workdir)
    bare = run_encode(driver, off, [[(True, t)] for t in texts], workdir)
    turns = run_encode(driver, on, [[(False, b"<s>" + t + b"</s>" + t)] for t in texts], workdir)
    turns_off = run_encode(driver, off, [[(False, b"<s>"), (True, t), (False, b"</s>")] for t in texts], workdir)
    for t, (a, _), (b, _), (c, c_bytes), (d, _), (e, _) in zip(
        texts, with_prefix, spaced, bare, turns, turns_off, strict=True
    ):
        assert a == b, t
        assert c_bytes == t, t  # no space was added
        assert d == [bos, *a, eos, *a], t
        assert e == [bos, *c, eos], t


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe"])
def test_llguidance_sees_the_engine_token_bytes(
    name: str, llama_cpp_vocab_dir: Path, driver: Path, workdir: Path
) -> None:
    """Structured output's host backend (llguidance, from the tokenizer.json built here) must see each
    token as the same bytes the engine decodes it to, or its masks would allow the wrong tokens."""
    llguidance = pytest.importorskip("llguidance")
    fields = llama_cpp_fields(llama_cpp_vocab_dir, name)
    n = len(fields["tokenizer.ggml.tokens"])
    tk = llguidance.LLTokenizer(hf_tokenizer_json(fields), n_vocab=n, eos_token=fields["tokenizer.ggml.eos_token_id"])
    types = fields["tokenizer.ggml.token_type"]
    ordinary = [i for i in range(n) if types[i] in (1, 6)]  # normal and byte tokens (markers print differently)
    vocab = workdir / f"llg-{name}.txt"
    write_vocab(vocab, fields)
    engine = dict(zip(ordinary, run_token_bytes(driver, vocab, ordinary, workdir), strict=True))
    # llguidance reserves the byte 0xFF (never part of UTF-8) to mark special tokens: <0xFF> is b"" to it.
    engine = {i: b for i, b in engine.items() if b != b"\xff"}
    assert len(engine) >= n - 300
    assert {i: tk.decode_bytes([i]) for i in engine} == engine


def llama_cpp_partition(text: str, fields: dict[str, Any], rstrip: set[int]) -> list[int | str]:
    """llama.cpp's tokenizer_st_partition with parse_special: each special token (CONTROL / USER_DEFINED /
    UNKNOWN), longest text first, splits every text fragment at each occurrence; after an RSTRIP token the
    whitespace (C isspace) of the right remainder is dropped. Fragments: token ids and texts."""
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    special = sorted((i for i, ty in enumerate(types) if ty in (2, 3, 4)), key=lambda i: -len(tokens[i]))
    frags: list[int | str] = [text]
    for sid in special:
        marker, out = tokens[sid], []
        for frag in frags:
            while isinstance(frag, str) and marker in frag:
                left, frag = frag.split(marker, 1)
                out += [left] if left else []
                out.append(sid)
                if sid in rstrip:
                    frag = frag.lstrip(" \t\n\v\f\r")
            if frag != "":
                out.append(frag)
        frags = out
    return frags


@pytest.fixture(scope="module")
def phi3_fields(llama_cpp_vocab_dir: Path, llama_cpp_templates_dir: Path) -> dict[str, Any]:
    """Phi-3's vocabulary (llama.cpp's test GGUF, general.name "Phi3") with Phi-3.5-mini-instruct's template."""
    fields = llama_cpp_fields(llama_cpp_vocab_dir, "phi-3")
    fields["tokenizer.chat_template"] = (llama_cpp_templates_dir / "microsoft-Phi-3.5-mini-instruct.jinja").read_text()
    return fields


@pytest.mark.parametrize("name", ["Phi3", "Phi-3-mini-4k-instruct", "Llama 2"])
def test_phi3_markers_strip_the_whitespace_after_them(
    name: str, phi3_fields: dict[str, Any], tmp_path: Path, lib: Library
) -> None:
    """A Phi-3 GGUF (general.name with "phi3" / "phi-3", as llama.cpp decides it) converted and loaded:
    framing text drops the whitespace after every special token but <unk>, <s> and <|endoftext|> (llama.cpp's
    RSTRIP), on into the content that follows; the chat template renders with <|end|> closing each turn, and
    <|end|> ends generation. Under another name the same vocabulary keeps the whitespace."""
    gguf_path = write_gguf(tmp_path / "phi3.gguf", arch="phi3", tokenizer=phi3_fields, extra_kv={"general.name": name})
    bundle = aiobasert.models.convert.convert_gguf(gguf_path, tmp_path / "phi3.base", progress=False)
    tokens = phi3_fields["tokenizer.ggml.tokens"]
    ids = {
        t: tokens.index(t)
        for t in (
            "<s>",
            "</s>",
            "<unk>",
            "<|endoftext|>",
            "<|user|>",
            "<|end|>",
            "<|assistant|>",
            "<|system|>",
            "<|placeholder1|>",
        )
    }
    phi3 = name != "Llama 2"
    rstrip = (
        {i for i, ty in enumerate(phi3_fields["tokenizer.ggml.token_type"]) if ty in (2, 3, 4)}
        - {ids["<s>"], ids["<unk>"], ids["<|endoftext|>"]}
        if phi3
        else set()
    )
    m = load(lib, bundle, 64)
    try:
        buf = (ctypes.c_uint32 * 4096)()

        def plain(text: str) -> list[int]:  # SentencePiece of one fragment (llama.cpp's .out holds it exact)
            n = lib.baseRT_encode_plain(m, text.encode(), buf, 4096)
            return list(buf[1:n])  # after the BOS

        def reference(text: str) -> list[int]:
            out = [ids["<s>"]]
            for frag in llama_cpp_partition(text, phi3_fields, rstrip):
                out += [frag] if isinstance(frag, int) else plain(frag)
            return out

        def framing(text: str) -> list[int]:
            n = lib.baseRT_encode(m, text.encode(), buf, 4096)
            return list(buf[:n])

        texts = [
            "<|user|>\nHi<|end|>\n<|assistant|>\n",
            "<|system|>  \n\t\v\f\r You are<|end|>x",
            "x<s>\nkeep</s>\n drop<|endoftext|>\n keep <unk> keep",
            "a<|placeholder1|>\n\n",
            "<|end|> \n",
        ]
        for text in texts:
            assert framing(text) == reference(text), text
        stripped = [ids["<s>"], ids["<|user|>"], *plain("Hi"), ids["<|end|>"], ids["<|assistant|>"]]
        assert (framing(texts[0]) == stripped) == phi3

        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " \n Hi there "}]
        pieces = render_chat(phi3_fields["tokenizer.chat_template"], messages)
        rendered = "".join(text for text, _ in pieces)
        assert rendered == "<|system|>\nBe brief.<|end|>\n<|user|>\n \n Hi there <|end|>\n<|assistant|>\n"
        datas = [text.encode() for text, _ in pieces]
        n = lib.baseRT_encode_pieces(
            m,
            (ctypes.c_char_p * len(datas))(*datas),
            (ctypes.c_int * len(datas))(*(int(c) for _, c in pieces)),
            len(datas),
            buf,
            4096,
        )
        assert list(buf[:n]) == reference(rendered)  # the user's leading whitespace goes too, as in llama.cpp
        assert lib.baseRT_is_eos_token(m, ids["<|end|>"]) and lib.baseRT_is_eos_token(m, ids["<|endoftext|>"])
    finally:
        lib.baseRT_free_model(m)


def test_phi3_rstrip_on_any_text_of_markers_and_whitespace(
    phi3_fields: dict[str, Any], tmp_path: Path, lib: Library
) -> None:
    """Hypothesis-made texts of Phi-3's markers (RSTRIP or not), whitespace of every kind and words, in any
    order: framing text always equals llama.cpp's partition, and the same text as content pieces (never
    matched as markers) round-trips its bytes (run under ASan + UBSan too: 300 examples, clean)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    gguf_path = write_gguf(
        tmp_path / "phi3.gguf", arch="phi3", tokenizer=phi3_fields, extra_kv={"general.name": "Phi3"}
    )
    bundle = aiobasert.models.convert.convert_gguf(gguf_path, tmp_path / "phi3.base", progress=False)
    tokens, types = phi3_fields["tokenizer.ggml.tokens"], phi3_fields["tokenizer.ggml.token_type"]
    keep = {tokens.index(t) for t in ("<s>", "<unk>", "<|endoftext|>")}
    rstrip = {i for i, ty in enumerate(types) if ty in (2, 3, 4)} - keep
    markers = [*[tokens[i] for i in sorted(rstrip | keep)][:12], "<|end|>", "<|user|>", "<s>", "<|endoftext|>"]
    parts = st.sampled_from([*markers, " ", "  ", "\n", "\t", "\v", "\f", "\r", "\u00a0", "Hi", "x", "<|", "|>"])
    m = load(lib, bundle, 64)
    buf = (ctypes.c_uint32 * 4096)()

    def plain(text: str) -> list[int]:
        n = lib.baseRT_encode_plain(m, text.encode(), buf, 4096)
        assert n >= 1
        return list(buf[1:n])

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(parts, max_size=16).map("".join))
    def check(text: str) -> None:
        want: list[int] = []
        for frag in llama_cpp_partition(text, phi3_fields, rstrip):
            want += [frag] if isinstance(frag, int) else plain(frag)
        want = want if want[:1] == [tokens.index("<s>")] else [tokens.index("<s>"), *want]  # BOS once
        n = lib.baseRT_encode(m, text.encode(), buf, 4096)
        assert list(buf[:n]) == want
        data = text.encode()
        n = lib.baseRT_encode_pieces(m, (ctypes.c_char_p * 2)(b"", data), (ctypes.c_int * 2)(0, 1), 2, buf, 4096)
        assert n >= 0
        raw, out = ctypes.create_string_buffer(64), b""
        for t in list(buf[1:n]):
            k = lib.baseRT_decode_token_raw(m, t, raw, 64)
            assert 0 <= k <= 64
            out += raw.raw[:k]
        assert out.replace("\u2581".encode(), b" ").lstrip(b" ") == data.lstrip(b" ") or not data.strip()

    try:
        check()
    finally:
        lib.baseRT_free_model(m)


def test_content_matches_blank_user_tokens_only(llama_cpp_vocab_dir: Path, driver: Path, workdir: Path) -> None:
    """Client content never becomes a marker (MPT's "[PAD50277]" is a USER_DEFINED token, as Qwen3's <think>
    is): only the USER_DEFINED whitespace runs are matched in it, as llama.cpp matches them everywhere."""
    vocab = workdir / "mpt-markers.txt"
    write_vocab(vocab, llama_cpp_fields(llama_cpp_vocab_dir, "mpt"))
    records = [[(False, b"x[PAD50277]")], [(True, b"x[PAD50277]")], [(False, b"a  b")], [(True, b"a  b")]]
    (framing, _), (content, content_bytes), (blank_f, _), (blank_c, _) = run_encode(driver, vocab, records, workdir)
    assert framing[-1] == 50277 and 50277 not in content and content_bytes == b"x[PAD50277]"
    assert blank_f == blank_c and 50276 in blank_c  # "  "


def test_gemma3_vocabulary_parity_with_hf(driver: Path, workdir: Path, strings: list[str]) -> None:
    """Gemma 3's SentencePiece vocabulary (262144 pieces, add_space_prefix = false, HTML tags and whitespace
    runs as USER_DEFINED tokens) against HF over the corpus, framing and content. The GGUF is the Gemma 3
    270M download of the model tests (llama.cpp ships no Gemma 3 vocabulary file)."""
    gguf = cache_dir() / "downloads" / "gemma-3-270m-q4_k_m.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} is not downloaded (the Gemma 3 model tests fetch it)")
    _, meta = aiobasert.models.convert._read_gguf(gguf)
    fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.add_space_prefix"] is False
    assert tokenizer_refusal(meta) is None
    vocab = workdir / "gemma3.txt"
    write_vocab(vocab, fields)
    framing_tk, plain_tk = hf_references(fields)
    results = run_encode(driver, vocab, [[(plain, s.encode())] for s in strings for plain in (False, True)], workdir)
    mismatches = [
        f"{kind} {s!r}"
        for s, framing, content in zip(strings, results[0::2], results[1::2], strict=True)
        for kind, (got, _), tk in (("framing", framing, framing_tk), ("content", content, plain_tk))
        if got != tk.encode(s, add_special_tokens=False).ids
    ]
    assert not mismatches, f"{len(mismatches)} differ:\n" + "\n".join(mismatches[:20])

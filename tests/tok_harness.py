"""Shared helpers of the native tokenizer tests: build native/tests/tok_driver.c, feed it, and compare
its ids with HF ``tokenizers`` on the same vocabulary (the tokenizer.json from aiobasert.models._hf_tokenizer)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from aiobasert.models._hf_tokenizer import hf_tokenizer_json

REPO = Path(__file__).resolve().parents[1]
DRIVER_SOURCES = [
    REPO / "native" / "tests" / "tok_driver.c",
    REPO / "native" / "src" / "tokenizer.c",
    REPO / "native" / "src" / "unicode_data.c",
]

Piece = tuple[bool, bytes]  # (plain, text): plain pieces are content, the others framing


def build_driver(out_dir: Path) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH: the native tokenizer tests need one")
    exe = out_dir / "tok_driver"
    flags = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"]
    if os.environ.get("AIOBASERT_SANITIZE") == "1":  # as setup.py's sanitizer build
        flags += ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    cmd = [compiler, *flags, f"-I{REPO / 'native' / 'src'}", *map(str, DRIVER_SOURCES), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def _blob(data: bytes) -> bytes:
    return b"%d\n" % len(data) + data + b"\n"


def write_vocab(path: Path, fields: Mapping[str, Any]) -> None:
    """Dump GGUF-style tokenizer fields in the driver's vocabulary format."""
    tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
    types: Sequence[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores: Sequence[float] = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    merges: Sequence[str] = fields.get("tokenizer.ggml.merges", [])
    model = fields.get("tokenizer.ggml.model", "gpt2")
    out = [
        b"pre %s\nmodel %s\nspace_prefix %d\n%d\n"
        % (fields.get("tokenizer.ggml.pre", "default").encode(), model.encode(), _add_space_prefix(fields), len(tokens))
    ]
    out += [
        b"%d %s " % (t, repr(float(sc)).encode()) + _blob(s.encode())
        for s, t, sc in zip(tokens, types, scores, strict=True)
    ]
    out.append(b"%d\n" % len(merges))
    out += [_blob(m.encode()) for m in merges]
    path.write_bytes(b"".join(out))


def _add_space_prefix(fields: Mapping[str, Any]) -> bool:
    """llama.cpp's default: on for SentencePiece unless the GGUF says otherwise."""
    return bool(fields.get("tokenizer.ggml.add_space_prefix", fields.get("tokenizer.ggml.model") == "llama"))


def _run(cmd: list[str]) -> list[str]:
    proc = subprocess.run(cmd, capture_output=True, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd[1]} failed ({proc.returncode}): {proc.stdout[:500]!r} {proc.stderr[:500]!r}")
    return proc.stdout.decode().splitlines()


def run_encode(
    driver: Path, vocab: Path, records: Sequence[Sequence[Piece]], tmp: Path
) -> list[tuple[list[int], bytes]]:
    """Encode each record (a list of pieces); returns (ids, concatenated token bytes) per record."""
    data = [b"%d\n" % len(records)]
    for pieces in records:
        data.append(b"%d\n" % len(pieces))
        data += [b"%d " % plain + _blob(text) for plain, text in pieces]
    inp = tmp / "encode.in"
    inp.write_bytes(b"".join(data))
    lines = _run([str(driver), "encode", str(vocab), str(inp)])
    assert len(lines) == 2 * len(records), "driver output is truncated"
    results = []
    for ids_line, hex_line in zip(lines[0::2], lines[1::2], strict=True):
        ids = [int(t) for t in ids_line.split()]
        results.append((ids, b"" if hex_line == "-" else bytes.fromhex(hex_line)))
    return results


def run_token_bytes(driver: Path, vocab: Path, ids: Sequence[int], tmp: Path) -> list[bytes]:
    """bpe_token_bytes of each id."""
    inp = tmp / "ids.in"
    inp.write_text(" ".join(map(str, ids)))
    return [b"" if h == "-" else bytes.fromhex(h) for h in _run([str(driver), "bytes", str(vocab), str(inp)])]


def run_utf8(driver: Path, records: Sequence[Sequence[bytes]], tmp: Path) -> list[tuple[list[bytes], int]]:
    """Feed each record's chunks to one utf8_assembler; returns (output per feed, pending bytes at the end)."""
    data = [b"%d\n" % len(records)]
    for feeds in records:
        data.append(b"%d\n" % len(feeds))
        data += [_blob(f) for f in feeds]
    inp = tmp / "utf8.in"
    inp.write_bytes(b"".join(data))
    results = []
    for line in _run([str(driver), "utf8", str(inp)]):
        *outs, pending = line.split(" ")
        results.append(([b"" if o == "-" else bytes.fromhex(o) for o in outs], int(pending)))
    return results


def hf_references(fields: Mapping[str, Any]) -> tuple[Tokenizer, Tokenizer]:
    """HF tokenizers for framing text (added tokens matched) and for content text (no added tokens but the
    USER_DEFINED whitespace runs: marker text is ordinary text)."""
    framing = Tokenizer.from_str(hf_tokenizer_json(fields))
    plain = Tokenizer.from_str(hf_tokenizer_json(fields, content=True))
    return framing, plain


def _byte_level_char(b: int) -> str:
    """GPT-2 bytes_to_unicode: printable Latin-1 bytes stand for themselves, the rest map to U+0100..."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(0x100 + sum(1 for x in range(b) if x not in printable))


def unencodable_bytes(fields: Mapping[str, Any]) -> bytes:
    """Bytes without a one-symbol token: BPE drops them from ordinary text (HF does too, having neither
    an unk token nor byte fallback), so they cannot survive a round trip."""
    vocab = set(fields["tokenizer.ggml.tokens"])
    return bytes(b for b in range(256) if _byte_level_char(b) not in vocab)


def _char_split(rng: random.Random, s: str) -> tuple[str, str]:
    k = rng.randint(0, len(s))
    return s[:k], s[k:]


def parity_mismatches(
    driver: Path, vocab: Path, fields: Mapping[str, Any], strings: Sequence[str], tmp: Path, seed: int = 0
) -> tuple[int, list[str]]:
    """Encode every string five ways through the driver and compare with HF; returns (checks, mismatches).

    Kinds: framing text (bpe_encode, parse_special=1), content text (parse_special=0), content split at a
    random BYTE offset into two pieces, framing split into two pieces at a random character (a marker may
    straddle the boundary: consecutive framing pieces are matched as one text), and a chat turn
    framing + content + framing. Every record's token bytes must also concatenate to its input bytes
    (less the bytes the vocabulary cannot encode, see unencodable_bytes).
    """
    framing_tk, plain_tk = hf_references(fields)
    start = framing_tk.token_to_id("<|im_start|>")
    end = framing_tk.token_to_id("<|im_end|>")
    assert start is not None and end is not None, "the vocabulary needs <|im_start|> and <|im_end|>"

    def full(s: str) -> list[int]:
        return list(framing_tk.encode(s, add_special_tokens=False).ids)

    def plain(s: str) -> list[int]:
        return list(plain_tk.encode(s, add_special_tokens=False).ids)

    rng = random.Random(seed)
    records: list[list[Piece]] = []
    expected: list[tuple[str, str, list[int]]] = []
    for s in strings:
        b = s.encode()
        k = rng.randint(0, len(b))
        f1, f2 = _char_split(rng, s)
        records += [
            [(False, b)],
            [(True, b)],
            [(True, b[:k]), (True, b[k:])],
            [(False, f1.encode()), (False, f2.encode())],
            [(False, b"<|im_start|>user\n"), (True, b), (False, b"<|im_end|>\n")],
        ]
        expected += [
            ("framing", s, full(s)),
            ("content", s, plain(s)),
            ("content/2 pieces", s, plain(s)),
            ("framing/2 pieces", s, full(s)),
            ("chat turn", s, [start, *plain("user\n" + s), end, *plain("\n")]),
        ]
    results = run_encode(driver, vocab, records, tmp)
    dropped = unencodable_bytes(fields)
    mismatches = []
    for pieces, (kind, s, want), (got, got_bytes) in zip(records, expected, results, strict=True):
        if got != want:
            mismatches.append(f"{kind} {s!r}: engine {got[:24]} != hf {want[:24]}")
        # (the markers of the chat turns consist of encodable bytes)
        if got_bytes != b"".join(text for _, text in pieces).translate(None, dropped):
            mismatches.append(f"{kind} {s!r}: token bytes {got_bytes[:60]!r} do not rebuild the input")
    return len(records), mismatches

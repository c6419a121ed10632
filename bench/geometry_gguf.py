"""A random-weight GGUF of a real model's geometry, with a real tokenizer: bench input for sizes nobody can
download here (a sibling of bench/vs_llama_server.py, which takes the result with --model).

The llama layout with the named model's layer shapes (135m: SmolLM2-135M, 1b: Llama-3.2-1B, 3b:
Llama-3.2-3B, 8b: Llama-3.1-8B), the tokenizer fields of one of llama.cpp's own vocabulary files
(models/ggml-vocab-*.gguf, which the test suite caches from the llama-cpp-python sdist: run the tokenizer
tests once, or pass --vocab-dir), and random weights. The matrices are written as GGML blocks directly:
K-quants as random blocks (every bit pattern is a valid block; super-block scales sized so values stay
~0.1, as tests/tiny_gguf.py does), Q8_0 / F16 from random floats. The rows of control tokens in the
output matrix (the embedding, for the tied geometries 135m / 1b / 3b) are zero, so no random logit ends a
stream early. --qtype picks the blocks (Q4_K matrices with a Q6_K output and embedding are close to a
Q4_K_M file's sizes); --quantize TYPE instead writes F16 matrices and has llama.cpp's own llama-quantize
make a real TYPE file (Q4_K_M: its per-tensor choice of blocks), with the llama-quantize that
bench/vs_llama_server.py builds beside llama-server (or --llama-quantize PATH).

    python bench/geometry_gguf.py 1b /tmp/llama-1b-q4k.gguf                 # 16 layers, ~0.8 GB
    python bench/geometry_gguf.py 135m /tmp/smol-q8.gguf --qtype Q8_0 --vocab gpt-2
    python bench/geometry_gguf.py 1b /tmp/llama-1b-q4km.gguf --quantize Q4_K_M       # llama-quantize's file
    python bench/vs_llama_server.py --model /tmp/llama-1b-q4k.gguf --threads 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert.models.cache import cache_dir
from aiobasert.models.convert import _read_gguf
from bench.thread_scaling import GEOMETRIES
from tests.tiny_gguf import K_BLOCKS, k_quant_blocks

Q = gguf.GGMLQuantizationType
QTYPES = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K, "Q8_0": Q.Q8_0, "F16": Q.F16}
DEFAULT_VOCAB = {"135m": "gpt-2", "1b": "llama-bpe", "3b": "llama-bpe", "8b": "llama-bpe"}
CONTROL = 3  # llama.cpp's token type of control tokens
TIED = {"135m", "1b", "3b"}  # the output matrix is the embedding (no output.weight), as in the real models


def vocab_file(name: str, vocab_dir: Path | None) -> Path:
    """llama.cpp's ggml-vocab-NAME.gguf: in vocab_dir, else in the suite's cache of the sdist's files."""
    dirs = [vocab_dir] if vocab_dir else sorted(cache_dir().glob("llama.cpp-vocab-*"))
    for d in dirs:
        if (d / f"ggml-vocab-{name}.gguf").is_file():
            return d / f"ggml-vocab-{name}.gguf"
    raise SystemExit(
        f"no ggml-vocab-{name}.gguf in {dirs or cache_dir()}: run the tokenizer tests once "
        "(tests/models/test_tokenizer_native.py caches llama.cpp's vocabulary files) or pass "
        "--vocab-dir"
    )


def write(
    geometry: str, out: Path, *, qtype: str, vocab: str, vocab_dir: Path | None, layers: int | None, seed: int = 0
) -> Path:
    g = GEOMETRIES[geometry]
    n_layers = layers or g.n_layers
    source = vocab_file(vocab, vocab_dir)
    _, meta = _read_gguf(source)
    # each key's own GGUF types (llama.cpp refuses e.g. an i32 tokenizer.ggml.bos_token_id: it reads a u32)
    kinds = {name: field.types for name, field in gguf.GGUFReader(source).fields.items()}
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"])
    types = np.asarray(tokenizer.get("tokenizer.ggml.token_type", [1] * n_vocab))
    head_dim = g.dim // g.n_heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(g.dim)
    w.add_feed_forward_length(g.ffn_dim)
    w.add_head_count(g.n_heads)
    w.add_head_count_kv(g.n_kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    for key, value in tokenizer.items():
        kind = kinds[key]
        w.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)
    main = QTYPES[qtype]
    edge = Q.Q6_K if main in K_BLOCKS else main  # embedding and output, as a Q4_K_M file keeps them

    def matrix(name: str, rows: int, cols: int, qt: Any, zero_rows: np.ndarray[Any, Any] | None = None) -> None:
        if qt in K_BLOCKS:
            blocks = k_quant_blocks(rng, qt, (rows, cols))
            if zero_rows is not None:
                blocks[zero_rows] = 0  # d = dmin = 0: the row's values are all zero
            w.add_tensor(name, blocks, raw_dtype=qt)
            return
        values = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols**-0.5)
        if zero_rows is not None:
            values[zero_rows] = 0.0
        if qt == Q.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qt), raw_dtype=qt)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(g.dim, dtype=np.float32)).astype(np.float32))

    control = np.flatnonzero(types == CONTROL)
    tied = geometry in TIED
    matrix("token_embd.weight", n_vocab, g.dim, edge, zero_rows=control if tied else None)
    for i in range(n_layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", g.n_heads * head_dim, g.dim, main)
        matrix(f"blk.{i}.attn_k.weight", g.n_kv_heads * head_dim, g.dim, main)
        matrix(f"blk.{i}.attn_v.weight", g.n_kv_heads * head_dim, g.dim, main)
        matrix(f"blk.{i}.attn_output.weight", g.dim, g.n_heads * head_dim, main)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", g.ffn_dim, g.dim, main)
        matrix(f"blk.{i}.ffn_up.weight", g.ffn_dim, g.dim, main)
        matrix(f"blk.{i}.ffn_down.weight", g.dim, g.ffn_dim, main)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", n_vocab, g.dim, edge, zero_rows=control)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama_quantize(tool: Path | None) -> Path:
    """llama.cpp's llama-quantize: `tool`, else the one bench/vs_llama_server.py built beside llama-server."""
    if tool:
        return tool
    from bench.vs_llama_server import CACHE

    found = sorted(CACHE.glob("llama-server-*/llama-quantize"))
    if not found:
        raise SystemExit(
            f"no llama-quantize under {CACHE}: build it (bench/device_sweep.py, or "
            "vs_llama_server.build_llama_server with the llama-quantize target) or pass --llama-quantize"
        )
    return found[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("geometry", choices=sorted(GEOMETRIES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--qtype", choices=sorted(QTYPES), default="Q4_K")
    ap.add_argument(
        "--quantize",
        metavar="TYPE",
        help="write F16 matrices and quantize them with llama.cpp's llama-quantize to TYPE (e.g. Q4_K_M: "
        "llama.cpp's own choice of block type per tensor) instead of writing --qtype blocks",
    )
    ap.add_argument("--llama-quantize", type=Path, help="the llama-quantize binary (default: the bench's build)")
    ap.add_argument(
        "--vocab",
        help="llama.cpp vocabulary name (ggml-vocab-NAME.gguf); default per geometry: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_VOCAB.items()),
    )
    ap.add_argument("--vocab-dir", type=Path)
    ap.add_argument("--layers", type=int, help="fewer layers than the geometry's (a quicker file)")
    args = ap.parse_args()
    vocab = args.vocab or DEFAULT_VOCAB[args.geometry]
    if args.quantize:
        tool = llama_quantize(args.llama_quantize)
        f16 = args.out.with_name(args.out.name + ".f16.tmp")
        try:
            write(args.geometry, f16, qtype="F16", vocab=vocab, vocab_dir=args.vocab_dir, layers=args.layers)
            subprocess.run([str(tool), str(f16), str(args.out), args.quantize], check=True, stdout=subprocess.DEVNULL)
        finally:
            f16.unlink(missing_ok=True)
        path = args.out
    else:
        path = write(
            args.geometry, args.out, qtype=args.qtype, vocab=vocab, vocab_dir=args.vocab_dir, layers=args.layers
        )
    print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()

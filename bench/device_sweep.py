"""The whole thread x stream sweep against llama-server in one call, for a session lent a many-core machine.

One prepared run (issue 28): build the reference engine and llama-server, make the geometry GGUFs, then per
geometry and thread count one `bench/vs_llama_server.py` run (both servers, the given stream counts, one
round, few tokens), and write one markdown table of every cell (ours / llama-server tok/s, ratio, TTFT,
peak RSS) to OUT/sweep.md, each run's full report beside it in OUT/logs/. A time budget keeps the whole
well inside a device call's 10 minutes: cells past it are listed as skipped, not run.

    python bench/device_sweep.py --out "$OUT"                                   # the 16-core sweep
    python bench/device_sweep.py --out /tmp/sweep --geometries 135m --layers 2 \\
        --threads 1,2 --streams 1,2 --max-tokens 8 --budget 300                 # a dry run on 2 cores

llama-server comes from --llama-server PATH, or is built from --llama-src (a llama.cpp source tree: a
machine that cannot reach PyPI gets it carried along), or from the llama-cpp-python sdist as
bench/vs_llama_server.py builds it. The GGUFs are bench/geometry_gguf.py's (random weights, real
tokenizers: --vocab-dir where the test suite's vocabulary cache is absent), Q4_K matrices written
directly, or quantized by llama.cpp's llama-quantize with --quantize TYPE (e.g. Q4_K_M) where it was
built beside llama-server.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import vs_llama_server  # noqa: E402  (the build and its cache are the bench's own)

from tests.cpu_features import cpu_flags  # noqa: E402

TABLE_ROW = re.compile(r"^\|\s*(\d+)\s*\|(.*)\|\s*$")


def build_from_source(src: Path, jobs: int) -> Path:
    """llama-server and llama-quantize built from a llama.cpp tree with the bench's cmake flags."""
    label, isa = vs_llama_server.isa_cmake_flags(cpu_flags())
    build = src / f"build-sweep-{label}"
    configure = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                 "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=ON", *isa]  # fmt: skip
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j", str(jobs)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return build / "bin" / "llama-server"


def make_gguf(
    geometry: str, layers: int | None, out_dir: Path, vocab_dir: Path | None, quantize: str | None, llama_server: Path
) -> Path:
    """The geometry's GGUF: Q4_K blocks written directly, or quantized by llama-quantize (built beside
    llama-server) from F16 matrices."""
    kind = quantize or "Q4_K"
    path = out_dir / f"{geometry}{f'-{layers}l' if layers else ''}-{kind.lower()}.gguf"
    if not path.exists():
        cmd = [sys.executable, str(ROOT / "bench" / "geometry_gguf.py"), geometry, str(path)]
        tool = str(llama_server.with_name("llama-quantize"))
        cmd += ["--quantize", quantize, "--llama-quantize", tool] if quantize else []
        cmd += ["--layers", str(layers)] if layers else []
        cmd += ["--vocab-dir", str(vocab_dir)] if vocab_dir else []
        subprocess.run(cmd, check=True)
    return path


def median_rows(report: str) -> list[list[str]]:
    """The cells of the report's first (median-round) table, one list per stream count."""
    rows = []
    for line in report.split("best round of each server")[0].splitlines():
        m = TABLE_ROW.match(line)
        if m:
            rows.append([m.group(1), *(c.strip() for c in m.group(2).split("|"))])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "sweep-out")))
    ap.add_argument("--geometries", default="135m,1b")
    ap.add_argument("--layers", type=int, help="fewer layers than each geometry's (a dry run)")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole; later cells are skipped")
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--llama-src", type=Path, help="a llama.cpp source tree to build llama-server from")
    ap.add_argument("--vocab-dir", type=Path)
    ap.add_argument("--quantize", help="quantize an F16 geometry GGUF with llama-quantize to this type")
    ap.add_argument("--no-build", action="store_true", help="the reference engine is already built")
    args = ap.parse_args()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    jobs = len(os.sched_getaffinity(0))
    if not args.no_build:
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    if args.llama_server:
        server = args.llama_server
    elif args.llama_src:
        server = build_from_source(args.llama_src, jobs)
    else:
        server = vs_llama_server.build_llama_server(None, jobs, ("llama-server", "llama-quantize"))
    built = time.monotonic() - t0
    lines = [
        f"# Thread x stream sweep: aiobasert serve vs llama-server ({os.cpu_count()} CPUs, "
        f"{len(os.sched_getaffinity(0))} usable)",
        "",
        f"{args.max_tokens} greedy tokens per stream, 1 round per cell; builds took {built:.0f} s; "
        "ratio = ours / llama-server (tok/s: above 1 we are faster; TTFT: below 1)",
        "",
        "| model | threads | streams | ours tok/s | llama-server tok/s | ratio | ours TTFT | llama TTFT "
        "| TTFT ratio | peak RSS MiB ours / theirs | tokens ours / theirs | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    skipped = []
    for geometry in args.geometries.split(","):
        gguf = make_gguf(geometry, args.layers, args.out, args.vocab_dir, args.quantize, server)
        for n in args.threads.split(","):
            if time.monotonic() - t0 > args.budget:
                skipped.append(f"{geometry} at {n} threads")
                continue
            cmd = [
                sys.executable,
                str(ROOT / "bench" / "vs_llama_server.py"),
                "--llama-server",
                str(server),
                "--model",
                str(gguf),
                "--threads",
                n,
                "--streams",
                args.streams,
                "--rounds",
                "1",
                "--max-tokens",
                str(args.max_tokens),
            ]
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            log = args.out / "logs" / f"{geometry}-{n}t.txt"
            log.write_text(run.stdout + run.stderr)
            if run.returncode != 0:
                lines.append(f"| {gguf.name} | {n} | - | failed: see logs/{log.name} |")
                continue
            for cells in median_rows(run.stdout):
                lines.append(f"| {gguf.name} | {n} | {' | '.join(cells)} |")
    if skipped:
        lines += ["", f"skipped past the {args.budget:.0f} s budget: {', '.join(skipped)}"]
    lines += ["", f"total {time.monotonic() - t0:.0f} s"]
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

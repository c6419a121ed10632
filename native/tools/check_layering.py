#!/usr/bin/env python3
"""Check that native/src is a DAG of concept layers (issue 10).

Every file of native/src belongs to one layer (LAYERS below, bottom first); a
header x.h and its x.c are one concept "x". Two kinds of edges are read from
the sources:

  include  a file's #include "y.h" of another project file
  call     a .c file naming a non-static function that another .c defines
           (a call, or its address taken: either way a link-time dependency)

The check fails, naming the edge, when a concept uses one of a higher layer,
and, naming the files, when the concept graph has a cycle (also inside one
layer). A file of native/src that LAYERS does not place is a failure too: a new
file has to be put somewhere on purpose.

The C parse is a scan over identifiers: comments, string and character
literals are blanked first (a function name in a message is no call),
preprocessor lines are read for #include and otherwise kept (a macro body's
calls are its file's calls; its name and parameters are not). A definition is an identifier followed by a
parenthesised list and `{` at brace depth 0; it is static when `static` is
among the tokens since the previous top-level declaration ended.

Usage: python native/tools/check_layering.py [--src DIR] [--layers FILE]
  --layers: a file of lines "layer-name: concept concept ...", bottom first,
  replacing LAYERS (the tests feed synthetic trees this way).
Exit status 0 when the graph is a layered DAG, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Bottom first. A concept may use concepts of its own layer (without a cycle)
# and of any layer below; never one above.
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["errors", "json", "unicode_data", "f16", "cpu", "cgroup", "topology"]),
    ("threads", ["threads"]),
    ("weight", ["weight"]),  # weight.h only: the matrix type the kernels, loader and forward share
    ("quantized kernels", ["quant"]),
    ("math", ["mathops"]),
    ("tokenizer", ["tokenizer"]),
    ("handles", ["handles"]),
    ("model", ["model"]),
    ("bundle reader", ["loader"]),
    ("runtime state", ["runtime"]),  # runtime.h only: the struct every runtime file shares
    ("kv pool", ["kv"]),
    ("prefix cache", ["prefix"]),
    ("forward", ["forward"]),
    ("sampling", ["sampling"]),
    # what a grammar accepts (the JSON automaton, the schema subset, structural tags), then the handle and masks
    ("grammar", ["json_grammar", "json_schema", "structural_tag", "grammar"]),
    ("batch", ["batch"]),
    # the entry points: model lifecycle (load, free, describe), text in and out, the single-sequence path
    ("entry points", ["generate", "text", "lifecycle"]),
]

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\S")
_NOT_FUNCTIONS = {"if", "for", "while", "switch", "return", "sizeof", "do", "else", "_Alignof", "__attribute__"}


def strip_c(text: str, literals: bool = True) -> str:
    """Comments and (unless literals is False) string and character literals blanked to spaces,
    newlines kept."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":  # skipped whole either way: a "/*" inside is no comment
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            if literals:
                out.append(c + " " * max(0, j - i - 2) + (c if j - i >= 2 else ""))
            else:
                out.append(text[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


@dataclass
class Source:
    path: Path
    includes: list[str] = field(default_factory=list)
    defines: set[str] = field(default_factory=set)  # non-static function definitions
    statics: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)  # every identifier used


def parse(path: Path) -> Source:
    raw = path.read_text(encoding="utf-8", errors="replace")
    src = Source(path, includes=_INCLUDE.findall(strip_c(raw, literals=False)))  # not a commented-out one
    code = strip_c(raw)
    # drop #include lines (their names are files, not identifiers); keep other directives' tokens
    code = re.sub(r"^[ \t]*#[ \t]*include[^\n]*", "", code, flags=re.M)
    code = code.replace("\\\n", " ")
    # a macro's name and parameters are no call (and `NAME(x) {` no definition); its body's names count
    code = re.sub(r"^[ \t]*#[ \t]*define[ \t]+\w+(\([^)\n]*\))?", " ", code, flags=re.M)
    code = re.sub(r"^[ \t]*#[ \t]*[a-z]+", " ", code, flags=re.M)  # the other directives' word itself
    src.names = {t for t in _TOKEN.findall(code) if t[0].isalpha() or t[0] == "_"}
    # Definitions are read from the code outside directives: a macro body is a fragment (its last call
    # followed by the next macro's `{` is no definition).
    tokens = _TOKEN.findall(re.sub(r"^[ \t]*#[^\n]*", " ; ", strip_c(raw).replace("\\\n", " "), flags=re.M))
    depth = 0
    decl_start = 0  # index of the first token of the current top-level declaration
    for k, t in enumerate(tokens):
        if t == "{":
            if depth == 0 and k > 0 and tokens[k - 1] == ")":
                name = _definition_name(tokens, k - 1)
                if name:
                    (src.statics if "static" in tokens[decl_start:k] else src.defines).add(name)
            depth += 1
        elif t == "}":
            depth = max(0, depth - 1)
            if depth == 0:
                decl_start = k + 1
        elif t == ";" and depth == 0:
            decl_start = k + 1
    return src


def _definition_name(tokens: list[str], close: int) -> str | None:
    """The identifier before the parenthesised list that ends at tokens[close]."""
    level = 0
    for k in range(close, -1, -1):
        if tokens[k] == ")":
            level += 1
        elif tokens[k] == "(":
            level -= 1
            if level == 0:
                name = tokens[k - 1] if k > 0 else ""
                if re.fullmatch(r"[A-Za-z_]\w*", name) and name not in _NOT_FUNCTIONS:
                    return name
                return None
    return None


def concept(path: Path) -> str:
    return path.stem


@dataclass
class Report:
    layers: list[tuple[str, list[str]]]
    edges: dict[tuple[str, str], list[str]]  # (from concept, to concept) -> why
    errors: list[str]


def check(src_dir: Path, layers: list[tuple[str, list[str]]]) -> Report:
    files = sorted(p for p in src_dir.iterdir() if p.suffix in (".c", ".h"))
    parsed = {p.name: parse(p) for p in files}
    errors: list[str] = []
    layer_of: dict[str, int] = {}
    for i, (_, members) in enumerate(layers):
        for c in members:
            layer_of[c] = i
    for p in files:
        if concept(p) not in layer_of:
            errors.append(f"{p.name}: not placed in any layer (add {concept(p)!r} to LAYERS)")

    edges: dict[tuple[str, str], list[str]] = {}

    def add(a: str, b: str, why: str) -> None:
        if a != b:
            edges.setdefault((a, b), []).append(why)

    for name, s in parsed.items():
        for inc in s.includes:
            if inc in parsed:
                add(concept(s.path), concept(parsed[inc].path), f"{name} includes {inc}")

    definer: dict[str, str] = {}
    for name, s in parsed.items():
        if s.path.suffix != ".c":
            continue
        for fn in s.defines:
            if fn in definer:
                errors.append(f"{fn} is defined in both {definer[fn]} and {name}")
            definer[fn] = name
    for name, s in parsed.items():
        if s.path.suffix != ".c":
            continue
        for fn in sorted(s.names - s.defines - s.statics):
            owner = definer.get(fn)
            if owner and owner != name:
                add(concept(s.path), concept(parsed[owner].path), f"{name} calls {fn} ({owner})")

    for (a, b), why in sorted(edges.items()):
        la, lb = layer_of.get(a), layer_of.get(b)
        if la is not None and lb is not None and lb > la:
            errors.append(
                f"upward edge: {a} (layer {layers[la][0]!r}) uses {b} (layer {layers[lb][0]!r}): "
                + "; ".join(why[:3])
                + (" ..." if len(why) > 3 else "")
            )
    for cycle in find_cycles({a for a, _ in edges} | {b for _, b in edges}, edges):
        steps = " -> ".join([*cycle, cycle[0]])
        detail = "; ".join(edges[(cycle[i], cycle[(i + 1) % len(cycle)])][0] for i in range(len(cycle)))
        errors.append(f"cycle: {steps} ({detail})")
    return Report(layers, edges, errors)


def find_cycles(nodes: Iterable[str], edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one node (Tarjan)."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, [])):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return [_cycle_in(sorted(c), succ) for c in comps]


def _cycle_in(comp: list[str], succ: dict[str, list[str]]) -> list[str]:
    """A simple cycle through comp[0] staying inside the component (BFS back to the start)."""
    members = set(comp)
    start = comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(succ.get(v, [])):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return list(reversed(path))
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def read_layers(path: Path) -> list[tuple[str, list[str]]]:
    layers = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, members = line.partition(":")
            layers.append((name.strip(), members.split()))
    return layers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    here = Path(__file__).resolve().parent
    ap.add_argument("--src", type=Path, default=here.parent / "src")
    ap.add_argument("--layers", type=Path, default=None)
    ap.add_argument("--edges", action="store_true", help="also print every edge and why")
    args = ap.parse_args(argv)
    layers = read_layers(args.layers) if args.layers else LAYERS
    report = check(args.src, layers)
    print("layer order (bottom first):")
    for i, (name, members) in enumerate(report.layers):
        print(f"  {i:2d} {name:14s} {' '.join(members)}")
    if args.edges:
        for (a, b), why in sorted(report.edges.items()):
            print(f"  {a} -> {b}: {'; '.join(why)}")
    if report.errors:
        sys.stdout.flush()
        print(f"FAIL: {len(report.errors)} layering error(s) in {args.src}:", file=sys.stderr)
        for e in report.errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    print(f"OK: {len(report.edges)} edges, no cycle, no upward edge")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""native/src is a DAG of concept layers (issue 10), checked by native/tools/check_layering.py.

The first test runs the checker on the real tree, as a developer would; the others feed it small
synthetic trees, so a checker that can no longer fail (a parse that misses calls, a cycle search
that finds nothing) fails here.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "native" / "tools" / "check_layering.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layering", CHECKER)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECKER), *args], capture_output=True, text=True, timeout=60)


def _tree(tmp_path: Path, files: dict[str, str], layers: str) -> tuple[Path, Path]:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in files.items():
        (src / name).write_text(textwrap.dedent(text))
    layers_file = tmp_path / "layers.txt"
    layers_file.write_text(textwrap.dedent(layers))
    return src, layers_file


def test_native_src_is_a_layered_dag() -> None:
    r = _run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no cycle, no upward edge" in r.stdout
    order = r.stdout.split("layer order (bottom first):")[1]
    # the order: errors/json/math -> bundle reader -> model ... kv -> prefix -> forward -> sampling
    # -> batch -> api (the model object sits below the loader that fills it)
    names = ["errors", "mathops", "model", "loader", "kv", "prefix", "forward", "sampling", "batch", "lifecycle"]
    positions = [order.index(f" {n}") for n in names]
    assert positions == sorted(positions), order


def test_every_source_file_is_placed_and_the_old_cycles_are_gone() -> None:
    mod = _checker()
    report = mod.check(ROOT / "native" / "src", mod.LAYERS)
    assert report.errors == []
    edges = set(report.edges)
    # the edges of the seven-file cycle the restructuring removed
    for gone in [
        ("loader", "lifecycle"),
        ("loader", "generate"),
        ("kv", "prefix"),
        ("kv", "batch"),
        ("prefix", "batch"),
        ("batch", "lifecycle"),
        ("sampling", "lifecycle"),
        ("grammar", "lifecycle"),
    ]:
        assert gone not in edges, (gone, report.edges.get(gone))
    # and the parse does see real calls: prefix uses the pool, everything checks models in model.c
    assert ("prefix", "kv") in edges
    assert ("batch", "model") in edges


def test_checker_reports_a_call_cycle(tmp_path: Path) -> None:
    src, layers = _tree(
        tmp_path,
        {
            "a.c": """
            #include "a.h"
            void a_go(void) { b_go(); }
        """,
            "a.h": "void a_go(void);\n",
            "b.c": """
            void a_go(void);
            static void helper(void) { a_go(); }
            void b_go(void) { helper(); }
        """,
        },
        "one: a b\n",
    )
    r = _run("--src", str(src), "--layers", str(layers))
    assert r.returncode == 1
    assert "cycle: a -> b -> a" in r.stderr, r.stderr
    assert "a.c calls b_go (b.c)" in r.stderr and "b.c calls a_go (a.c)" in r.stderr


def test_checker_reports_an_upward_edge_and_an_include_cycle(tmp_path: Path) -> None:
    src, layers = _tree(
        tmp_path,
        {
            "low.c": "int low_value(void) { return high_value() + 1; }\n",
            "high.c": "int high_value(void) { return 1; }\n",
            "x.h": '#include "y.h"\n',
            "y.h": '#include "x.h"\n',
        },
        """
        # bottom first
        bottom: low x y
        top: high
    """,
    )
    r = _run("--src", str(src), "--layers", str(layers))
    assert r.returncode == 1
    assert "upward edge: low (layer 'bottom') uses high (layer 'top'): low.c calls high_value (high.c)" in r.stderr
    assert "cycle: x -> y -> x (x.h includes y.h; y.h includes x.h)" in r.stderr


def test_checker_reports_an_unplaced_file(tmp_path: Path) -> None:
    src, layers = _tree(tmp_path, {"a.c": "void a(void) {}\n", "stray.c": "void stray(void) {}\n"}, "one: a\n")
    r = _run("--src", str(src), "--layers", str(layers))
    assert r.returncode == 1
    assert "stray.c: not placed in any layer" in r.stderr


def test_names_in_comments_strings_and_statics_are_not_calls(tmp_path: Path) -> None:
    src, layers = _tree(
        tmp_path,
        {
            "low.c": r"""
            /* high_value() is the layer above: never call it from here, nor
            #include "high.h"
            */
            static const char *path = "/*"; /* a comment opener in a string is none */
            // high_value();
            static const char *msg = "high_value(): \" still a string high_value";
            static char quote = '"';
            static int high_other(void) { return 2; } /* a static of the same name as high.c's */
            int low_value(void) { return high_other() + (msg[0] == quote) + (path[0] == '/'); }
        """,
            "high.h": "int high_value(void);\n",
            "high.c": """
            int high_value(void) { return low_value(); }
            int high_other(void) { return 3; }
        """,
        },
        "bottom: low\ntop: high\n",
    )
    mod = _checker()
    report = mod.check(src, mod.read_layers(layers))
    assert report.errors == []
    assert set(report.edges) == {("high", "low")}


def test_strip_keeps_lines_and_columns() -> None:
    mod = _checker()
    text = 'a /* x\n y */ b "s\\"t" \'c\' // z\nd'
    out = mod.strip_c(text)
    assert len(out) == len(text) and out.count("\n") == text.count("\n")
    assert out.split() == ["a", "b", '"', '"', "'", "'", "d"]


def test_call_graph_matches_the_compilers(tmp_path: Path) -> None:
    """The regex parse against the truth: each file compiled alone, its defined and undefined
    symbols read back with nm. Same definitions per file, same file-to-file call edges."""
    cc, nm = shutil.which("gcc") or shutil.which("cc"), shutil.which("nm")
    assert cc and nm, "a C compiler and nm (binutils) are needed"
    src = ROOT / "native" / "src"
    mod = _checker()
    defined: dict[str, set[str]] = {}
    undefined: dict[str, set[str]] = {}
    for c in sorted(src.glob("*.c")):
        obj = tmp_path / f"{c.stem}.o"
        subprocess.run(
            [
                cc,
                "-std=c11",
                "-O0",
                "-fPIC",
                "-D_GNU_SOURCE",
                f"-I{ROOT / 'native' / 'include'}",
                f"-I{src}",
                "-c",
                str(c),
                "-o",
                str(obj),
            ],
            check=True,
            timeout=120,
        )
        out = subprocess.run([nm, str(obj)], capture_output=True, text=True, check=True).stdout
        rows = [line.split() for line in out.splitlines()]
        defined[c.stem] = {r[2] for r in rows if len(r) == 3 and r[1] == "T"}
        undefined[c.stem] = {r[1] for r in rows if len(r) == 2 and r[0] == "U"}
        assert mod.parse(c).defines == defined[c.stem], c.name
    owner = {sym: stem for stem, syms in defined.items() for sym in syms}
    linked = {(a, owner[s]) for a, syms in undefined.items() for s in syms if s in owner and owner[s] != a}
    report = mod.check(src, mod.LAYERS)
    parsed = {edge for edge, why in report.edges.items() if any(" calls " in w for w in why)}
    assert parsed == linked

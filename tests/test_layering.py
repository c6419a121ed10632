"""aiobasert/ is a stack of layers (issue 29), as native/src is (tests/native/test_native_layering.py):
no module imports from a layer above its own, and no modules import each other in a circle.

Every import counts: at module level, inside a function (imported on first use) and under
`TYPE_CHECKING`; a name is an arrow to the module that defines it (`from . import ffi` is an arrow
to `_ffi`, `from .. import Engine` one to the package). The layers, bottom first, are `LAYERS`;
every module of the package must be placed in exactly one. The first test checks the real tree;
the others feed the checker small synthetic packages, so a checker that can no longer fail (a
parse that misses relative or lazy imports, a cycle search that finds nothing) fails here.

To see the arrows: `python tests/test_layering.py` prints each module's imports of the package.
"""

from __future__ import annotations

import ast
import fnmatch
import gc
import graphlib
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aiobasert"

LAYERS: list[tuple[str, tuple[str, ...]]] = [  # bottom first; an exact name wins over a pattern
    # what every layer may use: the typed errors, the public structs and config, the C ABI's mirror, lazy numpy
    (
        "base",
        (
            "aiobasert.errors",
            "aiobasert.types",
            "aiobasert.config",
            "aiobasert._ffi",
            "aiobasert._lazy_numpy",
        ),
    ),
    # model files: the bundle format, conversion, the cache (read by the engine's machinery)
    ("models", ("aiobasert.models", "aiobasert.models.*")),
    # the private machinery of one engine, below the thread that drives it
    ("core", ("aiobasert._core", "aiobasert._core.*")),
    # policies and pieces the engine composes: scheduling, streams, chat prompts, tool calls
    (
        "parts",
        (
            "aiobasert.batcher",
            "aiobasert.streams",
            "aiobasert.chat",
            "aiobasert.tools",
            "aiobasert.tools.*",
            "aiobasert.reasoning",
            "aiobasert.reasoning.*",
        ),
    ),
    ("thread", ("aiobasert.engine_thread",)),
    ("engine", ("aiobasert.engine", "aiobasert.group", "aiobasert.choices")),
    ("package", ("aiobasert",)),  # the public facade (aiobasert/__init__.py)
    # tools for tests of code built on aiobasert: they read the engine's state between steps
    ("testing", ("aiobasert.testing",)),
    ("server", ("aiobasert.server", "aiobasert.server.*")),
    ("cli", ("aiobasert.cli", "aiobasert.__main__")),
]

KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    # (importer, imported): why this arrow is tolerated for now, and what removes it. None today: the
    # engine / tools / tool_formats circle was the last (issue 29 item 3 broke it).
}


@dataclass
class Report:
    edges: dict[str, set[str]]
    errors: list[str] = field(default_factory=list)


def parse_python(source: str, filename: str = "<source>") -> ast.Module:
    """`ast.parse`, the garbage collector held off: on CPython 3.11.7 (CI's) a finalizer the collector runs
    inside the AST's construction (a task another test left behind, logging) upsets its recursion count
    and the parse fails with "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename)
    finally:
        if enabled:
            gc.enable()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at `root` -> the modules of the package it imports."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(parse_python(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                for alias in node.names:  # `from . import ffi`: the module ffi; `from .x import f`: x
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in modules else source)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> int | None:
    exact = [i for i, (_, pats) in enumerate(layers) if module in pats]
    if exact:
        return exact[0] if len(exact) == 1 else None
    matches = [i for i, (_, pats) in enumerate(layers) if any(fnmatch.fnmatchcase(module, p) for p in pats)]
    return matches[0] if len(matches) == 1 else None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """An import cycle, if there is one (the stdlib's topological sort finds it), its modules sorted."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as cycle:
        return [sorted(set(cycle.args[1]))]
    return []


def check(
    root: Path,
    layers: list[tuple[str, tuple[str, ...]]],
    exceptions: dict[tuple[str, str], str] | None = None,
) -> Report:
    exceptions = exceptions or {}
    graph = import_graph(root)
    report = Report(graph)
    for module in sorted(graph):
        if layer_of(module, layers) is None:
            report.errors.append(f"{module}: placed in no layer, or in several")
    kept = {m: {t for t in targets if (m, t) not in exceptions} for m, targets in graph.items()}
    for module, targets in sorted(kept.items()):
        here = layer_of(module, layers)
        for target in sorted(targets):
            there = layer_of(target, layers)
            if here is not None and there is not None and there > here:
                report.errors.append(
                    f"{module} ({layers[here][0]}) imports {target} ({layers[there][0]}), a layer above"
                )
    for component in _cycles(kept):
        report.errors.append("import cycle: " + ", ".join(component))
    return report


def test_aiobasert_is_layered_without_cycles() -> None:
    report = check(PACKAGE, LAYERS, KNOWN_EXCEPTIONS)
    assert report.errors == []
    # the parse sees real arrows, relative, lazy and `from . import` ones included
    assert "aiobasert._core.plan" in report.edges["aiobasert.batcher"]
    assert "aiobasert._core.plan" in report.edges["aiobasert._core.step"]
    assert "aiobasert._core.prepare" in report.edges["aiobasert.engine_thread"]
    assert "aiobasert._ffi" in report.edges["aiobasert._core.embed"]  # `from .. import _ffi`
    assert "aiobasert.chat" in report.edges["aiobasert.engine_thread"]  # imported on first use


def test_the_core_sits_below_the_thread_and_the_policy() -> None:
    """Issue 29 #2: `_core/` imported the plan types from batcher.py and `closed_objects` from tools.py."""
    graph = import_graph(PACKAGE)
    core_layer = layer_of("aiobasert._core", LAYERS)
    assert core_layer is not None
    core = [m for m in graph if m == "aiobasert._core" or m.startswith("aiobasert._core.")]
    above = {m for m in graph if (layer_of(m, LAYERS) or 0) > core_layer}
    assert {(m, t) for m in core for t in graph[m] if t in above} == set()
    assert "aiobasert.engine_thread" not in graph["aiobasert.server.metrics"]  # the re-export shim is gone


def test_every_known_exception_is_still_an_import() -> None:
    """An exception that no longer names a real arrow is stale: remove it."""
    graph = import_graph(PACKAGE)
    assert [pair for pair in KNOWN_EXCEPTIONS if pair[1] not in graph.get(pair[0], set())] == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


_TOY_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("low", ("pkg._low", "pkg._low.*")),
    ("mid", ("pkg.mid", "pkg.mid2")),
    ("top", ("pkg", "pkg.top")),
]


def test_checker_reports_an_upward_import_however_it_is_written(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "from .top import run\n",
        "top.py": "from .mid import step\n",
        "mid.py": "",
        "mid2.py": "",
        "_low/__init__.py": "",
        "_low/base.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from ..mid import step
            def later():
                from .. import top
            import pkg.mid2
        """,
    })  # fmt: skip
    report = check(root, _TOY_LAYERS)
    assert report.errors == [
        "pkg._low.base (low) imports pkg.mid (mid), a layer above",
        "pkg._low.base (low) imports pkg.mid2 (mid), a layer above",
        "pkg._low.base (low) imports pkg.top (top), a layer above",
    ]


def test_checker_reports_a_cycle_inside_one_layer_and_honours_an_exception(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "top.py": "",
        "mid.py": "from . import mid2\n",
        "mid2.py": "def f():\n    from .mid import g\n",
        "_low/__init__.py": "",
    })  # fmt: skip
    assert check(root, _TOY_LAYERS).errors == ["import cycle: pkg.mid, pkg.mid2"]
    assert check(root, _TOY_LAYERS, {("pkg.mid2", "pkg.mid"): "test"}).errors == []


def test_checker_reports_a_module_in_no_layer(tmp_path: Path) -> None:
    root = _package(tmp_path, {"__init__.py": "", "stray.py": ""})
    assert check(root, _TOY_LAYERS).errors == ["pkg.stray: placed in no layer, or in several"]


def private_engine_uses(source: str, filename: str = "<source>") -> list[str]:
    """Where `source` reaches a private attribute of an Engine: `x._name` (not a dunder) where `x` is a
    name or attribute called `engine` (`engine`, `self._engine`, `served.engine`, `m.engine`), as
    "line: expression"."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(parse_python(source, filename)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name.lstrip("_") == "engine":
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(node)}"))
    return [text for *_, text in sorted(found)]


def test_the_server_uses_only_the_engines_public_api() -> None:
    """The server is a client of the SDK (the "server" layer above "package"): it reaches an Engine
    through its public API only, never `engine._...` (what it needs is public, typed and documented)."""
    uses = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted((PACKAGE / "server").rglob("*.py"))
        if (found := private_engine_uses(path.read_text(encoding="utf-8"), str(path)))
    }
    assert uses == {}


def test_the_private_engine_check_sees_every_spelling() -> None:
    source = textwrap.dedent("""
        async def f(engine, served, self, m, other):
            await engine._call(lambda: None)
            self._engine._stream_turn(turn, params)
            lib = served.engine._thread.lib
            m.engine._chat_turn([])
            engine.stats(); self._engine.info; served.engine.__class__; other._private; self._chat_turn()
    """)
    assert private_engine_uses(source) == [
        "3: engine._call",
        "4: self._engine._stream_turn",
        "5: served.engine._thread",
        "6: m.engine._chat_turn",
    ]


if __name__ == "__main__":  # the arrows, for a reader
    for name, targets in sorted(import_graph(PACKAGE).items()):
        print(f"{name} -> {', '.join(sorted(targets)) or '-'}")
    sys.exit(1 if check(PACKAGE, LAYERS, KNOWN_EXCEPTIONS).errors else 0)

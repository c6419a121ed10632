"""Request preparation (tokenizing, grammar compiles, decode) is bounded before it is paid and
paid where only that request waits: never on the engine thread, never ahead of cheaper work
(docs/fairness.md, "The engine thread only steps")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# numpy's import held open (its module half initialized in sys.modules) on the worker thread that
# the first embedding imports it on, while the loop submits plain requests of every shape.
_NUMPY_IMPORT_RACE = """
import sys, threading, anyio, aiobasert
importing, release = threading.Event(), threading.Event()
class SlowNumpy:  # numpy's own loader, which waits (module already in sys.modules) before running numpy
    def find_spec(self, name, path=None, target=None):
        if name != "numpy":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec("numpy")
        real = spec.loader.exec_module
        def exec_module(module):
            importing.set()
            release.wait()
            real(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, SlowNumpy())
async def main():
    async with aiobasert.Engine.open(sys.argv[1], max_batch_size=4) as engine:
        results = []
        async def embed():
            results.append(len(await engine.embed("a cat")))
        async with anyio.create_task_group() as tg:
            tg.start_soon(embed)
            while not importing.is_set():
                await anyio.sleep(0.005)
            assert "numpy" in sys.modules  # half initialized, right now
            ok = failed = 0

            async def one(call):
                nonlocal ok, failed
                try:
                    await call()
                    ok += 1
                except Exception as exc:
                    failed += 1
                    print(type(exc).__name__, exc, file=sys.stderr)

            for i in range(12):
                # a grammar needs numpy itself: it is served once the import is done
                tg.start_soon(one, lambda: engine.generate("x", max_tokens=2, json_schema={"type": "integer"}))
                await one(lambda: engine.generate("hello", max_tokens=2, temperature=0.5))
                await one(lambda: engine.generate([1, 2, 3], max_tokens=2))
                await one(lambda: engine.decode([1, 2, 3]))
            release.set()
        print(ok, failed, results[0] > 0, sep="|")
anyio.run(main)
"""


def test_requests_never_see_a_half_imported_numpy(tiny_model_path: Path) -> None:
    """Issue 26 #1: numpy is imported lazily on a worker; every request submitted while that import is
    under way is served (none fails on the partially initialized module), and the embedding works."""
    proc = subprocess.run([sys.executable, "-c", _NUMPY_IMPORT_RACE, str(tiny_model_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "48|0|True", proc.stderr[-3000:]

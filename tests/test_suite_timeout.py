"""The suite's per-test timeout (tests/conftest.py + pyproject.toml) turns a hang
into a failure on asyncio AND trio, and the run goes on to the next test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HANGS = """
import anyio, pytest

pytestmark = pytest.mark.anyio

@pytest.mark.timeout(3)
async def test_hangs_on_an_event() -> None:
    await anyio.Event().wait()

@pytest.mark.timeout(3)
async def test_hangs_in_a_shielded_scope() -> None:
    with anyio.CancelScope(shield=True):
        await anyio.sleep(3600)

async def test_runs_after_the_hangs() -> None:
    await anyio.sleep(0)
"""


def test_a_hanging_test_fails_on_both_backends(tmp_path: Path) -> None:
    here = Path(__file__).resolve().parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_hangs.py").write_text(HANGS)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 60\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_hangs.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    for backend in ("asyncio", "trio"):
        assert f"FAILED test_hangs.py::test_hangs_on_an_event[{backend}]" in out, out
        assert f"FAILED test_hangs.py::test_hangs_in_a_shielded_scope[{backend}]" in out, out
    assert "PASSED test_hangs.py::test_runs_after_the_hangs[asyncio]" in out, out

"""The elapsed-time line for steps without progress of their own (aiobasert.models._progress)."""

from __future__ import annotations

import threading

import pytest

from aiobasert.models._progress import ticking


def test_a_slow_step_shows_its_elapsed_time(capsys: pytest.CaptureFixture[str]) -> None:
    with ticking("loading model", after_s=0.01):
        threading.Event().wait(0.5)  # a step well past after_s: the line must have appeared
    err = capsys.readouterr().err
    assert "loading model: " in err and err.rstrip().endswith(" s")


def test_a_quick_step_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with ticking("loading model", after_s=60):
        pass
    with ticking("loading model", enabled=False, after_s=0):
        threading.Event().wait(0.05)
    assert capsys.readouterr().err == ""


def test_the_block_s_exception_passes_through() -> None:
    with pytest.raises(KeyError), ticking("x", after_s=0.0):
        raise KeyError("boom")

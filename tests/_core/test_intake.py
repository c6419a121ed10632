"""_core/intake.py: the preparation workers. Their tokenizer (exact C arrays, typed refusals,
a costly text refused before it is tokenized), the job wrapper that keeps a job's failure to
its request, the lanes' order, and which worker thread serves which lane, with the real
library's tokenizer-only handles of the tiny model."""

from __future__ import annotations

import ctypes
import queue
import threading
from pathlib import Path
from typing import Any

import pytest

from aiobasert import ContextLengthExceededError, InternalError, InvalidRequestError
from aiobasert._core.cost import QUICK_COST
from aiobasert._core.intake import Intake, Reroute, Tokenizer, _Lanes, on_costly_worker, run_job
from aiobasert._ffi import Library


def test_encode_text_is_an_exact_c_array_of_the_ids(tok: Tokenizer) -> None:
    ids = tok.encode_list("hello world", special=False)
    arr = tok.encode_text("hello world", special=False)
    assert isinstance(arr, ctypes.Array) and arr._type_ is ctypes.c_uint32
    assert list(arr) == ids and len(arr) == len(ids)  # no spare slots of the C call's buffer
    pieces = tok.encode_pieces([("hello", False), (" world", True)])
    assert list(pieces) == tok.encode_list("hello", special=True) + tok.encode_list(" world", special=False)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"bytes", "prompt must be str"),
        ("a\x00b", "prompt cannot be encoded: text contains a NUL"),
        ("\ud800", "cannot be encoded"),
    ],
)
def test_text_the_c_library_cannot_take_is_a_typed_refusal(tok: Tokenizer, text: Any, match: str) -> None:
    before = tok.encoded
    with pytest.raises(InvalidRequestError, match=match):
        tok.encode_text(text, special=False)
    assert tok.encoded == before  # refused before the C call


def test_a_costly_text_that_cannot_fit_is_refused_without_tokenizing_it(tok: Tokenizer) -> None:
    text = "a" * (QUICK_COST + 1)
    with pytest.raises(ContextLengthExceededError, match="exceeds the context window of 16 tokens"):
        tok.encode_text(text, special=False, limit=16)
    assert tok.encoded == 0
    assert len(tok.encode_text(text, special=False, limit=None)) > 16 and tok.encoded == 1


def test_decode_joins_the_bytes_and_a_cut_character_becomes_u_fffd(tok: Tokenizer) -> None:
    ids = tok.encode_list("é日本", special=False)
    assert tok.decode(ids) == "é日本"
    assert tok.decode(ids[:1]) == "\ufffd"  # half of "é"


def test_run_job_keeps_every_failure_to_its_request_but_a_reroute(tok: Tokenizer) -> None:
    assert run_job(lambda t: t.handle, tok) == (tok.handle, None)
    typed = InvalidRequestError("bad")

    def raise_(exc: BaseException) -> Any:
        def job(t: Tokenizer) -> Any:
            raise exc

        return job

    assert run_job(raise_(typed), tok) == (None, typed)
    result, err = run_job(raise_(KeyError("bug")), tok)
    assert result is None and isinstance(err, InternalError) and isinstance(err.__cause__, KeyError)
    with pytest.raises(Reroute):
        run_job(raise_(Reroute()), tok)


def test_a_lane_take_serves_its_lanes_in_order_each_fifo_and_drains_after_close() -> None:
    lanes = _Lanes()

    def job(name: str) -> Any:
        return lambda t: name

    def done(result: Any, error: BaseException | None) -> None:
        pass

    for lane, name in [("cheap", "c1"), ("costly", "x1"), ("cheap", "c2")]:
        lanes.put(lane, job(name), done)  # type: ignore[arg-type]
    took = []
    for _ in range(3):
        item = lanes.take(("costly", "cheap"))
        assert item is not None
        took.append(item[0](None))  # type: ignore[arg-type]
    assert took == ["x1", "c1", "c2"]
    lanes.put("quick", job("q"), done)
    lanes.close()
    item = lanes.take(("quick",))
    assert item is not None and item[0](None) == "q"  # type: ignore[arg-type]
    assert lanes.take(("quick", "cheap", "costly")) is None  # closed and empty: the worker ends


def test_each_lane_is_served_by_its_workers_and_a_reroute_moves_the_job_to_the_costly_one(
    lib: Library, tiny_model_path: Path
) -> None:
    intake = Intake(lib, str(tiny_model_path))
    try:
        intake.wait_loaded()
        results: queue.Queue[tuple[str, Any, BaseException | None]] = queue.Queue()

        def run(label: str, *, grammar: bool, cost: int, reroute: bool = False) -> tuple[Any, BaseException | None]:
            def job(t: Tokenizer) -> Any:
                if reroute and not on_costly_worker():
                    raise Reroute
                return threading.current_thread().name, t.encode_list("ab", special=False)

            intake.submit(job, lambda r, e: results.put((label, r, e)), grammar=grammar, cost=cost)
            got, r, e = results.get(timeout=30)
            assert got == label
            return r, e

        (quick, ids), err = run("quick", grammar=False, cost=10)
        assert err is None and quick == "aiobasert-tokenize" and len(ids) == 2
        (costly, _), _ = run("costly", grammar=False, cost=QUICK_COST + 1)
        assert costly == "aiobasert-grammar-1"  # above QUICK_COST: the costly lane, grammar or not
        (cheap, _), _ = run("cheap", grammar=True, cost=10)
        assert cheap.startswith("aiobasert-grammar-")
        for _ in range(4):  # wherever a cheap grammar job lands, rerouted it ends on the costly worker
            (moved, _), err = run("moved", grammar=True, cost=10, reroute=True)
            assert err is None and moved == "aiobasert-grammar-1"
        assert intake.texts_encoded() >= 7
    finally:
        intake.close()
    assert on_costly_worker()  # no worker: a job run inline pays its own costly work


def test_the_costly_worker_takes_a_costly_job_before_a_cheap_one(lib: Library, tiny_model_path: Path) -> None:
    intake = Intake(lib, str(tiny_model_path))
    ran: queue.Queue[str] = queue.Queue()

    def blocker(label: str) -> tuple[threading.Event, threading.Event]:
        started, release = threading.Event(), threading.Event()

        def job(t: Tokenizer) -> None:
            started.set()
            assert release.wait(30)
            ran.put(f"{label} on {threading.current_thread().name}")

        intake.submit(job, lambda r, e: None, grammar=True, cost=QUICK_COST + 1 if label == "hold-costly" else 10)
        assert started.wait(30)
        return started, release

    def job(label: str) -> Any:
        return lambda t: ran.put(f"{label} on {threading.current_thread().name}")

    try:
        intake.wait_loaded()
        _, costly_hold = blocker("hold-costly")  # grammar-1, the costly lane's only worker
        _, cheap_hold = blocker("hold-cheap")  # grammar-0: grammar-1 is busy
        intake.submit(job("cheap"), lambda r, e: None, grammar=True, cost=10)
        intake.submit(job("costly"), lambda r, e: None, grammar=True, cost=QUICK_COST + 1)
        costly_hold.set()
        assert [ran.get(timeout=30) for _ in range(3)] == [
            "hold-costly on aiobasert-grammar-1",
            "costly on aiobasert-grammar-1",  # queued after the cheap job, served before it
            "cheap on aiobasert-grammar-1",
        ]
        cheap_hold.set()
        assert ran.get(timeout=30) == "hold-cheap on aiobasert-grammar-0"
    finally:
        intake.close()

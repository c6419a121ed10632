"""Request preparation off the engine thread: tokenization and grammar compiles.

Both can take unbounded time (a 15 MB prompt, a 40,000-entry enum) or stack
(llguidance recurses once per chained `$ref`), so the engine thread, which
must only step, never runs them. `Intake` owns a few worker threads (the
grammar workers with a large stack, `STACK_BYTES`), each with its own
tokenizer-only engine handle (`baseRT_load_tokenizer_only`: a handle of its
own, so the engine's model handle stays single-owner) and its own `Library`
view bound to it (the debug thread check then still proves the model handle
is only entered by the engine thread).

Two queues, so cheap work is never stuck behind a slow compile:

* the tokenizer queue (one thread, FIFO): requests without a grammar,
  embedding inputs and `Engine.encode`; requests reach the engine thread in
  the order they were submitted;
* the grammar queue (`GRAMMAR_WORKERS` threads): requests with a grammar are
  tokenized and compiled there and join the engine's FIFO queue when ready.

A job's result (or its typed error) goes back through `done`; nothing a job
raises ever reaches a worker thread's top (it would end the worker).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from ctypes import c_char_p, c_int, c_uint32
from typing import Any

from ..errors import AioBaseRTError, InvalidRequestError
from . import ffi as _ffi
from .protocol import Done
from .step import internal_error

STACK_BYTES = 256 * 1024 * 1024
"""Each grammar worker's stack: address space reserved, touched only as far as a compile
recurses (a 1,024-`$ref` chain, `types.MAX_SCHEMA_REFS`, needs < 32 MiB; 4,000 fit in this)."""
GRAMMAR_WORKERS = 2

_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


class Tokenizer:
    """A worker's own tokenizer handle; used on that worker thread only."""

    def __init__(self, lib: _ffi.Library, handle: int, *, owned: bool) -> None:
        self.lib = lib
        self.handle = handle
        self._owned = owned

    @classmethod
    def load(cls, lib: _ffi.Library, model_path: str) -> Tokenizer:
        """A tokenizer-only handle of our own, on (and bound to) the calling worker thread."""
        # Our own view of the library, bound to this thread: calls on our handle
        # are legitimate here and never count against the engine's thread check.
        own = _ffi.Library(lib.path, lib.origin, thread_check=lib.thread_check)
        own.bind_thread()
        handle = own.baseRT_load_tokenizer_only(os.fsencode(model_path))
        if not handle:
            raise own.last_error("baseRT_load_tokenizer_only")
        return cls(own, handle, owned=True)

    @classmethod
    def borrow(cls, lib: _ffi.Library, handle: int) -> Tokenizer:
        """The engine's own model handle (engines without a tokenizer-only load): engine thread only."""
        return cls(lib, handle, owned=False)

    def close(self) -> None:
        if self.handle and self._owned:
            self.lib.baseRT_free_model(self.handle)
        self.handle = 0

    def encode_text(self, text: str, *, special: bool) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be str or a list of token ids, not {type(text).__name__}")
        try:
            data = _ffi.c_str(text)
        except ValueError as exc:
            raise InvalidRequestError(f"prompt cannot be encoded: {exc}") from None
        cap = len(data) + 8  # byte-level BPE: at most one token per byte, plus BOS
        out = (c_uint32 * cap)()
        fn = "baseRT_encode" if special else "baseRT_encode_plain"
        n = getattr(self.lib, fn)(self.handle, data, out, cap)
        if n < 0:
            raise self.lib.last_error(fn)
        return list(out[:n])

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        try:
            datas = [_ffi.c_str(t) for t, _ in pieces]
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"message cannot be encoded: {exc}") from None
        texts = (c_char_p * len(datas))(*datas)
        plain = (c_int * len(datas))(*(1 if content else 0 for _, content in pieces))
        cap = sum(len(d) for d in datas) + 8
        out = (c_uint32 * cap)()
        n = self.lib.baseRT_encode_pieces(self.handle, texts, plain, len(datas), out, cap)
        if n < 0:
            raise self.lib.last_error("baseRT_encode_pieces")
        return list(out[:n])


Job = Callable[[Tokenizer], Any]


def run_job(job: Job, tok: Tokenizer) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, a typed error): nothing a job raises escapes."""
    try:
        return job(tok), None
    except AioBaseRTError as exc:
        return None, exc
    except Exception as exc:  # a bug in one request's preparation costs that request only
        return None, internal_error("preparing the request", exc)


# One tokenizer-only load at a time: each parses the bundle's header (for a 262k vocabulary a ~25 MB
# tree, freed when the load ends), so loads in turn never hold several trees at once.
_load_lock = threading.Lock()


class _Worker:
    def __init__(
        self, name: str, jobs: queue.SimpleQueue[tuple[Job, Done] | None], intake: Intake, stack: int
    ) -> None:
        self._jobs = jobs
        self._intake = intake
        self._tok: Tokenizer | None = None
        self.loaded = threading.Event()  # set once the first load was tried
        with _stack_lock:
            old = threading.stack_size(stack)
            try:
                self.thread = threading.Thread(target=self._main, name=name, daemon=True)
                self.thread.start()
            finally:
                threading.stack_size(old)

    def _load(self) -> Tokenizer:
        with _load_lock:
            return Tokenizer.load(self._intake.lib, self._intake.model_path)

    def _main(self) -> None:
        try:
            try:  # at once, not at the first job: see Intake.wait_loaded
                self._tok = self._load()
            except Exception:  # the first job tries again and reports why
                pass
            finally:
                self.loaded.set()
            while (item := self._jobs.get()) is not None:
                job, done = item
                if self._tok is None:
                    try:
                        self._tok = self._load()
                    except Exception as exc:  # tried again by the next job
                        done(None, exc if isinstance(exc, AioBaseRTError) else internal_error("loading", exc))
                        continue
                done(*run_job(job, self._tok))
        finally:
            if self._tok is not None:
                self._tok.close()


class Intake:
    """The preparation workers of one engine (see the module docstring)."""

    def __init__(self, lib: _ffi.Library, model_path: str) -> None:
        self.lib = lib
        self.model_path = model_path
        self._light: queue.SimpleQueue[tuple[Job, Done] | None] = queue.SimpleQueue()
        self._heavy: queue.SimpleQueue[tuple[Job, Done] | None] = queue.SimpleQueue()
        # Tokenizing does not recurse: the platform's default stack (0) does.
        self._workers = [_Worker("aiobasert-tokenize", self._light, self, 0)]
        self._workers += [
            _Worker(f"aiobasert-grammar-{i}", self._heavy, self, STACK_BYTES) for i in range(GRAMMAR_WORKERS)
        ]

    def wait_loaded(self) -> None:
        """Until every worker has loaded its tokenizer handle (or failed to: its first job says why).
        The engine waits for this before it loads the model's weights, so the workers' header parses
        peak beside the tokenizer alone, never beside the weights (a process's peak RSS)."""
        for w in self._workers:
            w.loaded.wait()

    def submit(self, job: Job, done: Done, *, grammar: bool) -> None:
        """Run job(tokenizer) on a worker; done(result, error) is called on that worker."""
        (self._heavy if grammar else self._light).put((job, done))

    def close(self) -> None:
        """Let the workers finish their queues and exit (they free their handles)."""
        self._light.put(None)
        for _ in range(GRAMMAR_WORKERS):
            self._heavy.put(None)

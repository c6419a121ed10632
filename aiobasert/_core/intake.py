"""Request preparation off the engine thread: tokenization and grammar compiles.

Both can take unbounded time (a 15 MB prompt, a 40,000-entry enum) or stack
(llguidance recurses once per chained `$ref`), so the engine thread, which
must only step, never runs them. `Intake` owns a few worker threads (the
grammar workers with a large stack, `STACK_BYTES`), each with its own
tokenizer-only engine handle (`baseRT_load_tokenizer_only`: a handle of its
own, so the engine's model handle stays single-owner) and its own `Library`
view bound to it (the debug thread check then still proves the model handle
is only entered by the engine thread).

Jobs go into three lanes by their cost (`cost.lane_of`: characters of
prompt text plus grammar source, measured before any work), so a cheap job
never waits behind a costly one:

* quick (the tokenizer worker, FIFO): cheap requests without a grammar,
  embedding inputs and `Engine.encode`; they reach the engine thread in the
  order they were submitted;
* cheap (grammar worker 0; worker 1 too when it has nothing costly): cheap
  requests with a grammar, which join the engine's FIFO queue when ready;
* costly (grammar worker 1): everything above `cost.QUICK_COST`, text
  or grammar, one at a time, FIFO.

Tokenizing returns a ctypes array (`TokenIds`), filled by the C call with the
GIL released, never a Python list: the engine thread feeds it to the engine
as it is.

A job's result (or its typed error) goes back through `done`; nothing a job
raises ever reaches a worker thread's top (it would end the worker).
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from ctypes import c_char_p, c_int, c_uint32
from typing import Any

from .. import _ffi
from ..errors import AioBaseRTError, InvalidRequestError
from .cost import MAX_ENCODE_IDS, QUICK_COST, Lane, check_fits, lane_of
from .output import Detokenizer
from .protocol import Done
from .step import internal_error

TokenIds = ctypes.Array[c_uint32]
"""Token ids as the engine takes them (a C uint32 array): what tokenizing returns."""

STACK_BYTES = 256 * 1024 * 1024
"""Each grammar worker's stack: address space reserved, touched only as far as a compile
recurses (a 1,024-`$ref` chain, `types.MAX_SCHEMA_REFS`, needs < 32 MiB; 4,000 fit in this)."""
GRAMMAR_WORKERS = 2
"""grammar-0 serves the cheap lane only, grammar-1 the costly lane first, then the cheap one."""

_DECODE_SLICE = 16384  # ids joined per C call when decoding (each holds the GIL)

_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


class Tokenizer:
    """A worker's own tokenizer handle; used on that worker thread only."""

    def __init__(self, lib: _ffi.Library, handle: int, *, owned: bool, model_path: str = "") -> None:
        self.lib = lib
        self.handle = handle
        self._owned = owned
        self.model_path = model_path
        self.encoded = 0  # texts this handle tokenized (tests count them)

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
        return cls(own, handle, owned=True, model_path=model_path)

    @classmethod
    def borrow(cls, lib: _ffi.Library, handle: int, model_path: str = "") -> Tokenizer:
        """The engine's own model handle (engines without a tokenizer-only load): engine thread only."""
        return cls(lib, handle, owned=False, model_path=model_path)

    def close(self) -> None:
        if self.handle and self._owned:
            self.lib.baseRT_free_model(self.handle)
        self.handle = 0

    def encode_list(self, text: str, *, special: bool) -> list[int]:
        """The ids of `text` as a list (Engine.encode's answer), read straight from the C call's buffer."""
        out, n = self._encode(text, special=special, limit=None)
        if n > MAX_ENCODE_IDS:
            raise InvalidRequestError(f"prompt: the text is {n} tokens, more than the limit of {MAX_ENCODE_IDS}")
        ids: list[int] = out[:n]
        return ids

    def encode_text(self, text: str, *, special: bool, limit: int | None = None) -> TokenIds:
        """The ids of `text`. With `limit` (the context window), a text that cannot encode to
        `limit` tokens or fewer is refused before it is tokenized (cost.check_fits)."""
        return _exact(*self._encode(text, special=special, limit=limit))

    def _encode(self, text: str, *, special: bool, limit: int | None) -> tuple[TokenIds, int]:
        """The C call's buffer (one slot per byte of text, plus BOS) and how many ids it holds."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be str or a list of token ids, not {type(text).__name__}")
        self.check_fits(len(text), limit)
        try:
            data = _ffi.c_str(text)
        except ValueError as exc:
            raise InvalidRequestError(f"prompt cannot be encoded: {exc}") from None
        cap = len(data) + 8  # byte-level BPE: at most one token per byte, plus BOS
        out = (c_uint32 * cap)()
        fn = "baseRT_encode" if special else "baseRT_encode_plain"
        self.encoded += 1
        n = getattr(self.lib, fn)(self.handle, data, out, cap)
        if n < 0:
            raise self.lib.last_error(fn)
        return out, n

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]], *, limit: int | None = None) -> TokenIds:
        self.check_fits(sum(len(t) for t, _ in pieces), limit)
        try:
            datas = [_ffi.c_str(t) for t, _ in pieces]
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"message cannot be encoded: {exc}") from None
        texts = (c_char_p * len(datas))(*datas)
        plain = (c_int * len(datas))(*(1 if content else 0 for _, content in pieces))
        cap = sum(len(d) for d in datas) + 8
        out = (c_uint32 * cap)()
        self.encoded += 1
        n = self.lib.baseRT_encode_pieces(self.handle, texts, plain, len(datas), out, cap)
        if n < 0:
            raise self.lib.last_error("baseRT_encode_pieces")
        return _exact(out, n)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of checked ids, as the engine thread's Detokenizer makes it (invalid UTF-8
        becomes U+FFFD): each distinct id is asked of the engine once."""
        detok = Detokenizer(self.lib, self.handle)
        table: dict[int, bytes] = {}
        parts = []
        for i in range(0, len(ids), _DECODE_SLICE):  # in slices: no single C call holds the GIL for long
            part = ids[i : i + _DECODE_SLICE]
            for t in set(part).difference(table):
                table[t] = detok.token_bytes(t)
            parts.append(b"".join(map(table.__getitem__, part)))
        return b"".join(parts).decode("utf-8", "replace")

    def check_fits(self, chars: int, limit: int | None) -> None:
        """ContextLengthExceededError when `chars` characters of text cannot encode to `limit` tokens
        (`cost.check_fits`), decided without tokenizing them."""
        # A quick job is tokenized and counted exactly (a few ms); a costly one is measured first.
        if limit is not None and chars > QUICK_COST:
            check_fits(chars, limit, self.lib, self.handle, self.model_path)


def _exact(out: TokenIds, n: int) -> TokenIds:
    """The first n ids of `out` in an array of their own (a C copy: no Python ints are made)."""
    ids = (c_uint32 * n)()
    ctypes.memmove(ids, out, n * ctypes.sizeof(c_uint32))
    return ids


Job = Callable[[Tokenizer], Any]


class Reroute(Exception):
    """Raised by a job on a worker that does not serve the costly lane (`on_costly_worker`) when it
    comes to work only the costly lane pays (the host grammar backend's first build): the job goes,
    whole, to the costly lane, and this worker goes on with its own (its cheap jobs never wait)."""


_serving = threading.local()  # .lanes: the lanes the calling worker serves


def on_costly_worker() -> bool:
    """Whether the calling thread pays costly work: a worker of the costly lane, or no worker (a
    job run inline)."""
    return "costly" in getattr(_serving, "lanes", ("costly",))


def run_job(job: Job, tok: Tokenizer) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, a typed error): nothing a job raises escapes but `Reroute`."""
    try:
        return job(tok), None
    except AioBaseRTError as exc:
        return None, exc
    except Reroute:
        raise
    except Exception as exc:  # a bug in one request's preparation costs that request only
        return None, internal_error("preparing the request", exc)


# One tokenizer-only load at a time: each parses the bundle's header (for a 262k vocabulary a ~25 MB
# tree, freed when the load ends), so loads in turn never hold several trees at once.
_load_lock = threading.Lock()


class _Lanes:
    """The jobs waiting for the workers of one engine, by lane (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[Lane, collections.deque[tuple[Job, Done]]] = {
            "quick": collections.deque(),
            "cheap": collections.deque(),
            "costly": collections.deque(),
        }
        self._closed = False

    def put(self, lane: Lane, job: Job, done: Done) -> None:
        with self._cond:
            self._queues[lane].append((job, done))
            self._cond.notify_all()

    def take(self, lanes: tuple[Lane, ...]) -> tuple[Job, Done] | None:
        """The next job of the first of `lanes` that has one (waits); None once closed and they are empty."""
        with self._cond:
            while True:
                for lane in lanes:
                    if self._queues[lane]:
                        return self._queues[lane].popleft()
                if self._closed:
                    return None
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _Worker:
    def __init__(self, name: str, lanes: tuple[Lane, ...], intake: Intake, stack: int) -> None:
        self._lanes = lanes
        self._intake = intake
        self.tok: Tokenizer | None = None
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
        _serving.lanes = self._lanes
        try:
            try:  # at once, not at the first job: see Intake.wait_loaded
                self.tok = self._load()
            except Exception:  # the first job tries again and reports why
                pass
            finally:
                self.loaded.set()
            while (item := self._intake.jobs.take(self._lanes)) is not None:
                job, done = item
                if self.tok is None:
                    try:
                        self.tok = self._load()
                    except Exception as exc:  # tried again by the next job
                        done(None, exc if isinstance(exc, AioBaseRTError) else internal_error("loading", exc))
                        continue
                try:
                    outcome = run_job(job, self.tok)
                except Reroute:  # run again, whole, where costly work is paid
                    self._intake.jobs.put("costly", job, done)
                    continue
                done(*outcome)
        finally:
            if self.tok is not None:
                self.tok.close()


class Intake:
    """The preparation workers of one engine (see the module docstring)."""

    def __init__(self, lib: _ffi.Library, model_path: str) -> None:
        self.lib = lib
        self.model_path = model_path
        self.jobs = _Lanes()
        # Tokenizing does not recurse: the platform's default stack (0) does.
        self._workers = [
            _Worker("aiobasert-tokenize", ("quick",), self, 0),
            _Worker("aiobasert-grammar-0", ("cheap",), self, STACK_BYTES),
            _Worker("aiobasert-grammar-1", ("costly", "cheap"), self, STACK_BYTES),
        ]

    def wait_loaded(self) -> None:
        """Until every worker has loaded its tokenizer handle (or failed to: its first job says why).
        The engine waits for this before it loads the model's weights, so the workers' header parses
        peak beside the tokenizer alone, never beside the weights (a process's peak RSS)."""
        for w in self._workers:
            w.loaded.wait()

    def texts_encoded(self) -> int:
        """Texts the workers have tokenized so far (a count the tests read)."""
        return sum(w.tok.encoded for w in self._workers if w.tok is not None)

    def submit(self, job: Job, done: Done, *, grammar: bool, cost: int) -> None:
        """Run job(tokenizer) on a worker of the lane for `cost` (characters of text plus grammar
        source: cost.lane_of); done(result, error) is called on that worker."""
        self.jobs.put(lane_of(cost, grammar=grammar), job, done)

    def close(self) -> None:
        """Let the workers finish their lanes and exit (they free their handles)."""
        self.jobs.close()

"""Typed exceptions.

Engine failures carry the engine's own message and `BaseRTErrorCode`; SDK-level
refusals (bad parameters, context overflow, overload, closed engine) are raised
in the caller's coroutine before anything reaches the engine. Every exception the
SDK raises on purpose is defined here, under the one root `AioBaseRTError`
(a second base, where there is one, lets plain `except ValueError:` code catch it too):

    AioBaseRTError
    ├── EngineError                       a libbaseRT call failed: `.code`, `.message`
    │   ├── InvalidArgumentError          (ValueError)        INVALID_ARGUMENT
    │   ├── ModelFileNotFoundError        (FileNotFoundError) FILE_NOT_FOUND
    │   ├── InvalidFormatError                                INVALID_FORMAT
    │   ├── UnsupportedError                                  UNSUPPORTED
    │   ├── EngineOutOfMemoryError        (MemoryError)       OUT_OF_MEMORY
    │   ├── GPUError                                          GPU
    │   └── GenerationFailedError                             GENERATION_FAILED
    ├── LibraryError                      libbaseRT not found / not loadable
    │   └── AbiMismatchError
    ├── InvalidRequestError               (ValueError) a request refused before the engine
    │   ├── InvalidSamplingParamsError
    │   └── ContextLengthExceededError
    ├── InvalidConfigError                (ValueError) an `EngineConfig` / `Engine.open` option
    ├── EngineOverloadedError             the request queue is full
    ├── EngineClosedError                 the engine is closed or closing
    ├── WrongEventLoopError               (RuntimeError) used outside its event loop
    ├── StreamBusyError                   (RuntimeError) two readers on one stream
    ├── StreamClosedError                 `await stream` after the stream was left
    ├── ThreadAffinityError               (AssertionError) debug mode: wrong thread in libbaseRT
    ├── BundleError                       (ValueError) a malformed `.base` file
    ├── ConversionError                   (ValueError) a source that cannot be converted
    ├── ModelNotAvailableError            (FileNotFoundError) no default model
    ├── UnknownModelError                 (LookupError) a model the group does not serve
    └── InternalError                     a bug in aiobasert, confined to the request it hit
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path


class ErrorCode(IntEnum):
    """`BaseRTErrorCode` (ABI 1). May gain values; never repurposed."""

    OK = 0
    UNKNOWN = 1
    INVALID_ARGUMENT = 2
    FILE_NOT_FOUND = 3
    INVALID_FORMAT = 4
    UNSUPPORTED = 5
    OUT_OF_MEMORY = 6
    GPU = 7
    GENERATION_FAILED = 8


class AioBaseRTError(Exception):
    """Root of every exception this package raises."""


class EngineError(AioBaseRTError):
    """A call into libbaseRT failed; `code` and `message` are the engine's."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str, *, code: int | None = None, function: str | None = None) -> None:
        if code is not None:
            try:
                self.code = ErrorCode(code)
            except ValueError:  # a code from a newer engine: keep the number
                self.code = ErrorCode.UNKNOWN
        self.raw_code = code if code is not None else int(self.code)
        self.message = message
        self.function = function
        # the engine's messages usually name their function already: say it once
        where = f"{function}: " if function and not message.startswith(function) else ""
        super().__init__(f"{where}{message} [{self.code.name}]")


class InvalidArgumentError(EngineError, ValueError):
    """The engine refused an argument (INVALID_ARGUMENT)."""

    code = ErrorCode.INVALID_ARGUMENT


class ModelFileNotFoundError(EngineError, FileNotFoundError):
    """The model file does not exist or cannot be opened (FILE_NOT_FOUND)."""

    code = ErrorCode.FILE_NOT_FOUND


class InvalidFormatError(EngineError):
    """The model file exists but is truncated, corrupt or not a `.base` bundle."""

    code = ErrorCode.INVALID_FORMAT


class UnsupportedError(EngineError):
    """The engine recognises the request but does not implement it (UNSUPPORTED)."""

    code = ErrorCode.UNSUPPORTED


class EngineOutOfMemoryError(EngineError, MemoryError):
    """The engine ran out of memory, e.g. KV blocks (OUT_OF_MEMORY)."""

    code = ErrorCode.OUT_OF_MEMORY


class GPUError(EngineError):
    """A device or kernel failure in a GPU engine (GPU)."""

    code = ErrorCode.GPU


class GenerationFailedError(EngineError):
    """A step failed mid-run (GENERATION_FAILED); the lanes of that step end with it."""

    code = ErrorCode.GENERATION_FAILED


_BY_CODE: dict[int, type[EngineError]] = {
    int(ErrorCode.INVALID_ARGUMENT): InvalidArgumentError,
    int(ErrorCode.FILE_NOT_FOUND): ModelFileNotFoundError,
    int(ErrorCode.INVALID_FORMAT): InvalidFormatError,
    int(ErrorCode.UNSUPPORTED): UnsupportedError,
    int(ErrorCode.OUT_OF_MEMORY): EngineOutOfMemoryError,
    int(ErrorCode.GPU): GPUError,
    int(ErrorCode.GENERATION_FAILED): GenerationFailedError,
}


def engine_error(code: int, message: str, function: str | None = None) -> EngineError:
    """The typed exception for an engine error code."""
    cls = _BY_CODE.get(int(code), EngineError)
    return cls(message or "(the engine gave no message)", code=code, function=function)


class LibraryError(AioBaseRTError):
    """libbaseRT could not be found or loaded, or speaks another ABI."""


class AbiMismatchError(LibraryError):
    """The loaded libbaseRT reports an ABI number other than the one supported."""


class InvalidRequestError(AioBaseRTError, ValueError):
    """A request was refused before reaching the engine (bad prompt or parameter)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""


class ContextLengthExceededError(InvalidRequestError):
    """prompt + max_tokens does not fit the engine's context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_context = max_context
        # The KV holds the prompt and every generated token but the last, so
        # prompt + max_tokens may be max_context + 1: say the exact limit.
        room = max_context - prompt_tokens + 1
        if room < 1:
            why = f"the prompt of {prompt_tokens} tokens alone exceeds the context window of {max_context} tokens"
        else:
            why = (
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the context window of "
                f"{max_context} tokens: at most {room} new tokens fit after this prompt"
            )
        super().__init__(why)


class EngineOverloadedError(AioBaseRTError):
    """The request queue is full; the request was not accepted (nothing was lost)."""


class EngineClosedError(AioBaseRTError):
    """The engine is closed or closing and takes no new requests."""


class InvalidConfigError(AioBaseRTError, ValueError):
    """An `Engine.open` option is out of range or of the wrong type."""


class WrongEventLoopError(AioBaseRTError, RuntimeError):
    """An engine (or one of its streams) was used outside the event loop that opened it.

    An engine belongs to one event loop (one asyncio loop or one trio run);
    another loop, another thread, or no loop at all gets this at once."""


class StreamBusyError(AioBaseRTError, RuntimeError):
    """A second task tried to read a stream while another task is waiting on it."""


class StreamClosedError(AioBaseRTError):
    """`await stream` on a stream that was left (break, aclose, cancellation)
    before all of its output was read: there is no whole completion to return."""


class ThreadAffinityError(AioBaseRTError, AssertionError):
    """Debug mode: a thread other than the engine thread entered libbaseRT."""


class InternalError(AioBaseRTError):
    """A bug in aiobasert, surfaced as an error of the one request (or step) it hit; every other
    stream goes on. The message says where it happened; `__cause__` is the original exception."""

    def __init__(self, where: str, cause: BaseException) -> None:
        super().__init__(f"internal error {where}: {cause!r}")
        self.where = where
        self.__cause__ = cause


# ---- models and files (raised by Engine.open / EngineGroup / the model cache) ----


class BundleError(AioBaseRTError, ValueError):
    """A `.base` file is malformed; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{os.fspath(path)}: {reason}")
        self.path = Path(path)
        self.reason = reason


class ConversionError(AioBaseRTError, ValueError):
    """The source cannot be converted; the message names the file and the reason."""


class ModelNotAvailableError(AioBaseRTError, FileNotFoundError):
    """The default model cannot be found or built; the message says how to fix it."""


class UnknownModelError(AioBaseRTError, LookupError):
    """A request named a model the group does not serve (the server's 404 `model_not_found`)."""

    def __init__(self, name: str | None, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(f"the model {name!r} does not exist; this server serves {', '.join(self.known) or 'none'}")

"""aiobasert: an asyncio/trio-native streaming SDK for the BaseRT LLM engine.

```python
async with aiobasert.Engine.open("model.base") as engine:
    async for tok in engine.stream("Once upon a time", max_tokens=64):
        print(tok.text, end="")
```
"""

from .engine import Engine
from .errors import (
    AbiMismatchError,
    AioBaseRTError,
    ContextLengthExceededError,
    EngineClosedError,
    EngineError,
    EngineOutOfMemoryError,
    EngineOverloadedError,
    ErrorCode,
    GenerationFailedError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidFormatError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    LibraryError,
    ModelFileNotFoundError,
    StreamBusyError,
    StreamClosedError,
    ThreadAffinityError,
    UnsupportedError,
    WrongEventLoopError,
)
from .streams import TokenStream
from .tools import ChatReply, ChatStream, TextDelta, Tool, ToolCall, ToolCallDelta
from .types import (
    ChatMessage,
    Completion,
    EngineStats,
    ModelInfo,
    SamplingParams,
    Timing,
    Token,
    TopLogprob,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "AbiMismatchError",
    "AioBaseRTError",
    "ChatMessage",
    "ChatReply",
    "ChatStream",
    "Completion",
    "ContextLengthExceededError",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineOutOfMemoryError",
    "EngineOverloadedError",
    "EngineStats",
    "ErrorCode",
    "GenerationFailedError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvalidFormatError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "LibraryError",
    "ModelFileNotFoundError",
    "ModelInfo",
    "SamplingParams",
    "StreamBusyError",
    "StreamClosedError",
    "TextDelta",
    "ThreadAffinityError",
    "Timing",
    "Token",
    "TokenStream",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "UnsupportedError",
    "Usage",
    "WrongEventLoopError",
]

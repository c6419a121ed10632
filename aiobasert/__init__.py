"""aiobasert: an asyncio/trio-native streaming SDK for the BaseRT LLM engine.

```python
async with aiobasert.Engine.open("model.base") as engine:
    async for tok in engine.stream("Once upon a time", max_tokens=64):
        print(tok.text, end="")
```
"""

from .batcher import client_scope
from .choices import ChoiceEvent, Choices
from .config import EngineConfig, SpeculationConfig
from .engine import Engine
from .errors import (
    AbiMismatchError,
    AioBaseRTError,
    BundleError,
    ContextLengthExceededError,
    ConversionError,
    EngineClosedError,
    EngineError,
    EngineOutOfMemoryError,
    EngineOverloadedError,
    ErrorCode,
    GenerationFailedError,
    GPUError,
    InternalError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidFormatError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    LibraryError,
    ModelFileNotFoundError,
    ModelNotAvailableError,
    StreamBusyError,
    StreamClosedError,
    ThreadAffinityError,
    UnknownModelError,
    UnsupportedError,
    WrongEventLoopError,
)
from .group import EngineGroup, ModelStats
from .reasoning import ReasoningDelta, Thinking
from .streams import TokenStream
from .tools import ChatReply, ChatStream, TextDelta, Tool, ToolCall, ToolCallDelta
from .types import (
    Capabilities,
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
    "BundleError",
    "Capabilities",
    "ChatMessage",
    "ChatReply",
    "ChatStream",
    "ChoiceEvent",
    "Choices",
    "Completion",
    "ContextLengthExceededError",
    "ConversionError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "EngineGroup",
    "EngineOutOfMemoryError",
    "EngineOverloadedError",
    "EngineStats",
    "ErrorCode",
    "GPUError",
    "GenerationFailedError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvalidFormatError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "LibraryError",
    "ModelFileNotFoundError",
    "ModelInfo",
    "ModelNotAvailableError",
    "ModelStats",
    "ReasoningDelta",
    "SamplingParams",
    "SpeculationConfig",
    "StreamBusyError",
    "StreamClosedError",
    "TextDelta",
    "Thinking",
    "ThreadAffinityError",
    "Timing",
    "Token",
    "TokenStream",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "UnknownModelError",
    "UnsupportedError",
    "Usage",
    "WrongEventLoopError",
    "client_scope",
]

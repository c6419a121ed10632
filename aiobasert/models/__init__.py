"""Models: the `.base` bundle format (`bundle`), GGUF conversion (`convert`), the model
cache with the demo and published models (`cache`), and tiny random models for tests
(`tiny`). The cache's functions are importable from here: `aiobasert.models.pull(...)`."""

from .cache import (
    DEFAULT_MODEL_FILENAME,
    CachedModel,
    cache_dir,
    default_model_path,
    gguf_bundle_path,
    is_gguf,
    list_models,
    published_gguf_path,
    pull,
    remove_model,
    resolve_model,
    smollm2_gguf_path,
)

__all__ = [
    "DEFAULT_MODEL_FILENAME",
    "CachedModel",
    "cache_dir",
    "default_model_path",
    "gguf_bundle_path",
    "is_gguf",
    "list_models",
    "published_gguf_path",
    "pull",
    "remove_model",
    "resolve_model",
    "smollm2_gguf_path",
]

"""`EngineConfig`: one frozen, validated config behind `Engine.open`'s keywords, `config=` and
`engine.config`."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aiobasert import Engine, EngineConfig, EngineGroup, InvalidConfigError

pytestmark = pytest.mark.anyio

FIELDS = [f.name for f in msgspec.structs.fields(EngineConfig)]

BAD: list[dict[str, Any]] = [
    {"max_batch_size": 0},
    {"max_batch_size": 2**31},
    {"max_queue": 1.5},
    {"prefill_chunk": True},
    {"max_context": 1},
    {"max_context": "2048"},
    {"prefix_cache": 1},
    {"prefix_cache_mb": -1},
    {"prefix_cache_mb": True},
    {"prefix_cache_mb": 1.5},
    {"kv_cache_dtype": "bf16"},
    {"kv_cache_dtype": None},
    {"dtype": "q5"},
    {"library": 3},
    {"library": b"lib.so"},
    {"thread_check": "yes"},
    {"grammar_backend_at_open": "no"},
]


def test_open_s_keywords_are_the_config_s_fields_with_the_same_defaults() -> None:
    params = inspect.signature(Engine.open).parameters
    assert [p for p in params if p not in ("model", "config")] == FIELDS
    default = EngineConfig()
    assert {name: params[name].default for name in FIELDS} == {name: getattr(default, name) for name in FIELDS}


@pytest.mark.parametrize("bad", BAD, ids=lambda bad: "-".join(f"{k}={v!r}" for k, v in bad.items()))
def test_a_bad_field_is_refused_on_construction_naming_it(bad: dict[str, Any]) -> None:
    ((name, _),) = bad.items()
    with pytest.raises(InvalidConfigError, match=name):
        EngineConfig(**bad)
    with pytest.raises(InvalidConfigError, match=name):  # the same rule behind the keywords
        Engine.open(None, **bad)
    with pytest.raises(InvalidConfigError, match=name):  # and behind a copy with one field changed
        msgspec.structs.replace(EngineConfig(), **bad)


def test_the_config_is_frozen_and_plain_data() -> None:
    config = EngineConfig(max_batch_size=2, library="/opt/libbaseRT.so")
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError)):
        config.max_batch_size = 3  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig) == config
    with pytest.raises(msgspec.ValidationError, match="max_contxt"):
        msgspec.convert({"max_contxt": 4}, EngineConfig)
    with pytest.raises(TypeError):
        EngineConfig(2)  # type: ignore[misc]  # keywords only


async def test_open_with_a_config_is_open_with_its_keywords(tiny_model_path: Path) -> None:
    config = EngineConfig(max_batch_size=2, max_context=64, max_queue=3, kv_cache_dtype="f32")
    async with Engine.open(tiny_model_path, config=config) as engine:
        assert engine.config is config
        assert (engine.info.max_batch_size, engine.info.max_context, engine.info.kv_cache_dtype) == (2, 64, "f32")
    async with Engine.open(
        tiny_model_path, max_batch_size=2, max_context=64, max_queue=3, kv_cache_dtype="f32"
    ) as engine:
        assert engine.config == config
    async with Engine.open(tiny_model_path, library=None) as engine:
        assert engine.config == EngineConfig()


def test_a_keyword_given_with_a_config_is_refused_not_dropped(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="max_context"):
        Engine.open(None, config=EngineConfig(max_batch_size=2), max_context=64)
    with pytest.raises(InvalidConfigError, match="config must be an EngineConfig"):
        Engine.open(None, config={"max_batch_size": 2})  # type: ignore[arg-type]
    # a keyword at its default is not "given": nothing is lost
    assert Engine.open(None, config=EngineConfig(max_batch_size=2), max_batch_size=8)._config.max_batch_size == 2
    # a Path for the library keyword: the config holds its text
    assert Engine.open(None, library=tmp_path / "lib.so")._config.library == str(tmp_path / "lib.so")


def test_max_buffered_tokens_is_gone() -> None:
    with pytest.raises(TypeError, match="max_buffered_tokens"):
        Engine.open(None, max_buffered_tokens=4)  # type: ignore[call-arg]
    assert "max_buffered_tokens" not in FIELDS


async def test_a_group_opens_every_model_with_its_config(tiny_model_path: Path) -> None:
    config = EngineConfig(max_batch_size=2, max_context=64)
    with pytest.raises(InvalidConfigError, match="max_context"):  # checked at open, before any load
        EngineGroup.open([tiny_model_path], preload=False, config=config, max_context=32)
    async with EngineGroup.open([tiny_model_path], config=config) as group, group.lease() as engine:
        assert engine.config is config and engine.info.max_context == 64

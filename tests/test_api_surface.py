"""The public API, pinned: every name `aiobasert`, `aiobasert.server` and `aiobasert.testing` export, with the
signature of each function and of each public method and field of each class, must equal
tests/api_surface.txt. A change to the public surface is a deliberate edit of that file
(regenerate it with `python tests/test_api_surface.py` and say why in CHANGELOG.md);
an accidental one fails here. Also: every exception the SDK defines is exported."""

from __future__ import annotations

import enum
import inspect
import sys
from pathlib import Path
from types import ModuleType

import msgspec

import aiobasert
import aiobasert.errors
import aiobasert.server
import aiobasert.testing

SNAPSHOT = Path(__file__).with_name("api_surface.txt")


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _describe_class(name: str, cls: type) -> list[str]:
    bases = ", ".join(b.__qualname__ for b in cls.__bases__)
    lines = [f"class {name}({bases})"]
    if issubclass(cls, enum.Enum):
        return lines + [f"    {m.name} = {m.value!r}" for m in cls]
    if issubclass(cls, msgspec.Struct):
        for field in msgspec.structs.fields(cls):
            lines.append(f"    field {field.name}: {field.type!r}")
    for attr, value in sorted(vars(cls).items()):
        if attr.startswith("_") and attr != "__init__":
            continue
        if isinstance(value, (staticmethod, classmethod)):
            lines.append(f"    {type(value).__name__} {attr}{_signature(value.__func__)}")
        elif isinstance(value, property):
            lines.append(f"    property {attr}")
        elif inspect.isfunction(value):
            kind = "async def" if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value) else "def"
            lines.append(f"    {kind} {attr}{_signature(value)}")
    return lines


def describe(module: ModuleType) -> list[str]:
    lines = [f"module {module.__name__}"]
    for name in sorted(module.__all__):
        obj = getattr(module, name)
        if isinstance(obj, type):
            lines += _describe_class(name, obj)
        elif callable(obj):
            lines.append(f"def {name}{_signature(obj)}")
        else:
            lines.append(f"{name}: {type(obj).__name__}")
    return lines


def render() -> str:
    return "\n".join(describe(aiobasert) + describe(aiobasert.server) + describe(aiobasert.testing)) + "\n"


def test_public_surface_matches_the_snapshot() -> None:
    assert render() == SNAPSHOT.read_text(), (
        "the public API changed: if on purpose, run `python tests/test_api_surface.py` and note it in CHANGELOG.md"
    )


def test_every_sdk_exception_is_exported() -> None:
    defined = {
        name
        for name, obj in vars(aiobasert.errors).items()
        if isinstance(obj, type) and issubclass(obj, BaseException) and not name.startswith("_")
    }
    assert defined - set(aiobasert.__all__) == set()
    # and nothing else defines one: the exception root has one home
    stray = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _subclasses(aiobasert.AioBaseRTError)
        if cls.__module__ != "aiobasert.errors"
    ]
    assert stray == []


def _subclasses(root: type) -> list[type]:
    out: list[type] = []
    for sub in root.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


if __name__ == "__main__":
    SNAPSHOT.write_text(render())
    sys.stdout.write(f"wrote {SNAPSHOT}\n")

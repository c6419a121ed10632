"""The JSON Schema policy every grammar shares (a request's json_schema, a tool's parameters):
objects that declare their properties are closed (`closed_objects`). Below both the grammar's
compile (`prepare.Preparer`) and the tools (aiobasert/tools/), which apply it."""

from __future__ import annotations

from typing import Any

# Keywords whose subschemas are whole schemas of a value (each closed in turn).
_VALUE_SCHEMAS = ("additionalProperties", "items", "contains", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# Applicators whose branches may declare the object's properties too (the object is not
# closed beside them: `additionalProperties` sees only its sibling `properties`).
_APPLICATORS = ("allOf", "anyOf", "oneOf")


def closed_objects(schema: Any, *, partial: bool = False) -> Any:
    """`schema` (a copy) with every object schema that declares `properties` and says
    nothing of `additionalProperties` closed (`"additionalProperties": false`).

    The policy of tool-call arguments and `json_schema` output (vLLM's default xgrammar
    backend has the same, and so does the engine's own grammar): a call gets exactly the
    properties its tool declares, so a forced call ends once they are written instead of
    adding undeclared ones until `max_tokens`. `additionalProperties: true` or a schema
    is honoured, and so is an object that declares no properties (`{"type": "object"}`:
    any object). An object is left as it is beside `allOf` / `anyOf` / `oneOf` / `$ref`
    or `unevaluatedProperties` (those may declare its properties), and so are the
    branches of an `allOf` of several schemas or of an applicator beside `properties`
    (each declares only some of them: `partial`), and an object whose `required` names
    a property it does not declare (closed, it would admit nothing). `not`, `if` / `then`
    / `else` are not entered (closing them would loosen or change what they mean)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _VALUE_SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("items"), list):  # draft 4-2019 tuple form
        out["items"] = [closed_objects(s) for s in out["items"]]
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [closed_objects(s) for s in out["prefixItems"]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    declares = isinstance(out.get("properties"), dict)
    for key in _APPLICATORS:
        branches = out.get(key)
        if isinstance(branches, list):
            part = declares or (key == "allOf" and len(branches) > 1)
            out[key] = [closed_objects(s, partial=part) for s in branches]
    kind = out.get("type", "object")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    open_beside = ("additionalProperties", "unevaluatedProperties", "$ref", *_APPLICATORS)
    required = out.get("required")
    undeclared = isinstance(required, list) and declares and any(r not in out["properties"] for r in required)
    if is_object and declares and not partial and not undeclared and not any(k in out for k in open_beside):
        out["additionalProperties"] = False
    return out

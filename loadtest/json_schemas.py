"""Held-out JSON schemas for structured-output tests and benchmarks: nested objects,
arrays, enums and required fields, asked for by one everyday instruction."""

from __future__ import annotations

from typing import Any

USER = [{"role": "user", "content": "Describe a person as JSON."}]

NAME = {"type": "string", "maxLength": 8}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
COLOR = {"enum": ["red", "green", "blue"]}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


# Held out: written for this test, not tuned on the tiny model's outputs. Strings, arrays and
# numbers are bounded so that a random model's answer ends within the token budget.
SCHEMAS: list[dict[str, Any]] = [
    obj({"name": NAME}),
    obj({"name": NAME, "age": AGE}),
    obj({"color": COLOR}),
    obj({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    obj({"tags": {"type": "array", "items": COLOR, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": AGE, "minItems": 1, "maxItems": 2}}),
    obj({"person": obj({"name": NAME, "age": AGE})}),
    obj({"a": obj({"b": obj({"c": COLOR})})}),
    obj({"name": NAME, "nick": NAME}, required=["name"]),
    obj({"kind": {"const": "point"}, "x": AGE, "y": AGE}),
    obj({"value": {"anyOf": [AGE, {"type": "boolean"}]}}),
    obj({"items": {"type": "array", "items": obj({"id": AGE}), "maxItems": 2}}),
    obj({"level": {"enum": ["low", "mid", "high"]}, "score": AGE}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    obj({"first": NAME, "last": NAME, "age": AGE}),
    obj({"flag": {"type": "boolean"}, "colors": {"type": "array", "items": COLOR, "maxItems": 2}}),
    obj({"pair": {"type": "array", "prefixItems": [AGE, COLOR], "items": False}}),
    obj({"meta": obj({"v": {"enum": [1, 2, 3]}}), "name": NAME}),
    obj({"n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    {"type": "array", "items": obj({"c": COLOR}), "minItems": 1, "maxItems": 2},
]

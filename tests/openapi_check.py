"""Validating JSON against a schema of a peer's OpenAPI 3.0 document (tests/data/).

OpenAPI 3.0 writes "may be null" as ``nullable: true``, which JSON Schema does not know: each
such schema is rewritten as "this, or null" before validation.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import jsonschema

DATA = Path(__file__).with_name("data")


def _nullable(node):
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def document(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@functools.cache
def _components(name: str) -> dict:
    return _nullable(copy.deepcopy(document(name)["components"]))


def validate(name: str, schema: str, value: object) -> None:
    """Raise jsonschema.ValidationError unless ``value`` is a valid ``schema`` of the
    document ``name`` (a file in tests/data/)."""
    root = {"$ref": f"#/components/schemas/{schema}", "components": _components(name)}
    jsonschema.Draft202012Validator(root).validate(value)


def response_schema(name: str, path: str, method: str, status: str) -> str:
    """The component name of a route's answer for ``status``."""
    op = document(name)["paths"][path][method]
    ref = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
    return ref.rsplit("/", 1)[-1]


def request_schema(name: str, path: str, method: str = "post") -> str:
    op = document(name)["paths"][path][method]
    return op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]


def example_request(name: str, schema: str, fallback: dict) -> dict:
    """A request of ``schema`` from the document's own examples: each property whose
    ``example`` is valid for it, plus ``fallback`` for required ones without a valid one."""
    spec = document(name)["components"]["schemas"][schema]
    body = {}
    for key, prop in spec.get("properties", {}).items():
        if "example" not in prop or prop["example"] == "null":  # "null": written for null
            continue
        candidate = {**fallback, key: prop["example"]}
        try:
            validate(name, schema, {k: v for k, v in candidate.items()
                                    if k in spec.get("required", []) or k == key})
        except jsonschema.ValidationError:
            continue
        body[key] = prop["example"]
    for key in spec.get("required", []):
        body.setdefault(key, fallback[key])
    validate(name, schema, body)
    return body

"""What a request's structured output asks for, as a plain dict that travels on the wire and
between nodes unchanged: ``{"kind": KIND, "value": TEXT}``.

Kinds: ``json_object`` (any JSON object; value empty), ``json_schema`` (value: the schema
as JSON text), ``regex`` (value: the pattern), ``choice`` (value: a JSON list of strings,
the output is exactly one of them) and ``grammar`` (value: a Lark grammar, llguidance's
dialect). Library-free and torch-free: the shape is checked here, compiling is
``engine.grammar.compile``'s job.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# A spec is parsed on every node that runs the request; a megabyte of schema is far past any
# real response format and bounds the work before the compiler's own limits apply.
MAX_VALUE_CHARS = 1 << 20


def check_spec(spec: Any, field: str = "structured") -> None:
    """ValueError naming the bad part of a spec (its shape only, not its compilability)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{field}: must be an object with kind and value")
    unknown = set(spec) - {"kind", "value"}
    if unknown:
        raise ValueError(f"{field}.{sorted(unknown)[0]}: unknown field")
    kind, value = spec.get("kind"), spec.get("value", "")
    if kind not in KINDS:
        raise ValueError(f"{field}.kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(value, str):
        raise ValueError(f"{field}.value: must be a string")
    if len(value) > MAX_VALUE_CHARS:
        raise ValueError(f"{field}.value: at most {MAX_VALUE_CHARS} characters")
    if kind == "json_object":
        return
    if not value:
        raise ValueError(f"{field}.value: must not be empty for kind {kind}")
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}.value: the schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{field}.value: a JSON schema must be an object or a boolean")
    elif kind == "choice":
        choices = _choices(value, field)
        if not choices:
            raise ValueError(f"{field}.value: choice needs at least one string")


def _choices(value: str, field: str) -> list[str]:
    try:
        choices = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}.value: choice must be a JSON list of strings: {e}") from e
    if not isinstance(choices, list) or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{field}.value: choice must be a list of non-empty strings")
    return choices


def choices_of(spec: dict[str, str]) -> list[str]:
    return _choices(spec["value"], "structured")

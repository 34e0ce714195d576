"""The OpenAI fields that constrain or shape output: ``response_format``, vLLM-style
``structured_outputs`` extras, and ``tools`` / ``tool_choice``. They become one grammar
spec (engine.grammar.spec) on the request's sampling, the tools for the chat template, and
the tool mode the response side parses with.

Only shapes are checked here; whether a schema compiles is checked where the grammar is
compiled (the router's tokenize pool, router.requests.validation), with the same library
and limits a worker uses.

Tool choice: ``none`` renders no tools and parses no calls; ``auto`` renders them and
parses calls from the text (router.http.tool_parse); a named function constrains the
output to its arguments (a JSON object of its ``parameters`` schema); ``required``
constrains it to a JSON array of ``{"name", "arguments"}`` calls of the listed functions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from router.http.http_errors import bad_field

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolMode:
    mode: str  # "auto" | "required" | "named"
    name: str = ""  # the named function


@dataclass
class Structured:
    spec: dict[str, str] | None = None  # the grammar on the request's sampling
    field: str = ""  # the request field the grammar came from (for its errors)
    tools_json: str = ""  # rendered through the chat template
    tools: ToolMode | None = None  # how the output is read back


def read(body: dict[str, Any], chat: bool) -> Structured:
    out = Structured()
    if chat:
        out = _tools(body.get("tools"), body.get("tool_choice"))
        if body.get("functions"):
            raise bad_field("functions", "the deprecated functions field is not supported; "
                                         "send tools")
        fmt = _response_format(body.get("response_format"))
        if fmt is not None:
            if out.spec is not None:
                raise bad_field("response_format", "cannot be combined with a tool_choice "
                                                   "that forces a call")
            out.spec, out.field = fmt, "response_format"
    extra = _extras(body.get("structured_outputs"))
    if extra is not None:
        if out.spec is not None:
            raise bad_field("structured_outputs", f"cannot be combined with {out.field}")
        out.spec, out.field = extra, "structured_outputs"
    return out


def _response_format(fmt: Any) -> dict[str, str] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_field("response_format", "must be an object with a type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object", "value": ""}
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise bad_field("response_format.json_schema",
                            "must be an object with name and schema")
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
            raise bad_field("response_format.json_schema.name",
                            "must be 1-64 letters, digits, '_', '-' or '.'")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_field("response_format.json_schema.strict", "must be a boolean")
        schema = js.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_field("response_format.json_schema.schema",
                            "must be a JSON schema object")
        return {"kind": "json_schema", "value": json.dumps(schema)}
    raise bad_field("response_format.type",
                    f"must be text, json_object or json_schema, got {_show(kind)}")


def _extras(so: Any) -> dict[str, str] | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_field("structured_outputs", "must be an object")
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
             if so.get(k) is not None]
    unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
    if unknown:
        raise bad_field(f"structured_outputs.{unknown[0]}",
                        "unknown; use one of json, regex, choice, grammar, json_object")
    if len(given) != 1:
        raise bad_field("structured_outputs", "set exactly one of json, regex, choice, "
                                              "grammar, json_object")
    k = given[0]
    v = so[k]
    where = f"structured_outputs.{k}"
    if k == "json_object":
        if v is not True:
            raise bad_field(where, "must be true")
        return {"kind": "json_object", "value": ""}
    if k == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise bad_field(where, f"not valid JSON ({e})") from e
        if not isinstance(v, (dict, bool)):
            raise bad_field(where, "must be a JSON schema object")
        return {"kind": "json_schema", "value": json.dumps(v)}
    if k == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad_field(where, "must be a non-empty list of non-empty strings")
        return {"kind": "choice", "value": json.dumps(v)}
    if not isinstance(v, str) or not v:
        raise bad_field(where, "must be a non-empty string")
    return {"kind": "regex" if k == "regex" else "grammar", "value": v}


def _tools(tools: Any, choice: Any) -> Structured:
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_field("tool_choice", "needs tools")
        return Structured()
    if not isinstance(tools, list):
        raise bad_field("tools", "must be a list of function tools")
    fns: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_field(f"{where}.type", "only function tools are supported")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_field(f"{where}.function", "must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_field(f"{where}.function.name",
                            "must be 1-64 letters, digits, '_', '-' or '.'")
        if name in fns:
            raise bad_field(f"{where}.function.name", f"{name!r} is listed twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_field(f"{where}.function.parameters", "must be a JSON schema object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_field(f"{where}.function.description", "must be a string")
        fns[name] = params
    if choice is None or choice == "auto":
        return Structured(tools_json=json.dumps(tools), tools=ToolMode("auto"))
    if choice == "none":
        return Structured()  # the model is told of no tools and no call is read back
    if choice == "required":
        call = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for n, p in fns.items()]
        schema = {"type": "array", "minItems": 1,
                  "items": call[0] if len(call) == 1 else {"anyOf": call}}
        return Structured(spec={"kind": "json_schema", "value": json.dumps(schema)},
                          field="tools", tools_json=json.dumps(tools),
                          tools=ToolMode("required"))
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_field("tool_choice", 'a named choice is {"type": "function", '
                                           '"function": {"name": ...}}')
        if name not in fns:
            raise bad_field("tool_choice.function.name", f"{_show(name)} is not in tools")
        return Structured(spec={"kind": "json_schema", "value": json.dumps(fns[name])},
                          field=f"tools[{list(fns).index(name)}].function.parameters",
                          tools_json=json.dumps(tools), tools=ToolMode("named", name))
    raise bad_field("tool_choice", "must be none, auto, required or a named function")


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."

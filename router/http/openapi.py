"""The OpenAPI 3 document of the router's HTTP API, served at /openapi.json.

Precise enough for schema-driven tools (schemathesis, client generators): every accepted
field with its type and range, every status the endpoints return.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import MAX_LOGPROBS
from router.http.openai_request import COMPLETION_MAX_LOGPROBS, MAX_STOP, U32
from router.requests.validation import MAX_CACHE_SALT

# A function's name, as router/http/structured_request.py checks it.
_FN_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
# What ends a choice: "tool_calls" when a chat with tools ended in calls (instead of "stop").
_FINISH = ["stop", "length", "abort", "tool_calls"]

_ERROR_CODES = {"400": "A bad field; param names it", "401": "Missing or wrong API key",
                "404": "Unknown model", "429": "Overloaded; see Retry-After",
                "503": "No workers can take the request"}


def _num(lo: float, hi: float, **kw: Any) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi, "nullable": True, **kw}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi, "nullable": True}


def _sampling_fields(max_tokens: int) -> dict[str, Any]:
    return {
        "max_tokens": _int(1, max_tokens),
        "temperature": _num(0, 2),
        "top_p": _num(0, 1, exclusiveMinimum=True),
        "presence_penalty": _num(-2, 2),
        "frequency_penalty": _num(-2, 2),
        "seed": _int(0, (1 << 63) - 1),
        "stop": {"nullable": True, "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}}]},
        "n": {"type": "integer", "enum": [1], "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean"}}},
        "user": {"type": "string"},
        "logit_bias": {"type": "object", "nullable": True, "maxProperties": 0,
                       "description": "accepted only empty (a bias is refused)"},
        # Extensions (vLLM's names)
        "cache_salt": {"type": "string", "maxLength": MAX_CACHE_SALT, "nullable": True},
        "structured_outputs": _structured_outputs(),
        "top_k": _int(-1, (1 << 31) - 1),
        "min_p": _num(0, 1),
        "repetition_penalty": _num(0, 10, exclusiveMinimum=True),
        "min_tokens": _int(0, U32),
        "ignore_eos": {"type": "boolean"},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                      "maximum": U32}},
        "skip_special_tokens": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean"},
    }


def _json_schema_value() -> dict[str, Any]:
    """A JSON schema given as a value: an object, or true/false."""
    return {"oneOf": [{"type": "object"}, {"type": "boolean"}]}


def _structured_outputs() -> dict[str, Any]:
    """vLLM's structured_outputs: exactly one constraint on the output."""
    return {"type": "object", "nullable": True, "minProperties": 1, "maxProperties": 1,
            "additionalProperties": False, "properties": {
                "json": {"oneOf": [{"type": "object"}, {"type": "boolean"},
                                   {"type": "string", "description": "a schema as JSON text"}]},
                "regex": {"type": "string", "minLength": 1},
                "choice": {"type": "array", "minItems": 1,
                           "items": {"type": "string", "minLength": 1}},
                "grammar": {"type": "string", "minLength": 1,
                            "description": "a Lark grammar (llguidance's dialect)"},
                "json_object": {"type": "boolean", "enum": [True]}}}


def _response_format() -> dict[str, Any]:
    def kind(name: str, **props: Any) -> dict[str, Any]:
        return {"type": "object", "required": ["type", *props], "properties": {
            "type": {"type": "string", "enum": [name]}, **props}}

    json_schema = {"type": "object", "properties": {
        "name": _FN_NAME, "description": {"type": "string"}, "strict": {"type": "boolean"},
        "schema": _json_schema_value()}}
    return {"oneOf": [kind("text"), kind("json_object"),
                      kind("json_schema", json_schema=json_schema)]}


def _tool_schemas() -> dict[str, Any]:
    """Function tools: what a request offers and chooses, what a reply calls."""
    fn_call = {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"},
        "arguments": {"type": "string", "description": "the arguments as JSON text"}}}
    return {
        "Tool": {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": _FN_NAME, "description": {"type": "string"},
                "parameters": {"type": "object", "description": "a JSON schema"}}}}},
        "ToolChoice": {"oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string"}}}}}]},
        "ToolCall": {"type": "object", "required": ["id", "type", "function"], "properties": {
            "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
            "function": fn_call}},
        # streamed: the first chunk of a call has its id, type and name; later ones add to
        # its arguments
        "ToolCallDelta": {"type": "object", "required": ["index"], "properties": {
            "index": {"type": "integer", "minimum": 0}, "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "properties": {
                "name": {"type": "string"}, "arguments": {"type": "string"}}}}},
    }


def _messages() -> dict[str, Any]:
    """One request message per role; the roles' enums keep exactly one of them matching."""
    text_part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    # null too (an assistant turn that only called tools): "nullable" counts only beside a
    # "type" in OpenAPI 3.0, so it sits in the string branch
    content = {"oneOf": [{"type": "string", "nullable": True},
                         {"type": "array", "items": text_part, "minItems": 1}]}

    def message(roles: list[str], **props: Any) -> dict[str, Any]:
        required = ["role", *props.pop("required", [])]
        return {"type": "object", "required": required, "properties": {
            "role": {"type": "string", "enum": roles}, "content": content,
            "name": {"type": "string"}, **props}}

    return {
        "SystemMessage": message(["system", "developer"]),
        "UserMessage": message(["user"]),
        "AssistantMessage": message(["assistant"], tool_calls={
            "type": "array", "items": {"$ref": "#/components/schemas/ToolCall"}}),
        "ToolMessage": message(["tool"], required=["tool_call_id"], tool_call_id={
            "type": "string", "minLength": 1, "description": "the id of the call it answers"}),
        "ChatMessage": {"oneOf": [{"$ref": f"#/components/schemas/{m}Message"}
                                  for m in ("System", "User", "Assistant", "Tool")]},
    }


def _choices(chat: bool) -> dict[str, Any]:
    """The choices of a reply (chat: its message) and of a stream chunk (chat: its delta)."""
    finish = {"type": "string", "enum": _FINISH if chat else _FINISH[:3]}
    lps = {"type": "object", "nullable": True}
    if not chat:
        choice = {"type": "object", "required": ["index", "text", "finish_reason"],
                  "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                 "logprobs": lps, "finish_reason": {**finish, "nullable": True}}}
        return {"CompletionChoice": choice}
    calls = {"type": "array", "items": {"$ref": "#/components/schemas/ToolCall"}}
    deltas = {"type": "array", "items": {"$ref": "#/components/schemas/ToolCallDelta"}}
    return {
        "ChatCompletionChoice": {
            "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                "index": {"type": "integer"}, "logprobs": lps, "finish_reason": finish,
                "message": {"type": "object", "required": ["role", "content"], "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": {"type": "string", "nullable": True,
                                "description": "null when the reply is only tool calls"},
                    "tool_calls": calls}}}},
        "ChatCompletionChunkChoice": {
            "type": "object", "required": ["index", "delta", "finish_reason"], "properties": {
                "index": {"type": "integer"}, "logprobs": lps,
                "finish_reason": {**finish, "nullable": True},
                "delta": {"type": "object", "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": {"type": "string"}, "tool_calls": deltas}}}},
    }


def _responses(ok_schema: str, streams: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": ok_schema}}}
    if streams:
        content["text/event-stream"] = {"schema": {
            "type": "string", "description": "with stream: true, server-sent events: each "
            "data line is a chunk (chat: ChatCompletionChunk; completions: Completion, its "
            "choices one piece of text each), then data: [DONE]"}}
    out: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for code, why in _ERROR_CODES.items():
        out[code] = {"description": why, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/Error"}}}}
    return out


def openapi_document(model_ids: list[str], secured: bool, max_model_len: int = 0
                     ) -> dict[str, Any]:
    """max_model_len: the cluster's current limit (0: unknown); no request may ask for
    more tokens than that, so the document says so."""
    max_tokens = max_model_len or U32
    model = {"type": "string", "enum": model_ids}
    chat_req = {"type": "object", "required": ["messages"], "properties": {
        "model": model, "messages": {"type": "array", "minItems": 1, "items": {
            "$ref": "#/components/schemas/ChatMessage"}},
        "max_completion_tokens": _int(1, max_tokens),
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": _int(0, MAX_LOGPROBS),
        "response_format": _response_format(),
        "tools": {"type": "array", "nullable": True,
                  "items": {"$ref": "#/components/schemas/Tool"}},
        "tool_choice": {"$ref": "#/components/schemas/ToolChoice"},
        "parallel_tool_calls": {"type": "boolean", "nullable": True,
                                "description": "accepted; every call found is returned"},
        **_sampling_fields(max_tokens)}}
    token_ids = {"type": "array", "minItems": 1, "items": {
        "type": "integer", "minimum": 0, "maximum": U32}}
    text = {"type": "string", "minLength": 1}
    cmpl_req = {"type": "object", "required": ["prompt"], "properties": {
        "model": model,
        "prompt": {"oneOf": [text, token_ids,  # or a batch of exactly one of either
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": text},
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": token_ids}]},
        "logprobs": _int(0, COMPLETION_MAX_LOGPROBS),
        "echo": {"type": "boolean", "enum": [False], "nullable": True},
        "best_of": {"type": "integer", "enum": [1], "nullable": True},
        **_sampling_fields(max_tokens)}}
    usage = {"type": "object", "properties": {
        **{k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens",
                                             "total_tokens")},
        "prompt_tokens_details": {"type": "object", "properties": {
            "cached_tokens": {"type": "integer"}}}}}
    obj = {"type": "object"}

    def reply(objects: list[str], choice: str, required: tuple[str, ...] = ("usage",)
              ) -> dict[str, Any]:
        return {"type": "object", "required": ["id", "object", "choices", *required],
                "properties": {"id": {"type": "string"},
                               "object": {"type": "string", "enum": objects},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": {"type": "array", "items": {
                                   "$ref": f"#/components/schemas/{choice}"}},
                               "usage": {**usage, "nullable": True}}}

    schemas = {
        "ChatCompletionRequest": chat_req, "CompletionRequest": cmpl_req,
        **_messages(), **_tool_schemas(), **_choices(True), **_choices(False),
        "ChatCompletion": reply(["chat.completion"], "ChatCompletionChoice"),
        "ChatCompletionChunk": reply(["chat.completion.chunk"], "ChatCompletionChunkChoice",
                                     ()),
        "Completion": reply(["text_completion"], "CompletionChoice"),
        "ModelList": {"type": "object", "properties": {"data": {"type": "array", "items": obj}}},
        "RequestList": {"type": "object", "properties": {"data": {"type": "array", "items": {
            "type": "object", "properties": {
                "request_id": {"type": "string"},
                "state": {"type": "string", "description": "QUEUED, RESERVING, PREFILLING, "
                          "TRANSFERRING, WAITING_FOR_KV, DECODING or FINISHED_*"},
                "age_s": {"type": "number"}, "producer": {"type": "string"},
                "consumer": {"type": "string"}, "colocated": {"type": "string"},
                "tokens_streamed": {"type": "integer"}}}}}},
        "Health": {"type": "object", "required": ["status"], "properties": {
            "status": {"type": "string"}, "reason": {"type": "string", "nullable": True}}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True}}}}},
    }

    def post(op_id: str, req: str, resp: str) -> dict[str, Any]:
        return {"post": {"operationId": op_id, "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{req}"}}}},
            "responses": _responses(f"#/components/schemas/{resp}", True)}}

    open_: dict[str, Any] = {"security": []}  # probes carry no key
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "pdserve router", "version": "1",
                 "description": "OpenAI-compatible API of a disaggregated P/D cluster"},
        "paths": {
            "/v1/chat/completions": post("createChatCompletion", "ChatCompletionRequest",
                                         "ChatCompletion"),
            "/v1/completions": post("createCompletion", "CompletionRequest", "Completion"),
            "/v1/models": {"get": {"operationId": "listModels",
                                   "responses": _responses("#/components/schemas/ModelList",
                                                           False)}},
            "/debug/requests": {"get": {"operationId": "debugRequests", "responses": _responses(
                "#/components/schemas/RequestList", False)}},
            "/health": {"get": {"operationId": "health", **open_, "responses": {
                code: {"description": d, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Health"}}}}
                for code, d in (("200", "Serving"), ("503", "Not serving; reason says why"))}}},
            "/metrics": {"get": {"operationId": "metrics", **open_, "responses": {"200": {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": schemas},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc

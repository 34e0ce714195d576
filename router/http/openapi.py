"""The OpenAPI 3 document of the router's HTTP API, served at /openapi.json.

Precise enough for schema-driven tools (schemathesis, client generators): every accepted
field with its type and range, every status the endpoints return.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import MAX_LOGPROBS
from router.http.openai_request import COMPLETION_MAX_LOGPROBS, MAX_STOP, U32

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
        # Extensions (vLLM's names)
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


def _responses(ok_schema: str, streams: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": ok_schema}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
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
    text_part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string",
                 "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"},
                              {"type": "array", "items": text_part, "minItems": 1}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string", "minLength": 1,
                         "description": "required when role is tool"}}}
    chat_req = {"type": "object", "required": ["messages"], "properties": {
        "model": model, "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": _int(1, max_tokens),
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": _int(0, MAX_LOGPROBS), **_sampling_fields(max_tokens)}}
    cmpl_req = {"type": "object", "required": ["prompt"], "properties": {
        "model": model,
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "items": {
                                 "type": "integer", "minimum": 0, "maximum": U32}}]},
        "logprobs": _int(0, COMPLETION_MAX_LOGPROBS), **_sampling_fields(max_tokens)}}
    usage = {"type": "object", "properties": {
        **{k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens",
                                             "total_tokens")},
        "prompt_tokens_details": {"type": "object", "properties": {
            "cached_tokens": {"type": "integer"}}}}}
    obj = {"type": "object"}
    schemas = {
        "ChatCompletionRequest": chat_req, "CompletionRequest": cmpl_req,
        "ChatCompletion": {"type": "object", "required": ["id", "object", "choices", "usage"],
                           "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                          "choices": {"type": "array", "items": obj},
                                          "usage": usage}},
        "Completion": {"type": "object", "required": ["id", "object", "choices", "usage"],
                       "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                      "choices": {"type": "array", "items": obj},
                                      "usage": usage}},
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

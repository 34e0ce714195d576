"""Tools and tool calls in a chat, shaped for the model's chat template.

Templates that know tools (Qwen, Llama 3.1+, Hermes, Mistral) read ``tools`` and each
assistant message's ``tool_calls`` (with ``arguments`` as an object, as transformers
passes them). A template that mentions neither (SmolLM2's, many small chat models') would
drop them silently, so the model would never see its functions: for those, the tools go
into the system message and past calls into the assistant's text, both in the Hermes
``<tool_call>`` format that the router's parser reads back.

Torch-free (the router renders prompts).
"""

from __future__ import annotations

import json
from typing import Any

_HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a "
    "function, reply with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_inputs(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) to render ``messages`` with ``tools``."""
    source = template or ""
    knows_tools = "tools" in source
    knows_calls = "tool_calls" in source
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            calls = [_call_for_template(c) for c in calls]
            if knows_calls:
                m["tool_calls"] = calls
            else:
                m.pop("tool_calls")
                text = m.get("content") or ""
                m["content"] = text + "".join(
                    "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                  "arguments": c["function"]["arguments"]})
                    + "\n</tool_call>" for c in calls)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if not tools:
        return out, {}
    if knows_tools:
        return out, {"tools": tools}
    listing = "\n".join(json.dumps(t) for t in tools)
    system = _HERMES_SYSTEM.format(tools=listing)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass  # kept as the client sent it
    return {**call, "type": call.get("type", "function"), "function": fn}

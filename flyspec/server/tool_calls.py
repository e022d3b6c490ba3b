"""Tool calls the server enforces: the JSON schema a call must follow, and the OpenAI `tool_calls` that a
finished output becomes.

How a model writes a tool call in free text differs by model family, and the server has no parser for
any of them; so it accepts tools only where a grammar can enforce the call (docs/server.md, "Agents and
tools"):

- tool_choice naming a function: the output is that function's arguments, one JSON object following
  its `parameters` schema (vLLM does the same for a named tool choice);
- tool_choice "required": the output is a JSON array of `{"name": ..., "parameters": {...}}` objects,
  each following its own function's schema; `parallel_tool_calls: false` allows exactly one call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from flyspec.server.protocol import ChatCompletionRequest, NamedToolChoice

# A function declared without parameters takes none: its arguments are the empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCallFormat:
    """How one request's output encodes its tool call(s).

    schema: the JSON schema the output follows. schema_path: the request field it comes from, which
    errors name. function: the function of a named tool choice, None for "required".
    """

    schema: dict[str, Any]
    schema_path: str
    function: str | None

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolCallFormat | None:
        """The format an enforced tool choice needs, or None when the request calls no tool."""
        if not req.calls_tools or req.tools is None:
            return None
        if isinstance(req.tool_choice, NamedToolChoice):
            name = req.tool_choice.function.name
            i, tool = next((i, t) for i, t in enumerate(req.tools) if t.function.name == name)
            schema = tool.function.parameters or _NO_PARAMETERS
            return cls(schema, f"tools.{i}.function.parameters", name)
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": t.function.parameters or _NO_PARAMETERS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in req.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return cls(schema, "tools", None)

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason for a complete call: "stop" for a named choice, else "tool_calls"."""
        return "stop" if self.function is not None else "tool_calls"

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI `tool_calls` of a complete output; None when it does not parse (cut short by
        max_tokens or a stop string), so the caller can return it as text instead."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.function is not None:
            return [_call(self.function, value)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not all(isinstance(c, dict) and "name" in c for c in value):
            return None
        return [_call(c["name"], c.get("parameters", {})) for c in value]


def _call(name: str, arguments: Any) -> dict[str, Any]:
    # Arguments are re-serialised compactly: a grammar allows whitespace between JSON tokens, and models
    # use it freely.
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }

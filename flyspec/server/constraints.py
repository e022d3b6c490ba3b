"""The output constraint a request asks for, and errors that name the field the client sent.

A request may constrain its output through exactly one of OpenAI's `response_format`, vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` or `structured_outputs`, or an
enforced tool call (`tools` with tool_choice "required" or naming a function). All of them become one
StructuredOutputsParams, whose grammar the engine masks into the target distribution at every verified
position (docs/verification.md, "Structured output under FLy").

The engine words its errors with its own field names (`structured_outputs.json: ...`), also for grammars
that only fail to compile inside `add_request`; `Constraint.rename` rewrites them to the field the client
sent (`response_format.json_schema.schema: ...`), so a 400 always points at the client's own input.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from flyspec.engine.structured import GRAMMAR_FAILED
from flyspec.sampling_params import StructuredOutputsParams
from flyspec.server.errors import OpenAIError
from flyspec.server.protocol import ChatCompletionRequest, CompletionRequest
from flyspec.server.tool_calls import ToolCallFormat

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_FIELDS = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
_ENGINE_NAME = re.compile(r"^structured_outputs(?:\.(\w+))?")


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint: the engine's params and, for each of their fields, the path of
    the request field it came from (`field_paths[""]` is the constraint as a whole)."""

    params: StructuredOutputsParams
    field_paths: dict[str, str]

    @property
    def field(self) -> str:
        """The engine's name of the constraint's field (`json`, `regex`, `choice`, ...)."""
        return next(f for f in _STRUCTURED_FIELDS if getattr(self.params, f) not in (None, False))

    def rename(self, error: OpenAIError) -> OpenAIError:
        """`error` with the engine's `structured_outputs[.field]` replaced by the client's field; other
        errors unchanged."""
        if error.status != 400:
            return error
        return _renamed(error.message, self.field_paths, error)

    def error(self, message: str) -> OpenAIError:
        """A 400 for an engine message about this constraint, naming the client's field."""
        return _renamed(message, self.field_paths)

    def runtime_error(self, error: OpenAIError) -> OpenAIError:
        """A request that failed in the engine because its grammar broke llguidance's limits while
        generating is a 400 naming the client's field (the grammar is too complex); other errors are
        unchanged."""
        at = error.message.find("structured_outputs.")
        if error.status != 500 or at < 0 or GRAMMAR_FAILED not in error.message:
            return error
        return _renamed(error.message[at:], self.field_paths)


def constraint_of(
    req: CompletionRequest | ChatCompletionRequest, tool_format: ToolCallFormat | None = None
) -> Constraint | None:
    """The request's output constraint, or None; a 400 naming the field for a constraint that is
    malformed or given twice. Grammars are compiled later, by the engine (see Constraint.rename)."""
    sources = []
    if req.response_format is not None and req.response_format.type != "text":
        sources.append("response_format")
    sources += [name for name in (*_GUIDED, "structured_outputs") if getattr(req, name) is not None]
    if tool_format is not None:
        sources.append("tools")
    if len(sources) > 1:
        raise OpenAIError(
            f"{sources[1]}: a request may constrain its output in one way only, and this one also sets "
            f"{sources[0]}",
            param=sources[1],
        )
    if not sources:
        return None
    source = sources[0]
    if source == "response_format":
        schema = "response_format.json_schema.schema"
        paths = {"": "response_format", "json": schema, "json_object": "response_format"}
    elif source in _GUIDED:
        paths = {"": source, _GUIDED[source]: source}
    elif source == "structured_outputs":
        paths = {"": source, **{f: f"{source}.{f}" for f in _STRUCTURED_FIELDS}}
    else:
        assert tool_format is not None
        paths = {"": tool_format.schema_path, "json": tool_format.schema_path}
    try:
        params = _params(req, source, tool_format)
    except ValueError as exc:
        raise _renamed(str(exc), paths) from None
    return Constraint(params, paths)


def _params(
    req: CompletionRequest | ChatCompletionRequest, source: str, tool_format: ToolCallFormat | None
) -> StructuredOutputsParams:
    if source == "response_format":
        assert req.response_format is not None
        params = StructuredOutputsParams.from_response_format(req.response_format.as_dict())
        assert params is not None  # only a "text" format gives None, and that is no constraint
        return params
    if source in _GUIDED:
        return StructuredOutputsParams(**{_GUIDED[source]: getattr(req, source)})
    if source == "structured_outputs":
        spec: dict[str, Any] = req.structured_outputs  # type: ignore[assignment]
        unknown = [key for key in spec if key not in _STRUCTURED_FIELDS]
        if unknown:
            raise ValueError(
                f"structured_outputs.{unknown[0]} is not supported: the server takes one of "
                f"{', '.join(_STRUCTURED_FIELDS)}"
            )
        return StructuredOutputsParams(**spec)
    assert tool_format is not None
    return StructuredOutputsParams(json=tool_format.schema)


def _renamed(message: str, paths: dict[str, str], original: OpenAIError | None = None) -> OpenAIError:
    """A 400 for an engine message: `structured_outputs[.field]` at its start becomes the client's path
    for that field; a message that already starts with one of the client's paths keeps it as `param`."""
    match = _ENGINE_NAME.match(message)
    if match is not None:
        field = match.group(1) or ""
        path = paths.get(field) or f"{paths['']}.{field}"
        return OpenAIError(path + message[match.end() :], param=path)
    if original is not None:
        return original
    known = [p for p in paths.values() if message.startswith(p)]
    return OpenAIError(message, param=max(known, key=len) if known else paths[""])

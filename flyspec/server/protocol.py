"""OpenAI-compatible request models and their validation.

Bodies parse the way vLLM's do (pydantic's lax mode): a number sent as a string (`"max_tokens": "2"`) is
accepted, and unknown fields are accepted and ignored (the handler names them in the
`x-flyspec-ignored-fields` response header and a warning log line). Two deliberate differences: a boolean
is never a number, and booleans must be JSON `true` / `false`.

Fields the server recognises but cannot honour yet (penalties, logprobs, n > 1, grammars, tool calling)
are a 400 naming the field, except for their no-op values (`n: 1`, `repetition_penalty: 1.0`, ...), which
clients such as `vllm bench serve` send on every request. Every sampling value is bounded into a range the
engine computes safely in float32; docs/server.md lists the bounds and why.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
)

from flyspec.server.errors import OpenAIError


def _not_a_bool(kind: str) -> BeforeValidator:
    # pydantic's lax mode reads true as 1; for a sampling value that is a client bug, not a number.
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"must be {kind}, not true/false")
        return value

    return BeforeValidator(check)


_INTEGER = _not_a_bool("an integer")
_NUMBER = _not_a_bool("a number")
Int = Annotated[int, _INTEGER]
Float = Annotated[float, _NUMBER]

# Documented bounds (docs/server.md explains each one).
TEMPERATURE_FLOOR = 0.01  # below it logits / temperature can overflow float32 (1e-40 gives inf, then NaN)
TEMPERATURE_MAX = 100.0  # above it the distribution is uniform to float32 precision; 1e300 is inf there
TOP_P_MIN = 1e-9  # float32 flushes much smaller values to 0; any top_p <= 1/vocab keeps one token anyway
TOP_K_MAX = 2**31 - 1  # fits every integer tensor the sampler builds; any top_k >= vocab size is "off"
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed, as vLLM accepts
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS_PER_REQUEST = 256

_BOUND_REASONS = {
    "temperature": f"use 0 for greedy decoding or a value in [{TEMPERATURE_FLOOR}, {TEMPERATURE_MAX:g}]; "
    "outside that range logits / temperature is not safe in float32",
    "top_p": f"it must be in [{TOP_P_MIN:g}, 1] (1 = off); smaller values round to 0 in float32, and any "
    "top_p at or below 1/vocabulary already keeps only the most likely token",
    "top_k": f"it must be -1 or 0 (off) or an integer up to {TOP_K_MAX}; any value >= the vocabulary size "
    "is off",
    "seed": f"seeds are signed 64-bit integers in [{SEED_MIN}, {SEED_MAX}]",
    "stop": f"at most {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_STRING_CHARS} characters each",
    "stop_token_ids": f"at most {MAX_STOP_TOKEN_IDS} token ids, each >= 0",
    "presence_penalty": "it must be in [-2, 2]",
    "frequency_penalty": "it must be in [-2, 2]",
    "repetition_penalty": "it must be > 0 (1 = off)",
    "min_p": "it must be in [0, 1] (0 = off)",
    "top_logprobs": "it must be in [0, 20]",
    "n": "it must be >= 1",
}

# Constrained types; the bool check comes after the constraint so the JSON schema shows minimum/maximum.
Temperature = Annotated[float, Field(ge=0, le=TEMPERATURE_MAX), _NUMBER]
TopP = Annotated[float, Field(ge=TOP_P_MIN, le=1), _NUMBER]
TopK = Annotated[int, Field(ge=-1, le=TOP_K_MAX), _INTEGER]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), _INTEGER]
Penalty = Annotated[float, Field(ge=-2, le=2), _NUMBER]
Fraction = Annotated[float, Field(ge=0, le=1), _NUMBER]
PositiveFloat = Annotated[float, Field(gt=0), _NUMBER]
NonNegativeInt = Annotated[int, Field(ge=0), _INTEGER]
PositiveInt = Annotated[int, Field(ge=1), _INTEGER]
TopLogprobs = Annotated[int, Field(ge=0, le=20), _INTEGER]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


class _Body(BaseModel):
    """Every request object: lax numbers, finite floats, unknown fields kept aside (model_extra)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a final chunk with token usage."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage in every chunk (not supported yet)


class ResponseFormat(_Body):
    """`response_format`: only `{"type": "text"}` (the default) is supported for now."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


# Recognised fields the engine does not implement yet -> the values that change nothing. Clients send
# these defaults routinely; anything else is refused by name rather than silently ignored.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,),
}


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions, including the flyspec and vLLM extensions
    (seed, top_k, stop_token_ids, ignore_eos, verification)."""

    model: str | None = None  # None = the served model, so `curl` users can omit it
    max_tokens: Int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extension; 0 or -1 = off
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[NonNegativeInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False  # extension (as in vLLM), for benchmarks that need fixed lengths
    verification: Literal["standard", "fly"] | None = None  # extension: "standard" forces lossless
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # shapes a stream; without stream=true it changes nothing
    response_format: ResponseFormat | None = None
    # Accepted, and without effect on decoding: bookkeeping fields of the OpenAI API.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # Recognised, honoured only with their no-op values (see _NO_OP_VALUES).
    n: PositiveInt = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: PositiveFloat | None = None
    min_p: Fraction | None = None
    min_tokens: NonNegativeInt | None = None
    logit_bias: dict[str, Float] | None = None
    use_beam_search: StrictBool | None = None
    length_penalty: Float | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    prompt_logprobs: Int | None = None
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    truncate_prompt_tokens: Int | None = None

    def _reject_unsupported(self) -> None:
        """Refuse recognised fields that carry anything but their no-op value."""
        for name, no_ops in _NO_OP_VALUES.items():
            value = getattr(self, name)
            if not _is_no_op(value, no_ops):
                shown = " or ".join("null" if v is None else json.dumps(v) for v in no_ops)
                raise OpenAIError(
                    f"{name}={_short(value)} is not supported yet: the engine does not implement it; send "
                    f"{shown} or leave the field out",
                    param=name,
                )
        if self.response_format is not None and self.response_format.type != "text":
            raise OpenAIError(
                f"response_format type {self.response_format.type!r} is not supported yet (structured "
                'output needs grammar masks in the engine); send {"type": "text"} or leave it out',
                param="response_format",
            )
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise OpenAIError(
                "stream_options.continuous_usage_stats=true is not supported yet; use include_usage",
                param="stream_options.continuous_usage_stats",
            )

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < TEMPERATURE_FLOOR:
            raise ValueError(f"temperature={value!r} is out of range: {_BOUND_REASONS['temperature']}")
        return value

    def stop_list(self) -> list[str]:
        """The stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    add_special_tokens: StrictBool = True  # vLLM: tokenise text prompts with the tokenizer's BOS etc.
    echo: StrictBool = False
    logprobs: NonNegativeInt | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None

    def check(self) -> None:
        """Raise OpenAIError for values this server does not support."""
        self._reject_unsupported()
        if self.echo:
            raise OpenAIError("echo=true is not supported yet (it needs prompt logprobs)", param="echo")
        if self.logprobs is not None:
            raise OpenAIError(
                f"logprobs={self.logprobs} is not supported yet; send null or leave it out", param="logprobs"
            )
        if self.best_of not in (None, 1):
            raise OpenAIError(f"best_of={self.best_of} is not supported yet: only 1", param="best_of")
        if self.suffix:
            raise OpenAIError("suffix is not supported (no fill-in-the-middle)", param="suffix")
        self.prompts()

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids), one choice each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) > MAX_PROMPTS_PER_REQUEST:
            raise OpenAIError(
                f"prompt: a list of {len(p)} prompts is too many; at most {MAX_PROMPTS_PER_REQUEST} per "
                "request (each becomes an engine request; send several requests instead)",
                param="prompt",
            )
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    """One `{"type": "text", "text": ...}` element of a message's content list."""

    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    """The function an assistant turn called: its name and its arguments (a JSON string, as OpenAI sends)."""

    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Body):
    """One tool call of an assistant turn in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_template(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as a mapping when they are a JSON object (HF
        templates serialise `arguments` with `tojson`; a string would come out doubly quoted)."""
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(_Body):
    """One chat message. Content is text or text parts; an assistant turn that called tools may have
    `content: null` with `tool_calls`, and `tool` messages carry a tool's result."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message content as one string ("" for a tool-calling turn without content)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as a dict for the tokenizer's chat template."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Body):
    """A tool's function: name, description and JSON-schema parameters."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """`tool_choice` naming one function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: StrictBool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # only meaningful with tool calling
    functions: list[dict[str, Any]] | None = None  # the legacy spelling of tools
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None  # accepted; the served models have no reasoning modes
    echo: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self, max_messages: int) -> None:
        """Raise OpenAIError for values this server does not support."""
        self._reject_unsupported()
        if self.logprobs:
            raise OpenAIError(
                "logprobs=true is not supported yet; send false or leave it out", param="logprobs"
            )
        if self.top_logprobs:
            raise OpenAIError(
                f"top_logprobs={self.top_logprobs} is not supported yet (logprobs are not); send 0 or "
                "leave it out",
                param="top_logprobs",
            )
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise OpenAIError(
                "set max_tokens or max_completion_tokens, not both", param="max_completion_tokens"
            )
        for name, value, no_op in (
            ("echo", self.echo, (None, False)),
            ("add_generation_prompt", self.add_generation_prompt, (True,)),
            ("continue_final_message", self.continue_final_message, (False,)),
            ("chat_template", self.chat_template, (None,)),
        ):
            if value not in no_op:
                raise OpenAIError(
                    f"{name}={_short(value)} is not supported: the server renders conversations with the "
                    "model's own chat template and opens the assistant turn",
                    param=name,
                )
        if self.chat_template_kwargs:
            raise OpenAIError(
                f"chat_template_kwargs={_short(self.chat_template_kwargs)} is not supported yet; leave it "
                "out",
                param="chat_template_kwargs",
            )
        self._check_tools()
        if len(self.messages) > max_messages:
            raise OpenAIError(
                f"messages: {len(self.messages)} messages cannot fit: every message adds at least one "
                f"token and max_model_len={max_messages}",
                param="messages",
                code="context_length_exceeded",
            )
        for i, message in enumerate(self.messages):
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise OpenAIError(
                    f"messages.{i}.content: required for a {message.role} message (only an assistant turn "
                    "with tool_calls may have content null)",
                    param=f"messages.{i}.content",
                )

    def _check_tools(self) -> None:
        if self.functions and self.function_call != "none":
            raise OpenAIError(
                'functions (function calling) is not supported yet; send function_call="none" or '
                "leave functions out",
                param="functions",
            )
        if not self.tools:
            if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
                raise OpenAIError(
                    "tool_choice asks for a tool call but no tools are given", param="tool_choice"
                )
            return
        if self.tool_choice != "none":
            if isinstance(self.tool_choice, NamedToolChoice):
                choice = f"naming {self.tool_choice.function.name!r}"
            else:
                choice = repr(self.tool_choice or "auto") + ("" if self.tool_choice else " (the default)")
            raise OpenAIError(
                f"tools with tool_choice {choice} is not supported yet: this server cannot parse or "
                'enforce tool calls; send tool_choice="none" for a plain text answer, or leave tools out',
                param="tools",
            )

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template dicts (tool calls and tool results included)."""
        return [m.to_template() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the current OpenAI name) or max_tokens (the older one)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Body):
    """Body of POST /tokenize with a text prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Body):
    """Body of POST /tokenize with a conversation, rendered through the chat template (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    """Body of POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[Int]


_Model = TypeVar("_Model", bound=BaseModel)

# What a union-typed field accepts, said once instead of one pydantic error per union member.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts (no images or audio)',
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}
# Error kinds that say more than "wrong type": preferred when a union reports several.
_SPECIFIC = (
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "too_long",
    "too_short",
    "string_too_long",
    "string_too_short",
    "finite_number",
    "int_from_float",
    "value_error",
)


def parse_body(model: type[_Model], body: bytes) -> _Model:
    """Parse and validate a JSON request body; every problem becomes a 400 OpenAIError naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the unknown fields anywhere in a parsed request (`*` for list positions)."""
    names = [prefix + name for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        inner = f"{prefix}{name}.*." if isinstance(value, list) else f"{prefix}{name}."
        for item in items:
            if isinstance(item, BaseModel):
                names.extend(ignored_fields(item, inner))
    return list(dict.fromkeys(names))


def _is_no_op(value: Any, no_ops: tuple[Any, ...]) -> bool:
    # Compare booleans by identity: False == 0 must not make `use_beam_search: 0` pass as a no-op.
    return any(
        value is ok if ok is None or isinstance(ok, bool) else not isinstance(value, bool) and value == ok
        for ok in no_ops
    )


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, dict | list | str | bool) or value is None else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _validation_error(exc: ValidationError) -> OpenAIError:
    errors = exc.errors()
    err = next((e for e in errors if e["type"] in _SPECIFIC), errors[0])
    kind = err["type"]
    if kind == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {err['msg']}", code="invalid_json")
    if kind == "model_type" and not err["loc"]:
        return OpenAIError("request body must be a JSON object", code="invalid_json")
    # A union member's loc carries its type name (e.g. 'list[int]', 'constrained-str'); keep field names and
    # indexes only.
    path: list[str] = []
    for part in err["loc"]:
        if isinstance(part, str) and (not part.isidentifier() or part in ("str", "int", "float", "bool")):
            continue
        path.append(str(part))
    param = ".".join(path) or None
    field = next((p for p in reversed(path) if not p.isdigit()), "")
    if kind == "missing":
        return OpenAIError(f"field '{param}' is required", param=param)
    if kind in _SPECIFIC[:8]:
        reason = _BOUND_REASONS.get(field, err["msg"])
        return OpenAIError(f"{param}={_short(err.get('input'))} is out of range: {reason}", param=param)
    if field in _UNION_FIELDS and len(errors) > 1:
        return OpenAIError(f"{param}: must be {_UNION_FIELDS[field]}", param=param)
    message = err["msg"].removeprefix("Value error, ")
    if message.startswith(f"{field}="):  # our own validators already name the field and its value
        return OpenAIError(message, param=param)
    return OpenAIError(f"{param}: {message}", param=param)

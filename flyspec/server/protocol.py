"""OpenAI-compatible request models and their validation.

Bodies parse the way vLLM's do (pydantic's lax mode): a number sent as a string (`"max_tokens": "2"`) is
accepted, and unknown fields are accepted and ignored (the handler names them in the
`x-flyspec-ignored-fields` response header and a warning log line). Two deliberate differences: a boolean
is never a number, and booleans must be JSON `true` / `false`.

The few fields the server recognises but cannot honour (beam search, min_tokens, ...) are a 400 naming
the field, except for their no-op values, which clients send by default. Every sampling value is bounded
into a range the engine computes safely in float32; the bounds are the engine's own
(flyspec/sampling_params.py), and docs/server.md lists them with the reasons.
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
    StrictStr,
    ValidationError,
    field_validator,
)

from flyspec.sampling_params import (
    LOGIT_BIAS_MAX,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PENALTY_MAX,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    SEED_MAX,
    SEED_MIN,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    TOP_K_MAX,
    TOP_P_MIN,
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

_MAX_TOKEN_ID_DIGITS = 10  # vocabularies index tokens with int32 ids

MAX_PROMPTS_PER_REQUEST = 256
"""Each prompt of a list is an engine request; more would monopolise the first-come-first-served queue."""
MAX_CHOICES_PER_REQUEST = 256
"""prompts x n: every choice is a sequence in the batch, so one request may not ask for more."""

_BOUND_REASONS = {
    "temperature": f"use 0 for greedy decoding or a value in [{TEMPERATURE_MIN}, {TEMPERATURE_MAX:g}]; "
    "outside that range logits / temperature is not safe in float32",
    "top_p": f"it must be in [{TOP_P_MIN:g}, 1] (1 = off); smaller values round to 0 in float32, and any "
    "top_p at or below 1/vocabulary already keeps only the most likely token",
    "top_k": f"it must be -1 or 0 (off) or an integer up to {TOP_K_MAX}; any value >= the vocabulary size "
    "is off",
    "seed": f"seeds are signed 64-bit integers in [{SEED_MIN}, {SEED_MAX}]",
    "stop": f"at most {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_STRING_CHARS} characters each",
    "stop_token_ids": f"at most {MAX_STOP_TOKEN_IDS} token ids, each >= 0",
    "presence_penalty": f"it must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}] (0 = off)",
    "frequency_penalty": f"it must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}] (0 = off)",
    "repetition_penalty": f"it must be in [{REPETITION_PENALTY_MIN}, {REPETITION_PENALTY_MAX:g}] (1 = off); "
    "within it a logit changes at most 100-fold",
    "min_p": "it must be in [0, 1] (0 = off)",
    "logit_bias": f"each bias must be in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]",
    "logprobs": f"it must be in [0, {MAX_LOGPROBS}] (the alternatives reported per token)",
    "top_logprobs": f"it must be in [0, {MAX_LOGPROBS}] (the alternatives reported per token)",
    "prompt_logprobs": f"it must be in [0, {MAX_LOGPROBS}] (the alternatives reported per prompt token)",
    "n": f"it must be in [1, {MAX_N}]",
    "best_of": f"it must be in [1, {MAX_N}]",
}

# Constrained types; the bool check comes after the constraint so the JSON schema shows minimum/maximum.
Temperature = Annotated[float, Field(ge=0, le=TEMPERATURE_MAX), _NUMBER]
TopP = Annotated[float, Field(ge=TOP_P_MIN, le=1), _NUMBER]
TopK = Annotated[int, Field(ge=-1, le=TOP_K_MAX), _INTEGER]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), _INTEGER]
Penalty = Annotated[float, Field(ge=-PENALTY_MAX, le=PENALTY_MAX), _NUMBER]
RepetitionPenalty = Annotated[float, Field(ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX), _NUMBER]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX), _NUMBER]
Fraction = Annotated[float, Field(ge=0, le=1), _NUMBER]
NonNegativeInt = Annotated[int, Field(ge=0), _INTEGER]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGER]
NumSamples = Annotated[int, Field(ge=1, le=MAX_N), _INTEGER]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


class _Body(BaseModel):
    """Every request object: lax numbers, finite floats, unknown fields kept aside (model_extra)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a final chunk with token usage."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage in every chunk (not supported)


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: the schema the output must validate against (always enforced
    strictly, by a grammar); name and description only label it."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """`response_format`: free text (the default), any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI shape that StructuredOutputsParams.from_response_format reads."""
        spec = None if self.json_schema is None else {"schema": self.json_schema.schema_}
        return {"type": self.type, "json_schema": spec}


# Recognised fields the engine does not implement -> the values that change nothing. Clients send these
# defaults routinely; anything else is refused by name rather than silently ignored.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
}
_NO_OP_REASONS = {
    "min_tokens": "the engine cannot hold back end-of-sequence yet",
    "use_beam_search": "the engine has no beam search",
    "length_penalty": "it only applies to beam search, which the engine does not have",
}

# OpenAI bookkeeping fields: accepted, and named in the ignored-fields header since they change nothing.
_BOOKKEEPING = ("user", "metadata", "store", "service_tier")


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions, including the flyspec and vLLM extensions
    (seed, top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, verification, guided_*)."""

    model: str | None = None  # None = the served model, so `curl` users can omit it
    max_tokens: Int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extension; 0 or -1 = off
    min_p: Fraction | None = None  # vLLM extension; 0 = off
    seed: Seed | None = None
    n: NumSamples = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM extension; 1 = off
    logit_bias: dict[str, Bias] | None = None
    prompt_logprobs: NumLogprobs | None = None  # vLLM extension
    stop: Stop | None = None
    stop_token_ids: Annotated[list[NonNegativeInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False  # extension (as in vLLM), for benchmarks that need fixed lengths
    # Extension: "standard" forces lossless verification; a lossy policy's name must be the engine's (any
    # registered policy: SamplingParams checks the name, the engine that it is its own); "target_only" /
    # "draft_only" choose who decodes the request (docs/sampling.md).
    verification: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # shapes a stream; without stream=true it changes nothing
    # Output constraints (one at most): OpenAI's response_format, vLLM's guided_* and structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Accepted, and without effect on decoding: bookkeeping fields of the OpenAI API.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # Recognised, honoured only with their no-op values (see _NO_OP_VALUES).
    min_tokens: NonNegativeInt | None = None
    use_beam_search: StrictBool | None = None
    length_penalty: Float | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys become canonical decimal token ids ("007" -> "7"), so turning them into ints is safe."""
        if value is None:
            return None
        canonical = {}
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(
                    f"logit_bias={_short(value)}: key {_short(key, 40)} is not a token id (JSON keys are "
                    'strings of digits, e.g. "50256")'
                )
            digits = key.lstrip("0") or "0"
            if len(digits) > _MAX_TOKEN_ID_DIGITS:
                raise ValueError(
                    f"logit_bias={_short(value)}: key {_short(key, 40)} is not a token id of any vocabulary "
                    f"(a token id has at most {_MAX_TOKEN_ID_DIGITS} digits)"
                )
            canonical[digits] = bias
        return canonical

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < TEMPERATURE_MIN:
            raise ValueError(f"temperature={value!r} is out of range: {_BOUND_REASONS['temperature']}")
        return value

    def _reject_unsupported(self) -> None:
        """Refuse recognised fields that carry anything but their no-op value."""
        for name, no_ops in _NO_OP_VALUES.items():
            value = getattr(self, name)
            if not _is_no_op(value, no_ops):
                shown = " or ".join("null" if v is None else json.dumps(v) for v in no_ops)
                why = _NO_OP_REASONS.get(name, "the server does not implement it")
                raise OpenAIError(
                    f"{name}={_short(value)} is not supported: {why}; send {shown} or leave the field out",
                    param=name,
                )
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise OpenAIError(
                "stream_options.continuous_usage_stats=true is not supported; use include_usage",
                param="stream_options.continuous_usage_stats",
            )

    def unused_fields(self) -> list[str]:
        """Recognised fields this request sent that change nothing in its output (bookkeeping fields,
        stream_options without stream): named in the ignored-fields header next to the unknown ones."""
        names = [n for n in _BOOKKEEPING if getattr(self, n) is not None]
        if self.stream_options is not None and not self.stream:
            names.append("stream_options")
        return names

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
    echo: StrictBool = False  # the prompt is returned before the completion (with its logprobs if asked)
    logprobs: NumLogprobs | None = None
    best_of: NumSamples | None = None
    suffix: str | None = None

    def check(self) -> None:
        """Raise OpenAIError for values this server does not support."""
        self._reject_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(
                f"best_of={self.best_of} is not supported with n={self.n}: the server returns every "
                "sample it draws, so best_of must equal n (or be left out)",
                param="best_of",
            )
        if self.suffix:
            raise OpenAIError("suffix is not supported (no fill-in-the-middle)", param="suffix")
        num_choices = len(self.prompts()) * self.n
        if num_choices > MAX_CHOICES_PER_REQUEST:
            raise OpenAIError(
                f"n={self.n} with {len(self.prompts())} prompts asks for {num_choices} choices; at most "
                f"{MAX_CHOICES_PER_REQUEST} per request (each is a sequence in the running batch)",
                param="n",
            )

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
    """A tool's function: name, description and JSON-schema parameters (strict or not, a call the server
    enforces always follows the schema)."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition

    def to_template(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape, unset fields left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


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
    top_logprobs: NumLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # with tool_choice "required": one call or several
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
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(
                f"top_logprobs={self.top_logprobs} needs logprobs=true (it sets how many alternatives each "
                "token's logprobs list)",
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
                f"chat_template_kwargs={_short(self.chat_template_kwargs)} is not supported; leave it out",
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
                "functions (legacy function calling) is not supported: send the functions as tools with "
                'tool_choice "required" or naming one, or function_call="none"',
                param="functions",
            )
        if not self.tools:
            if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
                raise OpenAIError(
                    "tool_choice asks for a tool call but no tools are given", param="tool_choice"
                )
            return
        if self.tool_choice in (None, "auto"):
            choice = '"auto"' + ("" if self.tool_choice else " (the default)")
            raise OpenAIError(
                f"tools with tool_choice {choice} is not supported: the server has no parser to find tool "
                'calls in free text. Send tool_choice "required" or {"type": "function", "function": '
                '{"name": ...}} to get a call that a grammar enforces, or tool_choice="none" for a text '
                "answer",
                param="tools",
            )
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in [t.function.name for t in self.tools]:
                raise OpenAIError(
                    f"tool_choice.function.name={name!r} is not one of the tools "
                    f"({', '.join(repr(t.function.name) for t in self.tools)})",
                    param="tool_choice.function.name",
                )

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is a tool call the server enforces (tool_choice "required" or named)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def unused_fields(self) -> list[str]:
        """As for completions, plus reasoning_effort, parallel_tool_calls where no enforced "required"
        call reads it, and tools / functions that a "none" choice keeps out of the prompt."""
        names = super().unused_fields()
        if self.reasoning_effort is not None:
            names.append("reasoning_effort")
        if self.parallel_tool_calls is not None and not (self.calls_tools and self.tool_choice == "required"):
            names.append("parallel_tool_calls")
        if self.tools and self.tool_choice == "none":
            names.append("tools")
        if self.functions:
            names.append("functions")
        return names

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template dicts (tool calls and tool results included)."""
        return [m.to_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools shown to the model: only when a call is enforced (with tool_choice "none" they are
        left out, as vLLM's --exclude-tools-when-tool-choice-none does)."""
        return [t.to_template() for t in self.tools or []] if self.calls_tools else None

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
    # A union member's loc carries its type name (e.g. 'list[int]', 'constrained-str'); keep field names,
    # indexes and token-id keys (logit_bias.50) only.
    path: list[str] = []
    type_names = ("str", "int", "float", "bool")
    for part in err["loc"]:
        if isinstance(part, str) and not part.isdigit() and (not part.isidentifier() or part in type_names):
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

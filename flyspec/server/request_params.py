"""A request's SamplingParams: OpenAI's and vLLM's fields mapped onto the engine's, with the length rules
that need the tokenised prompt.

`echo` with `logprobs: k` (what lm-evaluation-harness's loglikelihood requests send) asks the engine
for the prompt's logprobs too; `max_tokens: 0` (score the prompt, generate nothing) is allowed only then.
"""

from __future__ import annotations

from flyspec.sampling_params import SamplingParams, StructuredOutputsParams
from flyspec.server.errors import OpenAIError, invalid_request
from flyspec.server.protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    structured: StructuredOutputsParams | None,
) -> SamplingParams:
    """The engine parameters of one prompt of `req` (prompt_len tokens); a 400 naming the field for a
    value this prompt cannot take. The caller has checked that the prompt leaves room for a token."""
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = req.prompt_logprobs
        max_tokens, name = req.requested_max_tokens(), "max_completion_tokens"
        if req.max_tokens is not None:
            name = "max_tokens"
    else:
        logprobs = req.logprobs
        asked = [k for k in (req.prompt_logprobs, logprobs if req.echo else None) if k is not None]
        prompt_logprobs = max(asked) if asked else None
        if req.echo and prompt_logprobs is None and req.max_tokens == 0:
            prompt_logprobs = 0  # echo alone with nothing to generate: the engine still scores the prompt
        max_tokens, name = req.max_tokens, "max_tokens"
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif max_tokens == 0 and prompt_logprobs is None:
        raise OpenAIError(
            f"{name}=0: must be at least 1; 0 (generate nothing) is allowed only to score the prompt, with "
            + ("prompt_logprobs" if chat else "echo=true or prompt_logprobs"),
            param=name,
        )
    elif max_tokens < 0:
        raise OpenAIError(f"{name}={max_tokens}: must be at least 1", param=name)
    elif max_tokens > room:
        raise OpenAIError(
            f"{name}={max_tokens} is too large: the prompt is {prompt_len} tokens and "
            f"max_model_len={max_model_len}, so at most {room} tokens can be generated",
            param=name,
            code="context_length_exceeded",
        )
    bias = {int(token): value for token, value in (req.logit_bias or {}).items()}
    outside = sorted(t for t in bias if t >= vocab_size)
    if outside:
        raise OpenAIError(
            f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})",
            param="logit_bias",
        )
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            max_tokens=max_tokens,
            seed=req.seed,
            n=req.n,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias or None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=req.stop_list(),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            verification=req.verification,
            structured_outputs=structured,
        )
    except ValueError as exc:
        raise invalid_request(exc) from None

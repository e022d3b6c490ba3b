"""`flyspec serve`: the OpenAI-compatible server (flyspec/server/, docs/server.md) on uvicorn."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated

import typer

from flyspec.checks import is_loopback
from flyspec.cli.logs import configure_logging
from flyspec.cli.options import (
    AutoQuantizationOption,
    BatchInvariantOption,
    KvCacheMemoryOption,
    PrefixCachingOption,
    SpeculativeConfigOption,
    parse_memory_bytes,
    parse_quantization,
    parse_speculative_config,
)
from flyspec.server.limits import (
    DEFAULT_GRAMMAR_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flyspec.config import EngineConfig

logger = logging.getLogger("flyspec.server")

# Enough running requests that 32 concurrent clients (a common `vllm bench serve` setting) never queue;
# the token budget admits all of them for any K up to 7: 512 // (1 + K) >= 64. KV memory follows the
# tokens in use, within --kv-cache-memory-bytes. A budget of 512 rather
# than the engine's 2048 cuts prompts that arrive together into passes of at most 512 tokens, so their
# first tokens come out in turns instead of all after one long pass: with 16 GSM8K requests at once
# (int8, 2 cores) mean time to first token fell from 11.4 to 7.3 s at 1.06x the throughput
# (docs/performance.md).
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


def _check_serving(
    host: str,
    port: int,
    api_key: str | None,
    max_request_bytes: int,
    log_level: str,
    timeouts: dict[str, float],
) -> None:
    """Check the serving options and set up logging at ``log_level``; warn when the server is reachable
    from other machines without a key."""
    levels = {
        "debug": logging.DEBUG,
        "info": logging.INFO,
        "warning": logging.WARNING,
        "error": logging.ERROR,
    }
    if log_level not in levels:
        raise ValueError(f"--log-level={log_level!r} is invalid: it must be one of {', '.join(levels)}")
    logging.basicConfig(level=levels[log_level], format="%(levelname)s %(name)s: %(message)s")
    configure_logging(levels[log_level])
    if not 0 <= port <= 65535:
        raise ValueError(f"--port={port} is invalid: it must be in 0..65535")
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes={max_request_bytes} is invalid: it must be at least 1")
    for name, value in timeouts.items():
        if not value > 0:
            raise ValueError(f"{name}={value} is invalid: it must be a number of seconds > 0")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty: give a key or leave the option out")
    if not is_loopback(host) and api_key is None:
        logger.warning("binding to %s without --api-key: anyone who can reach this port can use it", host)


def serve(
    model: Annotated[str, typer.Argument(help="Target model: HF folder, .gguf file, or zoo name.")],
    speculative_config: SpeculativeConfigOption = None,
    host: Annotated[str, typer.Option(help="Address to bind; loopback unless you mean to expose it.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="FLYSPEC_API_KEY",
            help="Require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize.",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    quantization: AutoQuantizationOption = "auto",
    max_model_len: Annotated[
        int | None, typer.Option(help="Longest prompt + output in tokens (default: the model's).")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests running at once.")] = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Token budget of one target pass; each decode request charges 1 + K.")
    ] = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients send (default: the MODEL argument).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Engine seed for requests that set none.")] = 0,
    max_request_bytes: Annotated[
        int, typer.Option(help="Largest request body accepted; larger ones get HTTP 413 before being read.")
    ] = DEFAULT_MAX_REQUEST_BYTES,
    kv_cache_memory_bytes: KvCacheMemoryOption = None,
    enable_prefix_caching: PrefixCachingOption = True,
    batch_invariant: BatchInvariantOption = False,
    request_read_timeout: Annotated[
        float, typer.Option(help="Seconds a request body may take to arrive; slower ones get HTTP 408.")
    ] = DEFAULT_REQUEST_READ_TIMEOUT_S,
    grammar_timeout: Annotated[
        float,
        typer.Option(help="Seconds an output grammar may take to compile; slower ones get HTTP 400."),
    ] = DEFAULT_GRAMMAR_TIMEOUT_S,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API, with Prometheus metrics at /metrics.

    Routes: /v1/models, /v1/completions, /v1/chat/completions (stream=true for server-sent events),
    /tokenize, /detokenize, /version, /ping, /health, /openapi.json.

    Beyond OpenAI's fields (logprobs, echo, n, penalties, logit_bias, response_format, enforced tool
    calls): vLLM's top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, prompt_logprobs,
    guided_* and structured_outputs, and flyspec's verification ("standard" forces lossless
    verification). Unknown and no-effect fields are named in the x-flyspec-ignored-fields header.

    Each response carries the request's acceptance counters in `spec_decode`.
    """
    from flyspec.config import EngineConfig  # torch-free: config mistakes fail before any heavy import

    timeouts = {"--request-read-timeout": request_read_timeout, "--grammar-timeout": grammar_timeout}
    _check_serving(host, port, api_key, max_request_bytes, log_level, timeouts)
    config = EngineConfig(
        model=model,
        speculative_config=parse_speculative_config(speculative_config),
        dtype=dtype,
        device=device,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        seed=seed,
        quantization=parse_quantization(quantization),
        kv_cache_memory_bytes=parse_memory_bytes(kv_cache_memory_bytes),
        enable_prefix_caching=enable_prefix_caching,
        batch_invariant=batch_invariant,
    )
    import uvicorn

    name = served_model_name or model
    app = _served_app(config, name, model, api_key, max_request_bytes, request_read_timeout, grammar_timeout)
    logger.info("serving %s as '%s' on http://%s:%d/v1", model, name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def _served_app(
    config: EngineConfig,
    name: str,
    model: str,
    api_key: str | None,
    max_request_bytes: int,
    request_read_timeout: float,
    grammar_timeout: float,
) -> FastAPI:
    """The app serving a warmed-up engine of `config` as `name`."""
    from flyspec.engine.engine import LLMEngine
    from flyspec.server.app import build_app

    engine = LLMEngine(config)  # logs the admission cap and, with FLy, the lossy warning
    engine.warm_up()  # the first request does not pay one-time costs; a CPU too slow says so now
    return build_app(
        engine,
        served_model_name=name,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        model_root=model,
        request_read_timeout_s=request_read_timeout,
        grammar_timeout_s=grammar_timeout,
    )

"""`flyspec generate`: one-off generation with tokens/s and acceptance stats.

torch and transformers are imported inside the command, so `flyspec --help` stays fast.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flyspec.cli.options import (
    JsonFlag,
    QuantizationOption,
    SpeculativeConfigOption,
    parse_quantization,
    parse_speculative_config,
)

if TYPE_CHECKING:
    from flyspec.outputs import RequestOutput


def generate(
    model: Annotated[str, typer.Argument(help="Target model: HF folder, .gguf file or zoo name.")],
    prompt: Annotated[str, typer.Argument(help="The prompt text (a user message with --chat).")],
    speculative_config: SpeculativeConfigOption = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass in (0, 1]; 1 = off.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed of the request's random stream.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    quantization: QuantizationOption = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Generate one completion and print it with tokens/s and acceptance statistics."""
    from flyspec.llm import LLM, GenerationRequest
    from flyspec.sampling_params import SamplingParams

    spec = parse_speculative_config(speculative_config)
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens
    )
    llm = LLM(
        model,
        speculative_config=spec,
        dtype=dtype,
        device=device,
        quantization=parse_quantization(quantization),
    )
    request = (
        GenerationRequest(messages=[{"role": "user", "content": prompt}], params=params)
        if chat
        else GenerationRequest(prompt=prompt, params=params)
    )
    start = time.perf_counter()
    out = next(iter(llm.stream([request], use_tqdm=True, total=1)))
    summary = _summary(out, time.perf_counter() - start)
    typer.echo(summary["text"])
    typer.echo("")
    typer.echo(_stats_line(summary))
    if as_json:
        typer.echo(json.dumps(summary))


def _summary(out: RequestOutput, elapsed: float) -> dict[str, Any]:
    """The --json object: text, tokens, speed and the acceptance counters with their rates."""
    completion, counts = out.outputs[0], out.metrics.counts
    num_tokens = len(completion.token_ids)
    return {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "num_tokens": num_tokens,
        "seconds": round(elapsed, 4),
        "tokens_per_s": round(num_tokens / elapsed, 3) if elapsed > 0 else None,
        "mean_acceptance_length": round(counts.mean_acceptance_length, 4),
        "acceptance_rate": round(counts.acceptance_rate, 4),
        **counts.to_dict(),
    }


def _stats_line(s: dict[str, Any]) -> str:
    return (
        f"{s['num_tokens']} tokens in {s['seconds']:.2f} s ({s['tokens_per_s']} tokens/s, finish: "
        f"{s['finish_reason']}); mean acceptance length {s['mean_acceptance_length']:.2f}, "
        f"acceptance rate {s['acceptance_rate']:.1%}, forgiven tokens {s['num_forgiven_tokens']}"
    )

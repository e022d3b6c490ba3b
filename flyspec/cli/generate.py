"""`flyspec generate`: one-off generation with tokens/s and acceptance stats.

torch and transformers are imported inside the command, so `flyspec --help` stays fast.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer


def generate(
    model: Annotated[str, typer.Argument(help="Target model: HF folder, .gguf file or zoo name.")],
    prompt: Annotated[str, typer.Argument(help="The prompt text (a user message with --chat).")],
    speculative_config: Annotated[
        str | None,
        typer.Option(
            help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
            'or \'{"model": "DRAFT", "num_speculative_tokens": 4, "rejection_sample_method": "fly"}\'.'
        ),
    ] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass in (0, 1]; 1 = off.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed of the request's random stream.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="End with one JSON object on stdout.")] = False,
) -> None:
    """Generate one completion and print it with tokens/s and acceptance statistics."""
    from flyspec.llm import LLM, GenerationRequest
    from flyspec.sampling_params import SamplingParams

    spec: dict[str, Any] | None = None
    if speculative_config is not None:
        try:
            spec = json.loads(speculative_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from exc
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens
    )
    llm = LLM(model, speculative_config=spec, dtype=dtype, device=device)
    request = (
        GenerationRequest(messages=[{"role": "user", "content": prompt}], params=params)
        if chat
        else GenerationRequest(prompt=prompt, params=params)
    )
    start = time.perf_counter()
    out = next(iter(llm.stream([request], use_tqdm=True, total=1)))
    elapsed = time.perf_counter() - start
    completion, metrics = out.outputs[0], out.metrics
    num_tokens = len(completion.token_ids)
    summary = {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "num_tokens": num_tokens,
        "seconds": round(elapsed, 4),
        "tokens_per_s": round(num_tokens / elapsed, 3) if elapsed > 0 else None,
        "mean_acceptance_length": round(metrics.mean_acceptance_length, 4),
        "acceptance_rate": round(metrics.acceptance_rate, 4),
        "num_drafts": metrics.num_drafts,
        "num_draft_tokens": metrics.num_draft_tokens,
        "num_accepted_tokens": metrics.num_accepted_tokens,
        "num_forgiven_tokens": metrics.num_forgiven_tokens,
    }
    typer.echo(completion.text)
    typer.echo("")
    typer.echo(
        f"{num_tokens} tokens in {elapsed:.2f} s ({summary['tokens_per_s']} tokens/s, finish: "
        f"{completion.finish_reason}); mean acceptance length {metrics.mean_acceptance_length:.2f}, "
        f"acceptance rate {metrics.acceptance_rate:.1%}, forgiven tokens {metrics.num_forgiven_tokens}"
    )
    if as_json:
        typer.echo(json.dumps(summary))

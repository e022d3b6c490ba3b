"""`flyspec capacity`: the admission arithmetic of the token budget (no torch, so it answers at once)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from flyspec.budget import Capacity, capacity
from flyspec.cli.options import JsonFlag


def _capacity_dict(cap: Capacity) -> dict[str, Any]:
    return {
        "max_running": cap.max_running,
        "tokens_per_decode_request": cap.tokens_per_decode_request,
        "binding": cap.binding,
    }


def _explain(cap: Capacity) -> str:
    advice = {
        "budget": "the token budget binds: raise --max-num-batched-tokens to run more",
        "max_num_seqs": "max_num_seqs binds: raise --max-num-seqs to run more",
        "lookahead": "the drafter's lookahead tokens bind: raise --max-num-batched-tokens to run more",
    }[cap.binding]
    return (
        f"Each decode request charges {cap.tokens_per_decode_request} tokens of max_num_batched_tokens="
        f"{cap.max_num_batched_tokens}, so at most {cap.max_running} of max_num_seqs={cap.max_num_seqs} "
        f"requests can run; {advice}."
    )


def capacity_command(
    max_num_batched_tokens: Annotated[int, typer.Option(help="Target-pass token budget per step (B).")],
    max_num_seqs: Annotated[int, typer.Option(help="Most requests in the running set (S).")],
    num_speculative_tokens: Annotated[int, typer.Option(help="Draft tokens per step (K); 0 = none.")],
    extra_draft_slots: Annotated[
        int,
        typer.Option(
            help="Also charge R draft slots per request (1 + K + R), as an accounting that counts the "
            "draft pass in the target budget would; shown side by side with 1 + K."
        ),
    ] = 0,
    num_lookahead_tokens: Annotated[
        int | None, typer.Option(help="Query tokens per request a drafter needs inside the same budget (L).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """How many requests can run at once under the token budget:
    min(S, B // (1 + K)), and <= B // L with a lookahead drafter."""
    if num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens={num_speculative_tokens}: must be >= 0")
    if extra_draft_slots < 0:
        raise ValueError(f"--extra-draft-slots={extra_draft_slots}: must be >= 0")
    charge = 1 + num_speculative_tokens
    ours = capacity(max_num_batched_tokens, max_num_seqs, charge, num_lookahead_tokens)
    result = _capacity_dict(ours) | {
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
        "num_speculative_tokens": num_speculative_tokens,
        "num_lookahead_tokens": num_lookahead_tokens,
    }
    typer.echo(_explain(ours))
    if extra_draft_slots:
        charged = capacity(
            max_num_batched_tokens, max_num_seqs, charge + extra_draft_slots, num_lookahead_tokens
        )
        result["extra_draft_slots"] = extra_draft_slots
        result["with_extra_draft_slots"] = _capacity_dict(charged)
        typer.echo(
            f"Charging {extra_draft_slots} draft slots too ({charged.tokens_per_decode_request} tokens per "
            f"request) would allow only {charged.max_running} running requests instead of "
            f"{ours.max_running} ({charged.max_running / ours.max_running:.2f}x); the draft pass runs "
            "separately and should not be charged."
        )
    if as_json:
        typer.echo(json.dumps(result))

"""The fixed prompt set of a benchmark: the first questions of a gate dataset as token ids.

Chat questions (GSM8K, MATH-500, ...) go through the target tokenizer's chat template with the assistant
turn opened, exactly as `LLM.chat` does, so the engine and the peer see the same ids. The ids are made
once per run and handed to every arm, and their sha256 goes into the JSON so two runs can be checked to
have measured the same inputs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from flyspec.chat import render_chat
from flyspec.gate.data.questions import load_dataset


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: the dataset's question id and the token ids every arm is given."""

    id: str
    token_ids: list[int]


def load_prompts(dataset: str, count: int, tokenizer: Any) -> list[BenchPrompt]:
    """The first `count` questions of `dataset` (a gate dataset name or path) as token ids.

    Raises ValueError when the dataset has fewer questions, or a chat question meets a tokenizer without
    a chat template.
    """
    questions = load_dataset(dataset, limit=count)
    if len(questions) < count:
        raise ValueError(f"dataset {dataset!r} has {len(questions)} questions; the sweep needs {count}")
    prompts = []
    for q in questions:
        if q.messages is not None:
            try:
                ids, _ = render_chat(tokenizer, q.messages)
            except ValueError as exc:
                raise ValueError(f"dataset {dataset!r} holds chat prompts: {exc}") from None
        else:
            ids = tokenizer(q.prompt).input_ids
        prompts.append(BenchPrompt(q.id, list(ids)))
    return prompts


def prompts_sha256(prompts: list[BenchPrompt]) -> str:
    """sha256 of the prompt ids and token ids (identical inputs give identical hashes)."""
    payload = json.dumps([[p.id, p.token_ids] for p in prompts], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def waves(prompts: list[BenchPrompt], num_requests: int, batch_size: int) -> list[list[BenchPrompt]]:
    """Split `num_requests` requests into full waves of `batch_size` concurrent requests.

    The request count is rounded up to a whole number of waves, so every wave runs at the full batch
    size; prompts are taken in order and reused cyclically when the set is smaller than that.
    """
    if not prompts:
        raise ValueError("the prompt set is empty")
    num_waves = -(-num_requests // batch_size)
    picked = [prompts[i % len(prompts)] for i in range(num_waves * batch_size)]
    return [picked[w * batch_size : (w + 1) * batch_size] for w in range(num_waves)]

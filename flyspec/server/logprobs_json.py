"""Log-probabilities in the OpenAI wire shapes, from the engine's per-position entries.

The engine reports one `{token id: Logprob}` dict per position: the chosen token first, then the top-k
alternatives (docs/sampling.md, "Outputs"). Generated tokens carry the processed target distribution they
were verified or sampled with; prompt tokens the model's raw distribution. JSON has no -inf: a token the
processed distribution excludes is written as -9999.0, as vLLM does.

- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per token; the
  first prompt token of an echoed prompt has no logprob (null). `text_offset` adds up the lengths of the
  token strings before each token, as vLLM computes it.
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}` with
  exactly `top_logprobs` alternatives per token, most likely first.
- vLLM's `prompt_logprobs`: `[null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flyspec.outputs import Logprob, PositionLogprobs

LOGPROB_FLOOR = -9999.0
"""What -inf (a token the processed distribution excludes) is written as."""


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf becomes LOGPROB_FLOOR."""
    return LOGPROB_FLOOR if math.isinf(logprob) or logprob < LOGPROB_FLOOR else logprob


@dataclass
class CompletionLogprobs:
    """The completions `logprobs` object, built token by token (a stream sends the pieces; `text_offset`
    continues where the previous piece ended)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    next_offset: int = 0

    def add_unscored(self, text: str) -> None:
        """A token without logprobs: the first token of an echoed prompt."""
        self._append(text, None, None)

    def add(self, token_id: int, position: PositionLogprobs) -> None:
        """A token and its position's entries (chosen first, then the alternatives)."""
        chosen = position[token_id]
        top = {entry.decoded_token: finite(entry.logprob) for entry in position.values()}
        self._append(chosen.decoded_token, finite(chosen.logprob), top)

    def _append(self, text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.next_offset)
        self.next_offset += len(text)

    def take(self) -> dict[str, Any]:
        """The JSON of the tokens added since the last take (all of them when not streaming)."""
        piece = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return piece


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top: int) -> dict[str, Any]:
    """The chat `logprobs` object for these tokens, with `top` alternatives each."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        # The dict holds the top-k and the chosen token (k + 1 entries when it is not among them); by rank
        # (stable, so the chosen one wins a tie it is part of), the first `top` are a top-k.
        ranked = sorted(position.values(), key=lambda entry: entry.rank)[:top]
        content.append({**_chat_entry(position[token_id]), "top_logprobs": [_chat_entry(e) for e in ranked]})
    return {"content": content, "refusal": None}


def _chat_entry(entry: Logprob) -> dict[str, Any]:
    return {
        "token": entry.decoded_token,
        "logprob": finite(entry.logprob),
        "bytes": list(entry.decoded_token.encode("utf-8")),
    }


def prompt_logprobs_json(positions: list[PositionLogprobs | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else every reported entry by id."""
    return [
        None
        if position is None
        else {
            str(token_id): {"logprob": finite(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
            for token_id, e in position.items()
        }
        for position in positions
    ]

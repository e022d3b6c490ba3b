"""Log-probabilities of chosen tokens and their top-k alternatives, from distributions already computed.

Generated tokens: the processed target distribution at the token's position in the pass that produced
it (the prefill's last position, a decode step, or a verify pass; accepted, forgiven, recovered and bonus
tokens alike), so a forgiven token shows how unlikely the target found it. No extra model pass runs.
Prompt tokens: the model's raw distribution (log-softmax of the prefill logits), as vLLM reports them and
as likelihood-based evaluation expects; temperature and the other sampling settings do not apply.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from flyspec.outputs import Logprob, PositionLogprobs
from flyspec.sampling_params import SamplingParams

PROMPT_LOGPROB_SLICE = 256
"""Prompt positions whose logits are materialised at once: [256, V] float32 bounds the memory of scoring
a long prompt (about 150 MB for a 150k vocabulary) whatever the chunk size."""


class LogprobsRequest(Protocol):
    """What `LogprobsBuilder.emitted` reads of a request (engine/sequence.py's Sequence)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def logprobs(self) -> list[PositionLogprobs] | None: ...


class LogprobsBuilder:
    """Turns log-probability rows into PositionLogprobs, decoding each token id once (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoded: dict[int, str] = {}

    def decode(self, token_ids: Seq[int]) -> list[str]:
        """Each token id decoded on its own."""
        missing = sorted({t for t in token_ids if t not in self._decoded})
        if missing:
            for t, text in zip(missing, self.tokenizer.batch_decode([[t] for t in missing]), strict=True):
                self._decoded[t] = text
        return [self._decoded[t] for t in token_ids]

    def build(
        self, scores: torch.Tensor, tokens: Seq[int], num_top: Seq[int], *, kind: str = "probs"
    ) -> list[PositionLogprobs]:
        """One PositionLogprobs per row of `scores` [M, V]: the chosen tokens[m] first, then the
        num_top[m] most likely tokens.

        kind: "probs" (processed probabilities; logprob = ln p) or "logits" (raw logits; logprob =
        logit - logsumexp). Ranks and the top-k are taken on the scores themselves (the order is the
        same), so only the reported entries are turned into logprobs: no [M, V] log pass.
        """
        if not len(tokens):
            return []
        device = scores.device
        chosen = torch.tensor(list(tokens), dtype=torch.int64, device=device)
        chosen_scores = scores.gather(1, chosen.unsqueeze(1))
        ranks = ((scores > chosen_scores).sum(dim=1) + 1).tolist()
        top_scores, top_ids = scores.topk(max(num_top), dim=1)  # k = 0 gives [M, 0]
        if kind == "probs":
            chosen_lp, top_lp = log_of(chosen_scores), log_of(top_scores)
        else:
            norm = torch.logsumexp(scores, dim=1, keepdim=True)
            chosen_lp, top_lp = chosen_scores - norm, top_scores - norm
        chosen_values = chosen_lp.squeeze(1).tolist()
        top_values, top_tokens = top_lp.tolist(), top_ids.tolist()
        texts = dict(zip(*self._texts(tokens, top_tokens), strict=True))
        out = []
        for m, token in enumerate(tokens):
            entry = {token: Logprob(chosen_values[m], ranks[m], texts[token])}
            values = top_values[m]
            for i in range(num_top[m]):
                alt = top_tokens[m][i]
                if alt not in entry:
                    # rank = 1 + tokens strictly more likely: the first index holding this value.
                    entry[alt] = Logprob(values[i], values.index(values[i]) + 1, texts[alt])
            out.append(entry)
        return out

    def emitted(
        self, probs: torch.Tensor, seqs: Seq[LogprobsRequest], tokens: Seq[Seq[int]]
    ) -> list[list[PositionLogprobs] | None]:
        """Logprobs of each request's emitted tokens: tokens[b][j] under probs[b, j] ([B, P, V] processed
        target probabilities); None for requests that did not ask."""
        result: list[list[PositionLogprobs] | None] = [None] * len(seqs)
        want = [b for b, s in enumerate(seqs) if s.logprobs is not None and tokens[b]]
        if not want:
            return result
        b_idx = [b for b in want for _ in tokens[b]]
        j_idx = [j for b in want for j in range(len(tokens[b]))]
        device = probs.device
        rows = probs[torch.tensor(b_idx, device=device), torch.tensor(j_idx, device=device)]
        num_top = [seqs[b].params.logprobs or 0 for b in b_idx]
        entries = self.build(rows, [t for b in want for t in tokens[b]], num_top)
        start = 0
        for b in want:
            result[b] = entries[start : start + len(tokens[b])]
            start += len(tokens[b])
        return result

    def _texts(self, tokens: Seq[int], top_tokens: list[list[int]]) -> tuple[list[int], list[str]]:
        ids = sorted(set(tokens).union(*top_tokens))
        return ids, self.decode(ids)


def log_of(probs: torch.Tensor) -> torch.Tensor:
    """Natural log of processed probabilities (0 -> -inf)."""
    return probs.clamp_min(0).log()


def prompt_logprobs(
    builder: LogprobsBuilder,
    hidden: torch.Tensor,
    compute_logits: Any,
    next_tokens: Seq[int],
    num_top: int,
) -> list[PositionLogprobs]:
    """PositionLogprobs of next_tokens[i] given the prefix ending at hidden[i], under the raw model
    distribution, computed PROMPT_LOGPROB_SLICE positions at a time. compute_logits: hidden -> logits."""
    out: list[PositionLogprobs] = []
    for start in range(0, len(next_tokens), PROMPT_LOGPROB_SLICE):
        stop = start + PROMPT_LOGPROB_SLICE
        logits = compute_logits(hidden[start:stop]).float()
        tokens = next_tokens[start:stop]
        out.extend(builder.build(logits, tokens, [num_top] * len(tokens), kind="logits"))
    return out

"""The target's logits -> the processed distributions that sampling and verification use.

Order per row (docs/verification.md): grammar mask, logit bias, repetition / frequency / presence
penalties, then (sampling rows only) temperature, min-p, top-k, top-p. A verify pass scores position j
of a row after j draft tokens, so position j sees the grammar state and the penalty history of the
output plus those j drafts: verification then compares each draft with exactly the distribution that
target-only decoding would have sampled it from, which keeps standard verification lossless and gives
FLy's masked-token rule the real constraints.

Cost: requests without penalties, bias or grammar take the same path as before (one process_logits call
over all rows); only rows that use a feature pay for it. A request whose processing raises or yields a
non-finite distribution fails alone: its rows get a placeholder distribution and its index is reported,
so the rest of the batch is computed exactly as without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from flyspec.engine.structured import GrammarMatcher, Grammars
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.logits_processors import (
    apply_logit_bias,
    apply_penalties,
    apply_token_mask,
)
from flyspec.spec_decode.sampling import process_logits

logger = logging.getLogger("flyspec.engine")


class RequestLogitsState:
    """What one request's logits processing carries across steps: its grammar matcher, the counts of its
    generated tokens (penalties), the tokens of its prompt (repetition penalty) and its logit bias.

    Only requests that use one of these get a state (Sequence.logits_state is None otherwise). Penalties
    touch only tokens that occurred, so besides dense [V] counts the state keeps the distinct tokens of
    the history (the output, plus the prompt under a repetition penalty): processing then works on those
    columns alone, not on the whole vocabulary.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Seq[int],
        vocab_size: int,
        device: torch.device,
        grammar: GrammarMatcher | None,
    ) -> None:
        self.params = params
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.device = device
        self._counts: torch.Tensor | None = None
        self._pending: list[int] = []
        self._history: dict[int, None] = {}  # distinct history tokens, in order of first occurrence
        self._history_ids: torch.Tensor | None = None  # the same as a tensor, rebuilt when it grows
        self.prompt_seen: torch.Tensor | None = None
        if params.has_penalties:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1:
            ids = torch.tensor(list(prompt_token_ids), dtype=torch.int64, device=device)
            self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device).index_fill_(
                0, ids, True
            )
            self._history = dict.fromkeys(prompt_token_ids)
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        if params.logit_bias:
            self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
            self.bias_values = torch.tensor(
                list(params.logit_bias.values()), dtype=torch.float32, device=device
            )

    def accept(self, token: int) -> None:
        """A token was committed to the output (the grammar raises ValueError if it forbids it)."""
        if self.grammar is not None:
            self.grammar.accept(token)
        if self._counts is not None:
            self._pending.append(token)
            if token not in self._history:
                self._history[token] = None
                self._history_ids = None

    def history_ids(self) -> torch.Tensor:
        """[U] int64 distinct tokens a penalty may touch (output, and prompt under a repetition penalty)."""
        if self._history_ids is None:
            self._history_ids = torch.tensor(list(self._history), dtype=torch.int64, device=self.device)
        return self._history_ids

    def output_counts(self) -> torch.Tensor:
        """[V] float32 occurrences of each token among the committed output tokens."""
        assert self._counts is not None
        if self._pending:
            ids = torch.tensor(self._pending, dtype=torch.int64, device=self._counts.device)
            self._counts.index_add_(0, ids, torch.ones(len(self._pending), device=self._counts.device))
            self._pending.clear()
        return self._counts

    def fork(self, prompt_token_ids: Seq[int]) -> RequestLogitsState:
        """A fresh state for another sample of the same request (before any output)."""
        grammar = self.grammar.fork() if self.grammar is not None else None
        return RequestLogitsState(self.params, prompt_token_ids, self.vocab_size, self.device, grammar)


class ProcessedRequest(Protocol):
    """What TargetProcessing reads of a request: engine/sequence.py's Sequence, named by its shape here
    because sequence.py imports this module (a Sequence holds a RequestLogitsState)."""

    @property
    def request_id(self) -> str: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def logits_state(self) -> RequestLogitsState | None: ...


def sampling_tensors(
    params: Seq[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row temperature, top_k, top_p and min_p (None when no row uses min-p) for process_logits."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = None
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p, min_p


def placeholder_probs(logits: torch.Tensor) -> torch.Tensor:
    """A valid distribution for rows whose own processing failed: one-hot at the (NaN-free) argmax."""
    picked = torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1, keepdim=True)
    return torch.zeros_like(logits).scatter_(1, picked, 1.0)


def robust_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> tuple[torch.Tensor, list[int]]:
    """process_logits with one SamplingParams per row, where a row that cannot be processed (processing
    raises for it, or its distribution is not finite) gets `placeholder_probs` instead of failing the
    batch; returns the probabilities and the failed row indices. Used for draft distributions: a failed
    draft row drafts its argmax, with a one-hot distribution that verification handles exactly."""
    try:
        probs = process_logits(logits, *sampling_tensors(params, logits.device))
    except Exception:  # one bad row: process row by row so only it is replaced
        rows = []
        for i, p in enumerate(params):
            try:
                rows.append(process_logits(logits[i : i + 1], *sampling_tensors([p], logits.device)))
            except Exception:
                rows.append(torch.full_like(logits[i : i + 1], float("nan")))
        probs = torch.cat(rows)
    bad = (~torch.isfinite(probs.sum(dim=-1))).nonzero().squeeze(1).tolist()
    if bad:
        probs[bad] = placeholder_probs(logits[bad])
    return probs, bad


class TargetProcessing:
    """Processes the target's logits for the rows of one step (see the module docstring)."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars

    def probs(
        self,
        logits: torch.Tensor,
        seqs: Seq[ProcessedRequest],
        drafts: Seq[Seq[int]],
        *,
        check_rows: bool = True,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """Processed probabilities [N, V] for logits [N, V] whose rows are, per request b in order,
        len(drafts[b]) + 1 consecutive positions (the position after the newest token, then after each
        draft); and {b: error} for requests that failed (their rows hold a placeholder distribution).

        check_rows: also fail requests whose distribution is not finite (one reduction over the rows);
        verify() checks that itself, so the verify path passes False and isolates on its error.
        out: a float32 [N, V] buffer (not `logits`) the probabilities are written into, as the engine's
        step buffer (engine/step_buffer.py); a batch that has to be processed request by request
        (one of them failed) gets a new tensor instead.
        """
        failed: dict[int, str] = {}
        try:
            probs = self._process(logits, seqs, drafts, out)
        except Exception:  # isolate: process request by request, so only the failing ones are replaced
            pieces, start = [], 0
            for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
                rows = logits[start : start + len(d) + 1]
                start += len(d) + 1
                try:
                    pieces.append(self._process(rows, [seq], [d]))
                except Exception as exc:
                    failed[b] = f"processing the logits failed: {type(exc).__name__}: {exc}"
                    pieces.append(placeholder_probs(rows))
            probs = torch.cat(pieces)
        if check_rows:
            finite = torch.isfinite(probs.sum(dim=-1)).tolist()
            start = 0
            for b, d in enumerate(drafts):
                end = start + len(d) + 1
                if b not in failed and not all(finite[start:end]):
                    failed[b] = non_finite_message(seqs[b].params)
                    probs[start:end] = placeholder_probs(logits[start:end])
                start = end
        for b, message in failed.items():
            logger.warning("request %s fails alone: %s", seqs[b].request_id, message)
        return probs, failed

    def _process(
        self,
        logits: torch.Tensor,
        seqs: Seq[ProcessedRequest],
        drafts: Seq[Seq[int]],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        counts = [len(d) + 1 for d in drafts]
        params = [s.params for s, n in zip(seqs, counts, strict=True) for _ in range(n)]
        shaped = [b for b, s in enumerate(seqs) if s.logits_state is not None]
        if not shaped and all(p.greedy for p in params):
            # What process_logits gives greedy rows (the softmax of the logits as they are) without its
            # passes over [N, V] for checks and a division by 1: NaN rows come out NaN and fail their
            # request where rows are checked (here with check_rows, or in verify()).
            return torch.softmax(logits, dim=-1) if out is None else torch.softmax(logits, dim=-1, out=out)
        if shaped:
            # The caller's logits stay raw (a failed batch is retried from them): shape a copy, in `out`
            # when there is one (process_logits then works in place there).
            logits = logits.clone() if out is None else out.copy_(logits)
            starts = [0]
            for n in counts:
                starts.append(starts[-1] + n)
            self._shape(logits, seqs, drafts, shaped, starts)
        return process_logits(logits, *sampling_tensors(params, logits.device), out=out)

    def _shape(
        self,
        logits: torch.Tensor,
        seqs: Seq[ProcessedRequest],
        drafts: Seq[Seq[int]],
        shaped: list[int],
        starts: list[int],
    ) -> None:
        """Grammar mask, logit bias and penalties, in place, on the rows of the `shaped` requests."""
        device = logits.device
        states = {b: seqs[b].logits_state for b in shaped}

        def rows_of(bs: list[int]) -> torch.Tensor:
            return torch.tensor([r for b in bs for r in range(starts[b], starts[b + 1])], device=device)

        with_grammar = [b for b in shaped if states[b].grammar is not None]  # type: ignore[union-attr]
        if with_grammar:
            allowed = self.grammars.masks(
                [states[b].grammar for b in with_grammar],  # type: ignore[misc,union-attr]
                [drafts[b] for b in with_grammar],
                device,
            )
            apply_token_mask(logits, rows_of(with_grammar), allowed)

        with_bias = [b for b in shaped if states[b].bias_ids is not None]  # type: ignore[union-attr]
        if with_bias:
            rows, ids, values = [], [], []
            for b in with_bias:
                ids_b, values_b = states[b].bias_ids, states[b].bias_values  # type: ignore[union-attr]
                assert ids_b is not None and values_b is not None
                n = starts[b + 1] - starts[b]
                positions = torch.arange(starts[b], starts[b + 1], device=device)
                rows.append(positions.repeat_interleave(len(ids_b)))
                ids.append(ids_b.repeat(n))
                values.append(values_b.repeat(n))
            apply_logit_bias(logits, torch.cat(rows), torch.cat(ids), torch.cat(values))

        with_penalty = [b for b in shaped if seqs[b].params.has_penalties]
        if with_penalty:
            self._penalise(logits, seqs, drafts, with_penalty, starts)

    @staticmethod
    def _penalise(
        logits: torch.Tensor,
        seqs: Seq[ProcessedRequest],
        drafts: Seq[Seq[int]],
        bs: list[int],
        starts: list[int],
    ) -> None:
        """Penalties on the columns of each request's history tokens (plus its drafts) only.

        Row j of request b has the history output + d[:j]; for the U distinct tokens that can occur in
        any of its rows, counts[j, u] = output count + occurrences in d[:j], so the work per request is
        [K_b + 1, U], not [K_b + 1, V].
        """
        device = logits.device
        for b in bs:
            state = seqs[b].logits_state
            assert state is not None
            params = state.params
            d = torch.tensor(list(drafts[b]), dtype=torch.int64, device=device)
            ids = torch.unique(torch.cat([state.history_ids(), d]))
            if not len(ids):
                continue
            counts = state.output_counts()[ids].expand(len(d) + 1, -1)
            if len(d):
                hits = (d.unsqueeze(1) == ids.unsqueeze(0)).to(counts.dtype)  # [K_b, U]
                prefix = torch.cat([hits.new_zeros(1, len(ids)), hits.cumsum(dim=0)])
                counts = counts + prefix
            seen = None
            if state.prompt_seen is not None:
                seen = state.prompt_seen[ids].unsqueeze(0) | (counts > 0)
            block = torch.arange(starts[b], starts[b + 1], device=device).unsqueeze(1)
            n = starts[b + 1] - starts[b]

            def column(value: float, n: int = n) -> torch.Tensor:
                return torch.full((n,), value, dtype=torch.float32, device=device)

            logits[block, ids] = apply_penalties(
                logits[block, ids],
                counts,
                seen,
                column(params.presence_penalty),
                column(params.frequency_penalty),
                column(params.repetition_penalty),
            )


def non_finite_message(params: SamplingParams) -> str:
    """The error of a request whose processed distribution is NaN or infinite."""
    return (
        "processing the logits failed: the distribution is not finite (NaN or inf) with temperature="
        f"{params.temperature!r}, top_k={params.top_k!r}, top_p={params.top_p!r}"
    )

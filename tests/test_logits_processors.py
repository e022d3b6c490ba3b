"""Each logits processor against a tiny loop-by-loop reference: penalties, logit bias, token masks, the
bitmask layout grammar libraries write, and min-p (also against transformers' MinPLogitsWarper)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

from flyspec.spec_decode.logits_processors import (
    apply_logit_bias,
    apply_penalties,
    apply_token_mask,
    unpack_bitmask,
)
from flyspec.spec_decode.sampling import process_logits


def ref_penalise(
    row: list[float], prompt: list[int], output: list[int], presence: float, frequency: float, rep: float
) -> list[float]:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + output, then OpenAI's
    `logit - count * frequency - (count > 0) * presence` over the output, one token at a time."""
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= output.count(t) * frequency + presence
    return out


def test_penalties_match_reference_per_row():
    """Mixed rows (each penalty alone, all three together, none) equal the reference; tokens outside the
    history and -inf logits are untouched."""
    g = torch.Generator().manual_seed(0)
    vocab = 12
    logits = torch.randn(5, vocab, generator=g) * 3
    logits[2, 7] = float("-inf")
    cases = [  # prompt, output, presence, frequency, repetition
        ([1, 2], [3, 3, 4], 0.5, 0.0, 1.0),
        ([1, 2], [3, 3, 4], 0.0, 0.7, 1.0),
        ([5, 7], [7, 7, 8], 0.0, 0.0, 1.5),
        ([0, 9], [9, 1, 1, 1], 0.3, -0.4, 0.6),
        ([4], [], 0.0, 0.0, 1.0),
    ]
    counts = torch.zeros(len(cases), vocab)
    seen = torch.zeros(len(cases), vocab, dtype=torch.bool)
    for r, (prompt, output, *_rest) in enumerate(cases):
        for t in output:
            counts[r, t] += 1
        seen[r, prompt + output] = True
    column = [torch.tensor([c[i] for c in cases]) for i in (2, 3, 4)]
    ours = apply_penalties(logits.clone(), counts, seen, *column)
    for r, (prompt, output, presence, frequency, rep) in enumerate(cases):
        theirs = torch.tensor(ref_penalise(logits[r].tolist(), prompt, output, presence, frequency, rep))
        torch.testing.assert_close(ours[r], theirs)
    assert ours[2, 7] == float("-inf")


def test_penalties_without_repetition_ignore_seen():
    """seen=None (no row with a repetition penalty) applies only frequency and presence."""
    logits = torch.tensor([[1.0, -1.0, 2.0]])
    counts = torch.tensor([[2.0, 0.0, 1.0]])
    out = apply_penalties(logits, counts, None, torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([1.0]))
    torch.testing.assert_close(out, torch.tensor([[1.0 - 1.0 - 1.0, -1.0, 2.0 - 0.5 - 1.0]]))


def test_logit_bias_adds_per_row_and_token():
    """Each (row, token) pair gets its bias; other entries are unchanged."""
    logits = torch.zeros(3, 5)
    apply_logit_bias(
        logits, torch.tensor([0, 0, 2]), torch.tensor([1, 4, 1]), torch.tensor([5.0, -100.0, 2.5])
    )
    expected = torch.zeros(3, 5)
    expected[0, 1], expected[0, 4], expected[2, 1] = 5.0, -100.0, 2.5
    torch.testing.assert_close(logits, expected)


def test_token_mask_sets_forbidden_to_minus_inf_on_given_rows():
    """Only the listed rows are masked, and only where the mask forbids."""
    logits = torch.ones(3, 4)
    allowed = torch.tensor([[True, False, True, False], [False, False, False, True]])
    apply_token_mask(logits, torch.tensor([0, 2]), allowed)
    inf = float("-inf")
    assert logits.tolist() == [[1, inf, 1, inf], [1, 1, 1, 1], [inf, inf, inf, 1]]


def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j():
    """The layout llguidance and xgrammar fill: bit j of int32 word w allows token 32 w + j, bit 31
    included (negative words), and the tail past the vocabulary is dropped."""
    vocab = 40
    allowed = {0, 5, 31, 32, 39}
    words = [0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    bitmask = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]], dtype=torch.int32)
    mask = unpack_bitmask(bitmask, vocab)
    assert mask.shape == (1, vocab)
    assert set(mask[0].nonzero().view(-1).tolist()) == allowed


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    """Softmax, then zero every probability below min_p times the largest, then renormalise."""
    top = max(row)
    probs = [math.exp(x - top) for x in row]
    total = sum(probs)
    probs = [p / total for p in probs]
    kept = [p if p >= min_p * max(probs) else 0.0 for p in probs]
    return [p / sum(kept) for p in kept]


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_matches_reference_and_transformers(min_p):
    """process_logits' min-p (after temperature) equals the reference and transformers' MinPLogitsWarper;
    min_p=1 keeps only the most likely token, min_p=0 changes nothing."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g) * 2
    temperature = torch.full((4,), 0.7)
    ours = process_logits(
        logits, temperature, torch.zeros(4, dtype=torch.int64), torch.ones(4), torch.full((4,), min_p)
    )
    for r in range(4):
        scaled = (logits[r] / 0.7).tolist()
        torch.testing.assert_close(ours[r], torch.tensor(ref_min_p(scaled, min_p)), rtol=1e-5, atol=1e-7)
        if min_p > 0:
            warped = MinPLogitsWarper(min_p)(
                None, TemperatureLogitsWarper(0.7)(None, logits[r : r + 1].clone())
            )
            torch.testing.assert_close(ours[r], torch.softmax(warped, -1)[0], rtol=1e-5, atol=1e-7)
    if min_p == 1.0:
        assert ((ours > 0).sum(-1) == 1).all()


def test_min_p_ignored_on_greedy_rows_and_applied_before_top_p():
    """A greedy row stays the softmax of its logits; on a sampling row min-p filters before top-p, so
    top-p's mass is measured on the min-p-renormalised distribution (vLLM's order)."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    out = process_logits(
        logits,
        torch.tensor([0.0, 1.0]),
        torch.zeros(2, dtype=torch.int64),
        torch.tensor([1.0, 0.9]),
        torch.tensor([0.5, 0.2]),
    )
    torch.testing.assert_close(out[0], probs[0])
    # min_p 0.2 drops 0.05 (< 0.1); renormalised 0.5/0.95, 0.3/0.95 = 0.842 < 0.9, so top-p keeps three.
    assert (out[1] > 0).tolist() == [True, True, True, False]

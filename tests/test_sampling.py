"""Logits processing (temperature, top-k, top-p, greedy rows) and inverse-CDF sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from flyspec.spec_decode.sampling import first_argmax, inverse_cdf_sample, process_logits


def params(temperature, top_k, top_p):
    return (
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.int64),
        torch.tensor(top_p, dtype=torch.float32),
    )


def test_matches_transformers_warpers_row_by_row():
    """Each row equals transformers' Temperature -> TopK -> TopP warpers followed by softmax, with
    per-row settings mixed in one batch (an independent implementation of the same rules)."""
    g = torch.Generator().manual_seed(0)
    V = 300
    settings = [(0.7, 0, 1.0), (1.0, 20, 1.0), (1.3, 0, 0.9), (0.5, 50, 0.8), (2.0, 5, 0.3), (1.0, 0, 0.05)]
    logits = torch.randn(len(settings), V, generator=g) * 3
    t, k, p = params(*zip(*settings, strict=True))
    ours = process_logits(logits, t, k, p)
    for row, (temp, top_k, top_p) in enumerate(settings):
        scores = TemperatureLogitsWarper(temp)(None, logits[row : row + 1].clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        theirs = torch.softmax(scores, dim=-1)[0]
        assert torch.equal(ours[row] > 0, theirs > 0), f"row {row}: different support"
        torch.testing.assert_close(ours[row], theirs, rtol=1e-5, atol=1e-7)


def test_greedy_rows_are_softmax_of_raw_logits_ignoring_filters():
    """Temperature 0 means greedy: the row is the softmax of the raw logits even if top-k/top-p are set
    (verification evaluates greedy rows on that distribution, docs/verification.md)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [2.0, 1.0, 0.5, -1.0]])
    out = process_logits(logits, *params([0.0, 0.0], [1, 0], [0.1, 1.0]))
    torch.testing.assert_close(out[0], torch.softmax(logits[0], -1))
    torch.testing.assert_close(out[1], torch.softmax(logits[1], -1))


def test_top_k_keeps_ties_and_top_p_boundary():
    """top-k keeps every token tied with the k-th logit; top-p keeps the smallest descending prefix whose
    mass reaches p; top_k >= V and top_p = 1 change nothing."""
    tied = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    out = process_logits(tied, *params([1.0], [2], [1.0]))
    assert (out[0] > 0).tolist() == [True, True, True, False]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep_two = process_logits(logits, *params([1.0], [0], [0.75]))
    torch.testing.assert_close(keep_two, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    keep_three = process_logits(logits, *params([1.0], [0], [0.85]))
    assert (keep_three[0] > 0).tolist() == [True, True, True, False]
    keep_one = process_logits(logits, *params([1.0], [0], [0.01]))
    assert keep_one.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    same = process_logits(logits, *params([1.0], [4], [1.0]))
    torch.testing.assert_close(same, probs)


def test_top_k_with_top_p_one_keeps_whole_top_k_on_large_vocab():
    """On a 151,936-token vocabulary, top_k=1000 with top_p=1 keeps exactly the 1000 largest tokens (the
    float32 cumulative sum must not cut the tail)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 151_936, generator=g)
    out = process_logits(logits, *params([1.0, 0.8], [1000, 0], [1.0, 1.0]))
    assert int((out[0] > 0).sum()) == 1000
    torch.testing.assert_close(out[1], torch.softmax(logits[1] / 0.8, -1))
    torch.testing.assert_close(out.sum(-1), torch.ones(2))


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.tensor([[float("nan"), 0.0]]), [1.0], [0], [1.0]), "logits contain NaN"),
        ((torch.zeros(1, 2), [-0.5], [0], [1.0]), "temperature must be finite and >= 0"),
        ((torch.zeros(1, 2), [1.0], [-1], [1.0]), "top_k must be >= 0"),
        ((torch.zeros(1, 2), [1.0], [0], [0.0]), r"top_p must lie in \(0, 1\]"),
        ((torch.zeros(1, 2), [1.0, 1.0], [0], [1.0]), r"temperature must have shape \[1\]"),
        ((torch.zeros(2), [1.0], [0], [1.0]), r"logits must have shape \[N, V\]"),
    ],
)
def test_process_logits_rejects_bad_input(args, message):
    """NaN logits, negative temperature, negative top_k, top_p outside (0, 1] and mismatched shapes are
    ValueErrors naming the argument."""
    logits, t, k, p = args
    with pytest.raises(ValueError, match=message):
        process_logits(logits, *params(t, k, p))


def test_inverse_cdf_picks_first_index_exceeding_u_total():
    """The drawn index is the first whose cumulative weight exceeds u * total; rows need not sum to 1;
    zero-weight indices are skipped, also at u = 0 and at u just below 1."""
    w = torch.tensor([[0.0, 0.2, 0.0, 0.2, 0.0]] * 5)  # total 0.4, not normalised
    u = torch.tensor([0.0, 0.49, 0.5, 0.51, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_sample(w, u).tolist() == [1, 1, 3, 3, 3]


def test_inverse_cdf_never_returns_zero_probability_index_on_rounding():
    """A huge vocabulary with mass only at the front, sampled at u close to 1, never lands on a
    zero-probability tail index even where the float64 cumulative sum rounds."""
    w = torch.zeros(4, 151_936)
    w[:, :7] = torch.tensor([1e-8, 0.3, 1e-8, 0.2, 0.1, 1e-8, 0.4])
    u = torch.tensor([1 - 2**-53, 1 - 1e-12, 0.0, 0.999999], dtype=torch.float64)
    idx = inverse_cdf_sample(w, u)
    assert (w.gather(1, idx.unsqueeze(1)) > 0).all()
    assert idx.tolist()[2] == 0


def test_inverse_cdf_frequencies_follow_the_weights():
    """With uniforms from a seeded generator, index frequencies over 200,000 draws pass a chi-square test
    against the weights."""
    g = torch.Generator().manual_seed(3)
    w = torch.tensor([0.05, 0.0, 0.4, 0.15, 0.0, 0.3, 0.1])
    n = 200_000
    idx = inverse_cdf_sample(w.expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))
    counts = torch.bincount(idx, minlength=7).double()
    assert counts[1] == 0 and counts[4] == 0
    support = w > 0
    assert (
        chisquare(counts[support].numpy(), (w[support].double() / w.double().sum() * n).numpy()).pvalue > 0.01
    )


def test_inverse_cdf_rejects_empty_rows_and_bad_shapes():
    """A row with no positive weight and a u of the wrong length are ValueErrors."""
    with pytest.raises(ValueError, match="probs row 1 has no positive probability"):
        inverse_cdf_sample(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"u must have shape \[2\]"):
        inverse_cdf_sample(torch.ones(2, 3), torch.zeros(3, dtype=torch.float64))


def test_inverse_cdf_across_blocks_equals_sequential_cumsum():
    """On a vocabulary of several 1,024-column blocks plus a partial one, float64 rows give exactly the
    index of a plain sequential float64 cumulative sum (the two-level search changes nothing), and float32
    rows agree on all but a rounding-sized share, always with a positive-probability index."""
    g = torch.Generator().manual_seed(11)
    n, V = 3000, 5000
    w = torch.rand(n, V, generator=g, dtype=torch.float64) ** 8  # uneven, many near-zero
    w[torch.rand(n, V, generator=g) < 0.3] = 0.0
    u = torch.rand(n, generator=g, dtype=torch.float64)
    cdf = w.cumsum(dim=1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert torch.equal(inverse_cdf_sample(w, u), expected)
    got32 = inverse_cdf_sample(w.float(), u)
    assert (w.float().gather(1, got32.unsqueeze(1)) > 0).all()
    assert (got32 != expected).double().mean() < 0.01


def test_inverse_cdf_frequencies_across_block_edges():
    """Weights placed on both sides of block edges (1023/1024, 2047/2048) and in the partial last block
    are drawn with the right frequencies (chi-square over 30,000 seeded draws)."""
    g = torch.Generator().manual_seed(12)
    V, n = 3100, 30_000
    where = torch.tensor([0, 1023, 1024, 2047, 2048, 3071, 3072, 3099])
    mass = torch.tensor([0.05, 0.2, 0.1, 0.15, 0.05, 0.25, 0.1, 0.1])
    w = torch.zeros(V).index_put_((where,), mass)
    idx = inverse_cdf_sample(w.expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))
    counts = torch.bincount(idx, minlength=V).double()
    assert counts.sum() == counts[where].sum()
    assert chisquare(counts[where].numpy(), (mass.double() / mass.double().sum() * n).numpy()).pvalue > 0.01


def test_first_argmax_equals_torch_argmax_with_ties_across_blocks():
    """first_argmax gives torch.argmax's answer (the first maximal index), including ties inside a block,
    ties across block edges, a maximum in the partial last block, rows of -inf and small vocabularies."""
    g = torch.Generator().manual_seed(13)
    x = torch.randint(0, 4, (6, 3, 3000), generator=g).float()  # many ties at the maximum
    x[0, 0, 2500:] = 9.0  # maximum only in the partial last block
    x[1, 1, 1023] = x[1, 1, 1024] = 9.0  # tie across a block edge
    x[2, 2] = float("-inf")
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    small = torch.tensor([[0.2, 0.4, 0.4], [0.5, 0.5, 0.0]])
    assert first_argmax(small).tolist() == [1, 0]
    wide = torch.randn(4, 151_936, generator=g)
    assert torch.equal(first_argmax(wide), wide.argmax(dim=-1))

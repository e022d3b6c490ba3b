"""The verifier (docs/verification.md): equality with a plain per-row reference for every policy (standard,
FLy, typical acceptance) with and without a lossless prefix, every FLy clause and the typical rule by hand,
losslessness of standard random verification and of the lossless prefix, and rejection of bad input."""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import accumulate

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from flyspec.spec_decode.verify import FlyParams, TypicalParams, top_k_entropy, verify

# ---------------------------------------------------------------------------------------------------------
# Reference: the rules of docs/verification.md for one row, in plain Python, line by line.
# ---------------------------------------------------------------------------------------------------------


def ref_argmax(row: list[float]) -> int:
    """First maximal index."""
    best = 0
    for j, p in enumerate(row):
        if p > row[best]:
            best = j
    return best


def ref_inverse_cdf(weights: list[float], u: float) -> set[int]:
    """The first index whose cumulative weight exceeds u * total, in exact rational arithmetic. Where
    u * total lies within 1e-6 of the total from a boundary, float rounding may fall either way, so the
    positive-weight neighbour is accepted too. A zero-weight index is never a candidate."""
    w = [Fraction(x) for x in weights]
    cdf = list(accumulate(w))
    target = Fraction(u) * cdf[-1]
    tol = cdf[-1] / 10**6
    return {j for j in range(len(w)) if w[j] > 0 and cdf[j] > target - tol and cdf[j] - w[j] <= target + tol}


def ref_entropy(row: list[float], k: int) -> float:
    """H = -sum over the min(k, V) largest p of p ln p, 0 ln 0 = 0, no renormalisation."""
    top = sorted(row, reverse=True)[: min(k, len(row))]
    return -sum(p * math.log(p) if p > 0 else 0.0 for p in top)


def ref_full_entropy(row: list[float]) -> float:
    """H = -sum over the whole row of p ln p, 0 ln 0 = 0."""
    return -sum(p * math.log(p) if p > 0 else 0.0 for p in row)


def ref_verify_row(
    d: list[int],
    P: list[list[float]],
    Q: list[list[float]] | None,
    greedy: bool,
    K_b: int,
    policy: FlyParams | TypicalParams | None,
    u: list[float],
    su: float,
    lossless_before: int = 0,
) -> tuple[list[int], set[int], int, list[int]]:
    """Returns (kept draft tokens, candidates for the recovered/bonus token, num_accepted, the kept
    positions that were forgiven)."""

    def q_of(i: int) -> float:
        return 1.0 if Q is None else Q[i][d[i]]

    # Native decisions.
    ok = []
    for i in range(K_b):
        if greedy:
            ok.append(d[i] == ref_argmax(P[i]))
        else:
            ok.append(q_of(i) > 0 and P[i][d[i]] / q_of(i) >= u[i])

    forgiven = [False] * K_b
    if isinstance(policy, FlyParams):  # clauses 1-5, each on native decisions only
        W = policy.window_size
        for i in range(K_b):
            allowed = P[i][d[i]] > 0 and (greedy or q_of(i) > 0)
            forgiven[i] = (
                not ok[i]
                and i + W < K_b
                and ref_entropy(P[i], policy.entropy_top_k) >= policy.entropy_threshold
                and allowed
                and all(ok[i + 1 : i + W + 1])
            )
    elif isinstance(policy, TypicalParams):  # section 4.2
        eps, delta = policy.posterior_threshold, policy.posterior_alpha
        for i in range(K_b):
            threshold = min(eps, delta * math.exp(-ref_full_entropy(P[i])))
            forgiven[i] = not ok[i] and P[i][d[i]] > threshold and (greedy or q_of(i) > 0)
    # Lossless prefix (section 4.3): native decisions only before it.
    forgiven = [f and i >= lossless_before for i, f in enumerate(forgiven)]

    # Standard procedure with ok_i := ok_i or forgiven_i.
    kept = [ok[i] or forgiven[i] for i in range(K_b)]
    a = next((i for i in range(K_b) if not kept[i]), K_b)
    typical_recovery = isinstance(policy, TypicalParams) and a < K_b and a >= lossless_before
    if greedy or typical_recovery:
        last = {ref_argmax(P[a])}
    elif a < K_b:
        if Q is None:
            residual = list(P[a])
            residual[d[a]] = 0.0
        else:
            residual = [max(p - q, 0.0) for p, q in zip(P[a], Q[a], strict=True)]
        last = ref_inverse_cdf(residual if any(r > 0 for r in residual) else P[a], su)
    else:
        last = ref_inverse_cdf(P[a], su)
    return d[:a], last, a, [i for i in range(a) if forgiven[i]]


def assert_matches_reference(d, P, Q, greedy, lengths, policy, u, su, prefix=None) -> VerifyOutputCounts:
    """Run verify and the reference on the same inputs; assert equality row by row."""
    out = verify(
        d,
        P,
        Q,
        greedy=greedy,
        policy=policy,
        lossless_before=prefix,
        num_draft_tokens=lengths,
        uniform=u,
        sample_uniform=su,
    )
    B, K = d.shape
    counts = VerifyOutputCounts()
    for b in range(B):
        kept, last, acc, forg = ref_verify_row(
            d[b].tolist(),
            P[b].double().tolist(),
            None if Q is None else Q[b].double().tolist(),
            bool(greedy[b]),
            int(lengths[b]),
            policy,
            u[b].tolist(),
            float(su[b]),
            0 if prefix is None else int(prefix[b]),
        )
        row = out.token_ids[b].tolist()
        assert row[:acc] == kept and row[acc] in last and row[acc + 1 :] == [-1] * (K - acc), f"row {b}"
        assert int(out.num_accepted[b]) == acc, f"row {b}"
        assert int(out.num_forgiven[b]) == len(forg), f"row {b}"
        assert out.forgiven[b].nonzero().flatten().tolist() == forg, f"row {b}"
        counts.add(acc, len(forg), int(lengths[b]))
    return counts


class VerifyOutputCounts:
    """Tallies which branches a batch exercised (so a property test cannot pass vacuously)."""

    def __init__(self) -> None:
        self.forgiven = self.rejected = self.bonus = 0

    def add(self, accepted: int, forgiven: int, length: int) -> None:
        self.forgiven += forgiven
        self.rejected += accepted < length
        self.bonus += accepted == length


# ---------------------------------------------------------------------------------------------------------
# Property tests: vectorised verify == reference.
# ---------------------------------------------------------------------------------------------------------

WEIGHTS = st.sampled_from([0, 0, 1, 1, 1, 2, 3, 8])  # zeros and ties on purpose


@st.composite
def dist_rows(draw, n: int, vocab: int) -> torch.Tensor:
    rows = []
    for _ in range(n):
        w = [draw(WEIGHTS) for _ in range(vocab)]
        if not any(w):
            w[draw(st.integers(0, vocab - 1))] = 1
        rows.append(w)
    t = torch.tensor(rows, dtype=torch.float32)
    return t / t.sum(dim=1, keepdim=True)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    K = draw(st.integers(1, 8))
    V = draw(st.integers(2, 7))
    P = torch.stack([draw(dist_rows(K + 1, V)) for _ in range(B)])
    Q = torch.stack([draw(dist_rows(K, V)) for _ in range(B)]) if draw(st.booleans()) else None
    greedy = torch.tensor([draw(st.booleans()) for _ in range(B)])
    lengths = torch.tensor([draw(st.integers(0, K)) for _ in range(B)])
    d = torch.zeros(B, K, dtype=torch.int64)
    for b in range(B):
        for i in range(K):
            if i >= lengths[b] and draw(st.booleans()):
                d[b, i] = -1  # padding may hold anything
            elif draw(st.booleans()):
                d[b, i] = ref_argmax(P[b, i].tolist())  # make acceptances common
            else:
                d[b, i] = draw(st.integers(0, V - 1))
    unit = st.one_of(st.sampled_from([0.25, 0.5, 0.75]), st.floats(1e-9, 1 - 1e-9))
    u = torch.tensor([[draw(unit) for _ in range(K)] for _ in range(B)], dtype=torch.float64)
    su = torch.tensor([draw(st.one_of(st.just(0.0), unit)) for _ in range(B)], dtype=torch.float64)
    kind = draw(st.sampled_from(["standard", "fly", "typical"]))
    policy: FlyParams | TypicalParams | None = None
    if kind == "fly":
        policy = FlyParams(
            window_size=draw(st.integers(1, 8)),
            entropy_threshold=draw(st.one_of(st.sampled_from([0.0, 0.3, 0.6, 1.0]), st.floats(0, 2))),
            entropy_top_k=draw(st.integers(1, V + 3)),
        )
    elif kind == "typical":
        # delta < 1 keeps P_i(d_i) off the rounding-sensitive boundary delta * exp(-H) of a uniform row
        # (delta = 1 is checked by hand below).
        policy = TypicalParams(
            posterior_threshold=draw(st.one_of(st.sampled_from([0.09, 0.2, 0.5, 1.0]), st.floats(1e-3, 2))),
            posterior_alpha=draw(st.one_of(st.sampled_from([0.3, 0.6]), st.floats(0.01, 0.99))),
        )
    prefix = None
    if draw(st.booleans()):
        prefix = torch.tensor([draw(st.integers(0, K + 2)) for _ in range(B)])
    return d, P, Q, greedy, lengths, policy, u, su, prefix


@settings(max_examples=600, deadline=None)
@given(batches())
def test_verify_equals_reference_on_random_batches(batch):
    """Vectorised verify equals the per-row reference of the documented rules: greedy and random rows,
    K 1-8, ragged K_b, standard, FLy (varied W, theta and top_k) and typical acceptance (varied eps and
    delta), with and without a per-row lossless prefix, ties and zero probabilities, with and without Q."""
    assert_matches_reference(*batch)


@pytest.mark.parametrize("with_q", [True, False])
def test_large_seeded_batch_matches_reference_and_covers_every_branch(with_q):
    """A 2,000-row seeded batch matches the reference and actually exercises forgiveness, rejection and the
    bonus token (so the equality is not vacuous)."""
    g = torch.Generator().manual_seed(7)
    B, K, V = 2000, 6, 5
    # Peaked or flat target rows, so both low and high entropies occur.
    temp = torch.where(torch.rand(B, K + 1, 1, generator=g) < 0.5, 0.3, 3.0)
    P = torch.softmax(torch.randn(B, K + 1, V, generator=g) / temp, dim=-1)
    P[torch.rand(B, K + 1, V, generator=g) < 0.1] = 0.0
    P[..., 0] += 1e-3
    P = P / P.sum(-1, keepdim=True)
    Q = torch.softmax(torch.randn(B, K, V, generator=g), dim=-1) if with_q else None
    d = torch.where(
        torch.rand(B, K, generator=g) < 0.7, P[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g)
    )
    greedy = torch.rand(B, generator=g) < 0.5
    lengths = torch.randint(0, K + 1, (B,), generator=g)
    u = torch.rand(B, K, generator=g, dtype=torch.float64).clamp_min(1e-12)
    su = torch.rand(B, generator=g, dtype=torch.float64)
    fly = FlyParams(window_size=2, entropy_threshold=0.5, entropy_top_k=3)
    counts = assert_matches_reference(d, P, Q, greedy, lengths, fly, u, su)
    assert counts.forgiven > 50 and counts.rejected > 200 and counts.bonus > 200
    assert_matches_reference(d, P, Q, greedy, lengths, None, u, su)
    typical = TypicalParams(posterior_threshold=0.09, posterior_alpha=0.3)
    counts = assert_matches_reference(d, P, Q, greedy, lengths, typical, u, su)
    assert counts.forgiven > 200 and counts.rejected > 100 and counts.bonus > 200
    # A lossless prefix of 0-3 positions per row: forgiveness before it is switched off, and rows are
    # still forgiven after it.
    prefix = torch.randint(0, 4, (B,), generator=g)
    for policy in (fly, typical):
        free = assert_matches_reference(d, P, Q, greedy, lengths, policy, u, su)
        counts = assert_matches_reference(d, P, Q, greedy, lengths, policy, u, su, prefix)
        assert 20 < counts.forgiven < free.forgiven and counts.rejected > free.rejected


# ---------------------------------------------------------------------------------------------------------
# Hand-written FLy cases (greedy rows: native decisions are then fixed by P alone).
# ---------------------------------------------------------------------------------------------------------

FLAT = [0.4, 0.3, 0.2, 0.1]  # top-3 entropy about 1.09 nats, argmax 0
PEAKED = [0.97, 0.01, 0.01, 0.01]  # top-3 entropy about 0.12 nats, argmax 0


def greedy_case(rows: list[list[float]], draft: list[int], fly: FlyParams | None, length: int | None = None):
    """One greedy row: P from `rows` (K+1 of them), the given draft, optional K_b."""
    P = torch.tensor([rows], dtype=torch.float32)
    d = torch.tensor([draft])
    lengths = None if length is None else torch.tensor([length])
    return verify(d, P, None, greedy=torch.tensor([True]), policy=fly, num_draft_tokens=lengths)


def test_rejection_forgiven_when_target_unsure_and_window_clean():
    """A native rejection at an uncertain position, followed by W natively accepted tokens, is forgiven:
    the draft token is emitted and counted both as accepted and as forgiven."""
    fly = FlyParams(window_size=2, entropy_threshold=0.3, entropy_top_k=3)
    out = greedy_case([FLAT, PEAKED, PEAKED, PEAKED, FLAT], [1, 0, 0, 0], fly)
    assert out.token_ids.tolist() == [[1, 0, 0, 0, 0]]
    assert out.num_accepted.tolist() == [4] and out.num_forgiven.tolist() == [1]
    std = greedy_case([FLAT, PEAKED, PEAKED, PEAKED, FLAT], [1, 0, 0, 0], None)
    assert std.token_ids.tolist() == [[0, -1, -1, -1, -1]] and std.num_forgiven.tolist() == [0]


def test_fly_keyword_is_the_documented_alias_of_policy():
    """`verify(..., fly=FlyParams(...))` (SPEC 3.2's older spelling) decides exactly as `policy=` does, and
    giving both is a ValueError naming the rule."""
    fly = FlyParams(window_size=2, entropy_threshold=0.3, entropy_top_k=3)
    probs = torch.tensor([[FLAT, PEAKED, PEAKED, PEAKED, FLAT]], dtype=torch.float32)
    d, greedy = torch.tensor([[1, 0, 0, 0]]), torch.tensor([True])
    alias = verify(d, probs, None, greedy=greedy, fly=fly)
    named = verify(d, probs, None, greedy=greedy, policy=fly)
    assert alias.token_ids.tolist() == named.token_ids.tolist() == [[1, 0, 0, 0, 0]]
    assert alias.num_forgiven.tolist() == [1]
    with pytest.raises(ValueError, match="not both"):
        verify(d, probs, None, greedy=greedy, policy=fly, fly=fly)


def test_not_forgiven_when_window_has_native_rejection():
    """A native rejection inside the W following positions blocks forgiveness; the recovered token is
    drawn at the first rejection (argmax of P_0)."""
    fly = FlyParams(window_size=2, entropy_threshold=0.3, entropy_top_k=3)
    out = greedy_case([FLAT, PEAKED, PEAKED, PEAKED, FLAT], [1, 0, 2, 0], fly)
    assert out.token_ids.tolist() == [[0, -1, -1, -1, -1]]
    assert out.num_accepted.tolist() == [0] and out.num_forgiven.tolist() == [0]


def test_trailing_positions_never_forgiven_and_k_b_counts_not_k():
    """Position i with i + W >= K_b is never forgiven, even when every other clause holds; the bound uses
    the row's K_b, not the padded K."""
    fly = FlyParams(window_size=2, entropy_threshold=0.3, entropy_top_k=3)
    out = greedy_case([PEAKED, PEAKED, FLAT, PEAKED, FLAT], [0, 0, 1, 0], fly)  # i=2, 2+2 >= 4
    assert out.token_ids.tolist() == [[0, 0, 0, -1, -1]] and out.num_forgiven.tolist() == [0]
    rows = [FLAT, PEAKED, PEAKED, PEAKED, FLAT]
    full = greedy_case(rows, [1, 0, 0, 0], FlyParams(3, 0.3, 3))  # 0 + 3 < 4: forgiven
    assert full.num_forgiven.tolist() == [1] and full.num_accepted.tolist() == [4]
    ragged = greedy_case(rows, [1, 0, 0, -1], FlyParams(3, 0.3, 3), length=3)  # 0 + 3 >= 3
    assert ragged.token_ids.tolist() == [[0, -1, -1, -1, -1]] and ragged.num_forgiven.tolist() == [0]


def test_entropy_exactly_at_threshold_is_forgiven():
    """Clause 3 is H >= theta: theta equal to H forgives, the next float above H does not, and theta = 0
    forgives any allowed rejection (here with the top-1 entropy of a two-way tie)."""
    rows = [FLAT, PEAKED, PEAKED, PEAKED]
    h = float(top_k_entropy(torch.tensor(FLAT), 3))
    assert h == pytest.approx(ref_entropy(torch.tensor(FLAT).double().tolist(), 3), rel=1e-15)
    at = greedy_case(rows, [1, 0, 0], FlyParams(2, h, 3))
    above = greedy_case(rows, [1, 0, 0], FlyParams(2, math.nextafter(h, math.inf), 3))
    assert at.num_forgiven.tolist() == [1] and above.num_forgiven.tolist() == [0]
    tie = [0.5, 0.5, 0.0, 0.0]  # argmax 0, so draft 1 is a native rejection
    assert float(top_k_entropy(torch.tensor(tie), 1)) == pytest.approx(-0.5 * math.log(0.5))
    out = greedy_case([tie, PEAKED, PEAKED, PEAKED], [1, 0, 0], FlyParams(2, 0.0, 1))
    assert out.num_forgiven.tolist() == [1] and out.token_ids.tolist() == [[1, 0, 0, 0]]


def test_top_k_larger_than_vocab_uses_whole_row():
    """entropy_top_k above V is capped at V, not an error: with k=10 on V=4 the whole row counts, which
    here is what lifts H over theta."""
    row = [0.4, 0.3, 0.2, 0.1]
    theta = (ref_entropy(row, 3) + ref_entropy(row, 4)) / 2  # between top-3 and full entropy
    rows = [row, PEAKED, PEAKED, PEAKED]
    assert greedy_case(rows, [1, 0, 0], FlyParams(2, theta, 3)).num_forgiven.tolist() == [0]
    assert greedy_case(rows, [1, 0, 0], FlyParams(2, theta, 10)).num_forgiven.tolist() == [1]


def test_masked_draft_token_never_forgiven():
    """A draft token the target gives probability 0 (e.g. masked by top-k) is never forgiven, and for a
    random row neither is one the drafter gave probability 0."""
    masked = [0.5, 0.3, 0.2, 0.0]
    fly = FlyParams(2, 0.0, 3)
    out = greedy_case([masked, PEAKED, PEAKED, PEAKED], [3, 0, 0], fly)
    assert out.token_ids.tolist() == [[0, -1, -1, -1]] and out.num_forgiven.tolist() == [0]
    # Random row: P_0(d_0) = 0.3 > 0 but Q_0(d_0) = 0 -> native reject, not forgivable.
    P = torch.tensor([[masked, [0.0, 1, 0, 0], [0.0, 1, 0, 0], PEAKED]])
    Q = torch.tensor([[[1.0, 0, 0, 0], [0.0, 1, 0, 0], [0.0, 1, 0, 0]]])
    u = torch.full((1, 3), 0.5, dtype=torch.float64)
    su = torch.tensor([0.5], dtype=torch.float64)
    kw = dict(greedy=torch.tensor([False]), policy=fly, uniform=u, sample_uniform=su)
    assert verify(torch.tensor([[1, 1, 1]]), P, Q, **kw).num_forgiven.tolist() == [0]
    # Same row with Q_0(d_0) > 0 and P_0(d_0) / Q_0(d_0) = 0.3 / 0.9 < u: rejected natively, forgiven.
    Q[0, 0] = torch.tensor([0.1, 0.9, 0, 0])
    out = verify(torch.tensor([[1, 1, 1]]), P, Q, **kw)
    assert out.num_forgiven.tolist() == [1] and out.token_ids.tolist() == [[1, 1, 1, 0]]


def test_two_rejections_within_window_first_stays_rejected():
    """With native rejections at 0 and 1 and W=2, position 1 would be forgivable but position 0's window
    holds a native rejection, so 0 stays rejected (a forgiven position is no native acceptance)."""
    fly = FlyParams(2, 0.3, 3)
    out = greedy_case([FLAT, FLAT, PEAKED, PEAKED, PEAKED, FLAT], [1, 1, 0, 0, 0], fly)
    assert out.token_ids.tolist() == [[0, -1, -1, -1, -1, -1]]
    assert out.num_accepted.tolist() == [0] and out.num_forgiven.tolist() == [0]
    # Rejections W+1 apart: both are forgiven.
    out = greedy_case([FLAT, PEAKED, PEAKED, FLAT, PEAKED, PEAKED, FLAT], [1, 0, 0, 1, 0, 0], fly)
    assert out.num_forgiven.tolist() == [2] and out.num_accepted.tolist() == [6]


# ---------------------------------------------------------------------------------------------------------
# Hand-written typical-acceptance and lossless-prefix cases.
# ---------------------------------------------------------------------------------------------------------

UNSURE = [0.5, 0.3, 0.2, 0.0]  # full entropy about 1.03 nats: min(0.09, 0.3 * exp(-H)) = 0.09


def test_typical_forgives_plausible_tokens_without_a_window():
    """Typical acceptance forgives every native rejection whose P_i(d_i) exceeds min(eps, delta exp(-H_i))
    (here 0.3 and 0.2 > 0.09), with no window: consecutive rejections and the last position too, unlike
    FLy. A token of probability 0 is never forgiven."""
    typical = TypicalParams()
    out = greedy_case([UNSURE, UNSURE, UNSURE, FLAT], [1, 2, 1], typical)
    assert out.token_ids.tolist() == [[1, 2, 1, 0]]
    assert out.num_accepted.tolist() == [3] and out.num_forgiven.tolist() == [3]
    fly = greedy_case([UNSURE, UNSURE, UNSURE, FLAT], [1, 2, 1], FlyParams(1, 0.0, 3))
    assert fly.num_forgiven.tolist() == [0] and fly.token_ids.tolist() == [[0, -1, -1, -1]]
    masked = greedy_case([UNSURE, UNSURE, FLAT], [3, 1], typical)
    assert masked.token_ids.tolist() == [[0, -1, -1]] and masked.num_forgiven.tolist() == [0]


def test_typical_threshold_is_the_smaller_of_eps_and_delta_exp_minus_entropy():
    """On a peaked row (H about 0.17, delta exp(-H) about 0.25) a token of probability 0.01 passes only
    when eps drops below it; on a flat row the entropy term binds: with eps 1, P(d) = 0.3 passes at
    delta = 0.3 (threshold 0.107) and fails at delta = 1 (threshold 0.357, the delta = 1 edge)."""
    rows = [PEAKED, PEAKED]
    assert greedy_case(rows, [1], TypicalParams(0.09, 0.3)).num_forgiven.tolist() == [0]
    assert greedy_case(rows, [1], TypicalParams(0.005, 0.3)).num_forgiven.tolist() == [1]
    h = ref_full_entropy(UNSURE)
    assert 0.3 * math.exp(-h) < 0.3 < math.exp(-h)
    assert greedy_case([UNSURE, FLAT], [1], TypicalParams(1.0, 0.3)).num_forgiven.tolist() == [1]
    assert greedy_case([UNSURE, FLAT], [1], TypicalParams(1.0, 1.0)).num_forgiven.tolist() == [0]


def random_case(policy, prefix=None):
    """One random row, K=1: draft 3 has P = 0 (rejected, never forgiven); the residual max(P - Q, 0) is
    P_0 itself, and sample_uniform 0.99 draws its last positive token (2) where argmax P_0 is 0."""
    P = torch.tensor([[[0.7, 0.25, 0.05, 0.0], FLAT]])
    Q = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]])
    return verify(
        torch.tensor([[3]]),
        P,
        Q,
        greedy=torch.tensor([False]),
        policy=policy,
        lossless_before=prefix,
        uniform=torch.full((1, 1), 0.5, dtype=torch.float64),
        sample_uniform=torch.tensor([0.99], dtype=torch.float64),
    )


def test_typical_recovers_by_argmax_on_random_rows_except_inside_the_prefix():
    """The token at typical acceptance's first rejection is argmax P_a on a random row too (vLLM's
    sampler); inside a lossless prefix it is the standard residual draw, as lossless verification gives."""
    assert random_case(None).token_ids.tolist() == [[2, -1]]
    assert random_case(TypicalParams()).token_ids.tolist() == [[0, -1]]
    assert random_case(TypicalParams(), torch.tensor([1])).token_ids.tolist() == [[2, -1]]
    assert random_case(FlyParams(1, 0.0, 3)).token_ids.tolist() == [[2, -1]]


def test_typical_bonus_token_is_drawn_as_in_standard():
    """When every draft is kept, a random row's bonus token is drawn from P_K (not its argmax)."""
    P = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]]])
    kw = dict(greedy=torch.tensor([False]), sample_uniform=torch.tensor([0.05], dtype=torch.float64))
    out = verify(torch.tensor([[1]]), P, None, policy=TypicalParams(), **kw)
    assert out.token_ids.tolist() == [[1, 0]] and out.num_forgiven.tolist() == [0]


def test_lossless_prefix_switches_forgiveness_off_before_it():
    """Positions before lossless_before[b] are decided natively, rows of one batch each with their own
    prefix: FLy's forgivable position 0 is rejected with a prefix of 1 and forgiven with 0; typical's
    forgivable positions 1 and 2 are forgiven with a prefix of 0 or 1 (both lie past it), and with a
    prefix of 2 position 1 is a native rejection that ends the row with the target's argmax."""
    fly = FlyParams(window_size=2, entropy_threshold=0.3, entropy_top_k=3)
    rows = [FLAT, PEAKED, PEAKED, PEAKED, FLAT]
    assert greedy_case(rows, [1, 0, 0, 0], fly).num_forgiven.tolist() == [1]
    P = torch.tensor([rows, rows])
    d = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0]])
    out = verify(
        d, P, None, greedy=torch.tensor([True, True]), policy=fly, lossless_before=torch.tensor([1, 0])
    )
    assert out.token_ids.tolist() == [[0, -1, -1, -1, -1], [1, 0, 0, 0, 0]]
    assert out.num_forgiven.tolist() == [0, 1]
    # Typical: draft [0, 1, 2] on UNSURE rows: position 0 is natively accepted, 1 and 2 are forgivable.
    P = torch.tensor([[UNSURE, UNSURE, UNSURE, FLAT]] * 3)
    d = torch.tensor([[0, 1, 2]] * 3)
    greedy = torch.ones(3, dtype=torch.bool)
    out = verify(d, P, None, greedy=greedy, policy=TypicalParams(), lossless_before=torch.tensor([0, 1, 2]))
    assert out.token_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 0], [0, 0, -1, -1]]
    assert out.num_forgiven.tolist() == [2, 2, 0]


@settings(max_examples=200, deadline=None)
@given(batches())
def test_prefix_covering_every_draft_is_standard_verification(batch):
    """lossless_before >= K_b makes FLy and typical acceptance exactly standard verification (the same
    tokens, nothing forgiven), for greedy and random rows: how a request opts out of a lossy engine."""
    d, P, Q, greedy, lengths, _, u, su, _ = batch
    kw = dict(greedy=greedy, num_draft_tokens=lengths, uniform=u, sample_uniform=su)
    standard = verify(d, P, Q, **kw)
    cover = lengths + torch.randint(0, 3, lengths.shape)
    for policy in (FlyParams(1, 0.0, 3), TypicalParams(1.0, 0.01)):
        out = verify(d, P, Q, policy=policy, lossless_before=cover, **kw)
        assert torch.equal(out.token_ids, standard.token_ids)
        assert out.num_forgiven.sum() == 0


# ---------------------------------------------------------------------------------------------------------
# Standard random verification is lossless.
# ---------------------------------------------------------------------------------------------------------

P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
Q0 = torch.tensor([0.10, 0.40, 0.05, 0.25, 0.20, 0.00])
N_SAMPLES = 200_000


def first_tokens(draft: torch.Tensor, Q: torch.Tensor | None, g: torch.Generator, **kw) -> torch.Tensor:
    """First emitted token of N_SAMPLES random rows with K=2 (target rows broadcast, not copied)."""
    P = torch.stack([P0, Q0.flip(0) / Q0.sum(), P0]).expand(N_SAMPLES, 3, 6)
    out = verify(draft, P, Q, greedy=torch.zeros(N_SAMPLES, dtype=torch.bool), generator=g, **kw)
    return out.token_ids[:, 0]


def chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() / probs.double().sum() * len(tokens)
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def distorted(probs: torch.Tensor) -> torch.Tensor:
    """probs with 1 percentage point moved from token 0 to token 1 (total-variation distance 0.01)."""
    out = probs.clone()
    out[0] -= 0.01
    out[1] += 0.01
    return out


def test_standard_random_verification_is_lossless_with_draft_probs():
    """Drafts sampled from Q, verified with Q: the first emitted token follows P_0 (chi-square over
    200,000 seeded samples), and the same samples reject a P_0 distorted by 0.01 in total variation."""
    g = torch.Generator().manual_seed(1234)
    Q = torch.stack([Q0, P0]).expand(N_SAMPLES, 2, 6)
    draft = torch.multinomial(Q[:, 0], 1, generator=g).repeat(1, 2)
    tokens = first_tokens(draft, Q, g)
    assert chi_square_p(tokens, P0) > 0.01
    assert chi_square_p(tokens, distorted(P0)) < 1e-6


@pytest.mark.parametrize("fixed_draft", [1, 3, 5])
def test_standard_random_verification_is_lossless_without_draft_probs(fixed_draft):
    """A deterministic drafter (n-gram style, draft_probs=None) proposing the same token every time: the
    first emitted token still follows P_0, and a 0.01 distortion is detected."""
    g = torch.Generator().manual_seed(99 + fixed_draft)
    draft = torch.full((N_SAMPLES, 2), fixed_draft)
    tokens = first_tokens(draft, None, g)
    assert chi_square_p(tokens, P0) > 0.01
    assert chi_square_p(tokens, distorted(P0)) < 1e-6


@pytest.mark.parametrize("policy", [FlyParams(1, 0.0, 3), TypicalParams()])
def test_lossless_prefix_keeps_random_rows_lossless(policy):
    """With lossless_before = 1 the first emitted token of a lossy policy follows P_0 exactly (chi-square
    over 200,000 seeded samples drafted from Q), while the same policy without the prefix visibly
    does not: its forgiveness (and, for typical acceptance, its argmax recovery) distorts P_0."""
    g = torch.Generator().manual_seed(4321)
    Q = torch.stack([Q0, P0]).expand(N_SAMPLES, 2, 6)
    draft = torch.multinomial(Q[:, 0], 1, generator=g).repeat(1, 2)
    prefix = torch.ones(N_SAMPLES, dtype=torch.int64)
    assert chi_square_p(first_tokens(draft, Q, g, policy=policy, lossless_before=prefix), P0) > 0.01
    assert chi_square_p(first_tokens(draft, Q, g, policy=policy), P0) < 1e-6


def test_greedy_rows_emit_target_argmax_chain():
    """Greedy rows keep exactly the prefix that matches argmax P_i and then emit argmax P_a, whatever Q
    says (first maximal index on ties)."""
    P = torch.tensor([[[0.2, 0.4, 0.4], [0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.0, 0.0, 1.0]]])
    Q = torch.full((1, 3, 3), 1 / 3)
    out = verify(torch.tensor([[1, 0, 1]]), P, Q, greedy=torch.tensor([True]))
    assert out.token_ids.tolist() == [[1, 0, 2, -1]] and out.num_accepted.tolist() == [2]


def test_generator_makes_draws_reproducible():
    """With uniform and sample_uniform drawn from a seeded generator, the same seed gives the same result
    and omitting num_draft_tokens means K for every row."""
    g0 = torch.Generator().manual_seed(5)
    P = torch.softmax(torch.randn(32, 5, 11, generator=g0), -1)
    Q = torch.softmax(torch.randn(32, 4, 11, generator=g0), -1)
    d = torch.randint(0, 11, (32, 4), generator=g0)
    greedy = torch.zeros(32, dtype=torch.bool)

    def run(seed, lengths=None):
        return verify(
            d, P, Q, greedy=greedy, num_draft_tokens=lengths, generator=torch.Generator().manual_seed(seed)
        )

    a, b = run(3), run(3, torch.full((32,), 4))
    assert torch.equal(a.token_ids, b.token_ids)
    assert any(not torch.equal(a.token_ids, run(s).token_ids) for s in (4, 5, 6))


def test_zero_uniform_never_accepts_zero_probability_token():
    """u = 0 (torch.rand can return it) must not accept a draft token the target gives probability 0."""
    P = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    Q = torch.tensor([[[1.0, 0.0]]])
    out = verify(
        torch.tensor([[0]]),
        P,
        Q,
        greedy=torch.tensor([False]),
        uniform=torch.zeros(1, 1, dtype=torch.float64),
        sample_uniform=torch.zeros(1, dtype=torch.float64),
    )
    assert out.token_ids.tolist() == [[1, -1]]


# ---------------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument.
# ---------------------------------------------------------------------------------------------------------


def good_inputs():
    P = torch.full((2, 4, 5), 0.2)
    Q = torch.full((2, 3, 5), 0.2)
    return dict(
        draft_token_ids=torch.zeros(2, 3, dtype=torch.int64),
        target_probs=P,
        draft_probs=Q,
        greedy=torch.tensor([True, False]),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(target_probs=torch.full((2, 3, 5), 0.2)), "target_probs must have shape"),
        (dict(draft_probs=torch.full((2, 3, 6), 0.2)), "draft_probs must have shape"),
        (dict(draft_token_ids=torch.zeros(2, 3)), "draft_token_ids must be an integer tensor"),
        (dict(greedy=torch.tensor([1, 0])), "greedy must be a bool tensor"),
        (dict(num_draft_tokens=torch.tensor([4, 1])), "num_draft_tokens must lie in"),
        (dict(num_draft_tokens=torch.tensor([3])), "num_draft_tokens must be an integer tensor of shape"),
        (dict(draft_token_ids=torch.tensor([[0, -2, 0], [0, 0, 0]])), r"draft_token_ids\[0, 1\] = -2"),
        (dict(draft_token_ids=torch.tensor([[0, 0, 0], [0, 0, 5]])), r"draft_token_ids\[1, 2\] = 5"),
        (dict(uniform=torch.full((2, 3), 1.0, dtype=torch.float64)), "uniform must lie in"),
        (dict(uniform=torch.full((2, 2), 0.5, dtype=torch.float64)), "uniform must be a floating-point"),
        (dict(sample_uniform=torch.tensor([0.5, float("nan")], dtype=torch.float64)), "sample_uniform"),
        (dict(lossless_before=torch.tensor([0, -1])), "lossless_before must be"),
        (dict(lossless_before=torch.tensor([0.0, 1.0])), "lossless_before must be"),
        (dict(lossless_before=torch.tensor([0])), "lossless_before must be"),
        (dict(policy="fly"), "policy must be a VerificationPolicy"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(change, message):
    """Shapes that disagree, K_b > K, negative or out-of-vocabulary draft ids, bad uniforms, a bad lossless
    prefix and a policy given by name raise a ValueError that names the argument."""
    kwargs = good_inputs() | change
    args = [kwargs.pop(name) for name in ("draft_token_ids", "target_probs", "draft_probs")]
    with pytest.raises(ValueError, match=message):
        verify(*args, **kwargs)


@pytest.mark.parametrize("name", ["target_probs", "draft_probs"])
def test_nan_probabilities_rejected(name):
    """A NaN anywhere in the target or draft probabilities is an error naming the tensor."""
    kwargs = good_inputs()
    kwargs[name][1, 2, 3] = float("nan")
    args = [kwargs.pop(n) for n in ("draft_token_ids", "target_probs", "draft_probs")]
    with pytest.raises(ValueError, match=f"{name} contains NaN"):
        verify(*args, **kwargs)


def test_padding_draft_ids_are_ignored():
    """Out-of-vocabulary ids at positions >= K_b are padding, not errors, and never appear in the output."""
    kwargs = good_inputs()
    kwargs["draft_token_ids"] = torch.tensor([[0, -1, -1], [0, 0, 99]])
    args = [kwargs.pop(n) for n in ("draft_token_ids", "target_probs", "draft_probs")]
    out = verify(
        *args, **kwargs, num_draft_tokens=torch.tensor([1, 2]), generator=torch.Generator().manual_seed(0)
    )
    assert out.num_accepted[0] == 1 and 99 not in out.token_ids.tolist()[1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(window_size=0, entropy_threshold=0.3, entropy_top_k=3), "window_size=0"),
        (dict(window_size=2, entropy_threshold=-0.1, entropy_top_k=3), "entropy_threshold=-0.1"),
        (dict(window_size=2, entropy_threshold=float("nan"), entropy_top_k=3), "entropy_threshold=nan"),
        (dict(window_size=2, entropy_threshold=0.3, entropy_top_k=0), "entropy_top_k=0"),
    ],
)
def test_fly_params_validated(kwargs, field):
    """FlyParams rejects a window below 1, a negative or non-finite threshold and top_k below 1."""
    with pytest.raises(ValueError, match=field):
        FlyParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(posterior_threshold=0.0), "posterior_threshold=0.0 is invalid: it must be a finite number > 0"),
        (dict(posterior_threshold=float("inf")), "posterior_threshold=inf"),
        (
            dict(posterior_alpha=0.0),
            r"posterior_alpha=0.0 is invalid: it must be a finite number in \(0, 1\]",
        ),
        (dict(posterior_alpha=1.5), "posterior_alpha=1.5"),
        (dict(posterior_alpha="0.3"), "posterior_alpha='0.3'"),
    ],
)
def test_typical_params_validated(kwargs, field):
    """TypicalParams rejects eps <= 0 or non-finite and delta outside (0, 1]; defaults are vLLM's."""
    with pytest.raises(ValueError, match=field):
        TypicalParams(**kwargs)
    assert TypicalParams() == TypicalParams(posterior_threshold=0.09, posterior_alpha=0.3)


def test_all_zero_residual_falls_back_to_target_row():
    """When max(P_a - Q_a, 0) is all zero (reachable only through rounding or a Q row summing above 1),
    the recovered token is drawn from P_a instead of failing."""
    P = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
    Q = torch.tensor([[[0.6, 0.6]]])
    out = verify(
        torch.tensor([[0]]),
        P,
        Q,
        greedy=torch.tensor([False]),
        uniform=torch.full((1, 1), 0.9, dtype=torch.float64),
        sample_uniform=torch.tensor([0.75], dtype=torch.float64),
    )
    assert out.token_ids.tolist() == [[1, -1]] and out.num_accepted.tolist() == [0]

"""FLy's window, stated against the two definitions users meet (docs/verification.md, "The window").

- vLLM's (whose meaning `fly_window_size` keeps): W is the number of later native acceptance decisions
  checked, and position i can be forgiven only when i + W < K.
- The FLy authors' reference code: a window of length L that *includes* the mismatched position (so L - 1
  later decisions are checked), matched anywhere in the row, after which the last L positions of the row
  are reset to their native decisions (so position i can be forgiven only when i + L < K).

The rules below are written from those two descriptions (greedy rows, where native decisions depend on the
target alone) and compared with `verify()` on every pattern of native accepts and rejects for K = 2..8, and
on hand-built cases whose answers were worked out on paper from the authors' rule.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch

from flyspec.spec_decode.verify import FlyParams, verify

UNSURE = [0.4, 0.3, 0.2, 0.1]  # argmax 0, top-3 entropy ~1.09 nats: over any threshold used here
SURE = [0.97, 0.01, 0.01, 0.01]  # argmax 0, top-3 entropy ~0.17 nats
THETA = 0.6


def vllm_rule(ok: list[bool], unsure: list[bool], window: int) -> list[bool]:
    """Forgivable positions by vLLM's documented rule: W later native decisions, all accepted."""
    k = len(ok)
    return [not ok[i] and unsure[i] and i + window < k and all(ok[i + 1 : i + window + 1]) for i in range(k)]


def authors_rule(ok: list[bool], unsure: list[bool], win_len: int) -> list[bool]:
    """Forgivable positions by the authors' reference code: the pattern (rejected, then win_len - 1
    accepted) matched at i, the last win_len positions reset to native, the entropy gate applied after."""
    k = len(ok)
    matched = [i + win_len <= k and not ok[i] and all(ok[i + 1 : i + win_len]) for i in range(k)]
    reset = [matched[i] and i < k - win_len for i in range(k)]
    return [reset[i] and unsure[i] for i in range(k)]


def kept(ok: list[bool], forgiven: list[bool]) -> tuple[int, list[bool]]:
    """Standard truncation after forgiveness: draft tokens kept, and which of them were forgiven."""
    n = 0
    while n < len(ok) and (ok[n] or forgiven[n]):
        n += 1
    return n, [forgiven[i] and i < n for i in range(len(ok))]


def run_verify(patterns: list[tuple[list[bool], list[bool]]], window: int) -> list[tuple[int, list[bool]]]:
    """`verify()` on greedy rows built so that row b's native decisions are patterns[b][0] and its target
    is unsure exactly where patterns[b][1] says: draft 0 (the argmax) where accepted, draft 1 where not."""
    k = len(patterns[0][0])
    probs = torch.tensor(
        [[UNSURE if u else SURE for u in unsure] + [SURE] for _, unsure in patterns], dtype=torch.float32
    )
    drafts = torch.tensor([[0 if a else 1 for a in ok] for ok, _ in patterns])
    out = verify(
        drafts,
        probs,
        None,
        greedy=torch.ones(len(patterns), dtype=torch.bool),
        policy=FlyParams(window_size=window, entropy_threshold=THETA, entropy_top_k=3),
    )
    assert out.num_forgiven.tolist() == out.forgiven.sum(dim=1).tolist()
    return [
        (int(n), row[:k]) for n, row in zip(out.num_accepted.tolist(), out.forgiven.tolist(), strict=True)
    ]


@pytest.mark.parametrize("k", range(2, 9))
def test_fly_window_size_is_vllms_followers_checked_on_every_pattern(k):
    """For every pattern of native decisions (and of target certainty, for K <= 5) and every W < K,
    `verify()` keeps exactly what vLLM's documented rule keeps: W later native acceptances, i + W < K."""
    certainty = product((True, False), repeat=k) if k <= 5 else [(True,) * k]
    patterns = [(list(ok), list(u)) for ok in product((True, False), repeat=k) for u in certainty]
    for window in range(1, k):
        got = run_verify(patterns, window)
        want = [kept(ok, vllm_rule(ok, u, window)) for ok, u in patterns]
        assert got == want, f"K={k} W={window}"


@pytest.mark.parametrize("k", range(3, 9))
def test_the_authors_window_of_length_l_lies_between_w_equal_l_and_w_equal_l_minus_1(k):
    """The authors' window of length L checks the same L - 1 followers as fly_window_size = L - 1 but never
    forgives position K - L (whose window would end on the last draft); fly_window_size = L forgives at
    the same positions as the authors but checks one more follower. So, on every pattern:
    forgiven(W = L) <= authors(L) <= forgiven(W = L - 1), and authors(L) is forgiven(W = L - 1) without
    position K - L."""
    patterns = [(list(ok), [True] * k) for ok in product((True, False), repeat=k)]
    for win_len in range(2, k):
        authors = [authors_rule(ok, u, win_len) for ok, u in patterns]
        looser = [vllm_rule(ok, u, win_len - 1) for ok, u in patterns]
        stricter = [vllm_rule(ok, u, win_len) for ok, u in patterns]
        for a, lo, st in zip(authors, looser, stricter, strict=True):
            assert a == [f and i != k - win_len for i, f in enumerate(lo)]
            assert all(a[i] or not st[i] for i in range(k)) and all(lo[i] or not a[i] for i in range(k))
        # verify() with W = L - 1 differs from the authors only where position K - L was forgiven.
        got = run_verify(patterns, win_len - 1)
        for (ok, _), a, (n, forgiven) in zip(patterns, authors, got, strict=True):
            if not forgiven[k - win_len]:
                assert (n, forgiven) == kept(ok, a)


# Worked on paper from the authors' rule: K, the native decisions (A accepted, R rejected; lower case where
# the target was sure, under the threshold), the authors' window length L, the positions their code can
# forgive, the draft tokens it keeps, and the draft tokens verify() keeps with fly_window_size = L - 1.
AUTHORS_CASES = [
    (4, "RAAA", 3, [0], 4, 4),  # 0 + 3 < 4: forgiven
    (4, "RAAA", 4, [], 0, 4),  # L = 4 at K = 4 matches at 0, then the last 4 positions are reset
    (4, "ARAA", 3, [], 1, 4),  # 1 = K - L is reset although both followers were accepted
    (8, "RAAAAARA", 6, [0], 6, 6),  # L = 6, K = 8: only positions 0 and 1 can be forgiven
    (8, "ARAAAAAA", 6, [1], 8, 8),  # 1 + 6 < 8
    (8, "AARAAAAA", 6, [], 2, 8),  # 2 = K - L: reset, although its five followers were accepted
    (8, "RAAAARAA", 3, [0], 5, 8),  # 5 = K - L: reset
    (8, "RAARAAAA", 3, [0, 3], 8, 8),  # two mismatches L apart: both forgiven
    (8, "RARAAAAA", 3, [2], 0, 0),  # 0's window holds the native rejection at 2: nothing chains
    (8, "rAAAAAAA", 3, [], 0, 0),  # the target was sure where the draft was rejected
]


@pytest.mark.parametrize(
    ("k", "pattern", "win_len", "positions", "authors_kept", "verify_kept"), AUTHORS_CASES
)
def test_hand_built_cases_of_the_authors_rule(k, pattern, win_len, positions, authors_kept, verify_kept):
    """Each hand-built case by the authors' rule as written above, and `verify()` with
    fly_window_size = L - 1 (the same followers checked) on the same row."""
    assert len(pattern) == k
    ok = [c in "Aa" for c in pattern]
    unsure = [c.isupper() for c in pattern]
    forgiven = authors_rule(ok, unsure, win_len)
    assert [i for i, f in enumerate(forgiven) if f] == positions
    assert kept(ok, forgiven)[0] == authors_kept
    assert run_verify([(ok, unsure)], win_len - 1)[0][0] == verify_kept

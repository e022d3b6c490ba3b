"""The verifier: which draft tokens to keep, and the one token to add after them (docs/verification.md).

One function serves every verification policy (standard, FLy, typical acceptance: flyspec/spec_decode/
policies/), greedy and random rows mixed in one batch, ragged draft lengths, a lossless prefix per row,
and drafters with or without probabilities. Everything is vectorised over the batch and the K draft
positions. Passes over the [B, K+1, V] target probabilities are kept to the minimum (a finiteness check,
argmax when a row is greedy); a policy looks at full rows only where it may forgive, per-token work is a
gather, and the residual distribution is built only at the one position per row that needs it ([B, V]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyspec.spec_decode.policies.base import Drafts, VerificationPolicy
from flyspec.spec_decode.policies.fly import FlyParams, top_k_entropy
from flyspec.spec_decode.policies.typical import TypicalParams
from flyspec.spec_decode.sampling import first_argmax, inverse_cdf_sample

__all__ = ["FlyParams", "TypicalParams", "VerificationPolicy", "VerifyOutput", "top_k_entropy", "verify"]


@dataclass(frozen=True)
class VerifyOutput:
    """Result of `verify` for a batch of B rows."""

    token_ids: torch.Tensor
    """[B, K+1] int64: kept draft tokens, then one recovered or bonus token, then -1 padding."""
    num_accepted: torch.Tensor
    """[B] int64: draft tokens kept (forgiven ones included)."""
    num_forgiven: torch.Tensor
    """[B] int64: kept draft tokens that native verification rejected."""
    forgiven: torch.Tensor
    """[B, K] bool: the kept draft positions that native verification rejected (num_forgiven per row)."""


def _all_finite(tensor: torch.Tensor) -> bool:
    # One reduction and no [B, K+1, V] boolean temporary: any NaN (or inf) makes the sum non-finite.
    return bool(torch.isfinite(tensor.sum()))


@dataclass(frozen=True)
class _Batch:
    """The checked inputs that every step of `verify` reads, on the target's device."""

    draft: torch.Tensor
    """[B, K] int64: the draft tokens, with padding replaced by 0 so that gathers stay in range."""
    target_probs: torch.Tensor
    """[B, K+1, V]: as given."""
    draft_probs: torch.Tensor | None
    """[B, K, V] or None: as given."""
    greedy: torch.Tensor
    """[B] bool."""
    lengths: torch.Tensor
    """[B] int64: K_b."""
    positions: torch.Tensor
    """[K] int64: 0 .. K-1."""
    valid: torch.Tensor
    """[B, K] bool: positions i < K_b."""


def _lossy_policy(policy: VerificationPolicy | None) -> VerificationPolicy | None:
    """The policy, or None when verification is lossless; ValueError for something else."""
    if policy is not None and not isinstance(policy, VerificationPolicy):
        raise ValueError(f"policy must be a VerificationPolicy (e.g. FlyParams) or None, got {policy!r}")
    return policy if policy is not None and policy.lossy else None


def _check_tokens_and_probs(
    draft_token_ids: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None
) -> None:
    """ValueError unless draft_token_ids is [B, K] integer and the probabilities [B, K+1, V], [B, K, V]."""
    if (
        draft_token_ids.dim() != 2
        or draft_token_ids.dtype.is_floating_point
        or draft_token_ids.dtype == torch.bool
    ):
        raise ValueError(
            f"draft_token_ids must be an integer tensor of shape [B, K], got {draft_token_ids.dtype} "
            f"{list(draft_token_ids.shape)}"
        )
    b, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (b, k + 1) or target_probs.shape[2] < 1:
        raise ValueError(
            f"target_probs must have shape [B, K+1, V] = [{b}, {k + 1}, V], got {list(target_probs.shape)}"
        )
    if not target_probs.dtype.is_floating_point:
        raise ValueError(f"target_probs must be a floating-point tensor, got {target_probs.dtype}")
    vocab = target_probs.shape[2]
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (b, k, vocab):
            raise ValueError(
                f"draft_probs must have shape [B, K, V] = [{b}, {k}, {vocab}] (the target's vocabulary), "
                f"got {list(draft_probs.shape)}"
            )
        if not draft_probs.dtype.is_floating_point:
            raise ValueError(f"draft_probs must be a floating-point tensor, got {draft_probs.dtype}")


def _check_row_settings(
    greedy: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    lossless_before: torch.Tensor | None,
    b: int,
    k: int,
) -> None:
    """ValueError unless `greedy`, `num_draft_tokens` and `lossless_before` are valid [B] tensors."""
    if greedy.shape != (b,) or greedy.dtype != torch.bool:
        raise ValueError(
            f"greedy must be a bool tensor of shape [{b}], got {greedy.dtype} {list(greedy.shape)}"
        )
    if num_draft_tokens.shape != (b,) or num_draft_tokens.dtype.is_floating_point:
        raise ValueError(
            f"num_draft_tokens must be an integer tensor of shape [{b}], got {num_draft_tokens.dtype} "
            f"{list(num_draft_tokens.shape)}"
        )
    if b and ((num_draft_tokens < 0) | (num_draft_tokens > k)).any():
        raise ValueError(f"num_draft_tokens must lie in [0, K={k}] per row, got {num_draft_tokens.tolist()}")
    if lossless_before is not None and (
        lossless_before.shape != (b,)
        or lossless_before.dtype.is_floating_point
        or lossless_before.dtype == torch.bool
        or (b and bool((lossless_before < 0).any()))
    ):
        raise ValueError(
            f"lossless_before must be an integer tensor of shape [{b}] with values >= 0, got "
            f"{lossless_before.dtype} {list(lossless_before.shape)}"
        )


def _check_uniforms(
    uniform: torch.Tensor | None, sample_uniform: torch.Tensor | None, b: int, k: int
) -> None:
    """ValueError unless the given uniforms are float tensors of shape [B, K] and [B] in [0, 1)."""
    for name, tensor, shape in (("uniform", uniform, (b, k)), ("sample_uniform", sample_uniform, (b,))):
        if tensor is None:
            continue
        if tuple(tensor.shape) != shape or not tensor.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be a floating-point tensor of shape {list(shape)}, got {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
        if tensor.numel() and not ((tensor >= 0) & (tensor < 1)).all():
            raise ValueError(f"{name} must lie in [0, 1) (and not be NaN)")


def _checked_batch(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    num_draft_tokens: torch.Tensor | None,
    uniform: torch.Tensor | None,
    sample_uniform: torch.Tensor | None,
    lossless_before: torch.Tensor | None,
) -> _Batch:
    """The inputs on the target's device, once all are checked (ValueError names the first bad one)."""
    device = target_probs.device
    _check_tokens_and_probs(draft_token_ids, target_probs, draft_probs)
    b, k = draft_token_ids.shape
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((b,), k, dtype=torch.int64, device=device)
    _check_row_settings(greedy, num_draft_tokens, lossless_before, b, k)
    _check_uniforms(uniform, sample_uniform, b, k)
    if not _all_finite(target_probs):
        raise ValueError("target_probs contains NaN or inf")
    if draft_probs is not None and not _all_finite(draft_probs):
        raise ValueError("draft_probs contains NaN or inf")
    vocab = target_probs.shape[2]
    positions = torch.arange(k, device=device)
    greedy = greedy.to(device)
    lengths = num_draft_tokens.to(device=device, dtype=torch.int64)
    valid = positions.unsqueeze(0) < lengths.unsqueeze(1)  # [B, K]

    draft = draft_token_ids.to(device=device, dtype=torch.int64)
    out_of_vocab = valid & ((draft < 0) | (draft >= vocab))
    if out_of_vocab.any():
        row, pos = out_of_vocab.nonzero()[0].tolist()
        raise ValueError(
            f"draft_token_ids[{row}, {pos}] = {draft[row, pos].item()} is outside the vocabulary [0, {vocab})"
        )
    draft = torch.where(valid, draft, 0)  # padding may hold anything (e.g. -1); keep gathers in range
    return _Batch(draft, target_probs, draft_probs, greedy, lengths, positions, valid)


def verify(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    *,
    greedy: torch.Tensor,
    policy: VerificationPolicy | None = None,
    lossless_before: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sample_uniform: torch.Tensor | None = None,
    fly: FlyParams | None = None,
) -> VerifyOutput:
    """Verify a batch of drafts against the target under a verification policy (None = standard).

    The rules are those of docs/verification.md.

    Args:
        draft_token_ids: [B, K] int64; entries at positions >= K_b are padding and ignored.
        target_probs: [B, K+1, V] processed target probabilities; row K_b is the bonus row.
        draft_probs: [B, K, V] draft probabilities, or None for a drafter without them (Q_i(d_i) = 1).
        greedy: [B] bool, rows that use greedy (target-argmax) acceptance.
        policy: None (or StandardVerification()) for standard, lossless verification; FlyParams or
            TypicalParams (or any other registered VerificationPolicy) for a lossy one.
        lossless_before: [B] int64 >= 0: positions i < lossless_before[b] are decided natively (never
            forgiven), and a rejection there is recovered as standard verification would; None = 0.
        num_draft_tokens: [B] int64 K_b <= K; None means K for every row.
        uniform: [B, K] float64 in (0, 1) for the p/q test (0 is tolerated: a token the target gives
            probability 0 is never accepted natively); None draws it from `generator`.
        generator: torch.Generator for whatever of `uniform` and `sample_uniform` is not given.
        sample_uniform: [B] float64 in [0, 1) used to draw each random row's recovered or bonus token by
            inverse CDF; None draws it from `generator` (after `uniform`).
        fly: the older spelling of `policy=FlyParams(...)`, kept for callers written against it; giving
            both is an error.

    Returns:
        VerifyOutput with token_ids [B, K+1], num_accepted [B], num_forgiven [B] and forgiven [B, K].
    """
    if fly is not None:
        if policy is not None:
            raise ValueError("verify: pass the policy once, as policy= (fly= is its older alias), not both")
        policy = fly
    policy = _lossy_policy(policy)
    batch = _checked_batch(
        draft_token_ids,
        target_probs,
        draft_probs,
        greedy,
        num_draft_tokens,
        uniform,
        sample_uniform,
        lossless_before,
    )
    device = target_probs.device
    if uniform is None:
        uniform = torch.rand(batch.draft.shape, generator=generator, dtype=torch.float64, device=device)
    uniform = uniform.to(device=device, dtype=torch.float64)
    # Past the lossless prefix a policy may forgive, and recover by its own rule.
    prefix = None
    if policy is not None and lossless_before is not None:
        prefix = lossless_before.to(device=device, dtype=torch.int64)

    p_draft, q_draft = _draft_token_probs(batch)
    target_argmax = first_argmax(target_probs) if bool(batch.greedy.any()) else None  # [B, K+1]
    ok = _native_decisions(batch, p_draft, q_draft, uniform, target_argmax)
    forgiven, kept = _forgive(policy, batch, ok, p_draft, q_draft, prefix)
    accepted = _num_accepted(batch, kept)
    forgiven &= batch.positions < accepted.unsqueeze(1)
    by_argmax = _recovered_by_argmax(policy, batch, accepted, prefix)
    final = _final_tokens(batch, accepted, target_argmax, sample_uniform, generator, by_argmax)
    return _outputs(batch, accepted, final, forgiven)


def _draft_token_probs(batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """P_i(d_i) and Q_i(d_i) by gather, [B, K] float64 each; Q = 1 for a drafter without probabilities."""
    k = batch.draft.shape[1]
    draft = batch.draft.unsqueeze(2)
    p_draft = batch.target_probs[:, :k].gather(2, draft).squeeze(2).to(torch.float64)
    if batch.draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        device = batch.target_probs.device
        q_draft = batch.draft_probs.gather(2, draft).squeeze(2).to(device=device, dtype=torch.float64)
    return p_draft, q_draft


def _native_decisions(
    batch: _Batch,
    p_draft: torch.Tensor,
    q_draft: torch.Tensor,
    uniform: torch.Tensor,
    target_argmax: torch.Tensor | None,
) -> torch.Tensor:
    """[B, K] bool: standard verification's accepts, by the p/q test or, on greedy rows, the argmax."""
    # p > 0 makes u = 0 harmless; for u in (0, 1) it is implied by p / q >= u.
    ok_random = (q_draft > 0) & (p_draft > 0) & (p_draft / q_draft.clamp_min(1e-300) >= uniform)
    if target_argmax is not None:
        k = batch.draft.shape[1]
        ok = torch.where(batch.greedy.unsqueeze(1), batch.draft == target_argmax[:, :k], ok_random)
    else:
        ok = ok_random
    ok &= batch.valid  # padding counts as rejected (it never matters after)
    return ok


def _forgive(
    policy: VerificationPolicy | None,
    batch: _Batch,
    ok: torch.Tensor,
    p_draft: torch.Tensor,
    q_draft: torch.Tensor,
    prefix: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The native rejections a lossy policy forgives and the positions kept, both [B, K] bool."""
    if policy is None:
        return torch.zeros_like(ok), ok
    greedy, valid, positions = batch.greedy, batch.valid, batch.positions
    candidates = valid & ~ok & (p_draft > 0) & (greedy.unsqueeze(1) | (q_draft > 0))
    if prefix is not None:
        candidates &= positions.unsqueeze(0) >= prefix.unsqueeze(1)
    k = batch.draft.shape[1]
    drafts = Drafts(
        ok, valid, candidates, batch.lengths, positions, p_draft, q_draft, batch.target_probs[:, :k]
    )
    forgiven = policy.forgiven(drafts) & candidates  # no policy forgives outside the candidates
    return forgiven, ok | forgiven


def _num_accepted(batch: _Batch, kept: torch.Tensor) -> torch.Tensor:
    """a: [B] int64, the first position not kept, or K_b."""
    k = batch.draft.shape[1]
    not_kept = batch.valid & ~kept
    first_reject = (
        torch.where(not_kept, batch.positions, k).amin(dim=1) if k else torch.zeros_like(batch.lengths)
    )
    return torch.minimum(first_reject, batch.lengths)


def _recovered_by_argmax(
    policy: VerificationPolicy | None, batch: _Batch, accepted: torch.Tensor, prefix: torch.Tensor | None
) -> torch.Tensor | None:
    """[B] bool: the random rows whose recovered token is the target's argmax, or None for none."""
    if policy is None or not policy.recovered_by_argmax:
        return None
    # A policy's rule applies to a rejection past the lossless prefix only.
    by_argmax = ~batch.greedy & (accepted < batch.lengths)
    if prefix is not None:
        by_argmax &= accepted >= prefix
    return by_argmax


def _outputs(
    batch: _Batch, accepted: torch.Tensor, final: torch.Tensor, forgiven: torch.Tensor
) -> VerifyOutput:
    """VerifyOutput: the kept draft tokens, then the final token at a, then -1 padding; and the counts."""
    b, k = batch.draft.shape
    device = batch.draft.device
    token_ids = torch.full((b, k + 1), -1, dtype=torch.int64, device=device)
    token_ids[:, :k] = torch.where(batch.positions < accepted.unsqueeze(1), batch.draft, -1)
    token_ids[torch.arange(b, device=device), accepted] = final
    return VerifyOutput(
        token_ids=token_ids, num_accepted=accepted, num_forgiven=forgiven.sum(dim=1), forgiven=forgiven
    )


def _final_tokens(
    batch: _Batch,
    accepted: torch.Tensor,
    target_argmax: torch.Tensor | None,
    sample_uniform: torch.Tensor | None,
    generator: torch.Generator | None,
    by_argmax: torch.Tensor | None,
) -> torch.Tensor:
    """The recovered (a < K_b) or bonus (a == K_b) token of every row: [B] int64. Greedy rows, and random
    rows marked in `by_argmax` ([B] bool, or None), take the target's argmax at a; the others draw."""
    target_probs, draft_probs, draft = batch.target_probs, batch.draft_probs, batch.draft
    lengths, greedy = batch.lengths, batch.greedy
    b, k = draft.shape
    device = target_probs.device
    rows = torch.arange(b, device=device)
    final = torch.zeros(b, dtype=torch.int64, device=device)
    if target_argmax is not None:
        final = target_argmax[rows, accepted]
    random_rows = (~greedy).nonzero().squeeze(1)
    if sample_uniform is None and len(random_rows):
        # Drawn for every random row, argmax ones too, so that the generator's stream does not depend on
        # which rows a policy recovers by argmax.
        sample_uniform = torch.rand(b, generator=generator, dtype=torch.float64, device=device)
    if by_argmax is not None and bool(by_argmax.any()):
        picked = by_argmax.nonzero().squeeze(1)
        final[picked] = first_argmax(target_probs[picked, accepted[picked]])
        random_rows = (~greedy & ~by_argmax).nonzero().squeeze(1)
    if not len(random_rows):
        return final

    at = accepted[random_rows]
    rejected = at < lengths[random_rows]
    # [R, V] weights at the one position per row that needs them, built in place to keep passes few; at
    # least float32, as P - Q in bfloat16 would lose most of the residual's precision.
    weights = target_probs[random_rows, at].to(torch.promote_types(target_probs.dtype, torch.float32))
    if rejected.any():
        at_draft = at.clamp(max=k - 1)
        if draft_probs is None:
            # Q is a point mass on d_a: the residual is P_a with d_a zeroed.
            hit = rejected.nonzero().squeeze(1)
            weights[hit, draft[random_rows[hit], at_draft[hit]]] = 0.0
        else:
            q_at = draft_probs[random_rows, at_draft]
            if not bool(rejected.all()):
                q_at.masked_fill_(~rejected.unsqueeze(1), 0.0)  # bonus rows keep P
            weights.sub_(q_at).clamp_min_(0.0)
        # All-zero residual (P_a <= Q_a everywhere, or P_a one-hot on d_a): fall back to P_a.
        empty = rejected & (weights.sum(dim=1) <= 0)
        if empty.any():
            weights[empty] = target_probs[random_rows[empty], at[empty]].to(weights.dtype)
    try:
        final[random_rows] = inverse_cdf_sample(weights, sample_uniform.to(device)[random_rows])
    except ValueError as exc:
        raise ValueError(
            f"target_probs has a row with no positive probability where a token is drawn: {exc}"
        ) from exc
    return final

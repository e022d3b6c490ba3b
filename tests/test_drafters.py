"""Drafters: n-gram prompt lookup, and the draft-model drafter's batched, ragged catch-up passes with the
draft-cache lengths it owns (prefill, propose, commit)."""

from __future__ import annotations

import torch
import transformers

from flyspec.engine.drafters.draft_model import DraftModelDrafter
from flyspec.engine.drafters.ngram import NgramDrafter, ngram_continuation
from flyspec.engine.kv_blocks import BlockManager
from flyspec.engine.model_runner import ModelRunner
from flyspec.engine.sequence import Sequence
from flyspec.models.llama import ForwardBatch, LlamaForCausalLM
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.sampling import inverse_cdf_sample, process_logits

VOCAB = 97


def test_ngram_prefers_the_longest_match() -> None:
    """The last 3 tokens (1 2 3) occur once; the last 2 (2 3) occur earlier too: the 3-gram wins."""
    tokens = [2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert ngram_continuation(tokens, k=3, min_n=2, max_n=4) == [4, 5, 6]
    assert ngram_continuation(tokens, k=3, min_n=2, max_n=2) == [9, 9, 1]  # earliest 2-gram match


def test_ngram_returns_fewer_or_no_tokens() -> None:
    """A match near the end yields fewer than K tokens; no match (or too short a sequence) yields none."""
    assert ngram_continuation([5, 6, 7, 5, 6], k=4, min_n=2, max_n=3) == [7, 5, 6]
    assert ngram_continuation([1, 2, 3, 4, 5], k=4, min_n=2, max_n=3) == []
    assert ngram_continuation([1], k=4, min_n=1, max_n=3) == []
    assert ngram_continuation([4, 4], k=4, min_n=1, max_n=3) == [4]


def test_ngram_drafter_batches_ragged_rows() -> None:
    """Rows get their own K_b (0 when nothing matches) and padding beyond K_b; no probabilities."""
    seqs = [
        Sequence("a", None, [1, 2, 3, 1, 2], SamplingParams(), 0, frozenset()),
        Sequence("b", None, [1, 2, 3, 4], SamplingParams(), 0, frozenset()),
    ]
    prop = NgramDrafter(num_speculative_tokens=2, min_n=1, max_n=3).propose(seqs)
    assert prop.probs is None
    assert prop.num_tokens.tolist() == [2, 0]
    assert prop.token_ids.tolist() == [[3, 1], [0, 0]]


def _tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def _reference_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Last-position logits from a fresh, unbatched forward of the whole sequence."""
    cache = model.new_cache(8, 16)
    batch = ForwardBatch(torch.tensor([list(range(8))]), torch.tensor([0]), torch.tensor([len(tokens)]))
    hidden = model(torch.tensor([tokens]), batch, cache)
    return model.compute_logits(hidden[0, -1])


def _prefilled(
    drafter: DraftModelDrafter, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[Sequence]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = []
    blocks = BlockManager(drafter.runner.cache.num_blocks, drafter.runner.cache.block_size)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        seq = Sequence(f"r{i}", None, prompt, p, i, frozenset())
        seq.start()
        assert blocks.allocate(seq.block_table, 128)
        seqs.append(seq)
    drafter.prefill(seqs, [s.prompt_token_ids for s in seqs], [0] * len(seqs))
    for s in seqs:
        s.num_computed = s.num_prompt_tokens
        s.output_token_ids.append(5)  # the first generated token: not yet seen by the draft
    return seqs


def test_greedy_draft_equals_sequential_argmax_and_catches_up() -> None:
    """Greedy drafts of ragged rows equal token-by-token argmax decoding of the draft model, the first
    pass catches up the unseen tokens, and after a rollback the next proposal catches up again."""
    model = _tiny_model(0)
    k = 4
    drafter = DraftModelDrafter(ModelRunner(model, num_blocks=24, block_size=16), k, sample_method=None)
    seqs = _prefilled(drafter, [[3, 4, 5, 6, 7], [9, 8], [11, 12, 13]], SamplingParams(temperature=0))
    for _ in range(2):
        prop = drafter.propose(seqs, torch.rand(len(seqs), k, dtype=torch.float64))
        for b, seq in enumerate(seqs):
            tokens = list(seq.token_ids)
            expected = []
            for _ in range(k):
                expected.append(int(_reference_logits(model, tokens).argmax()))
                tokens.append(expected[-1])
            assert prop.token_ids[b].tolist() == expected
        assert prop.probs is None  # deterministic drafts: verification needs no q
        # Engine-like commit: keep the first draft token plus one new token, roll the draft cache back.
        drafter.commit(seqs, [1] * len(seqs))
        for b, seq in enumerate(seqs):
            seq.output_token_ids += [int(prop.token_ids[b, 0]), 17]


def test_probabilistic_draft_uses_each_rows_uniforms_and_keeps_q() -> None:
    """Probabilistic drafting returns q = the request's processed draft distribution and the token
    drawn from it by inverse CDF with the row's own uniform; in the same batch a greedy request drafts
    the argmax with a one-hot q."""
    model = _tiny_model(1)
    runner = ModelRunner(model, num_blocks=24, block_size=16)
    drafter = DraftModelDrafter(runner, 2, sample_method=None)
    params = SamplingParams(temperature=0.8, top_k=20)
    seqs = _prefilled(
        drafter, [[3, 4, 5], [6, 7, 8, 9], [10, 11]], [params, params, SamplingParams(temperature=0)]
    )
    u = torch.tensor([[0.1, 0.9], [0.5, 0.3], [0.5, 0.5]], dtype=torch.float64)
    prop = drafter.propose(seqs, u)
    for b, seq in enumerate(seqs[:2]):
        tokens = list(seq.token_ids)
        for j in range(2):
            q = process_logits(
                _reference_logits(model, tokens)[None],
                torch.tensor([0.8]),
                torch.tensor([20]),
                torch.tensor([1.0]),
            )[0]
            torch.testing.assert_close(prop.probs[b, j], q, atol=1e-5, rtol=1e-4)
            token = int(inverse_cdf_sample(q[None], u[b, j : j + 1])[0])
            assert int(prop.token_ids[b, j]) == token
            tokens.append(token)
    tokens = list(seqs[2].token_ids)
    for j in range(2):
        tokens.append(int(_reference_logits(model, tokens).argmax()))
        assert int(prop.token_ids[2, j]) == tokens[-1]
    assert torch.equal(prop.probs[2], torch.nn.functional.one_hot(prop.token_ids[2], VOCAB).float())
    assert DraftModelDrafter(runner, 2, "greedy").drafts_greedily(seqs[0])
    assert not DraftModelDrafter(runner, 2, None).drafts_greedily(seqs[0])

"""Choosing the drafter a speculative config asks for (the one place that knows the drafter classes)."""

from __future__ import annotations

import logging

from flyspec.config import SpeculativeConfig
from flyspec.engine.drafters.base import Drafter
from flyspec.engine.drafters.cross_vocab import CrossVocabDrafter
from flyspec.engine.drafters.draft_model import DraftModelDrafter
from flyspec.engine.drafters.ngram import NgramDrafter
from flyspec.engine.drafters.vocab_map import VocabMap
from flyspec.engine.kv_blocks import BlockManager
from flyspec.engine.model_runner import ModelRunner
from flyspec.engine.timing import PartTimer
from flyspec.models.loader import LoadedModel

logger = logging.getLogger("flyspec.engine")


def build_drafter(
    spec: SpeculativeConfig,
    target: LoadedModel,
    draft: LoadedModel | None,
    *,
    blocks: BlockManager,
    max_model_len: int,
    timer: PartTimer,
) -> Drafter:
    """The drafter for `spec`: n-gram lookup, or the loaded `draft` model (Token-Level Intersection when
    its vocabulary differs from the target's). `blocks` are the target's KV blocks: a draft model's cache
    gets as many (the engine sized them for both). `timer` times the draft model's forward passes."""
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return NgramDrafter(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    assert draft is not None, "method='draft_model' needs the loaded draft model"
    runner = ModelRunner(draft.model, blocks.num_blocks, blocks.block_size, timer=timer)
    if _same_vocabulary(target, draft):
        # The target's block tables address the draft's cache too: a freed block is freed in both.
        blocks.add_release_hook(runner.cache.release)
        return DraftModelDrafter(runner, k, spec.draft_sample_method)
    return _cross_vocab(spec, target, draft, runner, max_model_len)


def _cross_vocab(
    spec: SpeculativeConfig, target: LoadedModel, draft: LoadedModel, runner: ModelRunner, max_model_len: int
) -> CrossVocabDrafter:
    if spec.draft_sample_method == "probabilistic":
        raise ValueError(
            f"draft_sample_method='probabilistic' is invalid: the draft model {draft.path} has a "
            f"different vocabulary from the target {target.path}, and cross-vocabulary drafting "
            "(Token-Level Intersection) drafts greedily only; set draft_sample_method='greedy' or leave "
            "it unset"
        )
    vocab_map = VocabMap(target.tokenizer, draft.tokenizer, target.model.vocab_size, draft.model.vocab_size)
    # The draft may need more tokens than the target for the same text, up to this many per request; its
    # blocks are its own (positions differ from the target's), as many as the target has.
    max_len = min(2 * max_model_len, draft.model.max_position_embeddings)
    logger.info(
        "cross-vocabulary draft %s: Token-Level Intersection of %d of its %d token ids with the target's "
        "%d; drafting greedily",
        draft.path,
        vocab_map.size,
        draft.model.vocab_size,
        target.model.vocab_size,
    )
    return CrossVocabDrafter(runner, spec.num_speculative_tokens, vocab_map, max_len)


def _same_vocabulary(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether the draft shares the target's vocabulary: same vocab_size and same token -> id map."""
    return (
        target.model.vocab_size == draft.model.vocab_size
        and target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    )

"""Choosing the drafter a speculative config asks for (the one place that knows the drafter classes)."""

from __future__ import annotations

import logging

from flyspec.config import SpeculativeConfig
from flyspec.engine.drafters.base import Drafter
from flyspec.engine.drafters.cross_vocab import CrossVocabDrafter
from flyspec.engine.drafters.draft_model import DraftModelDrafter
from flyspec.engine.drafters.ngram import NgramDrafter
from flyspec.engine.drafters.vocab_map import VocabMap
from flyspec.engine.model_runner import ModelRunner
from flyspec.engine.timing import PartTimer
from flyspec.models.loader import LoadedModel

logger = logging.getLogger("flyspec.engine")


def build_drafter(
    spec: SpeculativeConfig,
    target: LoadedModel,
    draft: LoadedModel | None,
    *,
    num_slots: int,
    max_model_len: int,
    timer: PartTimer,
) -> Drafter:
    """The drafter for `spec`: n-gram lookup, or the loaded `draft` model (Token-Level Intersection when
    its vocabulary differs from the target's). `timer` times the draft model's forward passes."""
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return NgramDrafter(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    assert draft is not None, "method='draft_model' needs the loaded draft model"
    if _same_vocabulary(target, draft):
        # Verification writes up to K positions past the last kept token, as in the target's cache.
        runner = ModelRunner(draft.model, num_slots, max_model_len + k + 1, timer=timer)
        return DraftModelDrafter(runner, k, spec.draft_sample_method)
    return _cross_vocab(spec, target, draft, num_slots, max_model_len, timer)


def _cross_vocab(
    spec: SpeculativeConfig,
    target: LoadedModel,
    draft: LoadedModel,
    num_slots: int,
    max_model_len: int,
    timer: PartTimer,
) -> CrossVocabDrafter:
    if spec.draft_sample_method == "probabilistic":
        raise ValueError(
            f"draft_sample_method='probabilistic' is invalid: the draft model {draft.path} has a "
            f"different vocabulary from the target {target.path}, and cross-vocabulary drafting "
            "(Token-Level Intersection) drafts greedily only; set draft_sample_method='greedy' or leave "
            "it unset"
        )
    vocab_map = VocabMap(target.tokenizer, draft.tokenizer, target.model.vocab_size, draft.model.vocab_size)
    # The draft may need more tokens than the target for the same text; its cache grows on demand.
    cache_len = min(2 * max_model_len, draft.model.max_position_embeddings)
    runner = ModelRunner(draft.model, num_slots, cache_len, timer=timer)
    logger.info(
        "cross-vocabulary draft %s: Token-Level Intersection of %d of its %d token ids with the target's "
        "%d; drafting greedily",
        draft.path,
        vocab_map.size,
        draft.model.vocab_size,
        target.model.vocab_size,
    )
    return CrossVocabDrafter(runner, spec.num_speculative_tokens, vocab_map)


def _same_vocabulary(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether the draft shares the target's vocabulary: same vocab_size and same token -> id map."""
    return (
        target.model.vocab_size == draft.model.vocab_size
        and target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    )

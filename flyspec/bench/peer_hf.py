"""The Hugging Face transformers peer: its own `generate` (target-only) and assisted generation.

What a user would run instead of flyspec, in the same process, on the same token ids and the same weight
dtype: `AutoModelForCausalLM.generate` with greedy decoding, and assisted generation with the same
drafter and the same K at batch 1. "Same K" means a constant schedule and no confidence-based early stop
(transformers' defaults adapt K per step), so both engines draft exactly K tokens per step; an "ngram"
drafter maps to transformers' prompt lookup decoding with the same K.

Besides the tokens, each call reports how many target forward passes it made (a forward pre-hook), so
tokens per target forward can be compared with flyspec's mean acceptance length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flyspec.assets import resolve_model
from flyspec.bench.sweep import NGRAM
from flyspec.config import DEFAULT_PROMPT_LOOKUP_MAX


@dataclass
class PeerOutput:
    """One peer generation: the new token ids and the number of target forward passes it took."""

    token_ids: list[int]
    target_forwards: int


def _load(name_or_path: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    path = resolve_model(name_or_path)
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


class HFPeer:
    """transformers models for one target (and its drafters), loaded on first use."""

    def __init__(self, target: str, dtype: torch.dtype, device: str) -> None:
        self.target_name = target
        self.dtype = dtype
        self.device = device
        self._target: Any = None
        self._drafts: dict[str, Any] = {}
        self._forwards = 0

    @property
    def loaded_paths(self) -> list[str]:
        """Resolved paths of the models loaded so far (for the report)."""
        names = [self.target_name] if self._target is not None else []
        return [str(Path(resolve_model(n))) for n in names + list(self._drafts)]

    def _target_model(self) -> Any:
        if self._target is None:
            self._target = _load(self.target_name, self.dtype, self.device)
            self._target.register_forward_pre_hook(self._count_forward)
        return self._target

    def _count_forward(self, *_args: Any) -> None:
        self._forwards += 1

    def _draft_model(self, name: str) -> Any:
        if name not in self._drafts:
            self._drafts[name] = _load(name, self.dtype, self.device)
        return self._drafts[name]

    def load(self, drafter: str | None) -> None:
        """Load the target and, if given, a draft model now (so load time stays out of the timings)."""
        self._target_model()
        if drafter is not None and drafter != NGRAM:
            self._draft_model(drafter)

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool, drafter: str | None, k: int | None
    ) -> PeerOutput:
        """Greedy generation of up to `max_tokens` new tokens for one prompt.

        drafter None: plain `generate`; a draft model: assisted generation with exactly `k` draft tokens
        per step; "ngram": prompt lookup decoding with `k` tokens.
        """
        from transformers import GenerationConfig

        model = self._target_model()
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_tokens)
        kwargs: dict[str, Any] = {}
        if ignore_eos:
            kwargs["eos_token_id"] = (
                None  # applied after the model's defaults, so generation never stops early
            )
        if drafter == NGRAM:
            kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=DEFAULT_PROMPT_LOOKUP_MAX)
        elif drafter is not None:
            assistant = self._draft_model(drafter)
            # transformers reads these from the assistant's own generation config on every call.
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = assistant
        input_ids = torch.tensor([prompt_ids], dtype=torch.int64, device=self.device)
        self._forwards = 0
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            use_model_defaults=False,  # exactly the config above (plus the model's special tokens)
            **kwargs,
        )
        return PeerOutput(out[0, len(prompt_ids) :].tolist(), self._forwards)

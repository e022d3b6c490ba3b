"""Structured output: grammars compiled by llguidance, and the token masks they put on the target.

llguidance (the Rust grammar engine vLLM uses as its "guidance" backend) was chosen over xgrammar because
it is one 3 MB wheel with no dependencies, while xgrammar pulls triton and a TVM runtime; both compute
the same thing, a per-token allowed mask from a JSON schema, regex or context-free grammar.

Under speculative decoding the mask must hold at every verified position, not only at the first: for a
row with drafts d_0 .. d_{K-1}, position j is masked by the grammar state after d_0 .. d_{j-1}. llguidance
computes all K + 1 masks in one call, advancing a matcher through the drafts and rolling it back, so the
matcher only ever holds committed tokens. After a draft the grammar forbids, later positions get no mask:
that draft has probability 0, so verification never accepts or forgives it and never reaches them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from typing import Any

import torch

from flyspec.sampling_params import StructuredOutputsParams
from flyspec.spec_decode.logits_processors import unpack_bitmask


class GrammarMatcher:
    """One request's position in its grammar: consumes committed tokens, never drafts."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token: int) -> None:
        """Consume a committed token; ValueError if the grammar does not allow it (it never should: the
        mask gave it probability 0)."""
        if not self._matcher.consume_token(token):
            raise ValueError(f"the grammar rejected token {token}: {self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """True when the grammar is complete and allows no further token (end-of-sequence only)."""
        return bool(self._matcher.is_stopped())

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (for the samples of an n > 1 request)."""
        return GrammarMatcher(self._matcher.deep_copy())


class Grammars:
    """Compiles StructuredOutputsParams into matchers and computes their masks for one model's tokenizer.

    The llguidance tokenizer is built on first use (about a second for a 50k vocabulary), so engines
    that never see a structured request never pay for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._executor: Any = None

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            except ValueError as exc:
                raise ValueError(
                    f"structured_outputs: this model's tokenizer cannot drive a grammar ({exc}); a fast "
                    "(tokenizer.json) byte-level or sentencepiece tokenizer is needed"
                ) from None
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for `spec`; ValueError naming the field when the grammar does not compile."""
        import llguidance

        field, grammar = _grammar_text(spec)
        tokenizer = self._ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{field}: the grammar does not compile: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{field}: {matcher.get_error()}")
        return GrammarMatcher(matcher)

    def masks(
        self, matchers: Seq[GrammarMatcher], drafts: Seq[Seq[int]], device: torch.device
    ) -> torch.Tensor:
        """Allowed-token masks [sum(len(drafts[i]) + 1), V] bool: for matcher i, its current state and
        then the state after each prefix of drafts[i] (the matchers end where they started)."""
        self._ll_tokenizer()
        num_rows = sum(len(d) + 1 for d in drafts)
        bitmask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        plain, with_drafts, row = [], [], 0
        for m, d in zip(matchers, drafts, strict=True):
            if d:
                with_drafts.append((m._matcher, row, list(d)))
            else:
                plain.append((m._matcher, row))
            row += len(d) + 1
        # One parallel call per kind (the draft-token variant needs at least one draft per matcher). The
        # executor writes each row straight into the tensor's memory, as llguidance.torch does; that module
        # is not imported because it pulls torch.compile's stack (seconds of import time).
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, num_rows)
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                with_drafts, bitmask.data_ptr(), row_bytes, num_rows
            )
        for m in matchers:
            if m._matcher.is_error():
                raise ValueError(f"the grammar failed: {m._matcher.get_error()}")
        return unpack_bitmask(bitmask.to(device), self.vocab_size)


def _grammar_text(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(the field that carries the constraint, its llguidance grammar)."""
    import llguidance

    compile_ = llguidance.LLMatcher
    if spec.json is not None:
        return "json", compile_.grammar_from_json_schema(spec.json)
    if spec.json_object:
        return "json_object", compile_.grammar_from_json_schema({"type": "object"})
    if spec.regex is not None:
        return "regex", compile_.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # JSON string literals are valid Lark string literals, escapes included.
        return "choice", compile_.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choice)
        )
    assert spec.grammar is not None
    return "grammar", compile_.grammar_from_lark(spec.grammar)

"""Structured output: grammars compiled by llguidance, and the token masks they put on the target.

llguidance (the Rust grammar engine vLLM uses as its "guidance" backend) was chosen over xgrammar because
it is one 3 MB wheel with no dependencies, while xgrammar pulls triton and a TVM runtime; both compute
the same thing, a per-token allowed mask from a JSON schema, regex or context-free grammar.

Under speculative decoding the mask must hold at every verified position, not only at the first: for a
row with drafts d_0 .. d_{K-1}, position j is masked by the grammar state after d_0 .. d_{j-1}. llguidance
computes all K + 1 masks in one call, advancing a matcher through the drafts and rolling it back, so the
matcher only ever holds committed tokens. After a draft the grammar forbids, later positions get no mask:
that draft has probability 0, so verification never accepts or forgives it and never reaches them.

The grammar sees each token as the bytes it stands for. For byte-level BPE vocabularies (GPT-2, Llama 3,
Qwen, SmolLM) those bytes come from the vocabulary through the byte decoder, the inverse of the
byte-to-character map the pre-tokenizer applies before BPE, so they are right whatever decoder a
tokenizer folder declares (a folder converted from GGUF may declare a sentencepiece-style decoder, which
made llguidance read `é` as the two characters `Ã©`). Other vocabularies (sentencepiece) go through
llguidance's own reading of the tokenizer. Either way the vocabulary is checked against the tokenizer on
text with accents, CJK and emoji before any grammar runs on it.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from functools import cache
from typing import Any

import torch

from flyspec.sampling_params import StructuredOutputsParams
from flyspec.spec_decode.logits_processors import unpack_bitmask

GRAMMAR_FAILED = "the grammar failed while generating (too complex for the grammar engine's limits)"
"""How a grammar that compiled but broke llguidance's limits on a later token is reported."""
_LIMITS = ("LexerTooComplex", "ParserTooComplex")


class GrammarMatcher:
    """One request's position in its grammar: consumes committed tokens, never drafts. `field` names the
    StructuredOutputsParams field the grammar came from, for error messages."""

    def __init__(self, matcher: Any, field: str) -> None:
        self._matcher = matcher
        self.field = field

    def accept(self, token: int) -> None:
        """Consume a committed token; ValueError if the grammar does not allow it (it never should: the
        mask gave it probability 0) or if llguidance gives up on the grammar at it (its resource limits)."""
        if not self._matcher.consume_token(token):
            full = self._matcher.get_error()
            # llguidance's stop_reason() can say InternalError where its report says which limit it hit.
            if self._matcher.stop_reason() in _LIMITS or any(f"Stop: {r}" in full for r in _LIMITS):
                raise ValueError(f"structured_outputs.{self.field}: {GRAMMAR_FAILED}: {_first_line(full)}")
            raise ValueError(f"the grammar rejected token {token}: {_first_line(full)}")

    @property
    def is_finished(self) -> bool:
        """True when the grammar is complete and allows no further token (end-of-sequence only)."""
        return bool(self._matcher.is_stopped())

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (for the samples of an n > 1 request)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.field)


class Grammars:
    """Compiles StructuredOutputsParams into matchers and computes their masks for one model's tokenizer.

    The llguidance tokenizer is built on first use, so engines that never see a structured request never
    pay for it. Compiled grammars are kept (the last `cache_size`, by grammar text) as matchers that have
    computed their first mask, which is where llguidance builds its lexer: `compile()` may run on another
    thread (the server compiles on a worker, within a time budget, before the request reaches the engine),
    and `matcher()` on the engine thread then only forks the compiled one. All methods are thread-safe.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int], cache_size: int = 16
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._executor: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = ll_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def prepare(self) -> None:
        """Build the llguidance tokenizer now (about a second for a 150k vocabulary) rather than at the
        first compile; ValueError when the tokenizer cannot drive a grammar."""
        self._ll_tokenizer()

    def compile(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for `spec` whose first mask is computed; ValueError naming the field when the
        grammar does not compile. Keeps it, so that `matcher(spec)` afterwards costs a copy."""
        import llguidance

        field, grammar = _grammar_text(spec)
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return GrammarMatcher(compiled.deep_copy(), field)
        tokenizer = self._ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{field}: the grammar does not compile: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        # The first mask builds the lexer: for some grammars (nested bounded repeats) that is where all the
        # time goes, so it belongs to compiling, not to the engine's first step.
        matcher.compute_bitmask()
        if matcher.is_error():
            error = _first_line(matcher.get_error())
            raise ValueError(f"structured_outputs.{field}: the grammar does not compile: {error}")
        with self._lock:
            self._compiled[grammar] = matcher
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return GrammarMatcher(matcher.deep_copy(), field)

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for `spec` (a copy of the compiled one when `compile(spec)` ran before);
        ValueError naming the field when the grammar does not compile."""
        return self.compile(spec)

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
                # Past compiling, llguidance fails only on its resource limits: the grammar is too complex.
                error = _first_line(m._matcher.get_error())
                raise ValueError(f"structured_outputs.{m.field}: {GRAMMAR_FAILED}: {error}")
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


# Text every vocabulary must spell byte for byte before a grammar runs on it: accents, CJK, emoji (4-byte
# UTF-8, split across tokens by byte-level vocabularies), spaces and newlines.
_PROBES = ("Hello, world!", " café crème", "naïve Ångström", "東京タワーへ行く", "🙂👍🏽 ok", "a\n\tb  c")


@cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character map, which every byte-level pre-tokenizer applies."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int]) -> Any:
    """The llguidance tokenizer of an HF fast tokenizer over `vocab_size` ids; ValueError when the
    tokenizer cannot drive a grammar (not a fast tokenizer, or a vocabulary that does not spell the probe
    texts back byte for byte)."""
    import llguidance
    import llguidance.hf

    eos = list(eos_token_ids) or None
    try:
        backend = tokenizer.backend_tokenizer
    except AttributeError:
        backend = None
    try:
        if backend is not None and _is_byte_level(backend):
            ll = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_ByteLevelVocabulary(tokenizer, backend, vocab_size)),
                n_vocab=vocab_size,
                eos_token=eos,
            )
        else:
            ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError as exc:
        raise ValueError(
            f"structured_outputs: this model's tokenizer cannot drive a grammar ({exc}); a fast "
            "(tokenizer.json) byte-level or sentencepiece tokenizer is needed"
        ) from None
    # Encode the probes with a copy of the Rust tokenizer: this may run on a server worker thread while
    # the engine thread decodes with `tokenizer`.
    encode = copy.copy(backend).encode if backend is not None else None
    for text in _PROBES:
        if encode is not None:
            ids = encode(text, add_special_tokens=False).ids
        else:
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        spelled = ll.decode_bytes(ids)
        # A sentencepiece vocabulary may spell a text's start with its word-boundary space.
        if spelled not in (text.encode(), b" " + text.encode()):
            raise ValueError(
                "structured_outputs: this model's tokenizer cannot drive a grammar: its vocabulary spells "
                f"{text!r} as {spelled!r}"
            )
    return ll


def _is_byte_level(backend: Any) -> bool:
    """Whether the tokenizer maps text to bytes, and bytes to characters, before its model runs."""
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(step.get("type") == "ByteLevel" for step in steps)


class _ByteLevelVocabulary:
    """What llguidance.TokenizerWrapper reads: every token id's bytes, the special ids, EOS/BOS, and an
    encoder (llguidance tokenizes forced text with it)."""

    def __init__(self, tokenizer: Any, backend: Any, vocab_size: int) -> None:
        decoder = _byte_decoder()
        added = tokenizer.added_tokens_decoder
        self.special_token_ids = sorted(i for i, token in added.items() if token.special and i < vocab_size)
        # Ids the vocabulary lacks (holes, embedding rows padded to a round size) spell nothing.
        self.tokens = [b""] * vocab_size
        for piece, token_id in backend.get_vocab(with_added_tokens=True).items():
            if token_id >= vocab_size:
                continue
            if token_id in added or any(c not in decoder for c in piece):
                self.tokens[token_id] = piece.encode()  # added tokens are matched as their literal text
            else:
                self.tokens[token_id] = bytes(decoder[c] for c in piece)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        # A private copy: llguidance may encode from its own threads while the engine uses its tokenizer.
        self._backend = copy.copy(backend)

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


def _first_line(error: str) -> str:
    """llguidance's error without the parser state and grammar dump that follow it."""
    return error.split("\n", 1)[0]

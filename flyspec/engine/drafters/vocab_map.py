"""Token-Level Intersection (TLI): drafting with a model whose vocabulary differs from the target's.

Mapping. Every token of both tokenizers is normalised to the exact bytes it stands for: byte-level BPE
symbols (GPT-2's byte alphabet, where "Ġ" is a space and "Ċ" a newline) are decoded to their bytes,
SentencePiece pieces have "▁" read as a space and "<0xNN>" as one byte, and an added token (<|im_end|> ...)
stands for its content. A draft token and a target token correspond when their bytes are equal and both
are added tokens or both are ordinary ones (one pair per byte string: the lowest id wins where a
tokenizer has duplicates). Those pairs are the intersection. Draft logits outside it are set to -inf
before the argmax, so every draft token maps to exactly one target id, and the target verifies target
ids as with any other drafter. Drafting is greedy only: the draft's distribution lives on its own tokens
and covers only part of the target's vocabulary, so it is not a proposal distribution over target tokens
that the p/q test could use; a greedy draft is deterministic, and verification treats it exactly.

The draft's view of a request. The draft model never sees target ids: each request keeps a `DraftView`,
the draft's own tokenisation of the committed text, so that the draft runs on text tokenised the way it
was trained. Each step the view takes the target tokens committed since the last step, turns them into
bytes and appends the text. Only new text is tokenised, but BPE merges and pre-tokenizer splits near the
end of the text can change when more text arrives ("Ġthe" + "re" becomes "Ġthere"), so the last two
pre-tokenizer pieces are tokenised again together with the new text; the view then equals the draft
tokenizer's tokenisation of the whole text, while the work per step stays proportional to the new text.
The view reports how many of its leading ids are unchanged; the drafter keeps the longest prefix of its
draft cache (the committed ids plus the drafts it fed back last step) that still matches and recomputes
the rest. So a rejection by the target and a re-tokenisation at the boundary are the same rollback, and
the draft cache always holds a prefix of the view.

Added tokens are not text: a target added token whose content is also an added token of the draft (the
ChatML <|im_start|> / <|im_end|> of both Qwen and SmolLM2) becomes that draft id, a target special token
the draft lacks is left out of the view, and text is tokenised with the draft's special tokens disabled,
so literal text such as "<|im_end|>" never turns into a control token. Bytes that end inside a UTF-8
character are held back until the character completes; meanwhile the view is not `ready` and that
request drafts nothing for the step (invalid UTF-8 reaches the draft as U+FFFD).

Requirements: the draft tokenizer must tokenise a fragment of text into exactly its bytes (byte-level
BPE, as in GPT-2, Llama 3, Qwen and SmolLM2); SentencePiece tokenizers that add a prefix space to every
input are refused with a ValueError. Exactness does not depend on any of this: the target sees only
target ids, and the draft only chooses which target ids to propose.
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import json
import re
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Fragments a lossless draft tokenizer gives back byte for byte (leading spaces, newlines, space runs).
_PROBE_TEXTS = ("a b", " x\n\n  y")


@cache
def _byte_level_table() -> dict[int, str]:
    """str.translate table from GPT-2's byte-level alphabet back to bytes (as latin-1 characters)."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {ord(symbol): chr(b) for b, symbol in bytes_to_unicode().items()}


def _component_types(node: Any) -> set[str]:
    """Every "type" named anywhere in a tokenizer component's JSON (sequences nest)."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        for value in node.values():
            found |= _component_types(value)
        return found
    if isinstance(node, list):
        return set().union(*(_component_types(v) for v in node)) if node else set()
    return set()


def _is_byte_level(backend: Any) -> bool:
    """Whether a Rust tokenizer's pre-tokenizer or decoder is (or contains) ByteLevel."""
    components = (backend.pre_tokenizer, backend.decoder)
    return any("ByteLevel" in _component_types(json.loads(c.__getstate__())) for c in components if c)


def _token_bytes(tokenizer: Any) -> tuple[list[bytes | None], dict[int, str], set[int]]:
    """The bytes of every ordinary token id of a fast tokenizer (None where a symbol has no byte
    reading, and for added tokens), the added tokens as id -> content, and which added ids are special."""
    backend = tokenizer.backend_tokenizer
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
    added_tokens = tokenizer.added_tokens_decoder
    size = max([*vocab.values(), *added_tokens.keys(), -1]) + 1
    table: list[bytes | None] = [None] * size
    if _is_byte_level(backend):
        symbols = _byte_level_table()
        for token, i in vocab.items():
            # A symbol outside the alphabet stays above U+00FF and fails latin-1: no byte reading.
            with contextlib.suppress(UnicodeEncodeError):
                table[i] = token.translate(symbols).encode("latin-1")
    else:
        for token, i in vocab.items():
            byte = _BYTE_PIECE.fullmatch(token)
            table[i] = bytes([int(byte.group(1), 16)]) if byte else token.replace("▁", " ").encode()
    added = {i: tok.content for i, tok in added_tokens.items()}
    special = {i for i, tok in added_tokens.items() if tok.special}
    for i in added:
        table[i] = None  # an added token is matched by content, never as text
    return table, added, special


def _first_ids(pairs: Sequence[tuple[bytes, int]]) -> dict[bytes, int]:
    """bytes -> the lowest id standing for them."""
    index: dict[bytes, int] = {}
    for key, i in sorted(pairs, key=lambda p: p[1]):
        index.setdefault(key, i)
    return index


class VocabMap:
    """The intersection of a draft and a target vocabulary, at the id level and at the text level.

    `draft_to_target` [draft_vocab_size] and `target_to_draft` [target_vocab_size] are int64 tensors on
    the CPU with -1 outside the intersection; `allowed` [draft_vocab_size] is the mask of draft ids that
    may be proposed. `DraftView(vocab_map)` follows one request's text in the draft's tokens.
    """

    def __init__(
        self, target_tokenizer: Any, draft_tokenizer: Any, target_vocab_size: int, draft_vocab_size: int
    ) -> None:
        t_bytes, t_added, t_special = _token_bytes(target_tokenizer)
        d_bytes, d_added, _ = _token_bytes(draft_tokenizer)
        self.target_bytes = t_bytes

        t_plain = _first_ids([(b, i) for i, b in enumerate(t_bytes) if b and i < target_vocab_size])
        t_added_ids = _first_ids([(c.encode(), i) for i, c in t_added.items() if i < target_vocab_size])
        d_plain = _first_ids([(b, i) for i, b in enumerate(d_bytes) if b and i < draft_vocab_size])
        d_added_ids = _first_ids([(c.encode(), i) for i, c in d_added.items() if i < draft_vocab_size])
        self.draft_to_target = torch.full((draft_vocab_size,), -1, dtype=torch.int64)
        self.target_to_draft = torch.full((target_vocab_size,), -1, dtype=torch.int64)
        pairs = [
            (d, t_index[key])
            for d_index, t_index in ((d_plain, t_plain), (d_added_ids, t_added_ids))
            for key, d in d_index.items()
            if key in t_index
        ]
        if pairs:
            d_ids, t_ids = torch.tensor(pairs, dtype=torch.int64).unbind(1)
            self.draft_to_target[d_ids] = t_ids
            self.target_to_draft[t_ids] = d_ids
        self.allowed = self.draft_to_target >= 0
        if not bool(self.allowed.any()):
            raise ValueError(
                "the draft and target tokenizers share no token (empty Token-Level Intersection); "
                "cross-vocabulary drafting needs tokenizers over the same text"
            )

        # Text-level conversion of target tokens for DraftView: an added target token becomes the draft's
        # added token of the same content; a special one the draft lacks is dropped; a non-special one
        # the draft lacks is plain text.
        self.target_added: dict[int, int | None] = {}
        self.target_added_text: dict[int, bytes] = {}
        for i, content in t_added.items():
            d = d_added_ids.get(content.encode())
            if d is not None or i in t_special:
                self.target_added[i] = d
            else:
                self.target_added_text[i] = content.encode()
        # A private copy of the draft's Rust tokenizer, so disabling its special tokens for text changes
        # nothing for anyone else.
        from tokenizers import Tokenizer

        self.draft_backend = Tokenizer.from_str(draft_tokenizer.backend_tokenizer.to_str())
        self.draft_backend.encode_special_tokens = True
        self.draft_bytes = d_bytes
        self._check_fragments(draft_tokenizer)

    @property
    def size(self) -> int:
        """Number of draft ids in the intersection."""
        return int(self.allowed.sum())

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids in the intersection (-1 for ids outside it)."""
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    def greedy_pick(self, draft_logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Argmax draft ids [N] of draft logits [N, draft_vocab_size] over the intersection only.

        `allowed`: the mask already on the logits' device (the drafter caches it); default `self.allowed`.
        """
        mask = self.allowed.to(draft_logits.device) if allowed is None else allowed
        return draft_logits.masked_fill(~mask, float("-inf")).argmax(dim=-1)

    def _check_fragments(self, draft_tokenizer: Any) -> None:
        for text in _PROBE_TEXTS:
            ids = self.draft_backend.encode(text, add_special_tokens=False).ids
            got = b"".join(self.draft_bytes[i] or b"?" for i in ids)
            if got != text.encode():
                raise ValueError(
                    f"cross-vocabulary drafting needs a draft tokenizer that tokenises text fragments "
                    f"losslessly (byte-level BPE); {type(draft_tokenizer).__name__} turns {text!r} into "
                    f"{got!r}"
                )


class DraftView:
    """One request's committed text in the draft's tokens, extended incrementally (module docstring).

    `ids`: the draft ids; `num_target`: how many target tokens it has consumed; `ready`: False while
    the committed bytes end inside a UTF-8 character.
    """

    def __init__(self, vocab_map: VocabMap) -> None:
        self.map = vocab_map
        self.ids: list[int] = []
        self.num_target = 0
        # The end of the current text run that may still re-tokenise: its text, and how many of the last
        # entries of `ids` it became.
        self._tail = ""
        self._tail_len = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def ready(self) -> bool:
        """True when every committed byte is in the view (no UTF-8 character is half-committed)."""
        return not self._decoder.getstate()[0]

    def append(self, target_ids: Sequence[int]) -> int:
        """Add newly committed target tokens; return how many leading `ids` are unchanged by it."""
        vmap = self.map
        stable = len(self.ids)
        text: list[str] = []
        for t in target_ids:
            if t in vmap.target_added:
                stable = min(stable, self._add_text("".join(text) + self._decoder.decode(b"", final=True)))
                text.clear()
                self._decoder.reset()
                d = vmap.target_added[t]
                if d is not None:
                    self.ids.append(d)
                # Nothing re-tokenises across a control token.
                self._tail, self._tail_len = "", 0
                continue
            raw = vmap.target_added_text.get(t)
            if raw is None:
                raw = vmap.target_bytes[t] if t < len(vmap.target_bytes) else None
            text.append(self._decoder.decode(raw or b""))
        stable = min(stable, self._add_text("".join(text)))
        self.num_target += len(target_ids)
        return stable

    def _add_text(self, text: str) -> int:
        """Tokenise the tail plus `text` and replace the tail's ids; return the first changed index."""
        if not text:
            return len(self.ids)
        backend = self.map.draft_backend
        full = self._tail + text
        if backend.normalizer is not None:
            # Normalise here (normalisers such as NFC are idempotent), so that token offsets and the
            # pre-tokenizer's piece offsets below index the same string.
            full = backend.normalizer.normalize_str(full)
        encoding = backend.encode(full, add_special_tokens=False)
        first_changed = len(self.ids) - self._tail_len
        self.ids[first_changed:] = encoding.ids
        starts = [start for start, _ in encoding.offsets]
        # Without a pre-tokenizer BPE merges may span the whole run, so all of it stays in the tail.
        cut = 0
        if backend.pre_tokenizer is not None:
            pieces = backend.pre_tokenizer.pre_tokenize_str(full)
            if len(pieces) >= 2:
                # More text can only change the last piece (regex splits look one character ahead at most);
                # keeping two is a margin. A token never crosses a piece boundary, so one starts there.
                cut = bisect.bisect_left(starts, pieces[-2][1][0])
        self._tail = full[starts[cut] :] if cut < len(starts) else ""
        self._tail_len = len(starts) - cut
        return first_changed


def target_tokens_since(prompt: Sequence[int], output: Sequence[int], start: int) -> list[int]:
    """prompt + output from index `start` on, without building the whole list."""
    if start < len(prompt):
        return [*prompt[start:], *output]
    return list(output[start - len(prompt) :])

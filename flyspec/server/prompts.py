"""Prompts to token ids, off the event loop and bounded by what can fit.

All tokenizer work of the handlers runs on the server's worker lanes (flyspec/server/workers.py) with the
server's own tokenizer copy, so a long prompt never stalls /health or the streams of other requests. The
two lanes may use the copy at the same time: every call here only reads it (HF fast tokenizers change
their backend only when asked for truncation or padding, which the server never asks for), and the Rust
tokenizer encodes and decodes concurrently without the GIL.

A prompt must leave room for one generated token within max_model_len. Text much longer than that many
tokens is refused after tokenising a prefix only: prefixes of growing length (cut at whitespace, where
tokenizers start a new piece) are tokenised until one already exceeds the limit, so the work stays
proportional to the limit, not to the text. A prefix cut at a piece boundary never has more tokens than
the whole text; `_PREFIX_MARGIN` tokens of slack cover tokenizers whose pieces are not independent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from flyspec.chat import render_chat
from flyspec.server.errors import OpenAIError
from flyspec.server.workers import Lane, Workers

_T = TypeVar("_T")

_PREFIX_MARGIN = 16
# The first prefix tried holds this many characters per allowed token (English runs about 4 per token).
_CHARS_PER_TOKEN = 8
_GROWTH = 4
# How far back from a prefix's end to look for whitespace to cut at.
_CUT_WINDOW = 256


class PromptTooLong(Exception):
    """A prompt that cannot fit: `at_least` is a lower bound on its token count."""

    def __init__(self, at_least: int) -> None:
        super().__init__(at_least)
        self.at_least = at_least


class PromptEncoder:
    """Tokenises prompts and conversations for the handlers on the worker lanes (the light lane unless a
    call names another)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, workers: Workers) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.workers = workers

    async def _run(self, fn: Callable[[], _T], lane: Lane | None) -> _T:
        return await self.workers.run(fn, lane)

    async def prompt_ids(
        self, prompt: str | list[int], *, add_special_tokens: bool = True, lane: Lane | None = None
    ) -> list[int]:
        """Token ids of a completions prompt (text or ids); 400 when it is empty, out of the vocabulary,
        or cannot leave room for a generated token.

        Text is tokenised as vLLM's completions do it: with the tokenizer's own special tokens when
        `add_special_tokens` (a BOS only where the model's tokenizer adds one, e.g. Llama's, never for
        Qwen or SmolLM2), none otherwise."""
        if isinstance(prompt, str):
            if not prompt:
                raise OpenAIError("prompt: must not be empty", param="prompt")
            try:
                ids = await self._run(lambda: self._encode_bounded(prompt, add_special_tokens), lane)
            except PromptTooLong as exc:
                raise self.too_long(exc.at_least, "prompt") from None
        else:
            if len(prompt) >= self.max_model_len:
                raise self.too_long(len(prompt), "prompt")
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise OpenAIError(
                    f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
            ids = list(prompt)
        if not ids:
            raise OpenAIError("prompt: tokenises to no tokens", param="prompt")
        return ids

    async def chat_ids(
        self,
        messages: list[dict[str, Any]],
        *,
        bounded: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lane: Lane | None = None,
    ) -> list[int]:
        """Token ids of a conversation (and the tools shown to the model) rendered through the chat
        template, with the assistant turn open; `bounded`: 400 unless it leaves room for a generated
        token."""
        field = "messages"
        joined = "\n".join(str(m.get("content") or "") for m in messages)

        def render() -> list[int]:
            if bounded:  # the contents alone must fit (the template only adds tokens) before rendering
                self._check_prefixes(joined, _PREFIX_MARGIN + 2 * len(messages))
            return render_chat(self.tokenizer, messages, tools=tools)[0]

        try:
            ids = await self._run(render, lane)
        except PromptTooLong as exc:
            raise self.too_long(exc.at_least, field) from None
        except ValueError as exc:
            raise OpenAIError(f"{field}: {exc}", param=field) from None
        if bounded and len(ids) >= self.max_model_len:
            raise self.too_long(len(ids), field)
        return ids

    async def text_ids(self, text: str, *, add_special_tokens: bool, lane: Lane | None = None) -> list[int]:
        """Token ids of any text, unbounded in length (for /tokenize, whose body size is bounded)."""
        return await self._run(lambda: self._encode(text, add_special_tokens), lane)

    async def decode(self, ids: list[int], lane: Lane | None = None) -> str:
        """The text of token ids as the engine decodes output (special tokens skipped)."""
        return await self._run(lambda: self._decode(ids), lane)

    async def token_texts(self, ids: list[int]) -> list[str]:
        """Each token id decoded on its own, special tokens included (as the engine's logprobs spell
        tokens)."""
        return await self._run(lambda: list(self.tokenizer.batch_decode([[t] for t in ids])), None)

    async def token_strs(self, ids: list[int], lane: Lane | None = None) -> list[str]:
        """The vocabulary entry of each token id."""
        return await self._run(lambda: list(self.tokenizer.convert_ids_to_tokens(ids)), lane)

    def too_long(self, num_tokens: int, field: str) -> OpenAIError:
        """The 400 for a prompt of (at least) `num_tokens` tokens that cannot fit."""
        return OpenAIError(
            f"the prompt is {num_tokens} tokens or more, which leaves no room to generate within "
            f"max_model_len={self.max_model_len}",
            param=field,
            code="context_length_exceeded",
        )

    # --- on the worker thread ---

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        encoded = self.tokenizer(text, add_special_tokens=add_special_tokens, return_attention_mask=False)
        return list(encoded.input_ids)

    def _decode(self, ids: list[int]) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        # What tokenizer.decode computes, but through decode_batch, which releases the GIL (decode holds
        # it: 0.4 s for 500,000 ids).
        text = backend.decode_batch([ids], skip_special_tokens=True)[0]
        if self.tokenizer.clean_up_tokenization_spaces:
            text = self.tokenizer.clean_up_tokenization(text)
        return text

    def _encode_bounded(self, text: str, add_special_tokens: bool) -> list[int]:
        self._check_prefixes(text, _PREFIX_MARGIN)
        ids = self._encode(text, add_special_tokens)
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(len(ids))
        return ids

    def _check_prefixes(self, text: str, margin: int) -> None:
        """Raise PromptTooLong when a prefix of `text` already has more than max_model_len + margin
        tokens; tokenises prefixes of growing length only while the text is longer than the prefix."""
        size = _CHARS_PER_TOKEN * self.max_model_len
        while size < len(text):
            cut = _cut_at_whitespace(text, size)
            num_tokens = len(self._encode(text[:cut], False))
            if num_tokens > self.max_model_len + margin:
                raise PromptTooLong(num_tokens - margin)
            size *= _GROWTH


def _cut_at_whitespace(text: str, size: int) -> int:
    """An index near `size` just before a whitespace character that follows a non-whitespace one."""
    for i in range(size, max(0, size - _CUT_WINDOW), -1):
        if text[i].isspace() and not text[i - 1].isspace():
            return i
    return size

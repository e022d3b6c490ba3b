"""Chat prompts: the one place where a conversation becomes token ids through the tokenizer's template.

Every face (the `LLM` API, the CLI, the server, the gate and the benchmarks) renders conversations here,
so they all feed the model the same ids for the same messages.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(
    tokenizer: Any, messages: list[Message], *, tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], str]:
    """Token ids and text of a conversation with the assistant turn opened (add_generation_prompt).

    Raises ValueError when the tokenizer has no chat template or the template rejects the messages
    (templates raise jinja errors for conversations they do not accept, e.g. roles out of order).
    """
    if not has_chat_template(tokenizer):
        raise ValueError("the model's tokenizer has no chat template; send plain prompts instead")
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # jinja's TemplateError and the template's own raise_exception()
        raise ValueError(f"the chat template rejected the messages: {exc}") from None
    # The template already spells out special tokens such as BOS; tokenising with them would double them.
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    return ids, text

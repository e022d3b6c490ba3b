"""vLLM's tokenizer routes' bodies: `/tokenizer_info` and the `/tokenize` answer.

`GET /tokenizer_info` answers what vLLM's does: the tokenizer's configuration (its `init_kwargs`, which
hold tokenizer_config.json's fields: special tokens, `add_bos_token`, `chat_template`, ...) without file
paths, plus `tokenizer_class`. lm-evaluation-harness's `tokenizer_backend=auto` (and `remote`) reads it:
it needs `eos_token`, renders chats with `chat_template`, and tokenises through `/tokenize`.
"""

from __future__ import annotations

import json
from typing import Any

_CHUNK = 1 << 16


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The /tokenizer_info body for an HF tokenizer (computed once: it never changes)."""
    config = {
        key: _json_safe(value)
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if not key.endswith("_file")  # vocab_file, merges_file, tokenizer_file: paths on the server
    }
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None) and "chat_template" not in config:
        config["chat_template"] = tokenizer.chat_template
    return config


def _json_safe(value: Any) -> Any:
    if hasattr(value, "content"):  # AddedToken: its text, as vLLM writes it
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def tokenize_json(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> bytes:
    """The /tokenize answer `{"count", "max_model_len", "tokens", "token_strs"}` as JSON bytes, built a
    chunk at a time: one json.dumps of a million ids would hold the GIL (and so the event loop) for
    about 0.1 s."""
    parts = [f'{{"count":{len(ids)},"max_model_len":{max_model_len},"tokens":[']
    for start in range(0, len(ids), _CHUNK):
        parts.append(("," if start else "") + ",".join(map(str, ids[start : start + _CHUNK])))
    parts.append('],"token_strs":')
    if token_strs is None:
        parts.append("null")
    else:
        parts.append("[")
        for start in range(0, len(token_strs), _CHUNK):
            chunk = json.dumps(token_strs[start : start + _CHUNK], ensure_ascii=False)[1:-1]
            parts.append(("," if start and chunk else "") + chunk)
        parts.append("]")
    parts.append("}")
    return "".join(parts).encode()

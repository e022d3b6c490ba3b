"""Loading a Hugging Face folder's tokenizer the one way every part of flyspec does."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(folder: str | Path, model_type: str | None = None) -> Any:
    """The tokenizer of a Hugging Face folder. transformers 4.57.3+ warns about a Mistral regex bug for
    every local folder it saved itself (our converted zoo models included); only Mistral tokenizers are
    concerned, so the others opt out explicitly. ``model_type`` saves reading the config again."""
    import transformers

    if model_type is None:
        model_type = transformers.AutoConfig.from_pretrained(folder).model_type
    extra = {} if model_type == "mistral" else {"fix_mistral_regex": False}
    return transformers.AutoTokenizer.from_pretrained(folder, **extra)

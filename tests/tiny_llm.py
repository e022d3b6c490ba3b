"""Tiny random-weight Llama-family checkpoints with a real word-level tokenizer, for engine tests.

`save_tiny(path, ...)` writes an HF folder (config, safetensors weights, tokenizer, chat template) that
every loader path reads like a real checkpoint. Vocabulary: 4 special tokens, a few chat words, then
words "w0", "w1", ... up to VOCAB_SIZE ids, so any id the model produces decodes to a word.
`save_tiny(path, byte_level=True)` instead uses a byte-level tokenizer (4 special tokens, then one token
per byte, BYTE_VOCAB_SIZE ids), which can spell any text: a grammar can drive it (structured output).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

VOCAB_SIZE = 256
BYTE_VOCAB_SIZE = 260
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_WORDS = ["user", "assistant", ":"]
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def vocabulary(size: int = VOCAB_SIZE, extra_words: int = 0) -> dict[str, int]:
    """token -> id; `extra_words` shifts the word list to make a different (mismatching) vocabulary."""
    tokens = SPECIALS + CHAT_WORDS
    words = [f"w{i + extra_words}" for i in range(size - len(tokens))]
    return {tok: i for i, tok in enumerate(tokens + words)}


def make_tokenizer(size: int = VOCAB_SIZE, extra_words: int = 0) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer that prepends <s> and splits on whitespace."""
    tok = Tokenizer(models.WordLevel(vocabulary(size, extra_words), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _with_bos_and_chat(tok)


def make_byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges: ids 4..259 are the 256 bytes; prepends <s>."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return _with_bos_and_chat(tok)


def _with_bos_and_chat(tok: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    """`tok` as a transformers tokenizer that prepends <s>, with the special tokens and chat template."""
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(
    path: Path,
    *,
    seed: int,
    arch: str = "llama",
    std: float = 0.15,
    num_layers: int = 2,
    vocab_size: int = VOCAB_SIZE,
    extra_words: int = 0,
    max_position_embeddings: int = 512,
    byte_level: bool = False,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> Path:
    """Write a random-weight checkpoint; larger `std` gives peakier (lower-entropy) next-token logits.
    The head counts and hidden size set the KV cache's size per token (2 x layers x kv heads x
    hidden / heads values)."""
    if byte_level:
        vocab_size = BYTE_VOCAB_SIZE
    shape = {"vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 128}
    shape |= {
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
    }
    common = {**shape, "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False}
    common |= {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": 3}
    if arch == "gpt2":  # an architecture the native forward does not support
        config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=1, n_head=2)
    else:
        config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, std)
    model.save_pretrained(path)
    tokenizer = make_byte_tokenizer() if byte_level else make_tokenizer(vocab_size, extra_words)
    tokenizer.save_pretrained(path)
    return path


def save_perturbed(source: Path, path: Path, *, seed: int, noise: float) -> Path:
    """A draft that mostly agrees with `source`: its weights plus Gaussian noise, same tokenizer.

    It disagrees where the source is unsure (near-ties), which is where FLy may forgive.
    """
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * torch.randn_like(param))
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


class TinyModels:
    """Tiny checkpoints shared by the whole test session: each set of `save_tiny` arguments is written
    once, on first use, under `root`. Tests only read them (an engine never writes to its model folder).

    `pair()` is the usual engine-test pair: a target (seed 0) and an unrelated draft (seed 1), which
    rarely agree. `forgiving_pair()` is the pair FLy forgives on: a peaky-but-unsure target (std 0.25,
    entropy >= 0.3) and a draft that is its weights plus slight noise, so they disagree at near-ties.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, *, seed: int, **kwargs: object) -> str:
        """The checkpoint `save_tiny(path, seed=seed, **kwargs)` writes, made now if it is not yet."""
        path = self.root / "-".join(f"{k}={v}" for k, v in sorted({"seed": seed, **kwargs}.items()))
        if not path.exists():
            save_tiny(path, seed=seed, **kwargs)  # type: ignore[arg-type]
        return str(path)

    def perturbed(self, source: str, *, seed: int, noise: float) -> str:
        """`save_perturbed(source, ...)`: `source`'s weights plus Gaussian noise, made now if needed."""
        path = self.root / f"{Path(source).name}+noise={noise}-seed={seed}"
        if not path.exists():
            save_perturbed(Path(source), path, seed=seed, noise=noise)
        return str(path)

    def pair(self) -> dict[str, str]:
        """{"target": seed 0, "draft": seed 1}: two unrelated tiny Llama checkpoints."""
        return {"target": self.get(seed=0), "draft": self.get(seed=1)}

    def forgiving_pair(self, noise: float = 0.003) -> dict[str, str]:
        """{"target", "draft"}: a peaky-but-unsure target and its slightly noisy copy (see the class)."""
        target = self.get(seed=3, std=0.25)
        return {"target": target, "draft": self.perturbed(target, seed=5, noise=noise)}

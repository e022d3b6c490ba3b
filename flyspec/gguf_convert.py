"""Convert a GGUF file's weights into a bfloat16 safetensors file (with config.json and
generation_config.json), one tensor at a time.

transformers can do this in two calls (`from_pretrained(gguf_file=...)`, then `save_pretrained`), but
those dequantise every tensor to float32 first and then build the whole bfloat16 model: a 3 GB bfloat16
folder from the 1.1 GB Qwen2.5-Coder-1.5B GGUF peaked at 11.1 GB of resident memory. Here the names,
shapes and byte offsets of every output tensor are known from the GGUF's header before any weight is
read, so the safetensors header is written first and each tensor follows it, dequantised in slices of
rows read from the file (`os.pread`, so no page of the GGUF stays mapped into this process). Resident
memory stays near one slice, whatever the model's size.

The output is byte for byte what transformers writes: the same name mapping and tensor processors
(transformers' GGUF integration), the same float32 to bfloat16 rounding (torch's), the tensors sorted by
name as `safetensors` sorts them, the same header bytes, and the configs saved by transformers itself.
Everything is written to one `model.safetensors`, as transformers does below its 5 GB shard size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SLICE_BYTES = 8 << 20
"""Float32 bytes dequantised at once: a slice of rows of one tensor (the whole tensor when smaller)."""
_HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to a multiple of 8 bytes


def convert_weights(gguf: Path, out: Path) -> None:
    """Write `out`/model.safetensors (bfloat16), config.json and generation_config.json for `gguf`.

    Raises ValueError when the GGUF's tensors do not give exactly the weights of the model its config
    describes (a tensor missing, or one with an unexpected shape).
    """
    import torch
    import transformers
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    # Only the config: the parsed tokenizer (hundreds of thousands of strings) is not kept.
    parsed = {"config": load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]}
    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The model on the meta device costs no memory; it gives the names, shapes and tied weights that
    # transformers would load and save, and the config exactly as save_pretrained writes it.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    name_map = get_gguf_hf_weights_map(model)
    architecture = parsed["config"]["model_type"]
    reader = GGUFReader(gguf)
    processor = TENSOR_PROCESSORS.get(_gguf_architecture(reader), TensorProcessor)(config=parsed["config"])
    sources = {name_map[t.name]: _Source.of(t) for t in reader.tensors if t.name in name_map}
    # The reader's parsed fields (every token as its own array) take more memory than a slice of rows.
    del reader
    expected = _saved_shapes(model)
    if set(sources) != set(expected):
        missing = sorted(set(expected) - set(sources))
        raise ValueError(f"{gguf}: the GGUF has no tensor for {missing[:5]} of the {architecture} model")
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(expected)  # safetensors' order for tensors of one dtype
    header, offsets = _header(names, expected)
    fd = os.open(gguf, os.O_RDONLY)
    try:
        with open(out / "model.safetensors", "wb") as fh:
            fh.write(header)
            for name in names:
                for piece in _bf16_pieces(fd, sources[name], processor, parsed, name_map):
                    fh.write(piece)
                if fh.tell() != len(header) + offsets[name]:
                    raise ValueError(
                        f"{gguf}: tensor {sources[name].name} did not convert to {expected[name]}"
                    )
    finally:
        os.close(fd)
    # What save_pretrained records of the model it saves.
    model.config.architectures = [type(model).__name__]
    model.config.dtype = torch.bfloat16
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


@dataclass(frozen=True)
class _Source:
    """Where one tensor's bytes are in the GGUF file and how to read them."""

    name: str
    qtype: Any
    dtype: Any  # numpy dtype of the stored items (bytes for quantized types)
    shape: tuple[int, ...]  # stored shape: rows first; the last axis is bytes for quantized types
    n_bytes: int
    n_elements: int
    offset: int

    @classmethod
    def of(cls, tensor: Any) -> _Source:
        """The source of a gguf ReaderTensor (without its memory map)."""
        return cls(
            tensor.name,
            tensor.tensor_type,
            tensor.data.dtype,
            tuple(tensor.data.shape),
            int(tensor.n_bytes),
            int(tensor.n_elements),
            int(tensor.data_offset),
        )


def _gguf_architecture(reader: Any) -> str:
    """general.architecture as GGUF names it (the key of transformers' tensor processors)."""
    field = reader.get_field("general.architecture")
    return str(field.contents())


def _saved_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """The tensors save_pretrained writes, with their shapes: the state dict less tied copies."""
    state = model.state_dict()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    return {name: tuple(t.shape) for name, t in state.items() if name not in tied}


def _header(names: list[str], shapes: dict[str, tuple[int, ...]]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header (length prefix, JSON, space padding) and each tensor's end offset."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets: dict[str, int] = {}
    start = 0
    for name in names:
        numel = 1
        for dim in shapes[name]:
            numel *= dim
        end = start + 2 * numel
        entries[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [start, end]}
        offsets[name] = end
        start = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGN)
    return len(text).to_bytes(8, "little") + text, offsets


def _bf16_pieces(
    fd: int, source: _Source, processor: Any, parsed: dict[str, Any], name_map: dict[str, str]
) -> Iterator[Any]:
    """The tensor's bfloat16 bytes (as numpy arrays) in row order, a slice of rows at a time (the whole
    tensor when the processor reorders rows, as llama's query and key permutation does)."""
    import numpy as np
    import torch
    from gguf import dequantize

    rows = source.shape[0] if len(source.shape) > 1 else 1
    row_bytes = source.n_bytes // rows
    row_floats = source.n_elements // rows
    step = rows if _reorders(processor, source.name) else max(1, _SLICE_BYTES // (4 * row_floats))
    for first in range(0, rows, step):
        count = min(step, rows - first)
        raw = os.pread(fd, count * row_bytes, source.offset + first * row_bytes)
        if len(raw) != count * row_bytes:
            raise ValueError(f"GGUF tensor {source.name} is cut short")
        shape = (count, *source.shape[1:]) if len(source.shape) > 1 else source.shape
        stored = np.frombuffer(bytearray(raw), dtype=source.dtype).reshape(shape)
        weights = dequantize(stored, source.qtype)
        weights = processor.process(
            weights=weights, name=source.name, tensor_key_mapping=name_map, parsed_parameters=parsed
        ).weights
        yield torch.from_numpy(np.ascontiguousarray(weights)).to(torch.bfloat16).view(torch.int16).numpy()


def _reorders(processor: Any, gguf_name: str) -> bool:
    """Whether the processor may move rows of this tensor (then it must see the whole tensor): any
    processor but transformers' identity and llama's, which permutes only query and key rows."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor

    if type(processor) is TensorProcessor:
        return False
    if type(processor) is LlamaTensorProcessor:
        return ".attn_q." in gguf_name or ".attn_k." in gguf_name
    return True

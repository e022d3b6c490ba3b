"""Load config, tokenizer and weights into the native forward.

Sources: a Hugging Face folder (weights read straight from its safetensors files, one tensor at a time,
converted to the target dtype and device as they are read), a `.gguf` file (transformers dequantises it),
or a zoo name (flyspec/assets.py), which resolves to its prepared cache folder. The model is built on the meta
device and the weights are assigned, so no memory is spent on a random initialisation.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flyspec.assets import resolve_model
from flyspec.config import QUANTIZATION_CHOICES
from flyspec.models import kernel_check
from flyspec.models.kernel_check import KernelCheck, Workload, resolve_quantization
from flyspec.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from flyspec.models.quantization import check_quantization
from flyspec.models.tokenizer import load_tokenizer

_log = logging.getLogger("flyspec.load")
DEFAULT_KERNEL_ROWS = (1, 16)
"""Row counts of the kernel check when the caller does not say (one sequence, a batch of 16)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A ready model with its tokenizer, transformers config, resolved path, weight dtype (of the
    unquantized parts: embedding, norms, KV cache) and quantization method (None = none)."""

    model: LlamaForCausalLM
    tokenizer: Any
    hf_config: Any
    path: str
    dtype: torch.dtype
    quantization: str | None = None
    kernel_check: KernelCheck | None = None


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r}: not a torch device (use cpu, cuda or cuda:N)") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: only cpu and cuda are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available in this torch build or machine")
    return dev


def _resolve_dtype(dtype: str, checkpoint_dtype: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: must be one of auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = DTYPES.get(checkpoint_dtype.removeprefix("torch."), torch.float32)
    resolved = checkpoint_dtype if checkpoint_dtype in DTYPES.values() else torch.float32
    # float16 matmuls on CPU are slow and overflow-prone; bfloat16 has the same size and float32's range.
    if resolved == torch.float16 and device.type == "cpu":
        return torch.bfloat16
    return resolved


def _check_architecture(config: Any, source: Path) -> None:
    if getattr(config, "model_type", None) not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported model architecture {getattr(config, 'model_type', None)!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def _read_safetensors(folder: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            keys = list(fh.keys())
        for key in keys:
            # One mapping per tensor: the file pages a mapping has read count in the process's resident
            # memory until it closes, so one mapping for the whole file held a second copy of the
            # checkpoint at the end of the load (the 1.5B's: 7.2 GB peak for 3.6 GB of weights).
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                # Copied out of the file mapping: decode streams every weight each step, and file pages
                # can be reclaimed and faulted back between steps (about 8% slower in an A/B on the
                # reference VM); a rewritten file also cannot change (or SIGBUS) a loaded model.
                state[key] = fh.get_tensor(key).to(device=device, dtype=dtype, copy=True)
    return state


def _layer_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct [out, in] weight shapes of the decoder's linear layers (the lm_head aside: it runs
    on a few positions per pass)."""
    shapes = {
        (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name != "lm_head"
    }
    return sorted(shapes)


def _assign_layer_by_layer(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state, strict=True, assign=True)``, emptying ``state``, one decoder layer
    at a time: loading fuses q/k/v and gate/up into new tensors, and torch's copy of the dict would keep
    every separate one alive until the end (1.7 GB more at the 1.5B's peak); here each goes with its
    layer, and glibc returns it before the next (it keeps such holes resident otherwise)."""
    groups: dict[str, list[str]] = {}
    for key in state:
        parts = key.split(".")
        group = ".".join(parts[:3]) if parts[1:2] == ["layers"] else ""
        groups.setdefault(group, []).append(key)
    missing: set[str] | None = None
    unexpected: set[str] = set()
    for keys in groups.values():
        result = model.load_state_dict({key: state.pop(key) for key in keys}, strict=False, assign=True)
        _return_freed_memory()
        # strict, over the whole checkpoint: missing from every part, or unexpected in any
        missing = set(result.missing_keys) if missing is None else missing & set(result.missing_keys)
        unexpected |= set(result.unexpected_keys)
    if missing or unexpected:
        raise RuntimeError(
            f"the checkpoint does not fit the model: missing {sorted(missing or ())[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )


def _build(
    config: Any,
    state: dict[str, torch.Tensor],
    device: torch.device,
    quantization: str | None,
    kernel_rows: Workload | tuple[int, ...],
    label: str,
) -> tuple[LlamaForCausalLM, str | None, KernelCheck | None]:
    """The model with `state`'s tensors assigned (the dict is emptied, so that quantization can free each
    float weight as soon as its int8 copy exists), quantized as `quantization` resolves on this CPU."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    _assign_layer_by_layer(model, state)
    model = model.to(device).eval().requires_grad_(False)
    if quantization == "auto" and model.dtype == torch.float32:
        # float32 is asked for its precision (e.g. exact speculative decoding); the quantized formats
        # stand in for bfloat16 weights and are measured against them.
        _log.info("quantization=auto for %s: none (float32 weights are kept as they are)", label)
        quantization = None
    check = None
    bf16_cpu = model.dtype == torch.bfloat16 and device.type == "cpu"
    if quantization is not None or bf16_cpu:
        started = time.perf_counter()
        shapes = _layer_shapes(model)
        if quantization is None:  # only bfloat16's layout to choose
            check = kernel_check.check(shapes, kernel_rows, formats=())
        else:
            quantization, check = resolve_quantization(quantization, shapes, kernel_rows, device, label)
        if check is not None:
            how = "cached" if check.from_cache else f"measured in {check.seconds:.1f} s"
            _log.info("kernel check for %s: %.1f s (%s)", label, time.perf_counter() - started, how)
    if quantization is not None:
        started = time.perf_counter()
        _log.info("quantize %s to %s ...", label, quantization)
        model.quantize(quantization)
        _log.info("quantize %s to %s: %.1f s", label, quantization, time.perf_counter() - started)
    elif bf16_cpu and check is not None and check.pack_bf16:
        assert check.packed is not None
        model.pack()
        _log.info("bfloat16 weights of %s prepacked for oneDNN: %s", label, check.packed.describe())
    if quantization is not None or model.packed:
        _return_freed_memory()
    return model, quantization, check


def _return_freed_memory() -> None:
    """Give the heap memory freed with the float weights back to the operating system (glibc's
    malloc_trim; elsewhere nothing happens). Quantizing frees each float weight between allocations that
    stay, and glibc keeps such freed holes resident: 0.5 GB of the 1.5B's int8 load, 0.9 GB of the
    0.5B's, measured on AMD EPYC Zen 5."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def load_model(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "cpu",
    quantization: str | None = None,
    *,
    kernel_rows: Workload | tuple[int, ...] = DEFAULT_KERNEL_ROWS,
) -> LoadedModel:
    """Load an HF folder, a .gguf file or a prepared zoo name into the native forward.

    dtype "auto" keeps the checkpoint's dtype (a dequantised GGUF is float32), except that float16
    becomes bfloat16 on CPU. quantization "int8" or "int4" quantizes the linear layers and the lm_head after
    loading (flyspec/models/quantization.py; CPU only); "auto" takes the fastest format the kernel check
    measures on this CPU at `kernel_rows` rows (flyspec/models/kernel_check.py), or none, and keeps
    float32 weights as they are. The check also
    runs for an explicit format, which is kept but warned about when it is slower than bfloat16 here.
    `LoadedModel.quantization` is the format actually loaded. Raises ValueError for an unknown name, a
    path that is neither folder nor file, an unsupported architecture, or a bad dtype/device/quantization.
    """
    import transformers

    dev = _device(device)
    if quantization not in (None, *QUANTIZATION_CHOICES):
        raise ValueError(
            f"quantization={quantization!r}: must be None or one of {', '.join(QUANTIZATION_CHOICES)}"
        )
    if quantization != "auto":
        check_quantization(quantization, dev)
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of auto, {', '.join(DTYPES)}")
    started = time.perf_counter()
    _log.info("load %s ...", name_or_path)
    path = resolve_model(name_or_path)
    if path.is_dir():
        config = transformers.AutoConfig.from_pretrained(path)
        _check_architecture(config, path)
        checkpoint_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        target = _resolve_dtype(dtype, checkpoint_dtype, dev)
        state = _read_safetensors(path, target, dev)
        if not state:  # a folder with only pytorch_model.bin files: let transformers read them
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=target)
            state = hf.state_dict()
            del hf
        tokenizer = load_tokenizer(path, config.model_type)
    elif path.suffix.lower() == ".gguf":
        # The architecture is checked on the loaded model's config: transformers parses the whole GGUF
        # file for a config alone (about 8 s for a 98 MB file), and refuses architectures it cannot read.
        target = _resolve_dtype(dtype, torch.float32, dev)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=target)
        config = hf.config
        _check_architecture(config, path)
        state = {k: v.to(dev) for k, v in hf.state_dict().items()}
        del hf
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        raise ValueError(
            f"model file {str(path)!r} is not a .gguf file; pass a Hugging Face folder, a .gguf file "
            "or a zoo name"
        )
    _log.info(
        "load %s (%s): %.1f s",
        name_or_path,
        str(target).removeprefix("torch."),
        time.perf_counter() - started,
    )
    model, quantization, check = _build(config, state, dev, quantization, kernel_rows, name_or_path)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=config,
        path=str(path),
        dtype=target,
        quantization=quantization,
        kernel_check=check,
    )

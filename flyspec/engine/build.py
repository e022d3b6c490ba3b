"""Building an engine's parts from its config: the models, their limits, the KV blocks and the drafter.

Order matters for the user: the token budget is checked before any weights load, and the draft model
loads only once the target's limits are known good, so a bad setting fails fast. `LLMEngine` (engine.py)
takes the finished `EngineParts` and only runs steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from flyspec.budget import Capacity, capacity
from flyspec.config import EngineConfig
from flyspec.engine.allocator import keep_step_memory
from flyspec.engine.drafters.base import Drafter
from flyspec.engine.drafters.build import build_drafter
from flyspec.engine.kv_blocks import BLOCK_SIZE, BlockManager
from flyspec.engine.model_runner import ModelRunner
from flyspec.engine.timing import StepClock
from flyspec.models.kernel_check import engine_rows
from flyspec.models.loader import LoadedModel, load_model
from flyspec.spec_decode.metrics import SpecDecodeStats
from flyspec.spec_decode.verify import VerificationPolicy

logger = logging.getLogger("flyspec.engine")

DEFAULT_MAX_MODEL_LEN = 4096
"""max_model_len when unset: min(the model's max_position_embeddings, 4096), to bound cache growth."""
DEFAULT_KV_CACHE_SHARE = 0.25
"""kv_cache_memory_bytes when unset: what max_running requests of kv_cache_request_len (default
max_model_len) need, but at most this share of the machine's memory (of the GPU's free memory on CUDA),
and at least one request of max_model_len."""


@dataclass
class EngineParts:
    """Everything an engine's steps use, built once from its config (`build_parts`)."""

    capacity: Capacity
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    clock: StepClock
    stats: SpecDecodeStats
    weight_formats: dict[str, str]
    blocks: BlockManager
    kv_block_bytes: int
    target: ModelRunner
    drafter: Drafter | None
    policy: VerificationPolicy | None
    """The lossy verification policy, None for standard verification (or no speculation)."""
    lossless_prefix_tokens: int


def build_parts(
    config: EngineConfig, *, target: LoadedModel | None = None, draft: LoadedModel | None = None
) -> EngineParts:
    """The parts of an engine for `config`; `target` / `draft` are models already loaded for it (used as
    they are, checked against the config's quantization)."""
    spec = config.speculative_config
    k = config.num_speculative_tokens
    # Budget arithmetic first: a budget that cannot run one request fails before any weights load.
    cap = capacity(config.max_num_batched_tokens, config.max_num_seqs, 1 + k)
    if torch.device(config.device).type == "cpu":
        keep_step_memory()  # steps reuse what earlier steps freed (engine/allocator.py)
    target = _load_target(config, target, cap.max_running)
    max_model_len = _resolve_max_model_len(config.max_model_len, target.model.max_position_embeddings)
    clock = StepClock(target.model.device)
    stats = SpecDecodeStats(num_speculative_tokens=k)
    draft = _load_draft(config, draft, cap.max_running)
    if config.batch_invariant:
        for loaded in (target, draft):
            if loaded is not None:
                loaded.model.enable_batch_invariance()
    formats = {"target": _weight_format(target)}
    if draft is not None:
        formats["draft"] = _weight_format(draft)
    # One block table per request serves the target and a draft model: a block holds both.
    per_token = target.model.kv_bytes_per_token() + (draft.model.kv_bytes_per_token() if draft else 0)
    # Verification writes up to K positions past the last kept token.
    sizing = _kv_cache_sizing(config, per_token, max_model_len, k + 1, cap.max_running, target.model.device)
    num_blocks = sizing.num_blocks
    blocks = BlockManager(num_blocks, prefix_caching=config.enable_prefix_caching, stats=stats)
    runner = ModelRunner(target.model, num_blocks, BLOCK_SIZE, timer=clock.part("target_forward_s"))
    blocks.add_release_hook(runner.cache.release)
    drafter = None
    if spec is not None:
        timer = clock.part("draft_forward_s")
        drafter = build_drafter(spec, target, draft, blocks=blocks, max_model_len=max_model_len, timer=timer)
    parts = EngineParts(
        capacity=cap,
        tokenizer=target.tokenizer,
        max_model_len=max_model_len,
        vocab_size=target.model.vocab_size,
        eos_token_ids=_eos_token_ids(target),
        clock=clock,
        stats=stats,
        weight_formats=formats,
        blocks=blocks,
        kv_block_bytes=BLOCK_SIZE * per_token,
        target=runner,
        drafter=drafter,
        policy=spec.verification_policy(target.model.vocab_size) if spec is not None else None,
        lossless_prefix_tokens=(spec.lossless_prefix_tokens or 0) if spec is not None else 0,
    )
    _log_kv_cache(
        parts,
        per_token,
        sizing.why,
        with_draft=draft is not None,
        prefix_caching=config.enable_prefix_caching,
    )
    logger.info(cap.describe())
    if parts.policy is not None:
        logger.warning(parts.policy.lossy_warning())
    return parts


def _load_target(config: EngineConfig, target: LoadedModel | None, slots: int) -> LoadedModel:
    """The target model: `target` as given, or loaded for config.model; checked against the config."""
    if target is None:
        target = load_model(
            config.model,
            config.dtype,
            config.device,
            config.quantization,
            kernel_rows=engine_rows(config.num_speculative_tokens, slots),
        )
    _check_quantized_as_configured("target", target, config.quantization)
    return target


def _load_draft(config: EngineConfig, draft: LoadedModel | None, slots: int) -> LoadedModel | None:
    """The draft model: `draft` as given, loaded when the method needs one, else None; checked."""
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model" and draft is None and spec.model is not None:
        draft = load_model(
            spec.model,
            config.dtype,
            config.device,
            config.draft_quantization,
            kernel_rows=engine_rows(config.num_speculative_tokens, slots, draft=True),
        )
    if draft is not None:
        _check_quantized_as_configured("draft", draft, config.draft_quantization)
    return draft


def _log_kv_cache(
    parts: EngineParts, per_token: int, why: str, *, with_draft: bool, prefix_caching: bool
) -> None:
    """Log the KV cache's size, layout and what decided its size."""
    num_blocks = parts.blocks.num_blocks
    logger.info(
        "KV cache: %.1f MB, %d blocks of %d positions (%d positions, %d bytes per position%s): %s; "
        "prefix caching %s",
        num_blocks * parts.kv_block_bytes / 1e6,
        num_blocks,
        BLOCK_SIZE,
        num_blocks * BLOCK_SIZE,
        per_token,
        ", target and draft" if with_draft else "",
        why,
        "on" if prefix_caching else "off",
    )


@dataclass(frozen=True)
class KVCacheSizing:
    """How many KV cache blocks an engine gets, and why (the log line says it)."""

    num_blocks: int
    why: str


def _kv_cache_sizing(
    config: EngineConfig,
    bytes_per_token: int,
    max_model_len: int,
    extra: int,
    max_running: int,
    device: torch.device,
) -> KVCacheSizing:
    """KV cache blocks for the config: kv_cache_memory_bytes as given; else max_running requests of
    kv_cache_request_len (default max_model_len) positions, at most DEFAULT_KV_CACHE_SHARE of the memory;
    always at least one request of max_model_len. `extra`: positions a request may write past its
    length (verification's K + 1)."""
    block_bytes = BLOCK_SIZE * bytes_per_token
    longest = -(-(max_model_len + extra) // BLOCK_SIZE)
    requested = config.kv_cache_memory_bytes
    if requested is not None:
        num_blocks = _capped_blocks(requested, block_bytes, longest, max_model_len + extra, device)
        return KVCacheSizing(num_blocks, f"kv_cache_memory_bytes={requested}")
    if config.kv_cache_request_len is not None:
        # No request is longer than max_model_len, whatever the caller expects.
        request_len = min(config.kv_cache_request_len, max_model_len)
        why = f"{max_running} running requests of kv_cache_request_len={config.kv_cache_request_len}"
        if request_len < config.kv_cache_request_len:
            why += f" (no longer than max_model_len={max_model_len})"
        why += " positions"
    else:
        request_len = max_model_len
        why = (
            f"{max_running} running requests of max_model_len={max_model_len} positions (set "
            "kv_cache_request_len to the longest prompt plus max_tokens to size it for the work)"
        )
    per_request = -(-(request_len + extra) // BLOCK_SIZE)
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = int(available * DEFAULT_KV_CACHE_SHARE) // block_bytes
    num_blocks = max_running * per_request
    if num_blocks > share:
        num_blocks = share
        memory = "free GPU memory" if device.type == "cuda" else "memory"
        why += f", capped at {DEFAULT_KV_CACHE_SHARE:.0%} of the {memory}"
    if num_blocks < longest:
        num_blocks = longest
        why += f", raised to hold one request of max_model_len={max_model_len}"
    return KVCacheSizing(num_blocks, why)


def _capped_blocks(requested: int, block_bytes: int, longest: int, max_len: int, device: torch.device) -> int:
    """Blocks in kv_cache_memory_bytes=requested; ValueError when one request of max_len does not fit."""
    if device.type == "cpu" and requested > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        logger.warning(
            "kv_cache_memory_bytes=%d is more than this machine's memory: requests may exhaust it before "
            "the cap stops them",
            requested,
        )
    if requested // block_bytes < longest:
        raise ValueError(
            f"kv_cache_memory_bytes={requested} holds {requested // block_bytes * BLOCK_SIZE} positions, but "
            f"one request of max_model_len needs {max_len} ({block_bytes // BLOCK_SIZE} bytes per position, "
            f"in blocks of {BLOCK_SIZE}); raise kv_cache_memory_bytes to at least {longest * block_bytes} or "
            "lower max_model_len"
        )
    return requested // block_bytes


def _weight_format(loaded: LoadedModel) -> str:
    """How a model's linear layers hold their weights, e.g. "int8", "bfloat16 (prepacked)", "float32"."""
    if loaded.quantization is not None:
        return loaded.quantization
    dtype = str(loaded.dtype).removeprefix("torch.")
    return f"{dtype} (prepacked)" if loaded.model.packed else dtype


def _check_quantized_as_configured(role: str, loaded: LoadedModel, quantization: str | None) -> None:
    # A preloaded model (the benchmarks share weights across engines) must be what the config says;
    # "auto" accepts whatever the load chose.
    if quantization != "auto" and loaded.quantization != quantization:
        raise ValueError(
            f"the preloaded {role} model {loaded.path} has quantization={loaded.quantization!r}, but the "
            f"engine config asks for quantization={quantization!r}"
        )


def _resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    if requested is None:
        return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if requested > max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings}; use at most {max_position_embeddings}"
        )
    return requested


def _eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """End-of-sequence ids from the tokenizer, the model config and generation_config.json if present."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    candidates: list[object] = [
        loaded.tokenizer.eos_token_id,
        getattr(loaded.hf_config, "eos_token_id", None),
    ]
    # No generation_config.json (e.g. a .gguf file) is fine: the other sources suffice.
    with contextlib.suppress(OSError, ValueError, TypeError):
        candidates.append(GenerationConfig.from_pretrained(loaded.path).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)

"""Native PyTorch forward for the Llama family: llama, qwen2 (qkv bias), qwen3 (q/k RMSNorm), mistral.

The model attends over a paged `PagedKVCache` with ragged rows (`ForwardBatch`): row b writes the K/V of
its real tokens at positions `start[b] .. start[b] + num_tokens[b] - 1` of the blocks in its block table,
and query t sees keys `0 .. start[b] + t`. Prefill, one-token decode and the verification of K draft
tokens are all the same call.

Speed: a ragged batch (prompt chunks of different lengths, drafts of different lengths) runs its
projections and MLPs on the real tokens only, packed without padding; q/k/v and gate/up are fused into
one matmul each, layers call `torch.nn.functional` directly (no per-submodule `__call__`), and everything
that is the same for all layers (positions, RoPE tables, cache indices, the attention mask) is computed
once per forward. The parameter names of a transformers
checkpoint (`model.layers.N.self_attn.q_proj.weight`, ...) load through `load_state_dict`: a pre-hook
fuses them, and `state_dict()` splits them back, so both directions use transformers' names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flyspec.models import batch_invariant
from flyspec.models.kv_cache import PagedKVCache
from flyspec.models.packed_linear import PackedLinear, pack_model
from flyspec.models.quantization import prefill_pass, quantize_model, quantized_linear

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ForwardBatch:
    """Where each row of a batched forward lives in the KV cache.

    block_tables: [B, W] int64, row b's cache blocks in position order (position p is in block
    block_tables[b, p // block_size]); entries past the blocks a row needs are -1. start: [B] int64 cache
    position of the row's first input token; num_tokens: [B] int64 real tokens in the row (inputs at
    t >= num_tokens[b] are padding: their K/V are never written and their outputs are garbage). prefill:
    every row is prompt tokens (int4 layers then use their int8 prefill copy;
    flyspec/models/quantization.py).
    """

    block_tables: torch.Tensor
    start: torch.Tensor
    num_tokens: torch.Tensor
    prefill: bool = False


@dataclass(frozen=True)
class _Arch:
    """The shape facts of one checkpoint, read once from its transformers config."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]


def _arch_from_config(config: Any) -> _Arch:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {model_type!r}: flyspec's native forward supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    rotary_factor = getattr(config, "partial_rotary_factor", 1.0)
    if rotary_factor != 1.0:
        raise ValueError(f"partial_rotary_factor={rotary_factor} is not supported (only 1.0)")
    attention_bias = bool(getattr(config, "attention_bias", False))
    num_layers = config.num_hidden_layers
    if model_type == "mistral":
        windows: tuple[int | None, ...] = (getattr(config, "sliding_window", None),) * num_layers
    elif model_type in ("qwen2", "qwen3"):
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in layer_types)
    else:
        windows = (None,) * num_layers
    return _Arch(
        model_type=model_type,
        hidden_size=config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        num_layers=num_layers,
        vocab_size=config.vocab_size,
        eps=config.rms_norm_eps,
        qkv_bias={"llama": attention_bias, "qwen2": True, "qwen3": attention_bias}.get(model_type, False),
        o_bias=attention_bias if model_type in ("llama", "qwen3") else False,
        mlp_bias=bool(getattr(config, "mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        sliding_windows=windows,
    )


def rope_inv_freq(config: Any) -> torch.Tensor:
    """RoPE inverse frequencies (float32, CPU) for the default and the "llama3" scaling.

    Any other `rope_scaling` type raises ValueError naming it: silently ignoring a scaling would give a
    model that runs but attends wrongly at every position.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, llama3)")
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # F.linear on a float layer (no module __call__ overhead); a quantized layer's own forward.
    if type(layer) is nn.Linear:
        return F.linear(x, layer.weight, layer.bias)
    return layer.forward(x)


def _invariant_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return batch_invariant.padded_rows(partial(_linear, layer), x)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise (in float32 inside the kernel), round to x's dtype, then scale: transformers' rounding.
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


class _Norm(nn.Module):
    """Holds an RMSNorm weight under transformers' name (`...layernorm.weight`)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


def _fuse_projections(parent: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Let `parent.<fused>` (one Linear) load from and save as transformers' separate projections.

    The hooks sit on the parent because load_state_dict hands each child only the keys under its own name.
    """

    def fuse_on_load(module: nn.Module, state_dict: dict, prefix: str, *_args: Any) -> None:
        for suffix in ("weight", "bias"):
            keys = [f"{prefix}{name}.{suffix}" for name in parts]
            if all(key in state_dict for key in keys):
                state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)

    def split_on_save(module: nn.Module, state_dict: dict, prefix: str, _metadata: Any) -> None:
        for suffix in ("weight", "bias"):
            tensor = state_dict.pop(f"{prefix}{fused}.{suffix}", None)
            if tensor is not None:
                for name, piece in zip(parts, tensor.split(list(parts.values())), strict=True):
                    state_dict[f"{prefix}{name}.{suffix}"] = piece

    parent.register_load_state_dict_pre_hook(fuse_on_load)
    parent.register_state_dict_post_hook(split_on_save)


class _Attention(nn.Module):
    def __init__(self, a: _Arch) -> None:
        super().__init__()
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = nn.Linear(a.hidden_size, q_size + 2 * kv_size, bias=a.qkv_bias)
        _fuse_projections(self, "qkv_proj", parts)
        self.o_proj = nn.Linear(q_size, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = _Norm(a.head_dim)
            self.k_norm = _Norm(a.head_dim)


class _MLP(nn.Module):
    def __init__(self, a: _Arch) -> None:
        super().__init__()
        parts = {"gate_proj": a.intermediate_size, "up_proj": a.intermediate_size}
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        _fuse_projections(self, "gate_up_proj", parts)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)


class _DecoderLayer(nn.Module):
    def __init__(self, a: _Arch) -> None:
        super().__init__()
        self.self_attn = _Attention(a)
        self.mlp = _MLP(a)
        self.input_layernorm = _Norm(a.hidden_size)
        self.post_attention_layernorm = _Norm(a.hidden_size)


class _Backbone(nn.Module):
    def __init__(self, a: _Arch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = _Norm(a.hidden_size)


# Up to this many query tokens per row (decode and draft verification), the query heads that share a KV
# head are folded into extra query rows of that head: SDPA then reads each KV head once instead of once
# per query head, several times faster on CPU. Longer inputs (prefill) use SDPA's own GQA path.
_FOLD_MAX_TOKENS = 16


@dataclass
class _StepPlan:
    """Per-forward facts shared by every layer."""

    cos: torch.Tensor  # [B, T, 1, D], or [N, 1, D] for the N real tokens of a ragged batch
    sin: torch.Tensor  # the same shape, first half negated: rotate_half(x) * sin == roll(x) * sin
    length: int  # keys 0..length-1 are read
    read_blocks: torch.Tensor | None  # [B, nb] blocks to read; None: rows start at 0, inputs are the keys
    first_block: int | None  # one row whose blocks are one run from here: its keys are a view
    write_slots: torch.Tensor  # [N] flat cache positions of the real tokens
    write_src: torch.Tensor | None  # rows of the flattened [B*T] inputs that are real tokens
    fold: bool
    layer_masks: list[torch.Tensor | None]
    is_causal: bool


def _host_batch(
    batch: ForwardBatch, cache: PagedKVCache, bsz: int, seq: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """The batch's starts, token counts and block tables on the host, checked against T and the cache."""
    bs = cache.block_size
    # One host transfer per forward (none when the batch is on the CPU) for everything that decides
    # shapes, fast paths and bounds.
    width = batch.block_tables.shape[1]
    host = torch.cat((batch.start, batch.num_tokens, batch.block_tables.reshape(-1))).tolist()
    h_start, h_num = host[:bsz], host[bsz : 2 * bsz]
    tables = [host[2 * bsz + b * width : 2 * bsz + (b + 1) * width] for b in range(bsz)]
    if any(n < 0 or n > seq for n in h_num) or any(s < 0 for s in h_start):
        raise ValueError(f"ForwardBatch out of range: start={h_start}, num_tokens={h_num}, T={seq}")
    for row, s, n in zip(tables, h_start, h_num, strict=True):
        needed = row[: -(-(s + n) // bs)]
        if len(needed) < -(-(s + n) // bs) or any(not 0 <= b < cache.num_blocks for b in needed):
            raise ValueError(
                f"ForwardBatch block table {row} does not cover positions 0..{s + n - 1} with blocks of "
                f"a cache of {cache.num_blocks} blocks of {bs} positions"
            )
    return h_start, h_num, tables


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder whose parameters carry transformers' names (`model.layers.N...`, `lm_head`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.arch = _arch_from_config(config)
        a = self.arch
        self.config = config
        self.vocab_size = a.vocab_size
        self.max_position_embeddings = a.max_position_embeddings
        self.model = _Backbone(a)
        if not a.tie_word_embeddings:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        # A plain attribute, not a buffer: `.to(torch.bfloat16)` must not round the frequencies.
        self._inv_freq = rope_inv_freq(config)
        self.quantization: str | None = None
        # Set by `pack`: bfloat16 weights in oneDNN's blocked layout (models/packed_linear.py).
        self.packed = False
        # Set by `enable_batch_invariance`: row-invariant matmuls and attention (models/batch_invariant.py).
        self.batch_invariant = False
        self.requires_grad_(False)  # inference only
        self.register_load_state_dict_pre_hook(self._drop_tied_head)
        self.register_state_dict_post_hook(self._add_tied_head)

    @staticmethod
    def _drop_tied_head(module: LlamaForCausalLM, state_dict: dict, prefix: str, *_args: Any) -> None:
        if module.arch.tie_word_embeddings:
            state_dict.pop(prefix + "lm_head.weight", None)

    @staticmethod
    def _add_tied_head(module: LlamaForCausalLM, state_dict: dict, prefix: str, _metadata: Any) -> None:
        if module.arch.tie_word_embeddings:
            state_dict[prefix + "lm_head.weight"] = state_dict[prefix + "model.embed_tokens.weight"]

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of the KV cache `new_cache` makes)."""
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """An empty paged KV cache of `num_blocks` blocks of `block_size` positions."""
        a = self.arch
        return PagedKVCache(
            a.num_layers, a.num_kv_heads, a.head_dim, num_blocks, block_size, self.dtype, self.device
        )

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one position takes over all layers (keys and values)."""
        a = self.arch
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def quantize(self, method: str) -> None:
        """Quantize every linear layer and the lm_head in place (flyspec/models/quantization.py); a tied
        lm_head gets a quantized copy of the embedding table, which itself stays in the model's dtype."""
        quantize_model(self, method)
        if self.arch.tie_word_embeddings:
            embed = self.model.embed_tokens.weight
            self.lm_head = quantized_linear(method, embed, None, torch.float32, logits=True)
        self.quantization = method

    def pack(self) -> None:
        """Hold every bfloat16 linear layer's weight in oneDNN's blocked layout (CPU; the same outputs,
        faster at decode sizes: models/packed_linear.py). A tied lm_head gets a packed copy of the
        embedding table, which itself stays plain for the lookup."""
        pack_model(self)
        weight = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
        self.lm_head = PackedLinear(weight, None)
        self.packed = True

    def enable_batch_invariance(self) -> None:
        """Compute every position the same way whatever else shares its forward pass (other rows, other
        tokens of its own chunk, padding): fixed-shape matmuls and attention (models/batch_invariant.py).
        Probes this machine's kernels first and raises ValueError, leaving the model unchanged, where
        they still depend on the batch."""
        self.batch_invariant = True
        try:
            self._probe_batch_invariance()
        except ValueError:
            self.batch_invariant = False
            raise

    def _probe_batch_invariance(self) -> None:
        """Raise ValueError unless the hidden states of a random 24-token row come out bit-identical
        computed in one pass, beside a longer row, in two chunks, and with its last token decoded alone
        and beside another decoding row (the paths a request's positions take in the engine)."""
        cache = self.new_cache(16, 16)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (2, 37), generator=gen).to(self.device)
        a = ids[:1, :24]

        def run(input_ids: torch.Tensor, starts: list[int], nums: list[int], tables: list[list[int]]):
            t = partial(torch.tensor, dtype=torch.int64, device=self.device)
            return self(input_ids, ForwardBatch(t(tables), t(starts), t(nums)), cache)

        alone = run(a, [0], [24], [[0, 1]])[0]
        pair = ids.clone()
        pair[0, 24:] = 0
        beside = run(pair, [0, 0], [24, 37], [[2, 3, -1], [4, 5, 6]])[0, :24]
        run(a[:, :10], [0], [10], [[7, 8]])
        chunks = run(a[:, 10:], [10], [14], [[7, 8]])[0]
        run(a[:, :23], [0], [23], [[9, 10]])
        decoded = run(a[:, 23:], [23], [1], [[9, 10]])[0, 0]
        run(a[:, :23], [0], [23], [[12, 11]])
        batched = run(ids[:, 23:24], [23, 36], [1, 1], [[12, 11, -1], [4, 5, 6]])[0, 0]
        failures = [
            name
            for name, got, want in (
                ("beside a longer row", beside, alone),
                ("in two chunks", chunks, alone[10:]),
                ("decoded alone", decoded, alone[23]),
                ("decoded beside another row", batched, alone[23]),
            )
            if not torch.equal(got, want)
        ]
        if failures:
            raise ValueError(
                "batch_invariant=True is not available for this model on this machine: its positions still "
                f"differ when computed {', '.join(failures)} (the float matmul or attention kernels of "
                f"torch {torch.__version__} depend on the batch here); run without batch_invariant"
            )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits `[..., V]` of final-norm hidden states `[..., H]` (call it only on the positions
        needed), written into `out` (float32 `[..., V]`, contiguous) when given: a caller that keeps such
        a buffer across steps spares the allocator a fresh large tensor per call (engine/step_buffer.py).
        The values are the same bits either way."""
        if self.batch_invariant:
            logits = batch_invariant.padded_rows(self._logits, hidden)
            return logits if out is None else out.copy_(logits)
        return self._logits(hidden, out)

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantization is not None:
            return self.lm_head.forward(hidden, out=out)
        if self.packed:
            logits = self.lm_head.forward(hidden)
        else:
            weight = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
            logits = F.linear(hidden, weight)
        # The float32 copy goes straight into the buffer (no second full-vocabulary temporary).
        return logits.float() if out is None else out.copy_(logits)

    def _plan(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> _StepPlan:
        """What every layer of this forward shares: rotary tables, cache slots to write and read, masks."""
        device = input_ids.device
        bsz, seq = input_ids.shape
        bs = cache.block_size
        h_start, h_num, tables = _host_batch(batch, cache, bsz, seq)
        start = batch.start.to(device)
        num_tokens = batch.num_tokens.to(device)
        length = max(max(s + n for s, n in zip(h_start, h_num, strict=True)), 1)
        nb = -(-length // bs)
        tables_dev = batch.block_tables.to(device).clamp_min(0)  # -1 padding reads any block, masked

        steps = torch.arange(seq, device=device)
        positions = start[:, None] + steps  # [B, T]
        cos, sin = self._rotary(positions)

        full = all(n == seq for n in h_num)
        write_src = None
        if not full:
            write_src = (steps < num_tokens[:, None]).reshape(-1).nonzero().squeeze(1)
        # Padding positions may lie past a row's table: clamp them; they are never written.
        block_col = (positions // bs).clamp_max(tables_dev.shape[1] - 1)
        write_slots = (tables_dev.gather(1, block_col) * bs + positions % bs).reshape(-1)
        if write_src is not None:  # the projections run on the real tokens only (see forward)
            write_slots = write_slots[write_src]
            cos = cos.reshape(bsz * seq, 1, -1)[write_src]
            sin = sin.reshape(bsz * seq, 1, -1)[write_src]

        # Every row starting at 0 attends to its own inputs only: no cache read at all.
        from_inputs = all(s == 0 for s in h_start)
        read_blocks = None if from_inputs else tables_dev[:, :nb]
        first_block = None
        if not from_inputs and bsz == 1 and tables[0][:nb] == list(range(tables[0][0], tables[0][0] + nb)):
            first_block = tables[0][0]

        invariant = self.batch_invariant
        fold = invariant or seq <= _FOLD_MAX_TOKENS
        # Fast paths: every key visible (one-token decode of equally long rows), or a plain causal
        # prefill from position 0 (lets SDPA use its causal kernel). The batch-invariant attention
        # always takes its mask.
        all_visible = not invariant and seq == 1 and full and all(s + 1 == length for s in h_start)
        is_causal = not fold and full and seq == length and from_inputs
        layer_masks = self._layer_masks(positions, length, fold, unmasked=all_visible or is_causal)
        return _StepPlan(
            cos,
            sin,
            length,
            read_blocks,
            first_block,
            write_slots,
            write_src,
            fold,
            layer_masks,
            is_causal,
        )

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, T, 1, D] of `positions` [B, T], sin with its first half negated (_StepPlan)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self._inv_freq
        cos = torch.cat((freqs, freqs), dim=-1).cos()[:, :, None, :].to(self.dtype)
        sin = torch.cat((-freqs, freqs), dim=-1).sin()[:, :, None, :].to(self.dtype)
        return cos, sin

    def _layer_masks(
        self, positions: torch.Tensor, length: int, fold: bool, *, unmasked: bool
    ) -> list[torch.Tensor | None]:
        """Each layer's visibility mask over keys 0..length-1, one per distinct window (None: no mask)."""
        bsz, seq = positions.shape
        group = self.arch.num_heads // self.arch.num_kv_heads
        keys = torch.arange(length, device=positions.device)
        by_window: dict[int | None, torch.Tensor | None] = {}
        layer_masks = []
        for window in self.arch.sliding_windows:
            if window is not None and window >= length:
                window = None  # the window covers every key: same as full attention
            if window not in by_window:
                by_window[window] = None
                if window is not None or not unmasked:
                    visible = keys <= positions[:, :, None]  # [B, T, L]
                    if window is not None:
                        visible &= keys > positions[:, :, None] - window
                    if fold:  # query row t * group + g of the folded layout
                        visible = visible[:, :, None].expand(bsz, seq, group, length).reshape(bsz, -1, length)
                    by_window[window] = visible[:, None]
            layer_masks.append(by_window[window])
        return layer_masks

    def _attention(
        self,
        index: int,
        qk: torch.Tensor,
        v: torch.Tensor,
        plan: _StepPlan,
        cache: PagedKVCache,
        shape: tuple,
    ) -> torch.Tensor:
        """Write this layer's new K/V, attend over the cache; returns [..., H * D] in qk's layout.

        qk / v are [B, T, heads, D], or [N, heads, D] for the N real tokens of a ragged batch
        (`plan.write_src` set): q (and k/v when they are the keys) are scattered into the padded [B, T]
        layout for the attention only.
        """
        a = self.arch
        bsz, seq = shape
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        q, k = qk[..., :h, :], qk[..., h:, :]
        kv = torch.cat((k, v), dim=-2)
        cache.write(index, plan.write_slots, kv.reshape(-1, 2 * hkv, d))
        if plan.write_src is not None:
            padded = q.new_zeros(bsz * seq, h, d)
            padded[plan.write_src] = q
            q = padded.view(bsz, seq, h, d)
        if plan.read_blocks is None:
            if plan.write_src is not None:
                padded_kv = kv.new_zeros(bsz * seq, 2 * hkv, d)
                padded_kv[plan.write_src] = kv
                kv = padded_kv
            kv = kv.view(bsz, seq, 2 * hkv, d)[:, : plan.length]
            keys, values = kv[:, :, :hkv].transpose(1, 2), kv[:, :, hkv:].transpose(1, 2)
        else:
            keys, values = cache.read(index, plan.read_blocks, plan.length, plan.first_block)
        mask = plan.layer_masks[index]
        if plan.fold:
            group = h // hkv
            q = q.reshape(bsz, seq, hkv, group, d).transpose(1, 2)
            q = q.reshape(bsz, hkv, seq * group, d)
            if self.batch_invariant:
                assert mask is not None
                out = batch_invariant.attention(q, keys, values, mask)
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            out = out.view(bsz, hkv, seq, group, d).transpose(1, 2)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys,
                values,
                attn_mask=mask,
                is_causal=plan.is_causal and mask is None,
                enable_gqa=h != hkv,
            ).transpose(1, 2)
        if plan.write_src is not None:
            return out.reshape(bsz * seq, h * d)[plan.write_src]
        return out.reshape(bsz, seq, h * d)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Final-norm hidden states `[B, T, hidden]`; writes the K/V of the real tokens into `cache`.

        A ragged batch (rows shorter than T) runs every projection and MLP on its real tokens only, packed
        as [N, hidden]; only the attention sees the padded layout. Padding positions of the result are
        zeros.
        """
        with prefill_pass(batch.prefill):
            return self._forward(input_ids, batch, cache)

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        a = self.arch
        linear = _invariant_linear if self.batch_invariant else _linear
        bsz, seq = input_ids.shape
        plan = self._plan(input_ids, batch, cache)
        num_qk, head_dim = a.num_heads + a.num_kv_heads, a.head_dim
        src = plan.write_src
        tokens = input_ids if src is None else input_ids.reshape(-1)[src]
        hidden = F.embedding(tokens, self.model.embed_tokens.weight)
        lead = hidden.shape[:-1]
        for index, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(hidden, layer.input_layernorm.weight, a.eps)
            qkv = linear(attn.qkv_proj, x).view(*lead, -1, head_dim)
            qk, v = qkv[..., :num_qk, :], qkv[..., num_qk:, :]
            if a.qk_norm:
                weight = torch.cat(
                    (
                        attn.q_norm.weight.expand(a.num_heads, -1),
                        attn.k_norm.weight.expand(a.num_kv_heads, -1),
                    )
                )
                qk = _rms_norm(qk, weight, a.eps)
            # RoPE on q and k together; roll(x, D/2) * sin_signed == rotate_half(x) * sin, bit for bit.
            qk = qk * plan.cos + qk.roll(head_dim // 2, dims=-1) * plan.sin
            out = self._attention(index, qk, v, plan, cache, (bsz, seq))
            hidden = hidden + linear(attn.o_proj, out)

            x = _rms_norm(hidden, layer.post_attention_layernorm.weight, a.eps)
            gate, up = linear(mlp.gate_up_proj, x).chunk(2, dim=-1)
            hidden = hidden + linear(mlp.down_proj, F.silu(gate) * up)
        hidden = _rms_norm(hidden, self.model.norm.weight, a.eps)
        if src is None:
            return hidden
        padded = hidden.new_zeros(bsz * seq, a.hidden_size)
        padded[src] = hidden
        return padded.view(bsz, seq, a.hidden_size)

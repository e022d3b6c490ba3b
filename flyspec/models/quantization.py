"""Weight quantization as a load option: `quantization="int8"` (W8A8, dynamic per-token activations)
or `quantization="int4"` (4-bit weight groups, activations to int8 per group).

**int8.** Every linear layer of the decoder (q/k/v, o, gate/up, down) and the lm_head becomes an `Int8Linear`:
int8 weights with one symmetric scale per output channel, and activations quantized to int8 on the fly
with one symmetric scale per token (per row of the input), so a token with a large activation does not
cost the other tokens of the batch their precision. The product runs in oneDNN's int8 matmul (AMX or
VNNI where the CPU has them) with float32 accumulation of the scales:

    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k] + bias[n]

On a CPU with AVX2 but no VNNI (AMD Zen 3 and older, many laptops) our own kernel computes the same
product (`int8_kernel`, csrc/int8_matmul.cpp) for every pass: there oneDNN's `gemm:jit` took about twice
bfloat16's time for one row, and it multiplies unsigned activations by signed weights with AVX2's
`vpmaddubsw`, whose int16 pair sums saturate (255 * 127 * 2 > 32767), so its results were off by several
percent of the output's range; ours keeps every integer sum exact (docs/performance.md).

The embedding table stays in the model's dtype (a lookup reads a few rows; quantizing it would only add
error), and so do the norms, RoPE and attention with its KV cache.

Why our own module rather than torchao's `Int8DynamicActivationInt8WeightConfig` or
`torch.ao.quantization.quantize_dynamic`: in eager mode torchao runs `torch._int_mm` on CPU, no faster
than bfloat16 here, and torch.ao quantizes activations with one scale per tensor (deprecated besides);
oneDNN's `qlinear_pointwise` with prepacked weights is the kernel both lower to, and calling it directly
with per-token scales was 2-3x faster than bfloat16 for decode-sized inputs in the measurements in
docs/performance.md.

**int4.** Every linear layer and the lm_head become an `Int4Linear`: weights in groups of 64 input
channels (32 when the width is not a multiple of 64), each group with its own scale and offset
(asymmetric round-to-nearest). The product is our kernel (`int4_kernel`, csrc/int4_matmul.cpp, built
once per machine): the activations are quantized to int8 in the same groups, one symmetric scale per
group of each row, and multiplied with the 4-bit codes by AVX-512 VNNI, so the weights, a quarter of
bfloat16's bytes, are read once for up to 8 rows; a verify pass of a few rows costs little more than one
row. Where that kernel cannot be built (no compiler, no AVX-512 VNNI), torch's `_weight_int4pack_mm_for_cpu`
takes its place (activations in the model's dtype), a matrix-vector kernel whose time grows with every
row. Prompts of hundreds of tokens are still faster through int8's matmul, so each int4 layer also keeps
an int8 copy of its weights (`Int8Linear`) for prefill passes, which the model marks
(`ForwardBatch.prefill`, read here through `prefill_pass`): prompt tokens always take the int8 copy and
generated tokens always the int4 kernel, in target-only and speculative runs alike, so exactness is
unaffected. The lm_head, which a prefill pass calls for only the last position of each prompt, has no
copy. docs/performance.md has the measurements.

**float32** (`Float32Linear`) is not a user option but a format `quantization="auto"` may choose
(flyspec/models/kernel_check.py): on a CPU without bfloat16 arithmetic (AVX2-only, or AVX-512 without
AVX-512 BF16) a bfloat16 matmul is emulated, and a float32 copy of the weights, read at twice the bytes,
can still be faster once a pass has more than a few rows. The rest of the model stays bfloat16.

Quantization is on the CPU only (oneDNN and torch's CPU kernels); `check_quantization` says so for other
devices.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flyspec.config import QUANTIZATION_METHODS
from flyspec.huge_pages import HugePageArena, place
from flyspec.models import int4_kernel, int8_kernel

LINEAR_FORMATS = (*QUANTIZATION_METHODS, "float32")
"""What `quantize_model` can turn linear layers into: the user's formats and "auto"'s float32."""

_EPS = 1e-12  # an all-zero row (a padding token) gets a tiny scale instead of a division by zero


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """ValueError unless `quantization` is None or a supported method on `device`."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={quantization!r}: must be None or one of {', '.join(QUANTIZATION_METHODS)}"
        )
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU only (CPU kernels); got device={device}"
        )


_CHUNK_ELEMENTS = 1 << 18
"""Rows are quantized in chunks of about this many elements: the float32 temporaries of a chunk stay in
cache, which made quantizing a [2048, 8960] prefill input about 2x faster than in one piece, and the
weights of a 1.5B model at load time 2-5x faster (bit for bit the same result)."""


def _row_chunks(n: int, k: int) -> Iterator[slice]:
    """Slices of the n rows (of k elements each) in chunks of about `_CHUNK_ELEMENTS` elements."""
    rows = max(1, _CHUNK_ELEMENTS // k)
    for i in range(0, n, rows):
        yield slice(i, min(i + rows, n))


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights [N, K] and float32 scales [N], one per output channel (row)."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for rows in _row_chunks(n, k):
        w = weight[rows].detach().to(torch.float32, copy=True)  # a copy: the math below is in place
        s = scale[rows] = w.abs().amax(dim=1).clamp_(min=_EPS).div_(127.0)
        q[rows] = w.div_(s.unsqueeze(1)).round_().clamp_(-127, 127)
    return q, scale


def quantize_per_token(x: torch.Tensor, *, zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of the rows of a 2-D input and float32 scales [M, 1], one per row.

    |x / s| <= 127 by construction of s, so no clamp is needed; rounding is to nearest, ties to even.
    With `zero_point=128` the codes are stored as uint8 `round(x / s) + 128` (the same values, shifted;
    see `Int8Linear.int8_matmul` for why the kernel wants them so); with 0 as int8.
    The division runs on a float32 copy (never in x): a bfloat16 x divided by a float32 scale directly
    takes a slow mixed-dtype path.
    """
    if zero_point not in (0, 128):
        raise ValueError(f"zero_point={zero_point!r}: must be 0 (int8 codes) or 128 (uint8 codes)")
    dtype = torch.uint8 if zero_point else torch.int8
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=_EPS).div_(127.0)
    if x.numel() <= _CHUNK_ELEMENTS:
        return x.to(torch.float32, copy=True).div_(scale).round_().add_(zero_point).to(dtype), scale
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    for rows in _row_chunks(*x.shape):
        q[rows] = x[rows].to(torch.float32, copy=True).div_(scale[rows]).round_().add_(zero_point)
    return q, scale


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and per-token dynamically quantized int8 activations.

    Built from a float weight [N, K] (and bias [N]); the float weight is not kept. `out_dtype` is the
    dtype of the outputs (the model's dtype, or float32 for logits).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        *,
        arena: HugePageArena | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        q, scale = quantize_per_channel(weight)
        self.bias = None if bias is None else bias.detach().float()
        # On a CPU with AVX2 but no VNNI, oneDNN's int8 kernel is slow for few rows and saturates its
        # int16 pair sums (module docstring); ours runs every pass there.
        self._kernel = int8_kernel.library() if self.in_features % 4 == 0 else None
        if self._kernel is not None:
            codes, self.weight_scale = int8_kernel.pack(q, scale)
            self.codes = place(codes, arena)  # streamed at every step: huge pages (flyspec/huge_pages.py)
            return
        # Plain attributes, not buffers: the packed weight is an opaque oneDNN layout (the int8 matrix
        # reordered; `q` itself is not kept), and a quantized model is built from a float checkpoint at
        # load time, never saved.
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.weight_scale = scale
        self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)

    def int8_matmul(self, x_u8: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k (x_u8[m, k] - 128) * q_w[n, k] * s_w[n] as float32 [M, N] for uint8 codes [M, K] with
        zero point 128 (`quantize_per_token(x, zero_point=128)`), written into `out` (float32 [M, N],
        contiguous) when given.

        Into `out`: oneDNN's matmul has no output argument, but its "sum" post-op accumulates into a
        given tensor in place; accumulated onto zeros the result is the same bits.

        Why unsigned activations: without AMX, oneDNN multiplies int8 with VNNI's `vpdpbusd`, which takes
        one unsigned operand. Signed activations would need an s8s8 compensation term inside the packed
        weights, which `qlinear_prepack` does not build, so oneDNN fell back to its reference kernel
        (`ref_int8`, about 400x slower than bfloat16 on an AMD EPYC with AVX-512 VNNI). Unsigned codes
        with zero point 128 are the same values, use the zero-point compensation the packed weights do
        carry, and run oneDNN's optimised kernels (`brg_matmul:avx512_core_vnni`, AMX where present).
        The integer sums are exact either way, so the outputs are bit for bit the same.
        """
        if out is None:
            return torch.ops.onednn.qlinear_pointwise(
                x_u8, 1.0, 128, self.packed, self.weight_scale, self._zero_points, None, 1.0, 0,
                torch.float32, "none", [], "",
            )  # fmt: skip
        return torch.ops.onednn.qlinear_pointwise.binary(
            x_u8, 1.0, 128, self.packed, self.weight_scale, self._zero_points, out.zero_(), None, 1.0, 0,
            torch.float32, 1.0, 0, "sum", 1.0, "none", [], "",
        )  # fmt: skip

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] (any float dtype) -> [..., N] in `out_dtype`, written into `out` (contiguous, of
        that shape and dtype) when given."""
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        flat_out = None if out is None else out.view(-1, self.out_features)
        if self._kernel is not None:
            y = int8_kernel.matmul(
                self._kernel, rows, self.codes, self.weight_scale, self.out_features, self.bias,
                self.out_dtype, flat_out,
            )  # fmt: skip
            return y.view(*shape[:-1], self.out_features)
        x_u8, x_scale = quantize_per_token(rows, zero_point=128)
        into = flat_out if flat_out is not None and flat_out.dtype == torch.float32 else None
        y = self.int8_matmul(x_u8, into).mul_(x_scale)
        if self.bias is not None:
            y.add_(self.bias)
        if flat_out is not None and y is not flat_out:
            y = flat_out.copy_(y)
        return y.to(self.out_dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-token"


INT4_GROUP_SIZES = (64, 32)
"""Input channels per int4 group, first choice first (the kernel takes 32, 64, 128 or 256; 64 costs
half a bit per weight for the scales and offsets, about what llama.cpp's Q4_K spends)."""

_INT4_ROWS = 16  # the kernel packs output channels in blocks of 16; other widths are padded with zeros

_PREFILL = contextvars.ContextVar("flyspec_prefill_pass", default=False)


@contextlib.contextmanager
def prefill_pass(active: bool = True) -> Iterator[None]:
    """Mark the forward passes inside as prefill passes (prompt tokens only), so that int4 layers use
    their int8 copy; `active=False` leaves the mark as it is outside."""
    token = _PREFILL.set(active or _PREFILL.get())
    try:
        yield
    finally:
        _PREFILL.reset(token)


def quantize_per_group_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsigned 4-bit codes [N, K] (uint8, 0..15) and float32 (scale, offset) [K / group_size, N, 2] with
    w ~ (code - 8) * scale + offset, one pair per group of `group_size` input channels of each row (torch's
    int4 kernel's layout). The offset is the group's midpoint, so min and max are represented exactly."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    pairs = torch.empty(k // group_size, n, 2, dtype=torch.float32, device=weight.device)
    for rows in _row_chunks(n, k):
        w = weight[rows].detach().to(torch.float32, copy=True)  # a copy: the math below is in place
        w = w.view(-1, k // group_size, group_size)
        low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
        scale = ((high - low) / 15).clamp_(min=_EPS)
        codes[rows] = w.sub_(low).div_(scale).round_().clamp_(0, 15).view(-1, k)
        pairs[:, rows, 0] = scale.view(-1, k // group_size).t()
        pairs[:, rows, 1] = low.add_(scale, alpha=8).view(-1, k // group_size).t()
    return codes, pairs


class Int4Linear(nn.Module):
    """A linear layer with 4-bit grouped weights (see the module docstring for the two kernels).

    Built from a float weight [N, K] (and bias [N]); the float weight is not kept. Each output row depends
    only on its own input row, bit for bit, which keeps greedy speculative decoding exact over int4
    weights. `out_dtype` is the dtype of the outputs. With
    `prefill_copy` the layer also holds an `Int8Linear` of the same weight, used inside `prefill_pass()`.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        *,
        prefill_copy: bool = True,
        arena: HugePageArena | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self.group_size = next((g for g in INT4_GROUP_SIZES if self.in_features % g == 0), None)
        if self.group_size is None:
            raise ValueError(
                f"quantization='int4' needs layers whose input width is a multiple of "
                f"{min(INT4_GROUP_SIZES)}; this model has one of width {self.in_features}"
            )
        self.prefill = Int8Linear(weight, bias, out_dtype, arena=arena) if prefill_copy else None
        pad = -self.out_features % _INT4_ROWS
        if pad:
            weight = torch.cat((weight.detach(), weight.new_zeros(pad, self.in_features)))
        codes, pairs = quantize_per_group_int4(weight, self.group_size)
        # Plain attributes, not buffers, as for Int8Linear: packed layouts, never saved.
        self._kernel = int4_kernel.library()
        if self._kernel is not None:
            # Streamed at every decode step: in huge-page-advised memory (flyspec/huge_pages.py).
            packed, scales = int4_kernel.pack(codes, pairs)
            self.packed, self.scales_and_offsets = place(packed, arena), place(scales, arena)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
            self.scales_and_offsets = pairs.to(weight.dtype)
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] (float32, bfloat16 or float16) -> [..., N] in `out_dtype`, written into `out`
        (contiguous, of that shape and dtype) when given."""
        if self.prefill is not None and _PREFILL.get():
            y = self.prefill.forward(x)
            return y if out is None else out.copy_(y)
        shape = x.shape
        rows = x.reshape(-1, self.in_features).contiguous()  # the kernels read rows densely
        if self._kernel is not None:
            y = int4_kernel.matmul(
                self._kernel, rows, self.packed, self.scales_and_offsets, self.group_size,
                self.out_features, self.bias, self.out_dtype,
                None if out is None else out.view(-1, self.out_features),
            )  # fmt: skip
            return y.view(*shape[:-1], self.out_features)
        # torch's kernel wants the scales in the activations' dtype (a model's own calls match).
        pairs = self.scales_and_offsets.to(rows.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, pairs)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y.to(torch.float32).add_(self.bias)
        y = y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)
        return y if out is None else out.copy_(y)

    def extra_repr(self) -> str:
        groups = f"int4 groups of {self.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {groups}"


class Float32Linear(nn.Module):
    """A linear layer whose weight is held in float32: inputs of any float dtype are upcast, the product
    runs in float32 (MKL or oneDNN's float32 kernels), and the output is cast to `out_dtype`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        # Plain attributes, as for the quantized layers: built at load, never saved.
        self.weight32 = weight.detach().to(torch.float32, copy=True).contiguous()
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in `out_dtype`, copied into `out` when given."""
        y = F.linear(x.to(torch.float32), self.weight32, self.bias).to(self.out_dtype)
        return y if out is None else out.copy_(y)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32 weights"


def quantized_linear(
    method: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    logits: bool = False,
    arena: HugePageArena | None = None,
) -> nn.Module:
    """The layer of `method` ("int8", "int4" or "float32", one of `LINEAR_FORMATS`) built from a float
    weight [N, K] and bias; `logits` marks the lm_head (an int4 lm_head needs no prefill copy). `arena`:
    where the quantized weights our kernels stream go (each layer gets its own mapping without one)."""
    if method == "int4":
        return Int4Linear(weight, bias, out_dtype, prefill_copy=not logits, arena=arena)
    if method == "float32":
        return Float32Linear(weight, bias, out_dtype)
    return Int8Linear(weight, bias, out_dtype, arena=arena)


def quantize_model(model: nn.Module, method: str, *, lm_head: str = "lm_head") -> None:
    """Replace every `nn.Linear` of `model` by the layer of `method` (one of `LINEAR_FORMATS`), in place,
    freeing the float weights as it goes (so the peak memory is the float model plus one layer's copy).

    The top-level `lm_head` produces float32 logits; every other layer keeps the model's dtype.
    """
    if method != "float32":
        check_quantization(method, next(model.parameters()).device)
    dtype = next(model.parameters()).dtype
    # (parent, name) pairs, not the layers: a list that held the nn.Linear modules (as one of
    # model.modules() does) kept every float weight alive until the end, 1.7 GB more at the 1.5B's peak
    linears = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    arena = HugePageArena()
    for parent, name in linears:
        child = getattr(parent, name)
        logits = parent is model and name == lm_head
        out_dtype = torch.float32 if logits else dtype
        layer = quantized_linear(method, child.weight, child.bias, out_dtype, logits=logits, arena=arena)
        setattr(parent, name, layer)
        del child

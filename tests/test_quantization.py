"""int8 and int4 weight quantization (flyspec/models/quantization.py): the kernels' arithmetic, per-token
scales, int4 groups, the quantized model against its float original, exact speculative decoding over
quantized weights, and the configuration rules of the option."""

from __future__ import annotations

import pytest
import torch
from tiny_engine import finish, ids, run
from tiny_llm import TinyModels

from flyspec.config import EngineConfig, SpeculativeConfig
from flyspec.engine.engine import LLMEngine
from flyspec.models import cpu_kernels, int4_kernel, int8_kernel
from flyspec.models.llama import ForwardBatch
from flyspec.models.loader import load_model
from flyspec.models.quantization import (
    Int4Linear,
    Int8Linear,
    prefill_pass,
    quantize_per_channel,
    quantize_per_group_int4,
    quantize_per_token,
)
from flyspec.sampling_params import SamplingParams

PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 240}" for j in range(2 + 5 * i)) for i in range(6)]
_TORCH_INT4 = "_weight_int4pack_mm_for_cpu"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    return {**tiny_models.pair(), "qwen2": tiny_models.get(seed=2, arch="qwen2")}


@pytest.fixture(params=["onednn", "avx2"])
def int8_kernel_choice(request, monkeypatch) -> str:
    """Each int8 test runs on oneDNN's kernel (this CPU's) and on ours for AVX2 without VNNI
    (FLYSPEC_CPU_ISA=avx2: what an AMD Zen 3 runs)."""
    if request.param == "avx2":
        monkeypatch.setenv("FLYSPEC_CPU_ISA", "avx2")
    else:
        monkeypatch.setenv("FLYSPEC_INT8_KERNEL", "onednn")
    int8_kernel.library.cache_clear()
    if request.param == "avx2" and int8_kernel.library() is None:
        pytest.skip(f"our int8 kernel cannot be built here: {int8_kernel.unavailable_reason()}")
    yield request.param
    int8_kernel.library.cache_clear()


def test_int8_linear_computes_the_per_token_per_channel_product(int8_kernel_choice: str) -> None:
    """Int8Linear's output is s_x[m] * s_w[n] * (q_x @ q_w^T)[m, n] + bias[n], computed exactly in integers
    (checked against a float64 reference), for inputs of 1, 5 and 33 rows; on our AVX2 kernel also
    for rows far beyond what int16 pair sums of unsigned activations could hold (oneDNN's AVX2 kernel
    saturates there: docs/performance.md)."""
    if int8_kernel_choice == "onednn" and cpu_kernels.kernel_isa() == "avx2":
        pytest.skip(
            "oneDNN's int8 on a CPU without VNNI is gemm:jit, whose int16 pair sums saturate "
            "(docs/performance.md): flyspec runs its own kernel here (the avx2 case) unless asked otherwise"
        )
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 80), torch.randn(96)
    layer = Int8Linear(weight, bias, torch.float32)
    q_w, s_w = quantize_per_channel(weight)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 80) * torch.logspace(-2, 2, rows).unsqueeze(1)  # very different row scales
        q_x, s_x = quantize_per_token(x)
        exact = (q_x.double() @ q_w.double().T) * s_x.double() * s_w.double() + bias.double()
        torch.testing.assert_close(layer(x).double(), exact, rtol=1e-6, atol=1e-6)


def test_int8_rows_do_not_depend_on_the_other_rows(int8_kernel_choice: str) -> None:
    """Each output row of Int8Linear is bit-identical whether its input row is multiplied alone or with
    others (what keeps greedy speculative decoding exact over int8 weights); 11 rows cross our kernel's
    chunks of 4 rows, and 72 outputs end inside its blocks of 16."""
    torch.manual_seed(5)
    layer = Int8Linear(torch.randn(72, 96).to(torch.bfloat16), None, torch.bfloat16)
    x = torch.randn(11, 96).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(11)])
    assert torch.equal(layer(x), alone)


def test_large_inputs_are_quantized_in_chunks_with_the_same_result() -> None:
    """An input too large for one chunk (600 x 1024 bfloat16) gets exactly round(x / s) per row, as a
    small one does, and x itself is left untouched."""
    torch.manual_seed(2)
    x = torch.randn(600, 1024).to(torch.bfloat16)
    before = x.clone()
    q, s = quantize_per_token(x)
    expected = torch.round(x.float() / (x.float().abs().amax(dim=1, keepdim=True) / 127))
    assert torch.equal(q, expected.to(torch.int8)) and torch.equal(x, before)
    assert s.shape == (600, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_weights_are_quantized_in_chunks_with_the_same_result(dtype: torch.dtype) -> None:
    """A weight spanning several chunks (700 x 1024) gets, per channel and per group of 64, exactly the
    one-piece formulas' codes, scales and offsets, and the weight itself is left untouched (a float32
    weight is not copied by `.float()`, so in-place math on it would corrupt the model)."""
    torch.manual_seed(4)
    weight = torch.randn(700, 1024).to(dtype)
    before = weight.clone()
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q, s = quantize_per_channel(weight)
    assert torch.equal(s, scale) and torch.equal(q, torch.round(w / scale[:, None]).to(torch.int8))
    groups = w.view(700, 16, 64)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    step = (high - low) / 15
    codes, pairs = quantize_per_group_int4(weight, 64)
    assert torch.equal(codes, torch.round((groups - low) / step).view(700, 1024).to(torch.uint8))
    assert torch.equal(pairs[..., 0], step.view(700, 16).t())
    assert torch.equal(pairs[..., 1], (low + 8 * step).view(700, 16).t())
    assert torch.equal(weight, before)


def test_per_token_scales_keep_small_rows_precise() -> None:
    """A row with 1000x larger activations does not cost the other rows their precision (one scale per
    token), so each row's relative error matches the row quantized alone."""
    torch.manual_seed(1)
    weight = torch.randn(64, 64)
    layer = Int8Linear(weight, None, torch.float32)
    x = torch.randn(4, 64)
    x[2] *= 1000
    ref = x @ weight.T
    alone = torch.cat([layer(x[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(layer(x), alone, rtol=0, atol=0)
    rel = (layer(x) - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max() < 0.02


@pytest.fixture(params=["ours", "avx2", "torch"])
def int4_kernel_choice(request, monkeypatch) -> str:
    """Each int4 test runs on our few-row kernel for this CPU's best instruction set, on its AVX2 build
    (FLYSPEC_CPU_ISA=avx2, what an AVX2-only CPU runs; the same build where that is all the CPU has) and on
    torch's, the fallback where ours cannot be built (FLYSPEC_INT4_KERNEL=torch asks for it)."""
    if request.param == "torch":
        monkeypatch.setenv("FLYSPEC_INT4_KERNEL", "torch")
    if request.param == "avx2":
        monkeypatch.setenv("FLYSPEC_CPU_ISA", "avx2")
    int4_kernel.library.cache_clear()
    if request.param != "torch" and int4_kernel.library() is None:
        pytest.skip(f"our int4 kernel cannot be built here: {int4_kernel.unavailable_reason()}")
    if request.param == "avx2":
        assert int4_kernel.describe() == "flyspec int4 kernel (avx2)"
    yield request.param
    int4_kernel.library.cache_clear()


def _int4_reference(x: torch.Tensor, layer: Int4Linear, weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """float64 x @ W^T for the layer's int4 weights W = (code - 8) * scale + offset, one scale and offset
    per group; on our kernel with the scale and offset' = offset - 8 * scale in bfloat16 and x quantized to
    int8 per group of the same width (symmetric, round to nearest), as the kernel does."""
    group = layer.group_size
    codes, pairs = quantize_per_group_int4(weight, group)
    scale, offset = pairs[..., 0].double(), pairs[..., 1].double()
    if kernel == "torch":
        offset = offset - 8 * scale
    else:
        scale, offset = scale.bfloat16().double(), (offset - 8 * scale).bfloat16().double()
        xg = x.double().view(x.shape[0], -1, group)
        sx = xg.abs().amax(dim=2, keepdim=True) / 127
        x = (torch.round(xg / sx) * sx).view_as(x)
    w = codes.double() * scale.t().repeat_interleave(group, 1) + offset.t().repeat_interleave(group, 1)
    return x.double() @ w.T


@pytest.mark.parametrize("out_features", [96, 40])
def test_int4_linear_computes_the_grouped_product(out_features: int, int4_kernel_choice: str) -> None:
    """Int4Linear's output is x @ ((code - 8) * scale + offset)^T + bias with one scale and offset per
    group of 64 input channels (our kernel: activations quantized to int8 in the same groups), checked
    against a float64 reference for 1, 5 and 33 rows, also for a width not a multiple of 16 (40 output
    rows, padded to 48 and cut back)."""
    torch.manual_seed(3)
    weight, bias = torch.randn(out_features, 128), torch.randn(out_features)
    layer = Int4Linear(weight, bias, torch.float32)
    assert layer.group_size == 64
    codes, pairs = quantize_per_group_int4(weight, 64)
    scale, offset = (pairs[..., i].t().repeat_interleave(64, dim=1).double() for i in (0, 1))
    dequant = (codes.double() - 8) * scale + offset
    assert (dequant - weight.double()).abs().max() <= scale.max() / 2 + 1e-6  # round to nearest
    for rows in (1, 5, 33):
        x = torch.randn(rows, 128)
        expected = _int4_reference(x, layer, weight, int4_kernel_choice) + bias.double()
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("int4_kernel_choice", ["ours", "avx2"], indirect=True)
def test_our_int4_kernels_activation_quantization_adds_little_error(int4_kernel_choice: str) -> None:
    """Quantizing the activations to int8 per group of 64 (our kernel) adds little to the weights' own
    int4 error: on Gaussian inputs the product's relative error grows by under 1% of the weight error
    (under 5% for bfloat16 inputs and outputs)."""
    torch.manual_seed(6)
    weight = torch.randn(256, 512) * 0.02
    layer = Int4Linear(weight, None, torch.float32, prefill_copy=False)
    x = torch.randn(3, 512)
    exact = x.double() @ weight.double().T
    weights_only = _int4_reference(x, layer, weight, "torch")

    def err(y: torch.Tensor) -> float:
        return ((y.double() - exact).norm() / exact.norm()).item()

    assert err(layer(x)) < 1.01 * err(weights_only)
    low = Int4Linear(weight.bfloat16(), None, torch.bfloat16, prefill_copy=False)
    assert low(x.bfloat16()).dtype == torch.bfloat16 and err(low(x.bfloat16())) < 1.05 * err(weights_only)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_rows_do_not_depend_on_the_other_rows(dtype: torch.dtype, int4_kernel_choice: str) -> None:
    """Each output row of Int4Linear is bit-identical whether its input row is multiplied alone, with
    others, or within a slice of the batch: what keeps speculative decoding exact over int4 weights,
    whose verify passes have more rows than a target-only step. 19 rows cross our kernel's chunks of 8
    rows (4 on AVX2) and its different block widths for 1-8 rows; 72 outputs end inside a block of 16."""
    torch.manual_seed(4)
    layer = Int4Linear(torch.randn(72, 96).to(dtype), None, dtype)
    assert layer.group_size == 32  # 96 is not a multiple of 64
    x = torch.randn(19, 96).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(19)])
    assert torch.equal(layer(x), alone)
    assert all(torch.equal(layer(x)[i : i + n], layer(x[i : i + n])) for i in (0, 2) for n in range(2, 9))


def test_int4_layers_use_their_int8_copy_inside_a_prefill_pass() -> None:
    """Inside `prefill_pass()` an Int4Linear returns exactly its Int8Linear copy's output (the fast path
    for many rows); outside it, the int4 kernel's; the lm_head flavour has no copy and ignores the mark."""
    torch.manual_seed(5)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    layer = Int4Linear(weight, bias, torch.float32)
    head = Int4Linear(weight, None, torch.float32, prefill_copy=False)
    x = torch.randn(9, 64)
    decode = layer(x)
    with prefill_pass():
        assert torch.equal(layer(x), layer.prefill(x))
        assert torch.equal(head(x), Int4Linear(weight, None, torch.float32, prefill_copy=False)(x))
    assert not torch.equal(decode, layer.prefill(x)) and torch.equal(layer(x), decode)


def test_the_engine_runs_prompts_on_the_int8_copy_and_generated_tokens_on_int4(
    models, monkeypatch, int4_kernel_choice: str
) -> None:
    """With quantization='int4', the target's prefill passes (and the draft's) take the int8 copies and
    every decode or verify pass takes the int4 kernel: counted on the real layers of a real engine."""
    calls = {"int8 copy": 0, "int4 kernel": 0}
    owner, name = (torch.ops.aten, _TORCH_INT4) if int4_kernel_choice == "torch" else (int4_kernel, "matmul")
    real_kernel = getattr(owner, name)
    real_copy = Int8Linear.forward

    def kernel(*args):
        calls["int4 kernel"] += 1
        return real_kernel(*args)

    def copy(self, x):
        calls["int8 copy"] += 1
        return real_copy(self, x)

    spec = {"model": models["draft"], "num_speculative_tokens": 2}
    eng = LLMEngine(
        EngineConfig(model=models["target"], dtype="float32", quantization="int4", speculative_config=spec)
    )
    monkeypatch.setattr(owner, name, kernel)
    monkeypatch.setattr(Int8Linear, "forward", copy)
    eng.add_request("r", PROMPTS[3], SamplingParams(temperature=0, max_tokens=1))
    finish(eng)
    linears = 4 * 2  # four projections in each of the tiny model's two layers
    assert calls == {"int8 copy": 2 * linears, "int4 kernel": 1}  # target + draft prefill; the lm_head
    eng.add_request("s", PROMPTS[3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()  # the prefill
    calls.update({"int8 copy": 0, "int4 kernel": 0})
    finish(eng)
    assert calls["int8 copy"] == 0 and calls["int4 kernel"] > 0


def test_int4_refuses_a_width_without_whole_groups() -> None:
    """A layer whose input width is not a multiple of 32 cannot be cut into int4 groups: ValueError
    naming the width, not a kernel error."""
    with pytest.raises(ValueError, match="quantization='int4' needs .* multiple of 32; .* width 48"):
        Int4Linear(torch.randn(16, 48), None, torch.float32)


@pytest.mark.parametrize(
    ("method", "layer", "max_error", "agreement"),
    [("int8", Int8Linear, 0.05, 0.9), ("int4", Int4Linear, 0.5, 0.5)],
)
def test_quantized_model_is_close_to_its_float_original(
    models, method: str, layer: type, max_error: float, agreement: float
) -> None:
    """Every linear layer and the lm_head become the method's quantized layer (embedding stays float),
    and the logits of a prefill stay close to the float model's: a small relative error and the same
    argmax at most positions. Random Gaussian weights are the hard case for 4 bits (about 9% error per
    layer against int8's 0.9%), so int4's bounds are loose here: they catch a wrongly wired model
    (uncorrelated logits, error about 1.4, agreement about 1/256); the real models' agreement is in
    docs/performance.md."""
    ref = load_model(models["qwen2"], "float32")
    quant = load_model(models["qwen2"], "float32", quantization=method)
    assert quant.quantization == method and ref.quantization is None
    linears = [m for m in quant.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [] and isinstance(quant.model.lm_head, layer)
    assert quant.model.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.tensor([[5 + (i * 37) % 240 for i in range(40)]])
    batch = ForwardBatch(torch.tensor([[0, 1, 2]]), torch.tensor([0]), torch.tensor([40]))
    logits = []
    for loaded in (ref, quant):
        hidden = loaded.model(ids, batch, loaded.model.new_cache(3, 16))
        logits.append(loaded.model.compute_logits(hidden[0]))
    err = (logits[0] - logits[1]).norm() / logits[0].norm()
    assert err < max_error
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= agreement


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter", ["random_draft", "self_draft"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_greedy_speculative_decoding_over_quantized_weights_is_exact(
    models, method: str, drafter: str, k: int
) -> None:
    """Exactness holds for the same quantized weights: float32 greedy speculative output with a quantized
    target and draft is token-identical to the quantized target-only output (int8: integer products do
    not depend on how many rows a pass has, and each row's activation scale is its own; int4: the kernel
    computes each row on its own)."""
    draft = models["draft"] if drafter == "random_draft" else models["target"]

    def engine(spec: dict | None) -> LLMEngine:
        config = EngineConfig(
            model=models["target"], speculative_config=spec, dtype="float32", quantization=method
        )
        return LLMEngine(config)

    reference = ids(run(engine(None), PROMPTS, GREEDY))
    eng = engine({"model": draft, "num_speculative_tokens": k})
    assert ids(run(eng, PROMPTS, GREEDY)) == reference
    assert eng.stats.num_drafts > 0
    if drafter == "self_draft":
        assert eng.stats.acceptance_rate == 1.0


@pytest.mark.parametrize(("target_q", "draft_q"), [(None, "int8"), (None, "int4"), ("int8", "int4")])
def test_a_draft_quantized_on_its_own_is_exact(models, target_q: str | None, draft_q: str) -> None:
    """Quantizing only the draft, or the draft differently from the target (speculative_config
    quantization) changes the drafts, never the output: it equals the target's own greedy output."""
    base = {"model": models["target"], "dtype": "float32", "quantization": target_q}
    reference = ids(run(LLMEngine(EngineConfig(**base)), PROMPTS, GREEDY))
    spec = {"model": models["target"], "num_speculative_tokens": 3, "quantization": draft_q}
    eng = LLMEngine(EngineConfig(**base, speculative_config=spec))
    assert eng.drafter.runner.model.quantization == draft_q
    assert eng.target.model.quantization == target_q
    assert ids(run(eng, PROMPTS, GREEDY)) == reference


def test_quantization_config_rules() -> None:
    """quantization is None, 'int8' or 'int4', CPU only; the draft follows the engine unless its own
    setting says otherwise; ngram has no draft to quantize; to_dict lists the draft's setting only when
    set."""
    assert EngineConfig(model="m", quantization="int8").quantization == "int8"
    assert EngineConfig(model="m", quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="quantization='int3' is invalid: it must be one of 'int8', 'int4'"):
        EngineConfig(model="m", quantization="int3")
    with pytest.raises(ValueError, match="quantization='int4' is invalid: it runs on device='cpu' only"):
        EngineConfig(model="m", quantization="int4", device="cuda")
    with pytest.raises(ValueError, match="quantization='int8' is invalid: it runs on device='cpu' only"):
        EngineConfig(model="m", quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="draft quantization='int8' is invalid: it runs on device='cpu'"):
        EngineConfig(
            model="m",
            device="cuda",
            speculative_config={"model": "d", "num_speculative_tokens": 2, "quantization": "int8"},
        )
    with pytest.raises(ValueError, match="quantization='int8' is invalid: method='ngram' has no draft"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, quantization="int8")
    with pytest.raises(
        ValueError, match="quantization='fp8' is invalid: it must be one of 'int8', 'int4', 'auto', 'none'"
    ):
        SpeculativeConfig(model="d", num_speculative_tokens=2, quantization="fp8")

    def draft_q(engine_q: str | None, draft: str | None) -> str | None:
        spec = {"model": "d", "num_speculative_tokens": 2, "quantization": draft}
        return EngineConfig(model="m", quantization=engine_q, speculative_config=spec).draft_quantization

    assert draft_q("int8", None) == "int8" and draft_q(None, None) is None
    assert draft_q(None, "int8") == "int8" and draft_q("int8", "none") is None
    assert draft_q("int8", "int4") == "int4"
    assert EngineConfig(model="m", quantization="int8").draft_quantization is None
    unset = SpeculativeConfig(model="d", num_speculative_tokens=2)
    assert "quantization" not in unset.to_dict()
    given = SpeculativeConfig(model="d", num_speculative_tokens=2, quantization="none")
    assert SpeculativeConfig.from_dict(given.to_dict()) == given


def test_a_preloaded_model_must_match_the_configured_quantization(models) -> None:
    """An engine handed weights loaded without quantization refuses a config that asks for int8 (and the
    reverse), naming both, instead of silently running other weights than configured."""
    loaded = load_model(models["target"], "float32")
    config = EngineConfig(model=models["target"], dtype="float32", quantization="int8")
    with pytest.raises(ValueError, match="preloaded target model .* quantization=None, but the engine"):
        LLMEngine(config, target=loaded)
    with pytest.raises(ValueError, match="quantization='int3': must be None or one of int8, int4"):
        load_model(models["target"], "float32", quantization="int3")

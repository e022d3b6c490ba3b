"""The engine's KV memory end to end: memory that follows the tokens in use, the cap and preemption,
prefix sharing, and batch-invariant mode (tiny random-weight models in float32 for the mechanics, real
SmolLM2 weights where the claim is about real weights)."""

from __future__ import annotations

import pytest
from tiny_engine import engine, ids, run
from tiny_llm import TinyModels

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.engine.kv_blocks import BLOCK_SIZE
from flyspec.llm import LLM
from flyspec.sampling_params import SamplingParams

PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 240}" for j in range(2 + 5 * i)) for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    # "wide": a large KV cache per token (16 layers x 2 x 8 KV heads x 128 x fp32 = 128 KiB), so that
    # resident memory shows it.
    wide = tiny_models.get(
        seed=2, num_layers=16, hidden_size=1024, num_heads=8, num_kv_heads=8, max_position_embeddings=1024
    )
    return {**tiny_models.pair(), "wide": wide}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_one_long_request_costs_its_own_tokens_and_gives_them_back(models) -> None:
    """With room for 16 requests of 1024 positions (2 GiB of KV for this model), one request of 300
    prompt and 20 generated tokens makes about its own 320 x 128 KiB resident (the slot cache made 16
    slots of 512 positions resident: 1 GiB), holds 20 blocks while it runs, and when it ends holds
    none: its memory goes back to the operating system (prefix caching off, so nothing is kept). Measured
    on its second run, once the step's own buffers are resident."""
    eng = engine(models["wide"], max_num_seqs=16, max_model_len=1024, enable_prefix_caching=False)
    per_token = 16 * 2 * 8 * 128 * 4
    assert eng.kv_cache_capacity_bytes >= 16 * 1024 * per_token
    prompt = [5 + i % 200 for i in range(300)]
    # The same request once first, so that the step's own buffers (activations, the allocator's caches)
    # are resident before the measurement, which then sees the KV cache alone.
    run(eng, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    before = _rss()
    peak = {"used": 0, "rss": 0}

    def watch(e: LLMEngine) -> None:
        peak["used"] = max(peak["used"], e.kv_cache_used_bytes)
        peak["rss"] = max(peak["rss"], _rss())

    run(eng, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), each_step=watch)
    tokens = 300 + 20
    assert peak["used"] == -(-tokens // BLOCK_SIZE) * BLOCK_SIZE * per_token
    assert 0.7 * tokens * per_token < peak["rss"] - before < 2 * tokens * per_token
    assert eng.kv_cache_used_bytes == 0 and eng.stats.kv_cache_usage == 0
    assert _rss() - before < 0.25 * tokens * per_token


def test_prompt_blocks_stay_cached_after_the_request_ends(models) -> None:
    """With prefix caching on, a finished request's full prompt blocks stay (cached, not in use) and the
    blocks of its generated tokens are freed."""
    eng = engine(models["target"])
    prompt = [5 + i % 200 for i in range(70)]
    run(eng, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    block_bytes = eng.kv_cache_capacity_bytes // eng.blocks.num_blocks
    assert eng.kv_cache_used_bytes == 0
    assert eng.kv_cache_cached_bytes == (70 // BLOCK_SIZE) * block_bytes


@pytest.mark.parametrize("spec", [None, "draft"])
def test_a_small_cap_is_respected_and_preemption_keeps_greedy_outputs_exact(models, spec) -> None:
    """A cap that holds two requests of max_model_len for 8 requests of up to 56 tokens: the KV in use
    never exceeds it, requests are preempted and computed again, and every output equals the one of an
    engine with room for all (float32 greedy, with and without a draft model)."""
    speculative = {"model": models["draft"], "num_speculative_tokens": 3} if spec else None
    reference = ids(run(engine(models["target"], speculative), PROMPTS, GREEDY))
    probe = engine(models["target"], speculative, max_model_len=64)
    cap = 2 * -(-(64 + 4) // BLOCK_SIZE) * probe.kv_cache_capacity_bytes // probe.blocks.num_blocks
    eng = engine(models["target"], speculative, max_model_len=64, kv_cache_memory_bytes=cap)
    used = []
    outs = run(eng, PROMPTS, GREEDY, each_step=lambda e: used.append(e.kv_cache_used_bytes))
    assert max(used) <= cap == eng.kv_cache_capacity_bytes
    assert eng.stats.num_preemptions > 0
    assert ids(outs) == reference


def test_preempted_requests_keep_their_prompt_logprobs_and_logprobs(models) -> None:
    """Requests that ask for prompt logprobs and logprobs, preempted under a small cap and computed
    again, report each prompt position once and the same values as without preemption."""
    prompts = [" ".join(f"w{(7 * i + 3 * j) % 240}" for j in range(10 + 6 * i)) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    reference = run(engine(models["target"], max_model_len=64), prompts, params)
    probe = engine(models["target"], max_model_len=64)
    cap = 2 * -(-(64 + 1) // BLOCK_SIZE) * probe.kv_cache_capacity_bytes // probe.blocks.num_blocks
    eng = engine(models["target"], max_model_len=64, kv_cache_memory_bytes=cap)
    outs = run(eng, prompts, params)
    assert eng.stats.num_preemptions > 0
    for want, got in zip(reference, outs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids) == len(want.prompt_logprobs)
        for a, b in zip(
            [*want.prompt_logprobs[1:], *want.outputs[0].logprobs],
            [*got.prompt_logprobs[1:], *got.outputs[0].logprobs],
            strict=True,
        ):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_a_cap_below_one_request_is_a_clear_error(models) -> None:
    """kv_cache_memory_bytes too small for one request of max_model_len is a ValueError naming the field,
    what one request needs and the ways out; a non-positive value is rejected by the config."""
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=4096 .* raise kv_cache_memory_bytes"):
        engine(models["target"], max_model_len=64, kv_cache_memory_bytes=4096)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=0 is invalid"):
        EngineConfig(model=models["target"], kv_cache_memory_bytes=0)


@pytest.mark.parametrize("spec", [None, "draft", "ngram"])
def test_prompts_sent_twice_share_their_prefill_and_give_the_same_outputs(models, spec) -> None:
    """The gate's two arms: every prompt twice into one engine, the second copies after the first. The
    second copies share all full blocks of their prompts except a last one (hits counted in tokens, vLLM's
    counters), and every output, greedy and seeded, equals the output without prefix caching; with a
    draft model its KV is shared too."""
    speculative = {
        None: None,
        "draft": {"model": models["draft"], "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    }[spec]
    long_prompts = [" ".join(f"w{(11 * i + j) % 240}" for j in range(20 + 9 * i)) for i in range(6)]
    params = [GREEDY, SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)] * 3
    off = engine(models["target"], speculative, enable_prefix_caching=False)
    on = engine(models["target"], speculative)
    first_off, first_on = run(off, long_prompts, params), run(on, long_prompts, params)
    assert on.stats.prefix_cache_hits == 0
    second_on = run(on, long_prompts, params)
    assert ids(second_on) == ids(first_on) == ids(first_off)
    lengths = [len(o.prompt_token_ids) for o in first_on]
    assert on.stats.prefix_cache_queries == 2 * sum(lengths)
    assert on.stats.prefix_cache_hits == sum((n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in lengths) > 0
    assert on.stats.prompt_tokens == 2 * sum(lengths) - on.stats.prefix_cache_hits
    assert off.stats.prefix_cache_queries == off.stats.prefix_cache_hits == 0


def test_twin_prompts_added_together_share_their_prefill(models) -> None:
    """The gate's two arms send each prompt side by side, so both copies wait in the queue at once. The
    second copy waits one step while the first computes the shared blocks, then shares them: hits equal
    every pair's full blocks (all but a last one), and the outputs equal those without prefix caching."""
    prompts = [" ".join(f"w{(13 * i + j) % 240}" for j in range(25 + 11 * i)) for i in range(4)]
    twins = [p for p in prompts for _ in range(2)]
    off = engine(models["target"], enable_prefix_caching=False)
    on = engine(models["target"])
    with_cache, without = run(on, twins, GREEDY), run(off, twins, GREEDY)
    assert ids(with_cache) == ids(without)
    lengths = [len(o.prompt_token_ids) for o in with_cache[::2]]
    assert on.stats.prefix_cache_hits == sum((n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in lengths) > 0


def test_llm_stats_report_the_prefill_saved(models) -> None:
    """LLM.stats exposes the engine's counters: generating the same prompts twice shows the shared
    prompt tokens in prefix_cache_hits."""
    llm = LLM(models["target"], dtype="float32")
    prompt = " ".join(f"w{j % 240}" for j in range(40))
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.stats.prefix_cache_hits == 32 and llm.stats.prefix_cache_queries == 2 * 41


@pytest.mark.parametrize("spec", [None, "draft"])
def test_batch_invariant_mode_gives_a_request_the_same_tokens_alone_and_among_31_others(models, spec) -> None:
    """batch_invariant=True: greedy and seeded requests give exactly the same tokens alone and in a batch
    of 32 requests of different lengths (with prefix sharing between them), with and without a draft
    model; and greedy speculative output equals target-only output."""
    speculative = {"model": models["draft"], "num_speculative_tokens": 3} if spec else None
    prompts = [" ".join(f"w{(5 * i + 3 * j) % 240}" for j in range(3 + (7 * i) % 40)) for i in range(32)]
    prompts[9] = prompts[4] + " w1 w2"  # a shared prefix
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=16, ignore_eos=True) if i % 2 else GREEDY
        for i in range(32)
    ]
    batched = ids(
        run(engine(models["target"], speculative, batch_invariant=True, max_num_seqs=32), prompts, params)
    )
    for i in (0, 4, 9, 17):
        alone = engine(models["target"], speculative, batch_invariant=True)
        assert ids(run(alone, [prompts[i]], [params[i]]))[0] == batched[i]
    if speculative is not None:
        target_only = ids(run(engine(models["target"], batch_invariant=True), prompts[::2], params[::2]))
        assert target_only == batched[::2]


@pytest.mark.slow
def test_smollm2_batch_invariant_outputs_do_not_depend_on_the_batch() -> None:
    """Real SmolLM2 weights in bfloat16 with batch_invariant=True: GSM8K chat prompts give the same greedy
    and seeded tokens alone as in a batch of 16 (without the mode, 2 of 8 greedy and 6 of 8 seeded
    outputs changed in scripts/batch_invariance.py, at 32), and greedy speculative decoding with the
    n-gram drafter gives the target-only tokens, which in bfloat16 the ordinary path does not promise."""
    from flyspec.bench.prompts import load_prompts
    from flyspec.models.loader import load_model

    weights = load_model("smollm2-135m-instruct", "bfloat16")

    def llm(max_num_seqs: int, spec: dict | None = None) -> LLM:
        config = EngineConfig(
            model="smollm2-135m-instruct",
            dtype="bfloat16",
            max_num_seqs=max_num_seqs,
            batch_invariant=True,
            speculative_config=spec,
        )
        return LLM.from_config(config, target=weights)

    batch_llm = llm(16)
    prompts = [p.token_ids for p in load_prompts("gsm8k", 16, batch_llm.get_tokenizer())]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=16)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=16)
        for i in range(16)
    ]
    batched = [o.outputs[0].token_ids for o in batch_llm.generate(prompts, params, use_tqdm=False)]
    alone_llm = llm(1)
    for i in range(4):
        alone = alone_llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids
        assert alone == batched[i]
    spec = llm(16, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    spec_out = [o.outputs[0].token_ids for o in spec.generate(prompts[:16:2], params[0], use_tqdm=False)]
    assert spec.stats.num_accepted_tokens > 0
    assert spec_out == batched[:16:2]


def test_the_cache_is_sized_for_the_configured_work(models, caplog) -> None:  # noqa: ANN001
    """kv_cache_request_len sizes the KV cache for the work: max_running requests of that many positions
    (plus the K + 1 verification writes), never less than one request of max_model_len, instead of
    max_running requests of max_model_len; the log line says the size in MB and why. A request longer
    than kv_cache_request_len still runs (alone if it must) with the same greedy tokens."""
    per_request = -(-(256 + 1) // BLOCK_SIZE)
    default = engine(models["target"], max_num_seqs=8, max_model_len=256)
    assert default.blocks.num_blocks == 8 * per_request
    caplog.clear()  # an earlier test may have left the engine's logger at INFO: the default's line too
    with caplog.at_level("INFO", logger="flyspec.engine"):
        sized = engine(models["target"], max_num_seqs=8, max_model_len=256, kv_cache_request_len=40)
    assert sized.blocks.num_blocks == 8 * -(-(40 + 1) // BLOCK_SIZE)
    block_bytes = sized.kv_cache_capacity_bytes // sized.blocks.num_blocks
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert f"KV cache: {sized.kv_cache_capacity_bytes / 1e6:.1f} MB" in line
    assert "8 running requests of kv_cache_request_len=40 positions" in line
    assert block_bytes == default.kv_cache_capacity_bytes // default.blocks.num_blocks
    longer = engine(models["target"], max_num_seqs=8, max_model_len=256, kv_cache_request_len=1000)
    assert longer.blocks.num_blocks == default.blocks.num_blocks
    few = engine(models["target"], max_num_seqs=2, max_model_len=256, kv_cache_request_len=40)
    assert few.blocks.num_blocks == per_request  # one request of max_model_len always fits
    draft = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3}
    spec = engine(models["target"], draft, max_num_seqs=4, max_model_len=256, kv_cache_request_len=100)
    assert spec.blocks.num_blocks == 4 * -(-(100 + 3 + 1) // BLOCK_SIZE)
    long_prompts = [" ".join(f"w{(5 * i + j) % 240}" for j in range(150)) for i in range(3)]
    assert ids(run(sized, long_prompts, GREEDY)) == ids(run(default, long_prompts, GREEDY))


def test_kv_cache_request_len_is_checked() -> None:
    """kv_cache_request_len must be a positive integer, and not set beside kv_cache_memory_bytes (both
    would size the cache); a length past max_model_len counts as max_model_len."""
    with pytest.raises(ValueError, match="kv_cache_request_len=0 is invalid"):
        EngineConfig(model="m", kv_cache_request_len=0)
    with pytest.raises(ValueError, match="kv_cache_request_len=64 .*kv_cache_memory_bytes also sizes"):
        EngineConfig(model="m", kv_cache_request_len=64, kv_cache_memory_bytes=1 << 20)

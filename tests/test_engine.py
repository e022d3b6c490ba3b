"""The engine end to end on tiny random-weight checkpoints (fp32, CPU).

Exactness (docs/verification.md), FLy's forgiven positions, per-request stopping, seeded sampling
independent of the batch, draft state across KV block reuse, opt-in step timings, token-budget admission under
load (flyspec/budget.py), and bad input.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch
import transformers
from tiny_engine import engine, greedy_differences, ids, run
from tiny_llm import EOS_ID, TinyModels, save_tiny

from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.policies import policy_named

PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 240}" for j in range(2 + 5 * i)) for i in range(8)]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    forgiving = tiny_models.forgiving_pair()  # peakier but still unsure: H >= 0.3
    return {
        **tiny_models.pair(),
        "qwen2": tiny_models.get(seed=2, arch="qwen2"),
        "fly_target": forgiving["target"],
        "fly_draft": forgiving["draft"],
    }


def upto_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def hf_greedy(path: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding); it stops at eos."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    result = []
    for prompt in prompts:
        input_ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            input_ids,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=3,
        )
        result.append(out[0, input_ids.shape[1] :].tolist())
    return result


@pytest.fixture(scope="module")
def reference(models: dict[str, str]) -> dict[str, list[list[int]]]:
    """Target-only greedy outputs of our engine and of transformers for PROMPTS."""
    return {
        "ours": ids(run(engine(models["target"]), PROMPTS, GREEDY)),
        "hf": hf_greedy(models["target"], PROMPTS, MAX_TOKENS),
    }


def test_target_only_greedy_equals_transformers_generate(reference) -> None:
    """Plain decoding (no speculation, 8 ragged prompts batched) gives transformers' greedy tokens
    (compared up to end-of-sequence, where transformers stops and our ignore_eos requests go on)."""
    assert [upto_eos(t) for t in reference["ours"]] == reference["hf"]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("drafter", ["random_draft", "self_draft", "ngram"])
def test_greedy_speculative_decoding_is_exact(models, reference, drafter: str, k: int) -> None:
    """Exactness: standard verification with either drafter and any K gives exactly the target-only
    greedy tokens (and transformers'), for a batch of 8 prompts of different lengths. The random draft
    is almost always rejected, the target as its own draft almost always accepted: both paths run."""
    spec = {
        "random_draft": {"model": models["draft"], "num_speculative_tokens": k},
        "self_draft": {"model": models["target"], "num_speculative_tokens": k},
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1},
    }[drafter]
    eng = engine(models["target"], spec)
    outs = run(eng, PROMPTS, GREEDY)
    assert ids(outs) == reference["ours"]
    assert [upto_eos(t) for t in ids(outs)] == reference["hf"]
    stats = eng.stats
    assert stats.num_drafts > 0 and stats.generation_tokens == len(PROMPTS) * MAX_TOKENS
    assert stats.num_forgiven_tokens == 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.num_accepted_tokens
    if drafter == "self_draft":
        assert stats.acceptance_rate == 1.0
        assert stats.accepted_per_position == [stats.num_drafts] * k


@pytest.mark.parametrize("drafter", ["random_draft", "self_draft"])
def test_draft_state_follows_block_reuse(models, reference, drafter: str) -> None:
    """With two running requests at a time for eight, KV blocks serve several requests in turn: the draft
    model's cache lengths (owned by the drafter, per request) restart with each new request, so the output
    is still exactly the target-only greedy output."""
    draft = models["draft"] if drafter == "random_draft" else models["target"]
    eng = engine(models["target"], {"model": draft, "num_speculative_tokens": 3}, max_num_seqs=2)
    assert ids(run(eng, PROMPTS, GREEDY)) == reference["ours"]
    assert eng.stats.num_drafts > 0


def test_step_timings_are_opt_in_and_cover_each_step(models) -> None:
    """Off by default (step_timings is None); once enabled, each step appends one record whose timed
    parts are non-negative and fit inside the step; turning it off drops the records."""
    eng = engine(models["target"], {"model": models["draft"], "num_speculative_tokens": 2})
    assert eng.step_timings is None
    eng.record_step_timings()
    eng.add_request("r", PROMPTS[3], GREEDY)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    timings = eng.step_timings
    assert timings is not None and len(timings) == steps
    for t in timings:
        parts = (t.target_forward_s, t.draft_forward_s, t.verify_s)
        assert min(parts) >= 0 and sum(parts) <= t.step_s and t.other_s >= 0
    assert all(t.target_forward_s > 0 and t.draft_forward_s > 0 for t in timings)
    assert timings[0].verify_s == 0 and all(t.verify_s > 0 for t in timings[1:])  # prefill, then decode
    eng.record_step_timings(False)
    assert eng.step_timings is None


def test_qwen2_speculative_output_equals_transformers(models) -> None:
    """The qwen2 architecture (qkv bias) through the engine with speculation matches transformers."""
    spec = {"model": models["qwen2"], "num_speculative_tokens": 3}
    outs = run(engine(models["qwen2"], spec), PROMPTS[:4], GREEDY)
    assert [upto_eos(t) for t in ids(outs)] == hf_greedy(models["qwen2"], PROMPTS[:4], MAX_TOKENS)


def test_fly_differs_from_target_greedy_only_at_forgiven_positions(models, caplog) -> None:
    """With FLy and a draft that mostly agrees, each output token is the target's greedy choice given the
    output so far, except at the positions the engine reports as forgiven; their count is
    num_forgiven_tokens. Requests with verification="standard" in the same batch are exact target-only
    greedy and forgive nothing. The lossy warning is logged at start."""
    spec = {"model": models["fly_draft"], "num_speculative_tokens": 3, "rejection_sample_method": "fly"}
    with caplog.at_level(logging.WARNING, logger="flyspec.engine"):
        eng = engine(models["fly_target"], spec)
    assert eng.is_lossy
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [policy_named("fly").lossy_warning()]
    params = [GREEDY] * 8 + [dataclasses.replace(GREEDY, verification="standard")] * 4
    outs = run(eng, PROMPTS + PROMPTS[:4], params)

    forgiven_total = 0
    for out, differs in zip(outs, greedy_differences(models["fly_target"], outs), strict=True):
        assert differs == out.metrics.forgiven_positions
        assert len(differs) == out.metrics.num_forgiven_tokens
        forgiven_total += len(differs)
    assert forgiven_total > 0 and forgiven_total == eng.stats.num_forgiven_tokens
    target_only = ids(run(engine(models["fly_target"]), PROMPTS, GREEDY))
    assert ids(outs[8:]) == target_only[:4]
    assert all(o.metrics.num_forgiven_tokens == 0 for o in outs[8:])
    assert ids(outs[:8]) != target_only


def test_requests_finish_independently(models, reference, tmp_path) -> None:
    """max_tokens, a stop string (text cut before it), a stop token id and end-of-sequence each end
    their own request at the right token while multi-token speculative steps run; the others in the
    batch are unaffected."""
    base = reference["ours"]
    tok = transformers.AutoTokenizer.from_pretrained(models["target"])
    full_text = tok.decode(base[1])
    stop = " " + tok.decode([base[1][6]])
    eos_token = base[3][4]
    # A copy of the target whose generation_config declares one more end-of-sequence id.
    eos_model = tmp_path / "eos"
    shutil.copytree(models["target"], eos_model)
    gen_config = json.loads((eos_model / "generation_config.json").read_text())
    gen_config["eos_token_id"] = [EOS_ID, eos_token]
    (eos_model / "generation_config.json").write_text(json.dumps(gen_config))
    spec = {"model": models["target"], "num_speculative_tokens": 4}
    params = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop, "never-there"], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[base[2][3]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        GREEDY,
    ]
    outs = run(engine(str(eos_model), spec), PROMPTS[:5], params)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "stop", "stop", "stop", "length"]
    assert outs[0].outputs[0].token_ids == base[0][:5]
    cut = outs[1].outputs[0]
    assert cut.text == full_text[: full_text.index(stop)]
    assert base[1][: len(cut.token_ids)] == cut.token_ids
    assert stop in tok.decode(cut.token_ids) and stop not in tok.decode(cut.token_ids[:-1])
    assert outs[2].outputs[0].token_ids == base[2][: base[2].index(base[2][3]) + 1]
    assert outs[3].outputs[0].token_ids == base[3][: base[3].index(eos_token) + 1]
    assert outs[4].outputs[0].token_ids == base[4]
    assert all(o.finished and o.metrics.finished_time is not None for o in outs)


@pytest.mark.parametrize("speculative", [False, True])
def test_seeded_request_is_the_same_alone_and_in_a_batch(models, speculative: bool) -> None:
    """A seeded request sampled at temperature 1 gives the same tokens alone and among 7 other requests
    of different lengths and seeds (probabilistic drafting and verification included); another seed
    gives different tokens."""
    spec = {"model": models["draft"], "num_speculative_tokens": 3} if speculative else None
    seeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=1234, ignore_eos=True)
    alone = ids(run(engine(models["target"], spec), [PROMPTS[2]], seeded))[0]
    others = [
        SamplingParams(temperature=1.0, max_tokens=5 + 2 * i, seed=i, ignore_eos=True) for i in range(7)
    ]
    batch = [*others[:3], seeded, *others[3:]]
    prompts = PROMPTS[:3] + [PROMPTS[2]] + PROMPTS[3:7]
    in_batch = ids(run(engine(models["target"], spec), prompts, batch))[3]
    assert in_batch == alone
    reseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=99, ignore_eos=True)
    assert ids(run(engine(models["target"], spec), [PROMPTS[2]], reseeded))[0] != alone


def test_unseeded_requests_are_reproducible_from_the_engine_seed(models) -> None:
    """Without a request seed, the engine seed plus request index makes runs reproducible."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    first = ids(run(engine(models["target"], seed=7), PROMPTS[:3], params))
    assert first == ids(run(engine(models["target"], seed=7), PROMPTS[:3], params))
    assert first != ids(run(engine(models["target"], seed=8), PROMPTS[:3], params))


def test_saturating_load_reaches_and_respects_the_cap(models, caplog) -> None:
    """12 requests, budget 20 with K=4 (charge 5): the running count reaches max_running = 4 (the budget
    binds, as the start-up line says), never exceeds it, and every request finishes."""
    spec = {"model": models["draft"], "num_speculative_tokens": 4}
    with caplog.at_level(logging.INFO, logger="flyspec.engine"):
        eng = engine(models["target"], spec, max_num_batched_tokens=20, max_num_seqs=16)
    assert eng.max_running == 4
    assert any(
        "charges 5 tokens of max_num_batched_tokens=20: at most 4 of max_num_seqs=16" in r.getMessage()
        and "token budget binds" in r.getMessage()
        for r in caplog.records
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(12):
        eng.add_request(f"r{i}", PROMPTS[i % 4], params)
    running, finished = [], set()
    while eng.has_unfinished_requests():
        finished |= {o.request_id for o in eng.step() if o.finished}
        running.append(eng.num_running)
        assert eng.num_running + eng.num_waiting + len(finished) == 12
    assert max(running) == 4 and running.count(4) > 3
    assert finished == {f"r{i}" for i in range(12)}


def test_decode_continues_while_a_long_prompt_is_prefilled_in_chunks(models) -> None:
    """Three requests keep getting tokens every step while a 120-token prompt is prefilled in chunks
    of at most the budget they leave (24 - 3 * 4 = 12 tokens), so it takes 10 steps."""
    eng = engine(
        models["target"], {"method": "ngram", "num_speculative_tokens": 3}, max_num_batched_tokens=24
    )
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"short{i}", PROMPTS[i], params)
    eng.step()  # the three short prompts are prefilled together
    long_prompt = [1] + [10 + (i % 200) for i in range(119)]
    eng.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=4))
    prefill_steps = 0
    while True:
        before = eng.stats.prompt_tokens
        outs = {o.request_id: o for o in eng.step()}
        prefill_steps += 1
        assert eng.stats.prompt_tokens - before <= 12
        assert {"short0", "short1", "short2"} <= outs.keys()
        if "long" in outs:
            break
    assert prefill_steps == 10
    assert outs["long"].outputs[0].token_ids


def test_abort_frees_the_blocks_for_a_waiting_request(models) -> None:
    """Aborting a running request frees its place and its KV blocks: the waiting request is admitted next
    step."""
    eng = engine(models["target"], max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eng.add_request("a", PROMPTS[0], params)
    eng.add_request("b", PROMPTS[1], params)
    eng.step()
    assert (eng.num_running, eng.num_waiting) == (1, 1)
    assert eng.kv_cache_used_bytes > 0
    eng.abort_request("a")
    eng.abort_request("unknown")  # ignored
    assert eng.kv_cache_used_bytes == 0 and eng.stats.kv_cache_usage == 0
    assert [o.request_id for o in eng.step()] == ["b"]
    eng.add_request("a", PROMPTS[0], params)  # the id is free again
    assert eng.num_waiting == 1


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(models) -> None:
    """An empty prompt, a prompt longer than max_model_len, out-of-vocabulary ids, a duplicate id and
    verification='fly' on a standard engine each raise ValueError at add_request; the good requests
    around them complete."""
    eng = engine(models["target"], max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("good1", PROMPTS[0], params)
    bad = [
        ("empty", "", params, "empty"),
        ("empty-ids", [], params, "non-empty"),
        ("long", " ".join(["w5"] * 40), params, "max_model_len=32"),
        ("oov", [1, 999], params, "outside the vocabulary"),
        ("good1", PROMPTS[1], params, "already in use"),
        ("fly", PROMPTS[1], SamplingParams(verification="fly"), "rejection_sample_method='fly'"),
    ]
    for request_id, prompt, p, message in bad:
        with pytest.raises(ValueError, match=message):
            eng.add_request(request_id, prompt, p)
    eng.add_request("good2", PROMPTS[1], params)
    outs = run(eng, [PROMPTS[2]], params)
    assert outs[0].outputs[0].finish_reason == "length"
    assert not eng.has_unfinished_requests()


def test_generation_stops_at_max_model_len(models) -> None:
    """A request whose max_tokens would pass max_model_len stops there with finish_reason 'length'."""
    eng = engine(models["target"], {"model": models["target"], "num_speculative_tokens": 4}, max_model_len=16)
    prompt = [1, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    out = run(eng, [prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == 16
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m, tmp: engine(str(save_tiny(tmp / "gpt2", seed=0, arch="gpt2"))), "'gpt2'"),
        (
            lambda m, tmp: engine(
                m["target"],
                {"model": str(save_tiny(tmp / "d", seed=0, vocab_size=300)), "num_speculative_tokens": 2},
            ),
            "tokenises text fragments losslessly",
        ),
        (
            lambda m, tmp: engine(
                m["target"],
                {"model": str(save_tiny(tmp / "d", seed=0, extra_words=5)), "num_speculative_tokens": 2},
            ),
            "tokenises text fragments losslessly",
        ),
        (lambda m, tmp: engine(m["target"], max_num_batched_tokens=0), "max_num_batched_tokens=0"),
        (lambda m, tmp: engine(m["target"], max_num_seqs=0), "max_num_seqs=0"),
        (
            lambda m, tmp: engine(
                m["target"], {"method": "ngram", "num_speculative_tokens": 4}, max_num_batched_tokens=4
            ),
            "raise max_num_batched_tokens to at least 1 \\+ K = 5",
        ),
        (lambda m, tmp: engine(m["target"], max_model_len=10_000), "max_position_embeddings=512"),
    ],
)
def test_bad_engine_configuration_raises_a_clear_error(models, tmp_path, make, message) -> None:
    """Unsupported architecture, a draft of another vocabulary (size or token map) whose word-level
    tokenizer cannot follow the text for cross-vocabulary drafting, non-positive budgets, a budget below
    one request's charge, and max_model_len beyond the model: ValueError at start-up naming the problem."""
    with pytest.raises(ValueError, match=message):
        make(models, tmp_path)

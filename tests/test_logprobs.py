"""Logprobs of generated tokens and of prompt tokens, checked against an independent forward pass.

The reference is transformers' own model run once over prompt + output (fp32), with transformers' logits
warpers for the sampling settings: an implementation that shares nothing with the engine's passes.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from tiny_engine import engine, run
from tiny_llm import TinyModels
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams

PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30 w40 w50 w60 w70", "w5", " ".join(f"w{i}" for i in range(30, 50))]
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    forgiving = tiny_models.forgiving_pair(noise=0.01)
    return {**tiny_models.pair(), "fly_target": forgiving["target"], "fly_draft": forgiving["draft"]}


@pytest.fixture(scope="module")
def hf_models(models):
    cache: dict[str, transformers.PreTrainedModel] = {}

    def get(name: str) -> transformers.PreTrainedModel:
        if name not in cache:
            cache[name] = transformers.AutoModelForCausalLM.from_pretrained(
                models[name], dtype=torch.float32
            ).eval()
        return cache[name]

    return get


def reference_logprobs(hf, ids: list[int], start: int, params: SamplingParams) -> torch.Tensor:
    """log P(. | ids[:i]) for i = start .. len(ids) - 1 under the processed distribution: [n, V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1]
    if not params.greedy:
        logits = TemperatureLogitsWarper(params.temperature)(None, logits)
        if params.top_k:
            logits = TopKLogitsWarper(params.top_k)(None, logits)
    return torch.log_softmax(logits, dim=-1)


def check_sample_logprobs(out: RequestOutput, ref: torch.Tensor, k: int) -> None:
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert next(iter(entry)) == token, "the chosen token comes first"
        assert abs(entry[token].logprob - ref[j, token].item()) < TOL
        assert entry[token].rank == int((ref[j] > ref[j, token]).sum()) + 1
        top = ref[j].topk(k)
        assert set(entry) == {token} | set(top.indices.tolist())
        for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(entry[t].logprob - lp) < TOL
    chosen = [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True)]
    assert completion.cumulative_logprob == pytest.approx(sum(chosen))


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["none", "draft_model"])
def test_logprobs_equal_an_independent_forward_pass(models, hf_models, drafter, sampling):
    """Every generated token's reported logprob (and its top-3 alternatives, and its rank) equals the log
    of the processed target probability from transformers' forward over prompt + output, within 1e-4:
    target-only decoding and speculative decoding (accepted drafts, recovered and bonus tokens)."""
    spec = {"model": models["draft"], "num_speculative_tokens": 3} if drafter == "draft_model" else None
    params = SamplingParams(
        temperature=0 if sampling == "greedy" else 0.8,
        top_k=0 if sampling == "greedy" else 20,
        seed=7,
        max_tokens=12,
        ignore_eos=True,
        logprobs=3,
    )
    outs = run(engine(models["target"], spec), PROMPTS, params)
    hf = hf_models("target")
    for out in outs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        check_sample_logprobs(out, reference_logprobs(hf, ids, len(out.prompt_token_ids), params), 3)
        if sampling == "greedy":
            assert all(
                e[t].rank == 1 for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
            )


def test_logprobs_zero_reports_the_chosen_token_only(models):
    """logprobs=0: one entry per position, the chosen token; logprobs=None: no logprobs at all."""
    out = run(engine(models["target"]), PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, logprobs=0))[
        0
    ]
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    plain = run(engine(models["target"]), PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_forgiven_tokens_report_the_targets_low_probability(models, hf_models):
    """With FLy forgiving eagerly (theta 0, W 1), each forgiven token reports the target's probability of
    it, which is not the target's top choice (rank > 1, below the rank-1 alternative): the logprobs show
    exactly how unlikely the target found what FLy kept."""
    spec = {
        "model": models["fly_draft"],
        "num_speculative_tokens": 4,
        "rejection_sample_method": "fly",
        "fly_window_size": 1,
        "fly_entropy_threshold": 0.0,
    }
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = run(engine(models["fly_target"], spec), PROMPTS, params)
    hf = hf_models("fly_target")
    forgiven = 0
    for out in outs:
        completion = out.outputs[0]
        ids = out.prompt_token_ids + completion.token_ids
        ref = reference_logprobs(hf, ids, len(out.prompt_token_ids), params)
        check_sample_logprobs(out, ref, 1)
        for j in out.metrics.forgiven_positions:
            token, entry = completion.token_ids[j], completion.logprobs[j]
            assert entry[token].rank > 1
            best = next(lp for t, lp in entry.items() if lp.rank == 1)
            assert entry[token].logprob < best.logprob
            forgiven += 1
    assert forgiven > 0


def check_prompt_logprobs(out: RequestOutput, hf, k: int) -> None:
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    if len(ids) == 1:
        return
    ref = reference_logprobs(hf, ids, 1, SamplingParams(temperature=0))
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        token = ids[i + 1]
        assert next(iter(entry)) == token
        assert abs(entry[token].logprob - ref[i, token].item()) < TOL
        assert entry[token].rank == int((ref[i] > ref[i, token]).sum()) + 1
        top = ref[i].topk(k)
        for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(entry[t].logprob - lp) < TOL


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 8])
def test_prompt_logprobs_equal_an_independent_forward_pass(models, hf_models, max_num_batched_tokens):
    """prompt_logprobs: None for the first prompt token, then log P(token | prefix) of the raw model with
    the top-2 alternatives, within 1e-4 of transformers, also when the prompt is prefilled in chunks of 8
    tokens; with max_tokens=0 nothing is generated (finish_reason "length"), with max_tokens=1 (what
    lm-evaluation-harness sends with echo) one token is. Sampling settings do not change them."""
    eng = engine(models["target"], max_num_batched_tokens=max_num_batched_tokens)
    hf = hf_models("target")
    scored = run(eng, PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=2, temperature=1.5, top_k=3))
    for out in scored:
        check_prompt_logprobs(out, hf, 2)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    echo = run(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=1))
    for out, ref in zip(echo, scored, strict=True):
        assert out.prompt_logprobs == ref.prompt_logprobs
        assert len(out.outputs[0].token_ids) == 1 and len(out.outputs[0].logprobs) == 1


def test_prompt_logprobs_with_speculation_and_n_samples(models, hf_models):
    """In a speculative engine, an n = 3 request scores its prompt once (sample 0's prefill) and returns
    it on the RequestOutput; every sample has its own logprobs; a max_tokens=0 request scores the same
    prompt identically and leaves no slot behind."""
    eng = engine(models["target"], {"model": models["draft"], "num_speculative_tokens": 2})
    params = SamplingParams(
        temperature=1.0, seed=3, n=3, max_tokens=5, prompt_logprobs=1, logprobs=0, ignore_eos=True
    )
    out = run(eng, PROMPTS[1:2], params)[0]
    check_prompt_logprobs(out, hf_models("target"), 1)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.logprobs) == 5 and math.isfinite(c.cumulative_logprob) for c in out.outputs)
    scored = run(eng, PROMPTS[1:2], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert scored.prompt_logprobs == out.prompt_logprobs and scored.outputs[0].token_ids == []
    assert not eng.has_unfinished_requests() and eng.num_running == 0

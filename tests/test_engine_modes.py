"""Who decodes a request (SamplingParams.verification="target_only" / "draft_only") and
SpeculativeConfig.disable_by_batch_size, through the public LLM API on tiny random-weight checkpoints in
float32 (tests/tiny_llm.py), where greedy decoding is exact.

A target-only request must give the target's own output beside requests that speculate; a draft-only
request must give the draft model's own output with no target pass at all; both through continuous
batching, prefix sharing, preemption and seeded sampling; the acceptance counters must count only what
verification decided; and past the batch-size threshold nobody drafts.
"""

from __future__ import annotations

import pytest
from tiny_llm import save_perturbed, save_tiny

from flyspec.config import EngineConfig, SpeculativeConfig
from flyspec.engine.kv_blocks import BLOCK_SIZE
from flyspec.llm import LLM
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.server.protocol import CompletionRequest

PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 240}" for j in range(2 + 5 * i)) for i in range(8)]
MAX_TOKENS = 20
# FLy settings that forgive often on the tiny models' flat distributions, so that FLy rows really differ
# from the target's output in the mixed batches below.
FLY = {"rejection_sample_method": "fly", "fly_window_size": 1, "fly_entropy_threshold": 0.0}


def greedy(verification: str | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, verification=verification)


def seeded(seed: int, verification: str | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.9,
        top_p=0.95,
        seed=seed,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        verification=verification,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("modes")
    target = save_tiny(root / "target", seed=3, std=0.25)
    return {
        "target": str(target),
        "draft": str(save_perturbed(target, root / "draft", seed=5, noise=0.003)),
    }


def llm(model: str, spec: dict | None = None, **kwargs) -> LLM:
    return LLM.from_config(EngineConfig(model=model, speculative_config=spec, dtype="float32", **kwargs))


def spec_llm(models: dict[str, str], k: int = 3, **kwargs) -> LLM:
    return llm(models["target"], {"model": models["draft"], "num_speculative_tokens": k, **FLY}, **kwargs)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(models: dict[str, str]) -> dict[str, list[list[int]]]:
    """Each model's own greedy and seeded outputs, decoded without speculation."""
    target, draft = llm(models["target"]), llm(models["draft"])
    seeds = [seeded(100 + i) for i in range(len(PROMPTS))]
    return {
        "target": tokens(target.generate(PROMPTS, greedy(), use_tqdm=False)),
        "draft": tokens(draft.generate(PROMPTS, greedy(), use_tqdm=False)),
        "target_seeded": tokens(target.generate(PROMPTS, seeds, use_tqdm=False)),
        "draft_seeded": tokens(draft.generate(PROMPTS, seeds, use_tqdm=False)),
    }


MIX = ["target_only", None, "draft_only", "standard"]
"""The mode of prompt i is MIX[i % 4]: every mode beside every other in one batch."""


def test_modes_in_one_batch_give_each_models_own_greedy_output(models, reference) -> None:
    """In one FLy engine, target-only requests give exactly the target's greedy tokens, draft-only requests
    exactly the draft model's own (run as a target-only LLM), and the FLy rows beside them do forgive
    (the batch really mixes the paths). Only verified rows count drafts."""
    engine = spec_llm(models)
    outs = engine.generate(PROMPTS, [greedy(MIX[i % 4]) for i in range(len(PROMPTS))], use_tqdm=False)
    for i, out in enumerate(outs):
        mode = MIX[i % 4]
        if mode == "target_only":
            assert tokens([out])[0] == reference["target"][i]
        if mode == "draft_only":
            assert tokens([out])[0] == reference["draft"][i]
        if mode in ("target_only", "draft_only"):
            assert out.metrics.num_drafts == out.metrics.num_draft_tokens == 0
        else:
            assert out.metrics.num_drafts > 0
    assert sum(o.metrics.num_forgiven_tokens for i, o in enumerate(outs) if MIX[i % 4] is None) > 0
    stats = engine.stats
    assert stats.num_draft_tokens == sum(o.metrics.num_draft_tokens for o in outs)
    assert stats.num_accepted_tokens == sum(o.metrics.num_accepted_tokens for o in outs)
    assert stats.generation_tokens == len(PROMPTS) * MAX_TOKENS


def test_seeded_requests_follow_their_models_own_streams(models, reference) -> None:
    """Seeded sampling: a target-only request draws one number per token as an engine without
    speculation does, and a draft-only request one per token as the draft model alone does, so both
    give those engines' seeded outputs token for token (float32), beside speculating requests."""
    engine = spec_llm(models)
    params = [seeded(100 + i, MIX[i % 4]) for i in range(len(PROMPTS))]
    outs = tokens(engine.generate(PROMPTS, params, use_tqdm=False))
    for i, out in enumerate(outs):
        if MIX[i % 4] == "target_only":
            assert out == reference["target_seeded"][i]
        if MIX[i % 4] == "draft_only":
            assert out == reference["draft_seeded"][i]


def test_draft_only_runs_no_target_pass(models, reference) -> None:
    """A draft-only request alone in the engine: every step's target forward time is zero, and the
    answer is the draft model's."""
    profile = spec_llm(models).profile_steps(PROMPTS[3], greedy("draft_only"))
    assert profile.output.outputs[0].token_ids == reference["draft"][3]
    assert sum(step.target_forward_s for step in profile.steps) == 0.0
    assert sum(step.draft_forward_s for step in profile.steps) > 0.0


def test_modes_survive_preemption(models, reference) -> None:
    """A KV cap that holds two requests of max_model_len for eight: blocks serve requests of every mode
    in turn and preempted requests compute their tokens again (a draft-only one through the draft model
    alone), with the same outputs."""
    # 1 KiB per position: target and draft, 2 layers x 2 KV heads x 16 dims x (key, value) x 4 bytes;
    # a request of max_model_len 64 (+ K + 1 verified positions) takes 5 blocks of 16 positions.
    cap = 2 * 5 * BLOCK_SIZE * 1024
    engine = spec_llm(models, max_model_len=64, kv_cache_memory_bytes=cap)
    outs = engine.generate(PROMPTS, [greedy(MIX[i % 4]) for i in range(len(PROMPTS))], use_tqdm=False)
    assert engine.stats.num_preemptions > 0
    for i, out in enumerate(tokens(outs)):
        if MIX[i % 4] == "draft_only":
            assert out == reference["draft"][i]
        elif MIX[i % 4] in ("target_only", "standard"):
            assert out == reference["target"][i]


@pytest.mark.parametrize("first", ["draft_only", "target_only"])
def test_prefix_sharing_never_hands_a_request_blocks_without_its_models_kv(models, reference, first) -> None:
    """The same prompts run first in one mode, then in all modes at once. A draft-only request fills only
    the draft's half of its blocks, so it must register none (a standard request sharing them would read
    an empty target cache); a target-only request's blocks do get the draft's K/V, so a draft-only request
    may share them. Outputs stay each model's own, and the second round does share the first's blocks."""
    engine = spec_llm(models)
    engine.generate(PROMPTS, greedy(first), use_tqdm=False)
    hits = engine.stats.prefix_cache_hits
    params = [greedy(MIX[i % 4]) for i in range(len(PROMPTS))]
    for i, out in enumerate(tokens(engine.generate(PROMPTS, params, use_tqdm=False))):
        want = "draft" if MIX[i % 4] == "draft_only" else "target"
        if MIX[i % 4] is not None:
            assert out == reference[want][i]
    if first == "target_only":
        assert engine.stats.prefix_cache_hits > hits


def test_speculation_stops_at_the_batch_size_threshold(models, reference) -> None:
    """disable_by_batch_size=3 with four requests: while three or more run nobody drafts (the two short
    requests end before the others drop below three, so they never draft), below it the two long ones
    draft again after catching the draft model up; every output is still the target's."""
    engine = llm(
        models["target"],
        {"model": models["draft"], "num_speculative_tokens": 3, "disable_by_batch_size": 3},
        max_num_seqs=4,
    )
    lengths = [6, 6, 20, 20]
    prompts = [PROMPTS[i] for i in (1, 2, 3, 4)]
    outs = engine.generate(prompts, [greedy(max_tokens=n) for n in lengths], use_tqdm=False)
    assert [o.metrics.num_drafts for o in outs[:2]] == [0, 0]
    assert all(o.metrics.num_drafts > 0 for o in outs[2:])
    for out, i, n in zip(tokens(outs), (1, 2, 3, 4), lengths, strict=True):
        assert out == reference["target"][i][:n]


def test_bad_modes_and_thresholds_are_clear_errors(models) -> None:
    """draft_only needs a draft model of the target's vocabulary (a drafter that answers alone: not the
    n-gram lookup, nor an engine without speculation); it cannot take target-side processing;
    target_only is fine anywhere; disable_by_batch_size is an integer >= 2 and round-trips."""
    ngram = llm(models["target"], {"method": "ngram", "num_speculative_tokens": 2})
    for engine, has in ((llm(models["target"]), "no speculative config"), (ngram, "NgramDrafter")):
        with pytest.raises(ValueError, match=f"verification='draft_only' needs .*; this engine has .*{has}"):
            engine.generate(PROMPTS[0], greedy("draft_only"), use_tqdm=False)
    assert ngram.generate(PROMPTS[0], greedy("target_only"), use_tqdm=False)[0].metrics.num_drafts == 0
    for extra in ({"logprobs": 1}, {"presence_penalty": 0.5}, {"logit_bias": {5: 1.0}}):
        with pytest.raises(ValueError, match=f"draft_only' cannot be combined with {next(iter(extra))}"):
            SamplingParams(verification="draft_only", **extra)
    with pytest.raises(ValueError, match="verification='fastest'"):
        SamplingParams(verification="fastest")
    for mode in ("target_only", "draft_only"):  # the server's request field takes them too
        assert CompletionRequest.model_validate({"prompt": "w1", "verification": mode}).verification == mode
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            SpeculativeConfig(method="ngram", num_speculative_tokens=2, disable_by_batch_size=bad)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, disable_by_batch_size=16)
    assert SpeculativeConfig.from_dict(config.to_dict()) == config
    assert (
        "disable_by_batch_size" not in SpeculativeConfig(method="ngram", num_speculative_tokens=2).to_dict()
    )

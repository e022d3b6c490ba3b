"""Verification policies through the engine (docs/verification.md): typical acceptance and FLy with every
drafter, the lossless prefix (SPEC 4.3), and the per-request opt-out.

Tiny random-weight checkpoints in fp32 (tests/tiny_llm.py) for the mechanics; the slow test at the end
runs the real SmolLM2-135M with the n-gram drafter.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from tiny_engine import engine, greedy_differences, ids, run
from tiny_llm import TinyModels
from zoo import SMOLLM2, zoo_model

from flyspec.config import EngineConfig
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams

PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 240}" for j in range(2 + 5 * i)) for i in range(6)]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Aggressive settings, so that the tiny models' flat distributions give forgiven tokens at all.
LOSSY = {
    "fly": {"rejection_sample_method": "fly", "fly_window_size": 1, "fly_entropy_threshold": 0.0},
    "typical": {"rejection_sample_method": "typical"},
}
TYPICAL_WARNING = (
    "Typical acceptance verification is lossy: outputs do not follow the target model's distribution and "
    "may be of lower quality."
)


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    return tiny_models.forgiving_pair()


def drafter(models: dict[str, str], name: str, k: int = 3) -> dict:
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    return {"model": models["draft"], "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def target_only(models) -> list[list[int]]:
    return ids(run(engine(models["target"]), PROMPTS, GREEDY))


def test_typical_differs_from_target_greedy_only_at_forgiven_positions(models, caplog) -> None:
    """Typical acceptance with a draft that mostly agrees: each output token is the target's greedy choice
    given the output so far, except at the positions reported as forgiven (their count is
    num_forgiven_tokens, and there are some). Requests with verification="standard" in the same batch
    are exact target-only greedy, "typical" may be asked for explicitly, and "fly" cannot. The typical
    warning is logged once at start."""
    with caplog.at_level(logging.WARNING, logger="flyspec.engine"):
        eng = engine(models["target"], {**drafter(models, "draft"), **LOSSY["typical"]})
    assert eng.is_lossy
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [TYPICAL_WARNING]
    with pytest.raises(ValueError, match="verification='fly' needs an engine started with .*'typical'"):
        eng.add_request("x", PROMPTS[0], dataclasses.replace(GREEDY, verification="fly"))
    explicit = dataclasses.replace(GREEDY, verification="typical")
    standard = dataclasses.replace(GREEDY, verification="standard")
    outs = run(eng, PROMPTS + PROMPTS[:3], [GREEDY] * 5 + [explicit] + [standard] * 3)

    for out, differs in zip(outs, greedy_differences(models["target"], outs), strict=True):
        assert differs == out.metrics.forgiven_positions
        assert len(differs) == out.metrics.num_forgiven_tokens
    assert eng.stats.num_forgiven_tokens > 0
    reference = ids(run(engine(models["target"]), PROMPTS[:3], GREEDY))
    assert ids(outs[6:]) == reference
    assert all(o.metrics.num_forgiven_tokens == 0 for o in outs[6:])


# FLy with n-gram drafts forgives nothing on these random models (its window needs native acceptances);
# the real-weight test below runs it.
@pytest.mark.parametrize(("draft", "policy"), [("draft", "fly"), ("draft", "typical"), ("ngram", "typical")])
def test_lossless_prefix_keeps_the_first_tokens_of_greedy_requests_exact(
    models, target_only, policy: str, draft: str
) -> None:
    """With lossless_prefix_tokens L, the first L tokens of every greedy response are target-only greedy
    decoding's and nothing before position L is forgiven; with L >= max_tokens the whole output is
    token-identical to target-only (= standard speculative) decoding and no emitted token is forgiven.
    Without a prefix the same engine does forgive (so the prefix is what holds the tokens)."""
    spec = {**drafter(models, draft), **LOSSY[policy]}
    free = run(engine(models["target"], spec), PROMPTS, GREEDY)
    assert sum(o.metrics.num_forgiven_tokens for o in free) > 0
    prefix = 6
    outs = run(engine(models["target"], {**spec, "lossless_prefix_tokens": prefix}), PROMPTS, GREEDY)
    for out, reference in zip(outs, target_only, strict=True):
        assert out.outputs[0].token_ids[:prefix] == reference[:prefix]
        assert all(p >= prefix for p in out.metrics.forgiven_positions)
    assert any(o.metrics.forgiven_positions for o in outs)  # past the prefix the policy forgives again
    whole = run(engine(models["target"], {**spec, "lossless_prefix_tokens": MAX_TOKENS}), PROMPTS, GREEDY)
    assert ids(whole) == target_only
    # No emitted token was forgiven (the counter may still count a forgiven draft that the max_tokens
    # stop cut off: acceptance counters measure verification, not the committed text).
    assert all(o.metrics.forgiven_positions == [] for o in whole)


@pytest.mark.parametrize("policy", ["fly", "typical"])
def test_lossless_prefix_follows_standard_sampling_path_for_seeded_requests(models, policy: str) -> None:
    """Seeded sampling requests (temperature 0.8, probabilistic drafts): with a prefix of L the first L
    tokens are exactly those of standard speculative decoding with the same seeds (every step draws the
    same numbers, and before L every decision is the standard one), and with L >= max_tokens the whole
    output is; without a prefix the lossy policy changes some outputs."""
    spec = drafter(models, "draft")
    params = [
        SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, seed=s, ignore_eos=True) for s in range(6)
    ]
    standard = ids(run(engine(models["target"], spec), PROMPTS, params))
    lossy = {**spec, **LOSSY[policy]}
    assert ids(run(engine(models["target"], lossy), PROMPTS, params)) != standard
    prefix = 8
    outs = ids(run(engine(models["target"], {**lossy, "lossless_prefix_tokens": prefix}), PROMPTS, params))
    assert [o[:prefix] for o in outs] == [s[:prefix] for s in standard]
    assert outs != standard  # past the prefix the policy forgives again
    whole = {**lossy, "lossless_prefix_tokens": MAX_TOKENS}
    assert ids(run(engine(models["target"], whole), PROMPTS, params)) == standard


def test_prefix_counts_tokens_generated_so_far_per_request(models, target_only) -> None:
    """lossless_before is max(0, L - generated) per row: requests of one batch at different points of
    their generation (five admitted while one decodes) each keep exactly their own first L tokens, and
    are forgiven again after them."""
    spec = {**drafter(models, "draft"), **LOSSY["typical"], "lossless_prefix_tokens": 6}
    eng = engine(models["target"], spec)
    eng.add_request("early", PROMPTS[0], GREEDY)
    for _ in range(3):
        eng.step()
    rest = run(eng, PROMPTS[1:], GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    for out, reference in zip(rest, target_only[1:], strict=True):
        assert out.outputs[0].token_ids[:6] == reference[:6]
        assert all(p >= 6 for p in out.metrics.forgiven_positions)
    assert any(o.metrics.forgiven_positions for o in rest)


REAL_PROMPTS = [
    "List the days of the week, one per line: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, "
    "Sunday. Again: Monday,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten. Count again: one,",
    "Q: What is the capital of France?\nA: The capital of France is Paris.\nQ: What is the capital of Italy?"
    "\nA:",
    "Write a haiku about the sea, then repeat it.",
]


@pytest.mark.slow
def test_real_weights_prefix_keeps_standard_tokens_and_full_prefix_is_standard() -> None:
    """SmolLM2-135M in fp32, greedy, n-gram drafter (K=4): standard speculative decoding gives the
    reference; FLy and typical acceptance at their defaults forgive some tokens and change some outputs;
    with lossless_prefix_tokens 16 the first 16 tokens of every response equal the reference's; with
    L >= max_tokens both lossy policies are token-identical to standard."""
    from flyspec import LLM
    from flyspec.models.loader import load_model

    smollm2 = zoo_model(SMOLLM2)
    target = load_model(str(smollm2), "float32", "cpu")
    max_tokens, prefix = 48, 16
    params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def generate(extra: dict) -> list[RequestOutput]:
        spec = {"method": "ngram", "num_speculative_tokens": 4, **extra}
        config = EngineConfig(model=str(smollm2), speculative_config=spec, dtype="float32", max_num_seqs=6)
        return LLM.from_config(config, target=target).generate(REAL_PROMPTS, params, use_tqdm=False)

    standard = ids(generate({}))
    for policy in ("fly", "typical"):
        method = {"rejection_sample_method": policy}
        free = generate(method)
        assert sum(o.metrics.num_forgiven_tokens for o in free) > 0, policy
        assert ids(free) != standard, policy
        held = ids(generate({**method, "lossless_prefix_tokens": prefix}))
        assert [o[:prefix] for o in held] == [s[:prefix] for s in standard], policy
        assert ids(generate({**method, "lossless_prefix_tokens": max_tokens})) == standard, policy

"""One bad request never fails the others.

Values that SamplingParams refuses (temperature 1e300 is inf in float32, 1e-40 gives NaN probabilities,
top_k = 2**64 overflows int64) are forced past validation, as a bug would, into a running batch: that
request alone finishes with finish_reason "error" and a message, its slot is freed, and every other
request produces exactly the output it produces without it.
"""

from __future__ import annotations

import pytest
from tiny_engine import finish
from tiny_llm import TinyModels

from flyspec import LLM
from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams

PROMPTS = ["w1 w2 w3", "w40 w41 w42 w43 w44", "w7", "w100 w90 w80 w70"]
GOOD = [
    SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True)
    if i % 2
    else SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i in range(len(PROMPTS))
]
BAD_VALUES = [("temperature", 1e300), ("temperature", 1e-40), ("top_k", 2**64)]


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    return tiny_models.pair()


SPECS = {
    "none": None,
    "draft_model": {"num_speculative_tokens": 3},  # probabilistic drafting for sampling requests
    "fly": {"num_speculative_tokens": 3, "rejection_sample_method": "fly", "fly_entropy_threshold": 0.0},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
}


def engine(models, kind: str) -> LLMEngine:
    spec = SPECS[kind]
    if spec is not None and spec.get("method") != "ngram":
        spec = {"model": models["draft"], **spec}
    return LLMEngine(EngineConfig(model=models["target"], speculative_config=spec, dtype="float32"))


def forced(field: str, value: object) -> SamplingParams:
    params = SamplingParams(temperature=0.7, seed=99, max_tokens=16, ignore_eos=True)
    setattr(params, field, value)  # past validation, as a bug would
    return params


def drive(eng: LLMEngine, bad: tuple[str, object] | None, when: str) -> dict[str, RequestOutput]:
    """The good requests, plus the bad one added at the start, added mid-run, or turned bad mid-run."""
    final: dict[str, RequestOutput] = {}

    def step() -> None:
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out

    for i in range(2):
        eng.add_request(f"good{i}", PROMPTS[i], GOOD[i])
    turned = SamplingParams(temperature=0.7, seed=99, max_tokens=16, ignore_eos=True)
    if bad is not None and when == "start":
        eng.add_request("bad", "w5 w6", forced(*bad))
    if bad is not None and when == "turned":
        eng.add_request("bad", "w5 w6", turned)
    step()
    step()
    if bad is not None and when == "added":
        eng.add_request("bad", "w5 w6", forced(*bad))
    if bad is not None and when == "turned":
        setattr(turned, *bad)  # the running request's own parameters go bad between steps
    for i in range(2, len(PROMPTS)):
        eng.add_request(f"good{i}", PROMPTS[i], GOOD[i])
    return {**final, **finish(eng)}


@pytest.fixture(scope="module")
def baselines(models) -> dict[str, dict[str, list[int]]]:
    return {
        kind: {rid: o.outputs[0].token_ids for rid, o in drive(engine(models, kind), None, "start").items()}
        for kind in SPECS
    }


@pytest.mark.parametrize("when", ["start", "added", "turned"])
@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda b: f"{b[0]}={b[1]:g}")
@pytest.mark.parametrize("kind", list(SPECS))
def test_a_bad_request_fails_alone(models, baselines, kind, bad, when):
    """The bad request ends with finish_reason "error" and a message naming what failed; all slots are
    free afterwards; the good requests' tokens equal a run without the bad request."""
    eng = engine(models, kind)
    final = drive(eng, bad, when)
    failed = final.pop("bad")
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert failed.error and failed.error.startswith(("processing the logits failed", "verification failed"))
    assert {rid: o.outputs[0].token_ids for rid, o in final.items()} == baselines[kind]
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in final.values())
    assert (eng.num_running, eng.num_waiting) == (0, 0)


def test_llm_generate_returns_the_failed_request_and_the_others(models):
    """Through LLM.generate: the batch completes, the bad prompt's output carries the error."""
    llm = LLM(models["target"], dtype="float32")
    outs = llm.generate(
        PROMPTS[:2] + ["w5"], [GOOD[0], GOOD[1], forced("temperature", 1e300)], use_tqdm=False
    )
    assert [o.error is None for o in outs] == [True, True, False]
    assert outs[2].outputs[0].finish_reason == "error" and "temperature" in outs[2].error
    alone = llm.generate(PROMPTS[:2], GOOD[:2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in alone]

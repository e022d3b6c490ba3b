"""n > 1: independent samples with derived seeds, one RequestOutput, aborts and ids."""

from __future__ import annotations

import pytest
from tiny_engine import finish
from tiny_llm import TinyModels

from flyspec import LLM
from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.sampling_params import SamplingParams

PROMPT = "w3 w14 w15 w92 w65"


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    return tiny_models.pair()


def engine(models, speculative: bool, **kwargs) -> LLMEngine:
    spec = {"model": models["draft"], "num_speculative_tokens": 3} if speculative else None
    return LLMEngine(EngineConfig(model=models["target"], speculative_config=spec, dtype="float32", **kwargs))


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 10, "ignore_eos": True, **kwargs})


@pytest.mark.parametrize("speculative", [False, True])
def test_sample_i_uses_seed_plus_i(models, speculative):
    """A seeded n = 4 request returns outputs 0..3, and sample i is token for token the single request
    seeded seed + i (so samples differ from each other and are reproducible); the metrics add up."""
    eng = engine(models, speculative)
    eng.add_request("multi", PROMPT, sampled(n=4, seed=100))
    multi = finish(eng)["multi"]
    assert [c.index for c in multi.outputs] == [0, 1, 2, 3]
    for i in range(4):
        eng.add_request(f"single{i}", PROMPT, sampled(seed=100 + i))
    singles = finish(eng)
    assert [c.token_ids for c in multi.outputs] == [
        singles[f"single{i}"].outputs[0].token_ids for i in range(4)
    ]
    assert len({tuple(c.token_ids) for c in multi.outputs}) > 1
    assert multi.metrics.num_draft_tokens == sum(c.metrics.num_draft_tokens for c in multi.outputs)


def test_unseeded_samples_take_consecutive_arrival_seeds(models):
    """Unseeded: sample i of the first request uses engine seed + i, and the next request continues
    after the last sample (each sample counts as one arrival)."""
    eng = engine(models, False, seed=11)
    eng.add_request("multi", PROMPT, sampled(n=3))
    eng.add_request("after", PROMPT, sampled())
    unseeded = finish(eng)
    for i, seed in enumerate([11, 12, 13]):
        eng.add_request(f"s{i}", PROMPT, sampled(seed=seed))
    eng.add_request("s3", PROMPT, sampled(seed=14))
    seeded = finish(eng)
    assert [c.token_ids for c in unseeded["multi"].outputs] == [
        seeded[f"s{i}"].outputs[0].token_ids for i in range(3)
    ]
    assert unseeded["after"].outputs[0].token_ids == seeded["s3"].outputs[0].token_ids


def test_abort_stops_every_sample_and_frees_the_slots(models):
    """abort_request on an n > 1 request aborts all of its samples (running or still waiting)."""
    eng = engine(models, True, max_num_seqs=2)
    eng.add_request("multi", PROMPT, sampled(n=3, max_tokens=50))
    eng.step()
    assert eng.num_running == 2 and eng.num_waiting == 1
    eng.abort_request("multi")
    assert (eng.num_running, eng.num_waiting, eng.has_unfinished_requests()) == (0, 0, False)


def test_ids_of_samples_cannot_collide(models):
    """Samples run as f"{i}_{request_id}" (vLLM's spelling): a request id equal to a running sample's id,
    or a request whose samples would reuse a running id, is refused."""
    eng = engine(models, False)
    eng.add_request("abc", PROMPT, sampled(n=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("0_abc", PROMPT, sampled())
    eng.add_request("1_x", PROMPT, sampled())
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", PROMPT, sampled(n=2))


def test_llm_generate_returns_n_outputs_per_prompt(models):
    """Through the offline API: one RequestOutput per prompt, each with n completions."""
    llm = LLM(models["target"], dtype="float32")
    outs = llm.generate([PROMPT, "w1 w2"], sampled(n=2, seed=5), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for o in outs for c in o.outputs)

"""The offline API (vLLM's `LLM`): LLM.generate / LLM.chat on a tiny random-weight checkpoint."""

from __future__ import annotations

import pytest
from tiny_llm import save_tiny

import flyspec
from flyspec import LLM, RequestOutput, SamplingParams, SpeculativeConfig

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_tiny(tmp_path_factory.mktemp("llm") / "tiny", seed=0)
    return LLM(
        str(path), speculative_config={"model": str(path), "num_speculative_tokens": 3}, dtype="float32"
    )


def test_public_names_import_from_the_package() -> None:
    """`from flyspec import LLM, SamplingParams, SpeculativeConfig, RequestOutput` gives the real classes."""
    from flyspec.config import SpeculativeConfig as Spec
    from flyspec.llm import LLM as Llm

    assert (LLM, SpeculativeConfig) == (Llm, Spec)
    assert RequestOutput.__module__ == "flyspec.outputs"
    with pytest.raises(AttributeError):
        _ = flyspec.NoSuchThing


def test_generate_accepts_text_lists_and_token_ids_in_order(llm: LLM) -> None:
    """A string, a list of strings and token-id lists all work; outputs come back in prompt order with
    prompt text, prompt ids, tokens, detokenised text and acceptance metrics; repeated calls agree."""
    tok = llm.get_tokenizer()
    prompts = ["w1 w2 w3", "w9", "w4 w5 w6 w7 w8 w9 w10"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [tok(p).input_ids for p in prompts]
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 6
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
        assert out.metrics.num_drafts > 0 and out.metrics.acceptance_rate == 1.0  # self-draft
    single = llm.generate(prompts[1], GREEDY, use_tqdm=True)
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    by_ids = llm.generate([tok(p).input_ids for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in outs]
    assert by_ids[0].prompt is None
    one_ids = llm.generate(tok(prompts[0]).input_ids, GREEDY, use_tqdm=False)
    assert one_ids[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_per_prompt_sampling_params(llm: LLM) -> None:
    """One SamplingParams per prompt applies to its own prompt; a count mismatch is a ValueError."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 5)]
    outs = llm.generate(["w1 w2", "w3 w4"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], params, use_tqdm=False)


def test_a_bad_prompt_raises_and_leaves_the_engine_clean(llm: LLM) -> None:
    """An empty prompt in a batch raises ValueError naming its index; nothing is left queued."""
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate(["w1", "", "w2"], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert llm.generate("w1", GREEDY, use_tqdm=False)[0].finished


def test_chat_applies_the_chat_template(llm: LLM) -> None:
    """chat() renders the template with the assistant turn opened and generates from it, for one
    conversation or several."""
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "w1 w2"}]
    rendered = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("assistant : ")
    outs = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert outs[0].prompt == rendered
    assert outs[0].prompt_token_ids == tok(rendered, add_special_tokens=False).input_ids
    direct = llm.generate([tok(rendered, add_special_tokens=False).input_ids], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    two = llm.chat([conversation, [{"role": "user", "content": "w3"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_default_max_model_len_is_capped_at_4096(tmp_path) -> None:
    """max_model_len defaults to min(max_position_embeddings, 4096)."""
    small = LLM(str(save_tiny(tmp_path / "small", seed=0, max_position_embeddings=300)))
    big = LLM(str(save_tiny(tmp_path / "big", seed=0, max_position_embeddings=8192)))
    assert (small.max_model_len, big.max_model_len) == (300, 4096)


def test_profile_steps_times_every_step_of_one_generation(llm: LLM) -> None:
    """LLM.profile_steps generates exactly what generate() does, with one StepTiming per engine step (the
    prefill step plus one per draft-and-verify step: fewer than the tokens, since the self-draft keeps every
    draft), each part within its step and the steps within the wall time. (Recording on and off is the
    engine's, tests/test_engine.py.)"""
    prompt = llm.get_tokenizer()("w1 w2 w3").input_ids
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    profile = llm.profile_steps(prompt, params)
    expected = llm.generate([prompt], params, use_tqdm=False)[0]
    assert profile.output.outputs[0].token_ids == expected.outputs[0].token_ids
    decode_steps = profile.output.metrics.num_drafts
    assert len(profile.steps) == 1 + decode_steps and 1 <= decode_steps < 8
    for step in profile.steps:
        parts = step.target_forward_s + step.draft_forward_s + step.verify_s
        assert 0 <= parts <= step.step_s and step.other_s >= 0
    assert sum(s.step_s for s in profile.steps) <= profile.wall_s


def test_llm_takes_every_engine_config_field_and_only_those(tmp_path) -> None:
    """LLM's settings are EngineConfig's fields by keyword, checked by it: a bad value is EngineConfig's
    ValueError, an unknown name a TypeError naming it."""
    path = str(save_tiny(tmp_path / "tiny", seed=0))
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(path, max_num_seqs=0)
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(path, max_num_sequences=4)
    assert LLM(path, dtype="float32", max_model_len=64, seed=3).max_model_len == 64

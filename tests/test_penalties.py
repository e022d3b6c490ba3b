"""Penalties and logit bias inside the target's processing, with the right history at every verified
position: exact per-position distributions, lossless standard verification with respect to the
processed distribution (a seeded chi-square that the naive history fails), and speculative greedy
decoding token-identical to target-only greedy decoding with the same processing, which in turn
equals an independent reference decoder."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from scipy.stats import chisquare
from test_logits_processors import ref_penalise
from tiny_engine import engine, ids, run
from tiny_llm import TinyModels

from flyspec.engine.logits_processing import RequestLogitsState, TargetProcessing
from flyspec.engine.sequence import Sequence
from flyspec.engine.structured import Grammars
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.verify import verify

PROMPTS = [" ".join(f"w{(5 * i + 2 * j) % 200}" for j in range(2 + 4 * i)) for i in range(6)]
PENALISED = SamplingParams(
    temperature=0,
    max_tokens=24,
    ignore_eos=True,
    presence_penalty=0.8,
    frequency_penalty=0.4,
    repetition_penalty=1.5,
    logit_bias={20: 1.5, 40: -3.0},
)


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, str]:
    # std 0.6: peaky logits, so greedy decoding repeats itself and the penalties change the output.
    return {"target": tiny_models.get(seed=0, std=0.6), "draft": tiny_models.get(seed=1)}


def make_seq(
    prompt: list[int], output: list[int], params: SamplingParams, vocab: int, rid: str = "s"
) -> Sequence:
    state = RequestLogitsState(params, prompt, vocab, torch.device("cpu"), None)
    seq = Sequence(rid, None, prompt, params, 0, frozenset(), logits_state=state)
    for t in output:
        state.accept(t)
        seq.output_token_ids.append(t)
    return seq


def reference_probs(
    logits: list[float], prompt: list[int], history: list[int], params: SamplingParams
) -> torch.Tensor:
    row = list(logits)
    for t, b in (params.logit_bias or {}).items():
        row[t] += b
    row = ref_penalise(
        row, prompt, history, params.presence_penalty, params.frequency_penalty, params.repetition_penalty
    )
    scaled = torch.tensor(row) / (params.temperature or 1.0)
    return torch.softmax(scaled, dim=-1)


def test_each_verified_position_sees_output_plus_preceding_drafts():
    """Position j of a verify pass is processed with the output plus the first j draft tokens as its
    history (a draft at j - 1 counts as generated at j), for mixed requests in one batch: exactly the
    distribution target-only decoding would use after committing those drafts."""
    vocab = 10
    g = torch.Generator().manual_seed(0)
    params = [
        dataclasses.replace(PENALISED, temperature=0.9, logit_bias={3: 2.0}),
        SamplingParams(temperature=0.7),  # no processing state: the fast path, inside the same batch
        dataclasses.replace(PENALISED, temperature=0, logit_bias=None, repetition_penalty=1.0),
    ]
    prompts, outputs = [[1, 2], [4], [5, 6, 7]], [[3, 3, 8], [2], []]
    drafts = [[3, 9, 3], [], [6, 6]]
    seqs = [
        make_seq(pr, out, p, vocab) if p.shapes_logits else Sequence("plain", None, pr, p, 0, frozenset())
        for pr, out, p in zip(prompts, outputs, params, strict=True)
    ]
    for seq, out in zip(seqs, outputs, strict=True):
        seq.output_token_ids = list(out)
    logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=g) * 2
    probs, failed = TargetProcessing(Grammars(None, vocab, [])).probs(logits, seqs, drafts)
    assert failed == {}
    row = 0
    for p, prompt, out, d in zip(params, prompts, outputs, drafts, strict=True):
        for j in range(len(d) + 1):
            history = out + d[:j] if p.shapes_logits else []
            expected = reference_probs(logits[row].tolist(), prompt if p.shapes_logits else [], history, p)
            torch.testing.assert_close(probs[row], expected, rtol=1e-5, atol=1e-7)
            row += 1


def two_token_draws(history_aware: bool, n: int, seed: int) -> torch.Tensor:
    """The first two tokens of n independent requests after one speculative step (K = 2 drafts from Q,
    standard verification) and, where that step emitted one token only, a second step: [n, 2]."""
    vocab, k = 5, 2
    g = torch.Generator().manual_seed(seed)
    raw = torch.tensor([1.0, 0.6, 0.3, 0.0, -0.4])
    params = SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6, logit_bias={4: 0.8})
    q = torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05])
    processing = TargetProcessing(Grammars(None, vocab, []))
    seqs = [make_seq([0], [], params, vocab, rid=f"r{i}") for i in range(n)]
    drafts = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
    lists = drafts.tolist()
    logits = raw.repeat(n * (k + 1), 1)
    if history_aware:
        probs, _ = processing.probs(logits, seqs, lists)
    else:  # the naive processing: every position sees only the committed output
        probs, _ = processing.probs(logits, [s for s in seqs for _ in range(k + 1)], [[]] * (n * (k + 1)))
    out = verify(
        drafts,
        probs.view(n, k + 1, vocab),
        q.repeat(n, k, 1),
        greedy=torch.zeros(n, dtype=torch.bool),
        generator=g,
    )
    tokens = out.token_ids[:, :2].clone()
    single = (out.num_accepted == 0).nonzero().squeeze(1).tolist()
    for b in single:
        seqs[b].logits_state.accept(int(tokens[b, 0]))
    second, _ = processing.probs(raw.repeat(len(single), 1), [seqs[b] for b in single], [[]] * len(single))
    tokens[single, 1] = torch.multinomial(second, 1, generator=g).squeeze(1)
    return tokens


def test_standard_verification_is_lossless_for_the_processed_distribution():
    """The joint distribution of the first two tokens under speculative decoding with penalties and a
    logit bias equals P(t0) P(t1 | t0) of the processed distributions (chi-square over all 25 pairs);
    the naive processing that ignores the drafts' history gives a clearly different joint."""
    vocab, n = 5, 10_000
    raw = [1.0, 0.6, 0.3, 0.0, -0.4]
    params = SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6, logit_bias={4: 0.8})
    p0 = reference_probs(raw, [0], [], params)
    joint = torch.stack([p0[a] * reference_probs(raw, [0], [a], params) for a in range(vocab)]).view(-1)

    def p_value(tokens: torch.Tensor) -> float:
        counts = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab).double()
        expected = joint.double() / joint.double().sum() * n
        return float(chisquare(counts.numpy(), expected.numpy()).pvalue)

    assert p_value(two_token_draws(True, n, seed=1)) > 0.01
    assert p_value(two_token_draws(False, n, seed=1)) < 1e-6


@pytest.mark.parametrize("drafter", ["random_draft", "self_draft", "ngram"])
def test_speculative_greedy_with_penalties_equals_target_only(models, drafter):
    """fp32 exactness with penalties and logit bias: every drafter (any acceptance pattern) gives the
    same tokens as target-only greedy decoding with the same processing, and the penalties do change
    the output (the comparison is not vacuous)."""
    spec = {
        "random_draft": {"model": models["draft"], "num_speculative_tokens": 3},
        "self_draft": {"model": models["target"], "num_speculative_tokens": 4},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    }[drafter]
    target_only = ids(run(engine(models["target"]), PROMPTS, PENALISED))
    eng = engine(models["target"], spec)
    assert ids(run(eng, PROMPTS, PENALISED)) == target_only
    if drafter == "self_draft":  # the draft does not apply the penalties, so it is rejected where they bite
        assert 0 < eng.stats.num_accepted_tokens < eng.stats.num_draft_tokens
    plain = ids(
        run(
            engine(models["target"]),
            PROMPTS,
            dataclasses.replace(
                PENALISED, logit_bias=None, presence_penalty=0, frequency_penalty=0, repetition_penalty=1
            ),
        )
    )
    assert plain != target_only


def test_target_only_penalised_greedy_equals_a_reference_decoder(models):
    """Target-only greedy decoding with penalties and bias equals a reference loop: transformers' logits
    for the whole sequence so far, the loop-by-loop reference processors, argmax."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    outs = run(engine(models["target"]), PROMPTS[:3], PENALISED)
    for out in outs:
        prompt, generated = out.prompt_token_ids, []
        for _ in range(PENALISED.max_tokens):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + generated])).logits[0, -1]
            probs = reference_probs(logits.tolist(), prompt, generated, PENALISED)
            generated.append(int(probs.argmax()))
        assert out.outputs[0].token_ids == generated


def test_logit_bias_forces_a_token_and_is_checked_against_the_vocabulary(models):
    """A +100 bias makes a token the greedy choice everywhere (speculative or not); a token id outside
    the vocabulary is a ValueError naming logit_bias at add_request."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    for spec in (None, {"model": models["draft"], "num_speculative_tokens": 2}):
        assert ids(run(engine(models["target"], spec), PROMPTS[:2], params)) == [[77] * 6] * 2
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[999\] are outside the vocabulary"):
        engine(models["target"]).add_request("bad", "w1", SamplingParams(logit_bias={999: 1.0}))

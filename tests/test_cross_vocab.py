"""Cross-vocabulary drafting (Token-Level Intersection) through the engine, on tiny random-weight models.

The target and the drafts have byte-level BPE tokenizers of their own (trained here in milliseconds), so
ids differ and text is re-tokenised for the draft. Proves: greedy output is token-identical to target-only
decoding in fp32 with standard verification (any K, sampling requests in the batch, FLy or typical-acceptance
requests next to verification="standard" ones, or behind a lossless prefix); after any commit the drafter
proposes what a fresh one would (rollback and re-tokenisation are consistent); a draft that is the target
under another numbering of the vocabulary is always accepted (so the draft sees the committed text exactly,
the ids map the right way, long catch-ups in chunks fill its cache correctly, and its own extra tokens are
never proposed); probabilistic drafting with such a draft is a config error; a request whose text outgrows the
draft cache simply stops drafting.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from tiny_engine import engine, ids, run
from tiny_llm import save_tiny
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers.models import BPE
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from flyspec.engine.drafters.cross_vocab import CrossVocabDrafter
from flyspec.engine.drafters.vocab_map import VocabMap
from flyspec.engine.model_runner import ModelRunner
from flyspec.engine.sequence import Sequence
from flyspec.models.loader import load_model
from flyspec.sampling_params import SamplingParams

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0-3 in the target, as tiny_llm's configs expect
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "big", "small", "red", "blue"]
PROMPTS = [" ".join(WORDS[(5 * i + 3 * j) % len(WORDS)] for j in range(2 + 4 * i)) for i in range(6)]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy shared CPU they only slow down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _wrap(tok: Tokenizer, **extra: object) -> transformers.PreTrainedTokenizerFast:
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", **extra
    )


def trained_bpe(corpus: list[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `corpus` (different corpora give different merges and ids)."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return _wrap(tok)


def ascii_bytes(order: list[str], extra_specials: list[str]) -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges over printable ASCII and newline, tokens in `order`."""
    tok = Tokenizer(BPE({sym: i for i, sym in enumerate(order)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _wrap(tok, additional_special_tokens=extra_specials)


ASCII = [bytes_to_unicode()[b] for b in [*range(32, 127), 10]]


def save_with_tokenizer(path: Path, tokenizer: transformers.PreTrainedTokenizerFast, seed: int) -> str:
    save_tiny(path, seed=seed, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)  # replaces tiny_llm's word-level tokenizer
    return str(path)


def save_renumbered_copy(target: str, path: Path, order: list[str], extra_specials: list[str]) -> str:
    """The target model under the vocabulary `order` (+ extra special tokens): each token's embedding
    and lm_head rows move to its new id, so it computes the target's logits, renumbered. The extra
    tokens' lm_head rows are 4x the row of the target's most frequent greedy output token, so an
    unrestricted argmax would often pick them instead."""
    tokenizer = ascii_bytes(order, extra_specials)
    src = transformers.AutoModelForCausalLM.from_pretrained(target)
    src_tok = transformers.AutoTokenizer.from_pretrained(target)
    config = src.config.to_dict() | {"vocab_size": len(tokenizer)}
    dst = transformers.AutoModelForCausalLM.from_config(type(src.config).from_dict(config))
    state = src.state_dict()
    perm = torch.tensor([src_tok.convert_tokens_to_ids(sym) for sym in order])
    frequent = _most_frequent_output(target)
    extra_rows = 4.0 * state["lm_head.weight"][frequent].expand(len(extra_specials), -1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = state[name][perm]
        fill = extra_rows if name == "lm_head.weight" else torch.zeros_like(extra_rows)
        state[name] = torch.cat([rows, fill])
    dst.load_state_dict(state)
    dst.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


_FREQUENT: dict[str, int] = {}


def _most_frequent_output(target: str) -> int:
    if target not in _FREQUENT:
        outs = ids(run(engine(target), PROMPTS, GREEDY))
        _FREQUENT[target] = Counter(t for row in outs for t in row).most_common(1)[0][0]
    return _FREQUENT[target]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("xvocab")
    text_a = [*PROMPTS, "the cat sat on the mat and the dog ran fast", "one two three red green blue"] * 3
    text_b = ["a big dog and a small cat", "three blue mats in a red room", "def f(x): return x + 1"] * 3
    ascii_target = save_with_tokenizer(root / "ascii_target", ascii_bytes(SPECIALS + ASCII, []), seed=4)
    return {
        "target": save_with_tokenizer(root / "target", trained_bpe(text_a, 360), seed=0),
        "draft": save_with_tokenizer(root / "draft", trained_bpe(text_b, 300), seed=1),
        "ascii_target": ascii_target,
        "renumbered": save_renumbered_copy(
            ascii_target, root / "renumbered", ASCII[::-1] + SPECIALS[::-1], ["<d0>", "<d1>"]
        ),
        "bytes_draft": save_with_tokenizer(root / "bytes_draft", ascii_bytes(ASCII + SPECIALS, []), seed=2),
    }


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    """Target-only greedy tokens of the BPE target for PROMPTS."""
    return ids(run(engine(models["target"]), PROMPTS, GREEDY))


def test_the_tiny_vocabularies_really_differ(models) -> None:
    """The test models' tokenizers give different ids for the same text, and the BPE target merges
    differently from the BPE draft (otherwise nothing here would test re-tokenisation)."""
    tok = {name: transformers.AutoTokenizer.from_pretrained(path) for name, path in models.items()}
    text = PROMPTS[3]
    assert tok["target"](text).input_ids != tok["draft"](text).input_ids
    assert len(tok["target"](text).input_ids) != len(tok["draft"](text).input_ids)
    assert tok["ascii_target"](text).input_ids != tok["renumbered"](text).input_ids
    assert tok["ascii_target"].decode(tok["ascii_target"](text).input_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_cross_vocab_drafting_is_exact(models, reference, k: int) -> None:
    """Exactness (docs/verification.md) with a draft of another vocabulary: standard verification gives
    exactly the target-only greedy tokens for 6 prompts of different lengths batched, with drafts
    actually proposed and some accepted; two sampling requests in the same batch do not disturb the
    greedy ones."""
    spec = {"model": models["draft"], "num_speculative_tokens": k}
    if k == 3:
        spec["draft_sample_method"] = "greedy"  # the explicit setting behaves like the default
    eng = engine(models["target"], spec)
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=7, ignore_eos=True)
    outs = run(eng, [*PROMPTS, PROMPTS[1], PROMPTS[4]], [GREEDY] * len(PROMPTS) + [sampled, sampled])
    assert ids(outs[: len(PROMPTS)]) == reference
    assert all(len(t) == MAX_TOKENS for t in ids(outs[len(PROMPTS) :]))
    stats = eng.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert stats.num_forgiven_tokens == 0


def test_renumbered_copy_of_the_target_is_always_accepted(models, caplog) -> None:
    """A draft that is the target under another numbering (plus two draft-only tokens whose logits
    often beat every other) drafts exactly the target's greedy tokens: acceptance rate 1.0 and output
    identical to target-only. That holds only if the draft sees the committed text exactly, ids map in
    the right direction, the draft-only tokens are never proposed, and catch-ups longer than the chunk
    (5 tokens here) fill the draft cache correctly. The start-up log gives the intersection size."""
    spec = {"model": models["renumbered"], "num_speculative_tokens": 4}
    with caplog.at_level(logging.INFO, logger="flyspec.engine"):
        eng = engine(models["ascii_target"], spec)
    assert any(
        "Token-Level Intersection of 100 of its 102 token ids" in r.getMessage() for r in caplog.records
    )
    eng.drafter.catch_up_chunk = 5
    outs = run(eng, PROMPTS, GREEDY)
    target_only = ids(run(engine(models["ascii_target"]), PROMPTS, GREEDY))
    assert ids(outs) == target_only
    assert eng.stats.num_drafts > 0 and eng.stats.acceptance_rate == 1.0
    # The token the draft-only rows shadow is common in the output, so unmasked drafting would fail.
    assert sum(row.count(_most_frequent_output(models["ascii_target"])) for row in target_only) >= 5


def test_after_any_commit_the_drafter_proposes_what_a_fresh_one_would(models) -> None:
    """Rollback consistency: over 24 steps for 4 requests, each committing some of the drafts and then
    another target token (a random one, a word, or a UTF-8 lead byte that leaves half a character, so
    that drafts get rejected, the draft's own tokens re-tokenise differently, and rows wait), the drafter
    with its cache proposes exactly what a new drafter with an empty cache proposes."""
    target_tok = transformers.AutoTokenizer.from_pretrained(models["target"])
    draft = load_model(models["draft"], dtype="float32")
    vmap = VocabMap(target_tok, draft.tokenizer, len(target_tok), draft.model.vocab_size)
    k = 3
    drafter = CrossVocabDrafter(ModelRunner(draft.model, 128, 16), k, vmap, 512, catch_up_chunk=4)
    seqs = []
    for i, prompt in enumerate(PROMPTS[:4]):
        seq = Sequence(f"r{i}", prompt, target_tok(prompt).input_ids, GREEDY, i, frozenset())
        seq.start()
        seqs.append(seq)
    pools = [
        range(4, len(target_tok)),
        [i for i, b in enumerate(vmap.target_bytes) if b is not None and len(b) == 1 and b[0] >= 0xC2],
        [target_tok.convert_tokens_to_ids(w) for w in ("Ġthe", "Ġcat", "Ġa", "Ġdog")],
    ]
    gen = torch.Generator().manual_seed(0)
    drafted = waited = 0
    for _ in range(24):
        prop = drafter.propose(seqs)
        fresh = CrossVocabDrafter(ModelRunner(draft.model, 128, 16), k, vmap, 512).propose(seqs)
        assert torch.equal(prop.num_tokens, fresh.num_tokens)
        assert torch.equal(prop.token_ids, fresh.token_ids)
        drafted += int(prop.num_tokens.sum())
        waited += int((prop.num_tokens == 0).sum())
        for b, seq in enumerate(seqs):
            kept = int(torch.randint(0, int(prop.num_tokens[b]) + 1, (1,), generator=gen))
            pool = pools[int(torch.randint(0, len(pools), (1,), generator=gen))]
            extra = pool[int(torch.randint(0, len(pool), (1,), generator=gen))]
            seq.output_token_ids += [*prop.token_ids[b, :kept].tolist(), extra]
    assert drafted > 0 and waited > 0


@pytest.mark.parametrize("policy", ["fly", "typical"])
def test_lossy_policy_with_a_cross_vocab_draft(models, reference, policy: str) -> None:
    """FLy and typical acceptance run with a cross-vocabulary draft (the documented lossy + TLI setting):
    the engine is lossy, its requests complete, verification="standard" requests in the same batch stay
    exact, and with a lossless prefix as long as max_tokens every request is exact."""
    spec = {"model": models["draft"], "num_speculative_tokens": 4, "rejection_sample_method": policy}
    eng = engine(models["target"], spec)
    assert eng.is_lossy
    standard = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, verification="standard")
    outs = run(eng, PROMPTS + PROMPTS[:3], [GREEDY] * len(PROMPTS) + [standard] * 3)
    assert ids(outs[len(PROMPTS) :]) == reference[:3]
    assert all(o.metrics.num_forgiven_tokens == 0 for o in outs[len(PROMPTS) :])
    assert all(len(t) == MAX_TOKENS for t in ids(outs[: len(PROMPTS)]))
    exact = engine(models["target"], {**spec, "lossless_prefix_tokens": MAX_TOKENS})
    assert ids(run(exact, PROMPTS, GREEDY)) == reference


def test_probabilistic_drafting_with_another_vocabulary_is_a_config_error(models) -> None:
    """draft_sample_method='probabilistic' cannot work across vocabularies: ValueError naming the field,
    the value and the rule, at start-up."""
    spec = {"model": models["draft"], "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}
    with pytest.raises(ValueError, match=r"draft_sample_method='probabilistic' is invalid: .*greedily only"):
        engine(models["target"], spec)


def test_a_request_that_outgrows_the_draft_cache_stops_drafting(models) -> None:
    """The byte-per-token draft needs one token per character, about 4x the BPE target's tokens. With
    max_model_len=40 its cache holds 2 * 40 = 80 positions: a 23-token prompt of 90 characters drafts
    nothing (each step decodes one token, output still the target's), while a 25-character one drafts."""
    spec = {"model": models["bytes_draft"], "num_speculative_tokens": 3}
    long_prompt, short_prompt = PROMPTS[5], PROMPTS[1]
    assert len(long_prompt) > 80 > len(short_prompt) + 3
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = ids(run(engine(models["target"], max_model_len=40), [long_prompt, short_prompt], params))
    eng = engine(models["target"], spec, max_model_len=40)
    assert ids(run(eng, [long_prompt], params)) == reference[:1]
    assert eng.stats.num_draft_tokens == 0
    assert ids(run(eng, [short_prompt], params)) == reference[1:]
    assert eng.stats.num_draft_tokens > 0


def test_finished_and_aborted_requests_leave_no_draft_state(models, reference) -> None:
    """The engine releases each request from the drafter when it finishes or is aborted, so per-request
    draft views do not pile up, and a request id used again starts from a fresh view (same output)."""
    eng = engine(models["target"], {"model": models["draft"], "num_speculative_tokens": 3})
    assert ids(run(eng, PROMPTS[:3], GREEDY)) == reference[:3]
    eng.add_request("gone", PROMPTS[4], GREEDY)
    for _ in range(3):
        eng.step()
    assert set(eng.drafter._states) == {"gone"}
    eng.abort_request("gone")
    assert eng.drafter._states == {}
    assert ids(run(eng, PROMPTS[:3], GREEDY)) == reference[:3]  # ids r0..r2 again

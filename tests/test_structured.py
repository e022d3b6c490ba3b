"""Structured output: the grammar mask is part of the processed target distribution at every verified
position, so verification never keeps a draft token the grammar forbids (not even FLy's forgiving), and
every output follows the grammar.

The fast tests use a tiny random-weight model with a byte-level tokenizer (it can spell any JSON); the
slow one uses the real SmolLM2-135M as target and as a noisy draft.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from tiny_engine import engine, noisy_pair, run
from tiny_llm import make_byte_tokenizer, save_perturbed, save_tiny
from zoo import QWEN_05B, SMOLLM2, zoo_model

from flyspec.config import EngineConfig
from flyspec.engine.logits_processing import RequestLogitsState, TargetProcessing
from flyspec.engine.sequence import Sequence
from flyspec.engine.structured import Grammars
from flyspec.sampling_params import SamplingParams, StructuredOutputsParams
from flyspec.spec_decode.verify import FlyParams, verify

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
AGGRESSIVE_FLY = {
    "num_speculative_tokens": 4,
    "rejection_sample_method": "fly",
    "fly_window_size": 1,
    "fly_entropy_threshold": 0.0,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("byte_models")
    target = save_tiny(root / "target", seed=0, byte_level=True)
    return {
        "target": str(target),
        # Enough noise that the draft disagrees with the target at most positions.
        "draft": str(save_perturbed(target, root / "draft", seed=4, noise=0.1)),
    }


def json_params(seed: int | None, **kwargs) -> SamplingParams:
    return SamplingParams(
        **{
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 160,
            "structured_outputs": StructuredOutputsParams(json=SCHEMA),
            **kwargs,
        }
    )


def test_grammar_forbidden_drafts_are_never_kept_by_verify():
    """verify() with FLy at its most forgiving (theta 0, W 1) on target distributions processed with a real
    grammar mask: over 400 rows (greedy and sampling) whose drafts mix allowed and forbidden tokens and
    whose raw logits favour the forbidden ones, every kept draft prefix is one the grammar accepts,
    while allowed drafts are kept and forgiven. Without the mask the same drafts are kept: the mask is
    what the guarantee rests on."""
    tokenizer = make_byte_tokenizer()
    vocab = 260
    grammars = Grammars(tokenizer, vocab, [2])
    spec = StructuredOutputsParams(regex="[ab]{1,8}")
    allowed_ids = tokenizer("ab", add_special_tokens=False).input_ids
    forbidden_ids = tokenizer("xyz", add_special_tokens=False).input_ids
    g = torch.Generator().manual_seed(0)
    rows, k = 400, 4
    greedy = torch.arange(rows) % 2 == 0
    seqs, drafts = [], []
    for b in range(rows):
        params = SamplingParams(temperature=0 if greedy[b] else 1.0, structured_outputs=spec)
        state = RequestLogitsState(params, [1], vocab, torch.device("cpu"), grammars.matcher(spec))
        seqs.append(Sequence(f"r{b}", None, [1], params, 0, frozenset(), logits_state=state))
        pool = forbidden_ids if torch.rand(1, generator=g) < 0.5 else allowed_ids
        drafts.append([pool[int(i)] for i in torch.randint(len(pool), (k,), generator=g)])
    logits = torch.randn(rows * (k + 1), vocab, generator=g)
    logits[:, forbidden_ids] += 6.0  # the raw model prefers what the grammar forbids
    processing = TargetProcessing(grammars)
    draft_ids = torch.tensor(drafts)
    fly = FlyParams(window_size=1, entropy_threshold=0.0, entropy_top_k=3)

    def kept_prefixes(with_grammar: bool) -> tuple[list[list[int]], int]:
        if with_grammar:
            probs, failed = processing.probs(logits, seqs, drafts)
            assert failed == {}
        else:
            plain = [
                Sequence(
                    s.request_id, None, [1], SamplingParams(temperature=s.params.temperature), 0, frozenset()
                )
                for s in seqs
            ]
            probs, _ = processing.probs(logits, plain, drafts)
        out = verify(draft_ids, probs.view(rows, k + 1, vocab), None, greedy=greedy, policy=fly, generator=g)
        accepted = out.num_accepted.tolist()
        return [drafts[b][: accepted[b]] for b in range(rows)], int(out.num_forgiven.sum())

    kept, forgiven = kept_prefixes(with_grammar=True)
    checker = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=2),
        llguidance.LLMatcher.grammar_from_regex("[ab]{1,8}"),
    )
    for prefix in kept:  # an independent matcher accepts every kept prefix
        assert checker.validate_tokens(prefix) == len(prefix)
    assert sum(map(len, kept)) > 0 and forgiven > 0
    naive, _ = kept_prefixes(with_grammar=False)
    assert any(t in forbidden_ids for prefix in naive for t in prefix)


def test_fifty_json_requests_under_aggressive_fly_all_validate(models):
    """50 seeded sampling requests with a JSON schema, FLy forced to forgive eagerly (theta 0, W 1) and a
    draft that disagrees often: every output parses and validates against the schema, ends because the
    grammar completed (finish_reason "stop"), and FLy did forgive tokens along the way."""
    eng = engine(models["target"], {"model": models["draft"], **AGGRESSIVE_FLY})
    outs = run(eng, ["person:"] * 50, [json_params(seed) for seed in range(50)])
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.text, out.error)
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert eng.stats.num_forgiven_tokens > 0
    assert eng.stats.num_draft_tokens > eng.stats.num_accepted_tokens  # the draft was rejected too


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
def test_speculative_greedy_with_a_grammar_equals_target_only(models, drafter):
    """fp32 exactness under a grammar: standard verification gives exactly target-only greedy output,
    ignore_eos or not (the request ends when the grammar is complete)."""
    spec = (
        {"model": models["draft"], "num_speculative_tokens": 3}
        if drafter == "draft_model"
        else {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    )
    params = [json_params(None, temperature=0, ignore_eos=bool(i % 2)) for i in range(4)]
    prompts = ["a", "person: ", "{{{{", "json"]
    target_only = run(engine(models["target"]), prompts, params)
    speculative = run(engine(models["target"], spec), prompts, params)
    assert [o.outputs[0].token_ids for o in speculative] == [o.outputs[0].token_ids for o in target_only]
    for out in target_only:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_choice_regex_and_json_object_constrain_every_sample(models):
    """choice, regex and json_object constraints hold for every sample of n > 1 requests under FLy; the
    logprobs alternatives of a constrained position are all tokens the grammar allows."""
    eng = engine(models["target"], {"model": models["draft"], **AGGRESSIVE_FLY})
    choices = ["yes", "no", 'maybe "so"']
    params = [
        SamplingParams(
            n=4, seed=1, max_tokens=20, logprobs=5, structured_outputs=StructuredOutputsParams(choice=choices)
        ),
        SamplingParams(
            n=4, seed=2, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
        ),
        SamplingParams(
            n=4, seed=3, max_tokens=200, structured_outputs=StructuredOutputsParams(json_object=True)
        ),
    ]
    picked, pattern, objects = run(eng, ["q", "code", "obj"], params)
    for completion in picked.outputs:
        assert completion.text in choices and completion.finish_reason == "stop"
        for entry in completion.logprobs[:1]:
            finite = [t for t, lp in entry.items() if lp.logprob > float("-inf")]
            assert {eng.tokenizer.decode([t]) for t in finite} <= {c[0] for c in choices}
    for completion in pattern.outputs:
        text = completion.text
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text
    for completion in objects.outputs:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # an unbounded object may run out of max_tokens: it is then a prefix of one
            assert completion.finish_reason == "length" and completion.text.startswith("{")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_value_error_naming_the_field(models, spec, field):
    """add_request refuses the request (and only it) with a ValueError naming the field."""
    eng = engine(models["target"])
    with pytest.raises(ValueError, match=field):
        eng.add_request("bad", "x", SamplingParams(structured_outputs=spec))
    assert not eng.has_unfinished_requests()


def test_structured_outputs_params_validation_and_response_format():
    """Exactly one constraint; OpenAI response_format maps onto it (text -> none)."""
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match=r"structured_outputs\.json: not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    from_rf = StructuredOutputsParams.from_response_format
    assert from_rf({"type": "text"}) is None
    assert from_rf({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    schema_rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert from_rf(schema_rf) == StructuredOutputsParams(json=SCHEMA)
    with pytest.raises(ValueError, match=r"response_format\.json_schema\.schema"):
        from_rf({"type": "json_schema", "json_schema": {"name": "p"}})
    with pytest.raises(ValueError, match=r"response_format\.type"):
        from_rf({"type": "yaml"})


@pytest.mark.slow
def test_real_model_json_schema_under_aggressive_fly():
    """SmolLM2-135M as target and, with Gaussian noise on its weights, as a draft that disagrees often:
    25 seeded chat requests with a JSON schema under FLy (theta 0, W 1) all return JSON that validates."""
    from flyspec import LLM

    smollm2 = zoo_model(SMOLLM2)
    target, draft = noisy_pair(str(smollm2), "float32")
    config = EngineConfig(
        model=str(smollm2),
        speculative_config={"model": str(smollm2), **AGGRESSIVE_FLY},
        dtype="float32",
        max_num_seqs=25,
    )
    llm = LLM.from_config(config, target=target, draft=draft)
    messages = [{"role": "user", "content": "Describe a person as JSON with name, age and ok."}]
    outs = llm.chat(
        [messages] * 25,
        [json_params(seed, temperature=0.7, max_tokens=64) for seed in range(25)],
        use_tqdm=False,
    )
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert llm.stats.num_forgiven_tokens > 0


# Text a grammar must let a model spell, whatever its tokenizer: accents, CJK and emoji (4-byte UTF-8,
# which byte-level vocabularies split across tokens in the middle of a character).
UNICODE_CHOICES = ["café", "thé", "東京タワー", "🙂👍🏽"]
UNICODE_SPECS = [
    StructuredOutputsParams(choice=UNICODE_CHOICES),
    StructuredOutputsParams(regex="(café|thé|東京タワー|🙂👍🏽)"),
    StructuredOutputsParams(json={"type": "string", "enum": UNICODE_CHOICES}),
]


def _check_unicode_grammars(folder: Path) -> None:
    """Over a prepared model's own tokenizer: every token's bytes decode to the tokenizer's own text for
    it; and for each Unicode constraint, the model's own tokens of every allowed text are allowed by the
    mask at each step, end in a complete match (EOS allowed), and a near miss is masked out."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    grammars = Grammars(tokenizer, vocab, [eos])
    grammars.prepare()
    texts = tokenizer.batch_decode([[i] for i in range(vocab)], clean_up_tokenization_spaces=False)
    # llguidance marks special tokens with a leading 0xFF byte, so the token of byte 0xFF alone reads as
    # special; 0xFF never occurs in UTF-8 text, so no grammar over text can want it.
    skip = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    skip |= set(tokenizer.convert_tokens_to_ids(["ÿ"]))
    spelled = grammars._tokenizer
    wrong = [
        i
        for i in range(vocab)
        if i not in skip and spelled.decode_bytes([i]).decode("utf-8", "replace") != texts[i]
    ]
    assert wrong == []
    for spec in UNICODE_SPECS:
        quote = '"' if spec.json is not None else ""
        for text in UNICODE_CHOICES:
            matcher = grammars.matcher(spec)
            for token in tokenizer(quote + text + quote, add_special_tokens=False).input_ids:
                assert grammars.masks([matcher], [[]], torch.device("cpu"))[0, token], (spec, text, token)
                matcher.accept(token)
            assert grammars.masks([matcher], [[]], torch.device("cpu"))[0, eos], (spec, text)
        near_miss = tokenizer(quote + "cafe" + quote, add_special_tokens=False).input_ids
        matcher = grammars.matcher(spec)
        allowed = []
        for token in near_miss:
            allowed.append(bool(grammars.masks([matcher], [[]], torch.device("cpu"))[0, token]))
            if not allowed[-1]:
                break
            matcher.accept(token)
        assert not all(allowed), spec


def test_unicode_choices_regexes_and_enums_over_smollm2s_byte_level_vocabulary():
    """SmolLM2's folder as an older flyspec prepared it declared a sentencepiece-style decoder over its
    byte-level vocabulary, so llguidance's own reading of it saw `é` as `Ã©` and no Unicode constraint
    could be met (a 500 in the server). Built from the byte decoder, the grammar's vocabulary spells every
    token as the tokenizer does and choice, regex and JSON enum constraints with é, CJK and emoji accept
    the model's own tokens."""
    _check_unicode_grammars(zoo_model(SMOLLM2))


@pytest.mark.slow  # a 150k vocabulary: tokenizer, llguidance trie and 150k single-token decodes
def test_unicode_choices_regexes_and_enums_over_qwens_byte_level_vocabulary():
    """As for SmolLM2, over Qwen2.5's 151,936-id vocabulary (shared by the 0.5B and 1.5B models)."""
    _check_unicode_grammars(zoo_model(QWEN_05B))

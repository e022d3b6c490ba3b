"""lm-evaluation-harness 0.4.13 against `flyspec serve`: a loglikelihood multiple-choice task and a
generation task from local files, through lm-eval's own `local-completions` client, with per-sample logs.

The server runs FLy speculative decoding on a tiny model. The multiple-choice answers are chosen from the
engine's own prompt logprobs (half the documents label the engine's best choice, half another one), so
lm-eval's accuracy is known exactly (0.5), and every logged loglikelihood must equal the sum of the
continuation's prompt logprobs computed directly by flyspec.LLM. The generation references are the
server's own greedy outputs for half the questions and a word it cannot produce for the other half.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import transformers
from serve_process import flyspec_serve, tiny_args
from test_gate_evallogs_real import BIN, words_task
from tiny_llm import TinyModels

from flyspec import LLM, SamplingParams

MODEL = "tiny"
DOCS = 8
CHOICES = ["w4", "w5 w6", "w7", "w8 w9 w10"]
QUESTIONS = 8
MAX_TOKENS = 8

CHOICE_TASK = """task: flyspec_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[dict[str, object]]:
    """`flyspec serve` on a tiny target with FLy (K=3, a draft that mostly agrees), as a subprocess."""
    root = tmp_path_factory.mktemp("lm_eval_serve")
    pair = tiny_models.forgiving_pair()
    fly = {"model": pair["draft"], "num_speculative_tokens": 3, "rejection_sample_method": "fly"}
    with flyspec_serve(tiny_args(pair["target"], fly, MODEL), root / "serve.log") as url:
        yield {"url": url, "target": Path(pair["target"])}


def _question(i: int) -> str:
    return f"w{i + 1} w{2 * i + 3} w{3 * i + 5}"


def _lm_eval_pairs(
    tokenizer: transformers.PreTrainedTokenizerBase, context: str, choice: str
) -> tuple[list[int], int]:
    """The token ids lm-eval sends for (context, " " + choice) and the context length it scores from:
    the whole text tokenised without special tokens, split after the context's own tokens."""
    whole = tokenizer(context + " " + choice, add_special_tokens=False).input_ids
    return whole, len(tokenizer(context, add_special_tokens=False).input_ids)


def _samples(output: Path, task: str) -> list[dict]:
    (path,) = output.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # one lm-eval run (it imports datasets, transformers) against a served model: minutes here
@pytest.mark.skipif(shutil.which("lm_eval", path=str(BIN)) is None, reason="lm-eval is not installed")
@pytest.mark.parametrize("backend", ["huggingface", "auto"])
def test_lm_eval_loglikelihood_and_generation_against_flyspec_serve(
    server: dict[str, object], tmp_path: Path, backend: str
) -> None:
    """lm-eval's local-completions client (token-id prompts, echo + logprobs 1 + max_tokens 1 for each
    choice) runs a local multiple-choice task and a generation task with --log_samples: every logged
    loglikelihood equals the engine's prompt logprobs summed over the continuation (1e-4), is_greedy
    matches their ranks, and acc is exactly 0.5 as the labels were chosen; the generation task's
    exact_match is exactly 0.5 as its references were chosen.

    With the tokenizer folder given (`tokenizer_backend=huggingface`), and with lm-eval's default `auto`,
    which finds the server's /tokenizer_info and tokenises through /tokenize (before that route existed,
    `auto` fell back to looking the served name up on the hub, which fails offline)."""
    url, target = str(server["url"]), Path(str(server["target"]))
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    llm = LLM(str(target), dtype="float32")
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    expected: list[list[tuple[float, bool]]] = []
    for i in range(DOCS):
        pairs = [_lm_eval_pairs(tokenizer, _question(i), choice) for choice in CHOICES]
        outs = llm.generate([ids for ids, _ in pairs], scoring, use_tqdm=False)
        scores = []
        for (ids, ctxlen), out in zip(pairs, outs, strict=True):
            entries = [out.prompt_logprobs[j][ids[j]] for j in range(ctxlen, len(ids))]  # type: ignore[index]
            scores.append((sum(e.logprob for e in entries), all(e.rank == 1 for e in entries)))
        expected.append(scores)
    best = [max(range(len(CHOICES)), key=lambda c, s=s: s[c][0]) for s in expected]
    labels = [b if i % 2 == 0 else (b + 1) % len(CHOICES) for i, b in enumerate(best)]
    data = tmp_path / "choice.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": _question(i), "choices": CHOICES, "label": labels[i]}) + "\n"
            for i in range(DOCS)
        )
    )

    # The server's own greedy continuation of each question, sent as lm-eval sends it (token ids).
    refs = []
    for i in range(QUESTIONS):
        ids = tokenizer(_question(i), add_special_tokens=False).input_ids
        body = {"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": ["\n\n"]}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        refs.append(text if i % 2 == 0 else "w0 w0 w0")
    words = tmp_path / "words.jsonl"
    words.write_text(
        "".join(json.dumps({"question": _question(i), "answer": r}) + "\n" for i, r in enumerate(refs))
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "flyspec_choice.yaml").write_text(CHOICE_TASK.format(data=data))
    (tasks / "flyspec_words.yaml").write_text(words_task(words, MAX_TOKENS))

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    model_args = f"base_url={url}/v1/completions,model={MODEL}"
    if backend == "huggingface":
        model_args += f",tokenizer={target},tokenizer_backend=huggingface"
    cmd = [
        str(BIN / "lm_eval"),
        "--model",
        "local-completions",
        "--model_args",
        f"{model_args},max_retries=1",
    ]
    cmd += ["--tasks", "flyspec_choice,flyspec_words", "--include_path", str(tasks), "--log_samples"]
    cmd += ["--output_path", str(tmp_path / "out")]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert results["flyspec_choice"]["acc,none"] == 0.5
    assert results["flyspec_words"]["exact_match,whole"] == 0.5
    choice_samples = sorted(_samples(tmp_path / "out", "flyspec_choice"), key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in choice_samples] == list(range(DOCS))
    for sample, scores in zip(choice_samples, expected, strict=True):
        logged = [(float(ll), str(greedy) == "True") for ll, greedy in (r[0] for r in sample["resps"])]
        assert [ll for ll, _ in logged] == pytest.approx([ll for ll, _ in scores], abs=1e-4)
        assert [g for _, g in logged] == [g for _, g in scores]
        assert sample["acc"] == float(sample["doc_id"] % 2 == 0)
    word_samples = _samples(tmp_path / "out", "flyspec_words")
    assert len(word_samples) == 2 * QUESTIONS  # one line per filter
    choice_acc, words_match = (
        results["flyspec_choice"]["acc,none"],
        results["flyspec_words"]["exact_match,whole"],
    )
    print(f"lm-eval: multiple-choice acc {choice_acc}, generation exact_match {words_match}")

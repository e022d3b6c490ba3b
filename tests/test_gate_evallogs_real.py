"""Real eval logs for `gate compare`: lm-evaluation-harness (its `local-completions` client) and Inspect AI
(its `openai-api` provider) run against two `flyspec serve` processes on loopback, a tiny target alone
(baseline) and the same target with FLy speculative decoding (candidate), then their logs are read and
paired.

The references are chosen from each server's own greedy output for the same request: even questions
expect the baseline's text, odd ones the candidate's. So wherever FLy changed the output, the baseline
loses an even question and gains an odd one, and the expected lost/gained counts are known exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lm_eval_tasks import generation_task
from serve_process import flyspec_serve, tiny_args
from tiny_llm import TinyModels

from flyspec.gate.logs.compare import compare_logs, pair_logs
from flyspec.gate.logs.evallogs import read_eval_log
from flyspec.gate.stats import decide, paired_counts

BIN = Path(sys.executable).parent
QUESTIONS = 16
MAX_TOKENS = 12
MODEL = "tiny"


def _prompt(i: int) -> str:
    return f"w{i} w{2 * i} w{3 * i}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[dict[str, object]]:
    """Baseline (target only) and candidate (FLy, K=3, a draft that mostly agrees) servers."""
    root = tmp_path_factory.mktemp("evallogs")
    pair = tiny_models.forgiving_pair()
    fly = {"model": pair["draft"], "num_speculative_tokens": 3, "rejection_sample_method": "fly"}
    with (
        flyspec_serve(tiny_args(pair["target"], name=MODEL), root / "baseline.log") as baseline,
        flyspec_serve(tiny_args(pair["target"], fly, MODEL), root / "candidate.log") as candidate,
    ):
        urls = {"baseline": baseline, "candidate": candidate}
        yield {"root": root, "target": Path(pair["target"]), "urls": urls}


def _complete(url: str, prompt: str, chat: bool) -> str:
    if chat:
        body, route = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}, "chat/completions"
    else:
        body, route = {"model": MODEL, "prompt": prompt}, "completions"
    body |= {"max_tokens": MAX_TOKENS, "temperature": 0}
    choice = httpx.post(f"{url}/v1/{route}", json=body, timeout=120).json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def _references(urls: dict[str, str], chat: bool) -> tuple[list[str], int, int]:
    """Each question's reference (baseline text for even i, candidate text for odd i) and the lost and
    gained counts that follow."""
    outputs = {
        name: [_complete(url, _prompt(i), chat) for i in range(QUESTIONS)] for name, url in urls.items()
    }
    refs, lost, gained = [], 0, 0
    for i, (base, cand) in enumerate(zip(outputs["baseline"], outputs["candidate"], strict=True)):
        refs.append(base if i % 2 == 0 else cand)
        if base.split() != cand.split():
            lost += i % 2 == 0
            gained += i % 2 == 1
    return refs, lost, gained


# Two ways to read the answer out of the output: all of it, or its first word.
WORD_FILTERS = {
    "whole": [{"function": "remove_whitespace"}, {"function": "take_first"}],
    "first-word": [{"function": "regex", "regex_pattern": r"(w\d+)"}, {"function": "take_first"}],
}


def words_task(data: Path, max_tokens: int, name: str = "flyspec_words", filters: bool = True) -> str:
    """The word questions of `data` as an lm-eval task, with WORD_FILTERS or lm-eval's default single
    filter ("none")."""
    return generation_task(
        name,
        data,
        until="\n\n",
        max_gen_toks=max_tokens,
        filters=WORD_FILTERS if filters else None,
        ignore=[" "],
    )


@pytest.mark.slow  # two servers, then lm-eval twice (it imports datasets, transformers): minutes here
@pytest.mark.skipif(shutil.which("lm_eval", path=str(BIN)) is None, reason="lm-eval is not installed")
def test_lm_eval_logs_from_flyspec_serve_pair(servers: dict[str, object], tmp_path: Path) -> None:
    """lm-eval's own local-completions client evaluates a local JSONL generation task (dataset_path:
    json) on both servers with --log_samples; the two samples folders are read (two filters logged, so
    --filter is required) and paired: same doc ids and hashes, and exactly the lost/gained counts that
    the servers' outputs predict, with at least one flip. A second task with a single filter is logged
    beside it: the mixed folders compare with a per-task filter (`--filter flyspec_words=whole`). The
    same logs with the `filter` and `metrics` keys removed (as older lm-eval versions wrote them, one row
    per filter in the task's order) read back to the same samples, the filters named from lm-eval's own
    results_*.json."""
    urls: dict[str, str] = servers["urls"]  # type: ignore[assignment]
    refs, lost, gained = _references(urls, chat=False)
    assert lost + gained > 0, "FLy changed no output: the test would prove nothing"
    data = tmp_path / "words.jsonl"
    data.write_text(
        "".join(json.dumps({"question": _prompt(i), "answer": r}) + "\n" for i, r in enumerate(refs))
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "flyspec_words.yaml").write_text(words_task(data, MAX_TOKENS))
    # The same questions with lm-eval's default single filter, logged beside the first.
    (tasks / "flyspec_words_one.yaml").write_text(words_task(data, MAX_TOKENS, "flyspec_words_one", False))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    runs = {}
    for name, url in urls.items():
        model_args = (
            f"base_url={url}/v1/completions,model={MODEL},tokenizer={servers['target']},"
            "tokenizer_backend=huggingface,tokenized_requests=False,max_retries=1"
        )
        cmd = [str(BIN / "lm_eval"), "--model", "local-completions", "--model_args", model_args]
        cmd += ["--tasks", "flyspec_words,flyspec_words_one", "--include_path", str(tasks), "--log_samples"]
        cmd += ["--output_path", str(tmp_path / name)]
        log = open(tmp_path / f"lm_eval_{name}.log", "w")  # noqa: SIM115 - closed after the run
        runs[name] = (subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT), log)
    for name, (proc, log) in runs.items():
        assert proc.wait(timeout=900) == 0, (tmp_path / f"lm_eval_{name}.log").read_text()[-3000:]
        log.close()
    with pytest.raises(ValueError, match="choose one with --filter NAME, or .* --filter flyspec_words=NAME"):
        read_eval_log(str(tmp_path / "baseline"))
    with pytest.raises(ValueError, match="task 'flyspec_words_one' has no filter 'whole'"):
        read_eval_log(str(tmp_path / "baseline"), filter="whole")
    per_task = ["flyspec_words=whole"]
    baseline = read_eval_log(str(tmp_path / "baseline"), filter=per_task)
    candidate = read_eval_log(str(tmp_path / "candidate"), filter=per_task)
    assert baseline.metric == "exact_match" and len(baseline.samples) == 2 * QUESTIONS
    assert baseline.filter == "flyspec_words=whole, none"
    assert set(baseline.samples[0].hashes) == {"lm_eval_doc", "lm_eval_prompt", "lm_eval_target"}
    old = _without_filter_and_metrics_keys(tmp_path / "baseline", tmp_path / "old")
    assert read_eval_log(str(old), filter=per_task).samples == baseline.samples
    assert read_eval_log(str(old), filter=["flyspec_words=first-word"]).samples == (
        read_eval_log(str(tmp_path / "baseline"), filter=["flyspec_words=first-word"]).samples
    )
    paired = pair_logs(baseline, candidate)
    assert [t.task for t in paired.tasks] == ["flyspec_words", "flyspec_words_one"]
    task = paired.tasks[0]
    assert task.task == "flyspec_words" and [k for k, _ in task.keys] == [str(i) for i in range(QUESTIONS)]
    counts = paired_counts(task.baseline, task.candidate)
    print(f"lm-eval logs paired: n={counts.n} lost={counts.lost} gained={counts.gained}")
    assert (counts.n, counts.lost, counts.gained) == (QUESTIONS, lost, gained)
    # `gate compare` on the same folders, through the installed command as a user runs it.
    cmd = [str(BIN / "flyspec"), "gate", "compare", str(tmp_path / "baseline"), str(tmp_path / "candidate")]
    done = subprocess.run(
        [*cmd, "--margin", "0.5", "--filter", "flyspec_words=whole", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    row = next(c for c in report["comparisons"] if c["scope"] == "flyspec_words")
    expected = decide(QUESTIONS, lost, gained, 0.5)
    assert (row["n"], row["lost"], row["gained"]) == (QUESTIONS, lost, gained)
    assert (row["decision"], row["ci_low"]) == (expected.decision, pytest.approx(expected.low))
    assert report["decision"]["n"] == 2 * QUESTIONS
    assert "declared now, after the data" in done.stderr


def _without_filter_and_metrics_keys(folder: Path, out: Path) -> Path:
    """A copy of an lm-eval output folder whose sample rows lack `filter` and `metrics`, as lm-eval wrote
    them before it added those keys (its rows already came one per filter, in the task's filter order)."""
    for file in folder.rglob("*.json*"):
        target = out / file.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        if file.name.startswith("samples_"):
            rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
            for row in rows:
                del row["filter"], row["metrics"]
            target.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            shutil.copyfile(file, target)
    return out


INSPECT_TASK = """from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import exact
from inspect_ai.solver import generate

REFS = {refs!r}


@task
def flyspec_words():
    samples = [Sample(id=i, input=p, target=t) for i, (p, t) in enumerate(REFS)]
    return Task(dataset=samples, solver=generate(), scorer=exact(), epochs=2)
"""


@pytest.mark.slow  # Inspect twice against both servers: about half a minute here
def test_inspect_logs_from_flyspec_serve_pair(servers: dict[str, object], tmp_path: Path) -> None:
    """Inspect AI's openai-api provider evaluates a two-epoch chat task on both servers; the .eval logs
    are read with Inspect's read_eval_log and paired by sample id and epoch, giving twice (two greedy
    epochs) the lost/gained counts that the servers' chat outputs predict."""
    pytest.importorskip("inspect_ai")
    urls: dict[str, str] = servers["urls"]  # type: ignore[assignment]
    refs, lost, gained = _references(urls, chat=True)
    assert lost + gained > 0, "FLy changed no output: the test would prove nothing"
    task_file = tmp_path / "words_task.py"
    task_file.write_text(INSPECT_TASK.format(refs=[(_prompt(i), r) for i, r in enumerate(refs)]))
    for name, url in urls.items():
        env = {**os.environ, "FLYSPEC_BASE_URL": f"{url}/v1", "FLYSPEC_API_KEY": "unused"}
        # Inspect resolves the task file relative to the working directory.
        cmd = [str(BIN / "inspect"), "eval", task_file.name, "--model", f"openai-api/flyspec/{MODEL}"]
        cmd += ["--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--log-dir", str(tmp_path / name)]
        cmd += ["--log-format", "eval", "--display", "none"]
        done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    baseline, candidate = (
        read_eval_log(str(tmp_path / "baseline")),
        read_eval_log(str(tmp_path / "candidate")),
    )
    assert baseline.kind == "inspect" and baseline.metric == "exact"
    (task,) = pair_logs(baseline, candidate).tasks
    assert task.keys[:2] == [("0", 1), ("0", 2)] and len(task.keys) == 2 * QUESTIONS
    counts = paired_counts(task.baseline, task.candidate)
    print(f"Inspect logs paired: n={counts.n} lost={counts.lost} gained={counts.gained}")
    assert (counts.n, counts.lost, counts.gained) == (2 * QUESTIONS, 2 * lost, 2 * gained)
    # `gate compare` refuses two epochs per question (not independent pairs) and compares one when asked.
    with pytest.raises(ValueError, match="holds 2 epochs per question"):
        compare_logs(str(tmp_path / "baseline"), str(tmp_path / "candidate"), 0.5)
    pooled = compare_logs(str(tmp_path / "baseline"), str(tmp_path / "candidate"), 0.5, epoch=1).pooled
    assert pooled is not None and (pooled.n, pooled.lost, pooled.gained) == (QUESTIONS, lost, gained)
    # Greedy decoding answers both epochs alike, so the baseline's epoch 1 against the candidate's epoch 2
    # gives the same counts.
    sides = {"baseline": 1, "candidate": 2}
    pooled = compare_logs(str(tmp_path / "baseline"), str(tmp_path / "candidate"), 0.5, epoch=sides).pooled
    assert pooled is not None and (pooled.n, pooled.lost, pooled.gained) == (QUESTIONS, lost, gained)

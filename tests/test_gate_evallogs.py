"""Reading per-sample logs for `gate compare` and pairing them: lm-eval samples files (in the format
lm-eval 0.4 writes, rows as produced by tests/test_gate_evallogs_real.py), Inspect logs written with
Inspect's own API, and flyspec's store; mismatched question sets are refused naming the questions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import AnswerRecord, GateStore, RegisteredQuestion
from flyspec.gate.logs.compare import pair_logs
from flyspec.gate.logs.evallogs import read_eval_log, read_lm_eval_samples

STAMP = "2026-12-01T09-09-01.147126"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _row(
    doc_id: int, value: object, *, filter: str = "whole", prompt: str | None = None
) -> dict[str, object]:
    """A samples_*.jsonl row with the fields lm-eval 0.4.13 writes for a generate_until task."""
    prompt = prompt if prompt is not None else f"w{doc_id} w{2 * doc_id}"
    doc = {"id": f"q{doc_id}", "question": prompt, "answer": "w1"}
    return {
        "doc_id": doc_id,
        "doc": doc,
        "target": "w1",
        "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": {"until": ["\n\n"], "max_gen_toks": 12}}},
        "resps": [["w1"]],
        "filtered_resps": ["w1"],
        "filter": filter,
        "metrics": ["exact_match", "chars"],
        "doc_hash": _sha(json.dumps(doc, indent=2, ensure_ascii=False)),
        "prompt_hash": _sha(prompt),
        "target_hash": _sha("w1"),
        "exact_match": value,
        "chars": 7.0,
    }


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _lm_eval_run(root: Path, scores: dict[str, list[int]], filters: tuple[str, ...] = ("whole",)) -> Path:
    """An --output_path folder: results file plus one samples file per task, under a model folder."""
    model_dir = root / "tiny"
    for task, values in scores.items():
        rows = [_row(i, float(v), filter=f) for f in filters for i, v in enumerate(values)]
        _write(model_dir / f"samples_{task}_{STAMP}.jsonl", rows)
    (model_dir / f"results_{STAMP}.json").write_text("{}")
    return root


def test_lm_eval_folder_pairs_by_task_and_doc_id(tmp_path: Path) -> None:
    """A folder (samples nested in the model's subfolder) is read per task; the default metric is the
    task's first (exact_match, 0.0/1.0 floats accepted); lm-eval's three hashes are kept; pairing gives
    per-task lists in doc_id order (10 after 9) and the pooled lists."""
    base = _lm_eval_run(tmp_path / "base", {"gsm": [1] * 11, "arc_easy": [1, 0, 1]})
    cand = _lm_eval_run(tmp_path / "cand", {"gsm": [1] * 9 + [0, 1], "arc_easy": [0, 1, 1]})
    baseline, candidate = read_eval_log(str(base)), read_eval_log(str(cand))
    assert (baseline.kind, baseline.metric, baseline.filter) == ("lm-eval", "exact_match", "whole")
    sample = baseline.samples[0]
    assert set(sample.hashes) == {"lm_eval_doc", "lm_eval_prompt", "lm_eval_target"} and sample.epoch == 0
    paired = pair_logs(baseline, candidate)
    assert [t.task for t in paired.tasks] == ["arc_easy", "gsm"]
    gsm = paired.tasks[1]
    assert [k for k, _ in gsm.keys] == [str(i) for i in range(11)]
    assert (gsm.baseline, gsm.candidate) == ([1] * 11, [1] * 9 + [0, 1])
    assert paired.pooled == ([1, 0, 1] + [1] * 11, [0, 1, 1] + [1] * 9 + [0, 1])


def test_lm_eval_metric_and_filter_choice(tmp_path: Path) -> None:
    """With two filters logged, --filter is required and selects its rows; an unknown filter or metric
    is named with what exists; a non-binary metric (a float such as 7.0, or 0.5) is refused."""
    run = _lm_eval_run(tmp_path / "run", {"gsm": [1, 0]}, filters=("strict-match", "flexible-extract"))
    with pytest.raises(ValueError, match=r"logged several filters \(flexible-extract, strict-match\)"):
        read_eval_log(str(run))
    assert len(read_eval_log(str(run), filter="strict-match").samples) == 2
    with pytest.raises(ValueError, match=r"no filter 'none' \(logged: flexible-extract, strict-match\)"):
        read_eval_log(str(run), filter="none")
    with pytest.raises(ValueError, match=r"no metric 'acc' in this row \(its metrics: exact_match, chars\)"):
        read_eval_log(str(run), metric="acc", filter="strict-match")
    with pytest.raises(ValueError, match=r"chars=7\.0 is not a right/wrong score"):
        read_eval_log(str(run), metric="chars", filter="strict-match")
    half = _write(tmp_path / "half" / f"samples_gsm_{STAMP}.jsonl", [_row(0, 1.0), _row(1, 0.5)])
    with pytest.raises(
        ValueError, match=r"samples_gsm_.*\.jsonl:2 \(task 'gsm', doc_id 1\): exact_match=0\.5"
    ):
        read_lm_eval_samples(half)


def test_lm_eval_bad_inputs(tmp_path: Path) -> None:
    """Two runs of one task in a folder, a duplicate doc_id, lm-eval's aggregated results file, a folder
    with no samples and a missing path are each refused with one clear line."""
    run = _lm_eval_run(tmp_path / "run", {"gsm": [1, 0]})
    _write(run / "tiny" / "samples_gsm_2027-01-01T00-00-00.0.jsonl", [_row(0, 1.0)])
    with pytest.raises(ValueError, match="two sample logs of task 'gsm'"):
        read_eval_log(str(run))
    dup = _write(tmp_path / "dup" / f"samples_gsm_{STAMP}.jsonl", [_row(0, 1.0), _row(0, 0.0)])
    with pytest.raises(
        ValueError, match=r":2: doc_id 0 appears twice for filter 'whole' \(first on line 1\)"
    ):
        read_eval_log(str(dup))
    with pytest.raises(ValueError, match="aggregated results file"):
        read_eval_log(str(run / "tiny" / f"results_{STAMP}.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no Inspect logs"):
        read_eval_log(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="STORE.db:RUN:ARM"):
        read_eval_log(str(tmp_path / "nothing.jsonl"))


def test_mismatched_questions_are_refused_naming_them(tmp_path: Path) -> None:
    """Pairing refuses logs whose question sets differ (counts and the first ids each way, and the tasks
    when those differ) and logs whose ids match but whose prompts or docs do not (hash mismatch)."""
    base = read_eval_log(str(_lm_eval_run(tmp_path / "b", {"gsm": [1] * 8})))
    fewer = read_eval_log(str(_lm_eval_run(tmp_path / "c", {"gsm": [1] * 6, "mmlu": [1]})))
    with pytest.raises(ValueError) as info:
        pair_logs(base, fewer)
    message = str(info.value)
    assert "tasks only in the baseline: none; only in the candidate: mmlu" in message
    assert (
        "only in the baseline: 2 (gsm/6, gsm/7)" in message and "only in the candidate: 1 (mmlu/0)" in message
    )
    other = _write(
        tmp_path / "d" / f"samples_gsm_{STAMP}.jsonl",
        [_row(i, 1.0, prompt="a different prompt" if i in (2, 5) else None) for i in range(8)],
    )
    with pytest.raises(ValueError, match=r"lm_eval_doc hash differs for 2 \(gsm/2, gsm/5\).*lm_eval_prompt"):
        pair_logs(base, read_eval_log(str(other)))


def _inspect_log(
    path: Path, task: str, values: dict[tuple[int, int], object], scorers: tuple[str, ...]
) -> Path:
    from inspect_ai.log import EvalConfig, EvalDataset, EvalLog, EvalSample, EvalSpec, write_eval_log
    from inspect_ai.scorer import Score

    spec = EvalSpec(
        created="2026-12-01T00:00:00+00:00", task=task, dataset=EvalDataset(), model="m", config=EvalConfig()
    )
    samples = [
        EvalSample(
            id=f"s{i}",
            epoch=epoch,
            input=f"question {i}",
            target="42",
            scores={name: Score(value=value) for name in scorers},
        )
        for (i, epoch), value in values.items()
    ]
    write_eval_log(EvalLog(eval=spec, status="success", samples=samples), str(path))
    return path


def test_inspect_logs_pair_by_sample_id_and_epoch(tmp_path: Path) -> None:
    """Inspect .eval and .json logs (written by Inspect's own API, read by its read_eval_log) pair by
    sample id and epoch; C/I, 1/0 and True/False are right/wrong; a named scorer is required when there
    are several; partial credit ('P' or 0.5) is refused with the sample named; a folder holds one log
    per task."""
    pytest.importorskip("inspect_ai")
    base = _inspect_log(
        tmp_path / "base.eval", "qa", {(0, 1): "C", (0, 2): "C", (1, 1): "I", (1, 2): "C"}, ("match",)
    )
    cand = _inspect_log(
        tmp_path / "cand.json", "qa", {(0, 1): 1, (0, 2): False, (1, 1): True, (1, 2): 1.0}, ("match",)
    )
    paired = pair_logs(read_eval_log(str(base)), read_eval_log(str(cand)))
    (qa,) = paired.tasks
    assert qa.keys == [("s0", 1), ("s0", 2), ("s1", 1), ("s1", 2)]
    assert (qa.baseline, qa.candidate) == ([1, 1, 0, 1], [1, 0, 1, 1])
    two = _inspect_log(tmp_path / "two.eval", "qa", {(0, 1): "C"}, ("match", "includes"))
    with pytest.raises(ValueError, match=r"2 scorers \(match, includes\); choose one with --metric"):
        read_eval_log(str(two))
    assert read_eval_log(str(two), metric="includes").metric == "includes"
    partial = _inspect_log(tmp_path / "partial.eval", "qa", {(0, 1): "C", (1, 1): "P"}, ("model_graded",))
    with pytest.raises(
        ValueError, match=r"sample 's1', epoch 1\): score 'model_graded'='P' is not a right/wrong"
    ):
        read_eval_log(str(partial))
    with pytest.raises(ValueError, match="--filter applies to lm-eval logs only"):
        read_eval_log(str(base), filter="whole")
    folder = tmp_path / "folder"
    folder.mkdir()
    _inspect_log(folder / "a.eval", "qa", {(0, 1): "C"}, ("match",))
    # In a folder, Inspect's own listing decides what is a log: .eval files, and .json files with its
    # timestamped names (so an unrelated JSON file next to them is not read).
    _inspect_log(folder / "2026-12-01T00-00-00+00-00_math_x1.json", "math", {(0, 1): "I"}, ("match",))
    (folder / "notes.json").write_text("{}")
    assert {s.task for s in read_eval_log(str(folder)).samples} == {"qa", "math"}
    _inspect_log(folder / "c.eval", "qa", {(0, 1): "C"}, ("match",))
    with pytest.raises(ValueError, match="two Inspect logs of task 'qa'"):
        read_eval_log(str(folder))


def _store(path: Path) -> Path:
    with GateStore(path) as store:
        questions = [RegisteredQuestion("gsm8k", str(i), i, _sha(f"p{i}"), "1", "gsm8k") for i in range(4)]
        registration = {"margin": 0.02, "alpha": 0.025, "seed": 0}
        store.register("r1", Registration.read("gate", registration), questions)
        for arm, right in (("baseline", [1, 1, 0, 1]), ("candidate", [1, 0, 1, 1])):
            for i, ok in enumerate(right):
                record = AnswerRecord(arm, 0, "gsm8k", str(i), i, "out", "1", bool(ok), "stop", 5, 5, 0.1)
                store.add_answer("r1", record)
    return path


def test_store_arms_pair(tmp_path: Path) -> None:
    """STORE.db:RUN:ARM reads one arm of a run from the gate store (registered prompt hashes kept);
    two arms of one run pair; an unknown run or arm is named with what exists; a missing store file is
    not created."""
    db = _store(tmp_path / "gate.db")
    baseline = read_eval_log(f"{db}:r1:baseline")
    assert baseline.kind == "flyspec" and baseline.samples[0].hashes == {"flyspec_prompt": _sha("p0")}
    paired = pair_logs(baseline, read_eval_log(f"{db}:r1:candidate"))
    assert (paired.tasks[0].baseline, paired.tasks[0].candidate) == ([1, 1, 0, 1], [1, 0, 1, 1])
    with pytest.raises(ValueError, match=r"no run 'r2' \(runs: r1\)"):
        read_eval_log(f"{db}:r2:baseline")
    with pytest.raises(ValueError, match=r"no answers of arm 'fly' \(arms: baseline, candidate\)"):
        read_eval_log(f"{db}:r1:fly")
    with pytest.raises(FileNotFoundError, match="no such gate store"):
        read_eval_log(f"{tmp_path / 'missing.db'}:r1:baseline")
    assert not (tmp_path / "missing.db").exists()


def test_lm_eval_filter_per_task(tmp_path: Path) -> None:
    """A folder mixing a task that logged two filters with one that logged a single filter: without
    --filter the two-filter task is named with the per-task form to use; a filter for every task fails on
    the task that lacks it (naming the per-task form); `--filter gsm=flexible-extract` picks that task's
    filter and the single-filter task keeps its only one. A per-task filter of a task the log lacks, or two
    filters for one task, are refused."""
    run = tmp_path / "run"
    _lm_eval_run(run, {"gsm": [1, 0, 1]}, filters=("strict-match", "flexible-extract"))
    _write(run / "tiny" / f"samples_arc_{STAMP}.jsonl", [_row(i, 1.0, filter="none") for i in range(2)])
    with pytest.raises(ValueError, match=r"task 'gsm' logged several filters .* --filter gsm=NAME"):
        read_eval_log(str(run))
    with pytest.raises(ValueError, match=r"task 'arc' has no filter 'flexible-extract' .* --filter arc=NAME"):
        read_eval_log(str(run), filter="flexible-extract")
    log = read_eval_log(str(run), filter=["gsm=flexible-extract"])
    assert sorted((s.task, s.question_id) for s in log.samples) == [
        ("arc", "0"),
        ("arc", "1"),
        ("gsm", "0"),
        ("gsm", "1"),
        ("gsm", "2"),
    ]
    assert log.filter == "gsm=flexible-extract, none"
    both = read_eval_log(str(run), filter=["gsm=strict-match", "arc=none"])
    assert both.filter == "arc=none, gsm=strict-match"
    with pytest.raises(ValueError, match=r"--filter mmlu=x: .* has no task 'mmlu' \(tasks: arc, gsm\)"):
        read_eval_log(str(run), filter=["mmlu=x"])
    with pytest.raises(ValueError, match="one filter per task"):
        read_eval_log(str(run), filter=["gsm=strict-match", "gsm=flexible-extract"])


def _old_row(doc_id: int, value: object, *, extra_metric: bool = False) -> dict[str, object]:
    """A row as lm-eval wrote it before its samples carried `filter` and `metrics` keys."""
    row = _row(doc_id, value)
    del row["filter"], row["metrics"]
    if not extra_metric:
        del row["chars"]
    return row


def test_lm_eval_rows_without_filter_or_metrics_keys(tmp_path: Path) -> None:
    """Older lm-eval rows carry no `filter` and no `metrics` key and repeat each doc_id once per filter,
    the filters one after another. One filter: read as is, the only metric value is the metric (it used to
    fail with "doc_id 0 appears twice for filter 'None'" only when filters repeat, and with "no 'metrics'
    list" always). Two filters: the n-th row of a doc_id is the n-th filter, named from the task's
    filter_list in results_*.json (else #1, #2), and chosen with --filter; several metric values need
    --metric unless results_*.json gives the metric order."""
    one = _write(
        tmp_path / "one" / f"samples_gsm_{STAMP}.jsonl", [_old_row(i, float(i % 2)) for i in range(4)]
    )
    log = read_eval_log(str(one))
    assert (log.metric, log.filter) == ("exact_match", None)
    assert [s.correct for s in log.samples] == [False, True, False, True]
    two = tmp_path / "two" / "tiny"
    rows = [_old_row(i, 1.0) for i in range(3)] + [_old_row(i, 0.0) for i in range(3)]
    _write(two / f"samples_gsm_{STAMP}.jsonl", rows)
    with pytest.raises(ValueError, match=r"logged several filters \(#1, #2\)"):
        read_eval_log(str(two.parent))
    assert [s.correct for s in read_eval_log(str(two.parent), filter="#2").samples] == [False] * 3
    config = {"filter_list": [{"name": "strict-match"}, {"name": "flexible-extract"}]}
    (two / f"results_{STAMP}.json").write_text(json.dumps({"configs": {"gsm": config}}))
    log = read_eval_log(str(two.parent), filter="strict-match")
    assert [s.correct for s in log.samples] == [True] * 3 and log.filter == "strict-match"
    assert [s.correct for s in read_eval_log(str(two.parent), filter="flexible-extract").samples] == [
        False
    ] * 3
    values = _write(tmp_path / "values" / f"samples_gsm_{STAMP}.jsonl", [_old_row(0, 1.0, extra_metric=True)])
    with pytest.raises(ValueError, match=r"holds several values \(exact_match, chars\); name the metric"):
        read_eval_log(str(values))
    assert read_eval_log(str(values), metric="exact_match").metric == "exact_match"
    (values.parent / f"results_{STAMP}.json").write_text(
        json.dumps({"configs": {"gsm": {"metric_list": [{"metric": "exact_match"}, {"metric": "chars"}]}}})
    )
    assert read_eval_log(str(values)).metric == "exact_match"
    mixed = _write(tmp_path / "mixed" / f"samples_gsm_{STAMP}.jsonl", [_row(0, 1.0), _old_row(1, 1.0)])
    with pytest.raises(ValueError, match=r":2: this row has no 'filter' key while others have one"):
        read_eval_log(str(mixed))


def test_inspect_errored_samples_are_named(tmp_path: Path) -> None:
    """A finished Inspect log whose samples errored (no score) is refused naming those samples and their
    errors, not with "0 scorers (none)"."""
    pytest.importorskip("inspect_ai")
    from inspect_ai.log import EvalError, write_eval_log
    from inspect_ai.log import read_eval_log as inspect_read

    path = _inspect_log(tmp_path / "err.eval", "qa", {(0, 1): "C", (1, 1): "C", (2, 1): "I"}, ("match",))
    log = inspect_read(str(path))
    for sample in log.samples[1:]:
        sample.scores = None
        sample.error = EvalError(
            message="RuntimeError: the model server went away", traceback="", traceback_ansi=""
        )
    write_eval_log(log, str(path))
    with pytest.raises(ValueError) as info:
        read_eval_log(str(path))
    message = str(info.value)
    assert "2 sample(s) of task 'qa' errored in Inspect and have no score" in message
    assert "sample 's1' epoch 1: RuntimeError: the model server went away" in message and "'s2'" in message
    assert "0 scorers" not in message

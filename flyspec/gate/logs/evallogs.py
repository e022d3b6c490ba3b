"""Per-sample results of finished evaluations for ``flyspec gate compare``: ``read_eval_log`` reads one
side (an lm-eval ``--log_samples`` file or folder, an Inspect AI log or folder, or ``STORE.db:RUN:ARM``)
into an ``EvalLog``, one right/wrong ``SampleScore`` per question and epoch; docs/gate.md, "Comparing
existing logs", says how each format is keyed and scored.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flyspec.gate.data.questions import Row, jsonl_rows

if TYPE_CHECKING:
    from inspect_ai.log import EvalSample

_LM_EVAL_FILE = re.compile(r"^samples_(?P<task>.+)_(?P<stamp>[^_]+)\.jsonl$")
_LM_EVAL_HASHES = ("doc_hash", "prompt_hash", "target_hash")
# What lm-eval writes in a samples row besides the metric values.
_LM_EVAL_FIELDS = (
    *("doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics"),
    *_LM_EVAL_HASHES,
)
_INSPECT_SUFFIXES = (".eval", ".json")
_INSPECT_VALUES: dict[str, bool] = {"C": True, "I": False, "N": False}
_SHOWN_ERRORS = 3


@dataclass(frozen=True)
class SampleScore:
    """One question (in one epoch) of one log: right or wrong, with the log's hashes by kind (``lm_eval_doc``,
    ``inspect_input``, ``flyspec_prompt``, ...); two logs must agree on the kinds both have."""

    task: str
    question_id: str
    epoch: int
    correct: bool
    hashes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalLog:
    """One side of a comparison: what was read, in which format, how it was scored, and the samples."""

    source: str
    kind: str
    metric: str
    filter: str | None
    samples: list[SampleScore]


def _binary(value: object, where: str, what: str) -> bool:
    """A right/wrong score: the paired tests count lost and gained questions, so partial credit is refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value in _INSPECT_VALUES:
        return _INSPECT_VALUES[value]
    raise ValueError(
        f"{where}: {what}={value!r} is not a right/wrong score (1/0, true/false, C/I); the paired test "
        "needs one per question, so partial credit or a continuous metric cannot be compared"
    )


# lm-evaluation-harness


def parse_filters(filter: str | Sequence[str] | None) -> tuple[str | None, dict[str, str]]:
    """``--filter`` values: ``NAME`` (every task) and ``TASK=NAME`` (one task), repeatable; returns the
    filter for every task (or None) and the per-task choices. ValueError for two choices of one scope."""
    values = [filter] if isinstance(filter, str) else list(filter or ())
    default: str | None = None
    per_task: dict[str, str] = {}
    for value in values:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"--filter {value!r}: give NAME or TASK=NAME")
        task, sep, name = value.partition("=")
        if not sep:
            if default is not None and default != value:
                raise ValueError(f"--filter {default} and --filter {value}: give one filter for every task")
            default = value
        elif not task or not name:
            raise ValueError(f"--filter {value!r}: give NAME or TASK=NAME")
        elif per_task.get(task, name) != name:
            raise ValueError(f"--filter {task}={per_task[task]} and {value}: one filter per task")
        else:
            per_task[task] = name
    return default, per_task


def _results_config(file: Path, task: str) -> dict[str, object]:
    """The task's config in lm-eval's ``results_*.json`` beside the samples file (empty when there is
    none): it names the filters and metrics in the order lm-eval used them."""
    for results in sorted(file.parent.glob("results_*.json"), reverse=True):
        try:
            config = json.loads(results.read_text(encoding="utf-8")).get("configs", {}).get(task)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(config, dict):
            return config
    return {}


def _filter_names(file: Path, config: dict[str, object], rows: list[tuple[int, Row]]) -> list[str | None]:
    """Each row's filter. Older lm-eval versions (until late 2024) wrote no ``filter`` key but one row per
    filter and document, in the task's filter order: the n-th row of a doc_id is the n-th filter of the
    task's ``filter_list`` in ``results_*.json`` (else ``#1``, ``#2``, ...); a single filter stays unnamed."""
    keyed = ["filter" in row for _, row in rows]
    if all(keyed):
        return [str(row["filter"]) for _, row in rows]
    if any(keyed):
        line = rows[keyed.index(False)][0]
        raise ValueError(f"{file}:{line}: this row has no 'filter' key while others have one")
    seen: dict[str, int] = {}
    blocks = []
    for _, row in rows:
        key = json.dumps(row.get("doc_id"))
        blocks.append(seen.get(key, 0))
        seen[key] = blocks[-1] + 1
    count = max(blocks, default=0) + 1
    if count == 1:
        return [None] * len(rows)
    listed = config.get("filter_list")
    names = [f.get("name") for f in listed if isinstance(f, dict)] if isinstance(listed, list) else []
    if len(names) != count or len(set(names)) != count or not all(isinstance(n, str) for n in names):
        names = [f"#{i + 1}" for i in range(count)]
    return [names[b] for b in blocks]


def _metric_names(row: Row, config: dict[str, object]) -> tuple[list[str], bool]:
    """The row's metrics and whether their order is known: its ``metrics``, else (older lm-eval) the task's
    ``metric_list`` in ``results_*.json`` that the row holds, else, unordered, its keys not lm-eval's own."""
    names = row.get("metrics")
    if isinstance(names, list) and names:
        return [str(n) for n in names], True
    listed = config.get("metric_list")
    if isinstance(listed, list):
        known = [m.get("metric") for m in listed if isinstance(m, dict) and m.get("metric") in row]
        if known:
            return [str(m) for m in known], True
    return [k for k in row if k not in _LM_EVAL_FIELDS], False


def _chosen_filter(
    file: Path, task: str, logged: list[str | None], default: str | None, per_task: dict[str, str]
) -> str | None:
    named = sorted(str(f) for f in logged)
    chosen = per_task.get(task, default)
    if chosen is None:
        if len(logged) > 1:
            raise ValueError(
                f"{file}: task {task!r} logged several filters ({', '.join(named)}): choose one with "
                f"--filter NAME, or for this task only with --filter {task}=NAME"
            )
        return logged[0] if logged else None
    if chosen not in logged:
        raise ValueError(
            f"{file}: task {task!r} has no filter {chosen!r} (logged: {', '.join(named)})"
            + (f"; choose this task's with --filter {task}=NAME" if task not in per_task else "")
        )
    return chosen


def read_lm_eval_samples(
    path: str | Path, metric: str | None = None, filter: str | Sequence[str] | None = None
) -> EvalLog:
    """lm-eval ``--log_samples`` output (a file or a folder of ``samples_*.jsonl``), scored by ``metric``
    (default: each task's first) under ``filter`` (``parse_filters``; a task that logged one needs none)."""
    path = Path(path)
    default, per_task = parse_filters(filter)
    by_task = _lm_eval_tasks(path)
    unknown = sorted(set(per_task) - set(by_task))
    if unknown:
        raise ValueError(
            f"--filter {unknown[0]}={per_task[unknown[0]]}: {path} has no task {unknown[0]!r} "
            f"(tasks: {', '.join(sorted(by_task))})"
        )
    samples: list[SampleScore] = []
    metrics: set[str] = set()
    filters: set[str] = set()
    for task, file in sorted(by_task.items()):
        rows = list(jsonl_rows(file))
        config = _results_config(file, task)
        row_filters = _filter_names(file, config, rows)
        logged = sorted(set(row_filters), key=str)
        chosen = _chosen_filter(file, task, logged, default, per_task)
        seen: dict[str, int] = {}
        for (line_no, row), row_filter in zip(rows, row_filters, strict=True):
            if row_filter != chosen:
                continue
            where = f"{file}:{line_no}"
            qid, name = _lm_eval_metric(row, where, config, metric)
            if qid in seen:
                raise ValueError(
                    f"{where}: doc_id {qid} appears twice for filter {chosen!r} (first on line {seen[qid]})"
                )
            seen[qid] = line_no
            hashes = {f"lm_eval_{h[:-5]}": str(row[h]) for h in _LM_EVAL_HASHES if row.get(h)}
            correct = _binary(row[name], f"{where} (task {task!r}, doc_id {qid})", name)
            samples.append(SampleScore(task, qid, 0, correct, hashes))
            metrics.add(name)
        if chosen is not None:
            filters.add(f"{task}={chosen}" if task in per_task else chosen)
    if not samples:
        raise ValueError(f"{path}: no samples for filter {filter!r}")
    return EvalLog(
        str(path), "lm-eval", ", ".join(sorted(metrics)), ", ".join(sorted(filters)) or None, samples
    )


def _lm_eval_tasks(path: Path) -> dict[str, Path]:
    """Task -> its samples file; ValueError when a task has two (two runs in one folder)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("samples_*.jsonl") if p.is_file())
    if not files:
        raise ValueError(f"{path}: no lm-eval samples_*.jsonl files (run lm-eval with --log_samples)")
    by_task: dict[str, Path] = {}
    for file in files:
        match = _LM_EVAL_FILE.match(file.name)
        task = match.group("task") if match else file.stem
        if task in by_task:
            raise ValueError(
                f"{path}: two sample logs of task {task!r} ({by_task[task].name}, {file.name}); pass one "
                "file or a folder holding one run"
            )
        by_task[task] = file
    return by_task


def _lm_eval_metric(row: Row, where: str, config: dict[str, object], metric: str | None) -> tuple[str, str]:
    """A row's question id and the metric that scores it (``metric``, else the row's first)."""
    doc_id = row.get("doc_id")
    if isinstance(doc_id, bool) or not isinstance(doc_id, int | str):
        raise ValueError(f"{where}: row has no doc_id (is this an lm-eval samples file?)")
    names, ordered = _metric_names(row, config)
    name = metric
    if name is None:
        if not names:
            raise ValueError(f"{where}: row has no metric value; name the metric with --metric")
        if not ordered and len(names) > 1:
            raise ValueError(
                f"{where}: the row lists no 'metrics' (an older lm-eval) and holds several "
                f"values ({', '.join(names)}); name the metric with --metric"
            )
        name = names[0]
    if name not in row:
        raise ValueError(
            f"{where}: no metric {name!r} in this row (its metrics: {', '.join(names) or 'none'})"
        )
    return str(doc_id), name


# Inspect AI


def _sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _inspect_files(path: Path) -> list[str]:
    """The log files to read: the file itself, or what Inspect's own listing finds in the folder (``.eval``
    files, and ``.json`` files with Inspect's timestamped names; a manifest or other JSON is skipped)."""
    if path.is_file():
        return [str(path)]
    from inspect_ai.log import list_eval_logs

    files = sorted(info.name for info in list_eval_logs(str(path), recursive=True))
    if not files:
        raise ValueError(f"{path}: no Inspect logs (*.eval or *.json) in this folder")
    return files


def _refuse_errored(file: str, task: str, samples: list[EvalSample]) -> None:
    """ValueError naming the samples of an Inspect log that errored (they have no score)."""
    errored = [s for s in samples if s.error is not None]
    if errored:
        shown = "; ".join(
            f"sample {s.id!r} epoch {s.epoch}: {' '.join(str(s.error.message).split())[:120]}"
            for s in errored[:_SHOWN_ERRORS]
        )
        more = f"; and {len(errored) - _SHOWN_ERRORS} more" if len(errored) > _SHOWN_ERRORS else ""
        raise ValueError(
            f"{file}: {len(errored)} sample(s) of task {task!r} errored in Inspect and have no score "
            f"({shown}{more}). An errored sample is neither right nor wrong, so the log cannot be "
            "paired: retry them (`inspect eval-retry`) and compare the completed log"
        )


def read_inspect_log(path: str | Path, scorer: str | None = None) -> EvalLog:
    """An Inspect AI log file (``.eval``/``.json``) or a folder of them (one task each), scored by
    ``scorer`` (required when the samples carry several scores)."""
    try:
        from inspect_ai.log import read_eval_log as inspect_read
    except ImportError:
        raise ValueError(
            f"{path}: reading Inspect logs needs the inspect-ai package (pip install inspect-ai)"
        ) from None
    path = Path(path)
    samples: list[SampleScore] = []
    tasks: dict[str, str] = {}
    chosen_scorers: set[str] = set()
    for file in _inspect_files(path):
        try:
            log = inspect_read(file)
        except Exception as exc:  # noqa: BLE001 - Inspect raises many kinds for an unreadable file
            raise ValueError(f"{file}: not a readable Inspect log ({type(exc).__name__}: {exc})") from None
        task = log.eval.task
        if task in tasks:
            raise ValueError(f"{path}: two Inspect logs of task {task!r} ({tasks[task]}, {file})")
        tasks[task] = file
        if log.status != "success":
            raise ValueError(f"{file}: the Inspect run did not finish (status {log.status!r})")
        _refuse_errored(file, task, log.samples or [])
        for sample in log.samples or []:
            where = f"{file} (task {task!r}, sample {sample.id!r}, epoch {sample.epoch})"
            scores = sample.scores or {}
            name = scorer
            if name is None:
                if len(scores) != 1:
                    raise ValueError(
                        f"{where}: {len(scores)} scorers ({', '.join(scores) or 'none'}); "
                        "choose one with --metric"
                    )
                name = next(iter(scores))
            if name not in scores:
                raise ValueError(f"{where}: no scorer {name!r} (its scorers: {', '.join(scores) or 'none'})")
            correct = _binary(scores[name].value, where, f"score {name!r}")
            # Chat messages carry generated ids that differ between runs: hash only their roles and text.
            asked = (
                sample.input if isinstance(sample.input, str) else [[m.role, m.text] for m in sample.input]
            )
            hashes = {"inspect_input": _sha256_json(asked), "inspect_target": _sha256_json(sample.target)}
            samples.append(SampleScore(task, str(sample.id), int(sample.epoch), correct, hashes))
            chosen_scorers.add(name)
    if not samples:
        raise ValueError(f"{path}: the Inspect log holds no samples")
    return EvalLog(str(path), "inspect", ", ".join(sorted(chosen_scorers)), None, samples)


# flyspec's own store


def read_store_arm(store_path: str | Path, run_id: str, arm: str) -> EvalLog:
    """The stored answers of one arm of one run in a gate store (``repeat`` is the epoch)."""
    from flyspec.gate.data.store import GateStore

    path = Path(store_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such gate store")
    with GateStore(path) as store:
        if store.get_run(run_id) is None:
            known = ", ".join(r.run_id for r in store.runs()) or "none"
            raise ValueError(f"{path}: no run {run_id!r} (runs: {known})")
        hashes = {(q.dataset, q.question_id): q.prompt_hash for q in store.questions(run_id)}
        answers = store.answers(run_id)
    arms = sorted({a.arm for a in answers})
    chosen = [a for a in answers if a.arm == arm]
    if not chosen:
        raise ValueError(
            f"{path}: run {run_id!r} has no answers of arm {arm!r} (arms: {', '.join(arms) or 'none'})"
        )
    samples = []
    for a in chosen:
        key = (a.dataset, a.question_id)
        prompt = {"flyspec_prompt": hashes[key]} if key in hashes else {}
        samples.append(SampleScore(a.dataset, a.question_id, a.repeat, a.correct, prompt))
    return EvalLog(f"{path}:{run_id}:{arm}", "flyspec", "correct", None, samples)


def _store_spec(spec: str) -> tuple[str, str, str] | None:
    """``STORE.db:RUN:ARM`` split from the right (a Windows-style or odd path keeps its colons)."""
    parts = spec.rsplit(":", 2)
    if len(parts) != 3 or not all(parts) or Path(spec).exists():
        return None
    looks_like_store = Path(parts[0]).is_file() or parts[0].endswith((".db", ".sqlite", ".sqlite3"))
    return (parts[0], parts[1], parts[2]) if looks_like_store else None


def read_eval_log(spec: str, metric: str | None = None, filter: str | Sequence[str] | None = None) -> EvalLog:
    """One side of ``gate compare`` (module docstring); ``metric`` is lm-eval's metric or Inspect's scorer,
    ``filter`` lm-eval's (``parse_filters``). ValueError or FileNotFoundError, naming the file, otherwise."""
    filter = filter or None
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"log={spec!r}: give a samples_*.jsonl file or folder, an Inspect log, or STORE.db:RUN:ARM"
        )
    store = _store_spec(spec)
    if store is not None:
        if metric is not None or filter is not None:
            raise ValueError(
                f"{spec}: --metric and --filter apply to lm-eval and Inspect logs, not to a gate store"
            )
        return read_store_arm(*store)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{spec}: no such file or folder (expected an lm-eval samples_*.jsonl, an Inspect .eval/.json "
            "log, or STORE.db:RUN:ARM)"
        )
    folder = path.is_dir()
    if (folder and any(path.rglob("samples_*.jsonl"))) or (not folder and path.suffix == ".jsonl"):
        return read_lm_eval_samples(path, metric, filter)
    if not folder and path.suffix not in _INSPECT_SUFFIXES:
        raise ValueError(
            f"{spec}: unknown log format (expected samples_*.jsonl from lm-eval, an Inspect .eval/.json log, "
            "or STORE.db:RUN:ARM)"
        )
    if not folder and path.name.startswith("results_") and path.suffix == ".json":
        raise ValueError(
            f"{spec}: this is lm-eval's aggregated results file; compare the samples_*.jsonl files that "
            "--log_samples writes next to it"
        )
    if filter is not None:
        raise ValueError(f"{spec}: --filter applies to lm-eval logs only")
    return read_inspect_log(path, metric)

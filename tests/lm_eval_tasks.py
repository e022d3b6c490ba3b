"""lm-evaluation-harness task files for tests: local JSONL questions, scored by exact match, written as
the YAML lm-eval reads with `--include_path`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

Filters = dict[str, list[dict[str, str]]]


def generation_task(
    name: str,
    data: Path,
    *,
    until: str,
    max_gen_toks: int,
    filters: Filters | None = None,
    generation: dict[str, Any] | None = None,
    ignore: list[str] | None = None,
) -> str:
    """A `generate_until` task over `data` (JSONL rows with `question` and `answer`): greedy, stopping at
    `until`, at most `max_gen_toks` tokens, plus `generation` (extra request fields, e.g. flyspec's
    `verification`); `filters` (name -> lm-eval filter steps) pick the answer out of the output, and
    exact_match scores it, ignoring the `ignore` regexes."""
    metric: dict[str, Any] = {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}
    task: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {
            "until": [until],
            "max_gen_toks": max_gen_toks,
            "do_sample": False,
            "temperature": 0,
            **(generation or {}),
        },
    }
    if filters:
        task["filter_list"] = [{"name": n, "filter": steps} for n, steps in filters.items()]
    task["metric_list"] = [{**metric, "regexes_to_ignore": ignore} if ignore else metric]
    task["metadata"] = {"version": 1.0}
    return yaml.safe_dump(task, sort_keys=False, allow_unicode=True)

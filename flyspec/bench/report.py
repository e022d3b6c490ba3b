"""Numbers of a finished sweep: one row per arm, and the ratios between arms.

The goals these numbers are judged against live in BENCHMARKS.md, not here: this module measures.

JSON layout (`flyspec bench --json FILE`; schema "flyspec.bench/2"; "flyspec.bench/1" reports had a
`targets` list as well, which is no longer written and is ignored when such a report is rendered):

- `command`: the command line; `machine`: CPU, cores, memory, library versions, load average;
  `settings`: model, drafters, dtype, device, dataset, prompts (ids and sha256), max_tokens, repeats,
  ignore_eos, warm-up tokens;
- `results`: one object per arm: `label`, `backend` ("flyspec" | "hf"), `method` ("target" | "standard" | a
  lossy policy: "fly", "typical"), `batch_size`, `drafter`, `k`, `fly_window`, `default_window`,
  `fly_threshold`, `lossless_prefix` (a lossy arm's prefix; absent in reports written before it existed,
  read as 0), `requests` (per run), `repeats`, `generated_tokens`, `seconds` (both summed over runs),
  `tokens_per_s` (their ratio), `tokens_per_s_runs` (one per repetition), `decode_tokens_per_s` (flyspec
  only: tokens after each request's first, over the time from a wave's first first-token to its last finish,
  so prompt processing is left out), `mean_acceptance_length` (tokens per verification step; for the peer,
  tokens per target forward), `acceptance_rate`, `forgiven_share` (forgiven / accepted draft tokens: the
  lossy share), `peak_rss_mb` (largest resident set size sampled while the arm ran), `prefix_match` (mean
  share of each output that equals flyspec target-only batch-1 output before the first difference); fields
  that do not apply are null;
- `ratios`: `name`, `numerator`, `denominator` (arm labels), `value` (tokens/s ratio) and, where both
  arms speculate, `acceptance_gain` (relative gain in mean acceptance length); an arm is compared with
  target-only of its own weight format, a lossy arm also with standard speculative decoding of the same
  drafter, K, batch size and format, and a quantized arm with its unquantized twin;
- `batch_scaling`: per weight format, speculative method and lossless prefix (lossy arms at their
  default settings otherwise), tokens/s relative to target-only at each batch size and
  `stops_paying_at` (the first batch size where it falls below 1, or null);
- `breakdown`: per profiled arm, seconds and shares of decode time per engine part
  (see flyspec.bench.breakdown); `peak_rss_mb`: the process's peak; `load_s`: seconds spent loading
  models and building engines (outside every timing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flyspec.bench.runner import Measurement
from flyspec.bench.sweep import Arm
from flyspec.config import lossy_policy_names
from flyspec.outputs import AcceptanceCounts

SCHEMA = "flyspec.bench/2"
READABLE_SCHEMAS = ("flyspec.bench/1", SCHEMA)
"""Schemas `--from-json` renders: /1 differs only by a `targets` list that rendering ignores."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_match(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> float | None:
    """Mean over shared prompts of (tokens before the first difference) / (reference length)."""
    shared = [pid for pid in outputs if pid in reference and reference[pid]]
    if not shared:
        return None
    return sum(_common_prefix(outputs[p], reference[p]) / len(reference[p]) for p in shared) / len(shared)


def summarise(
    arm: Arm,
    runs: list[Measurement],
    requests: int,
    reference: dict[str, list[int]] | None,
) -> dict[str, Any]:
    """The result row of one arm from its timed runs."""
    tokens = sum(r.tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    row: dict[str, Any] = {
        **arm.to_dict(),
        "requests": requests,
        "repeats": len(runs),
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens_per_s_runs": [r.tokens / r.seconds if r.seconds > 0 else None for r in runs],
        "decode_tokens_per_s": None,
        "mean_acceptance_length": None,
        "acceptance_rate": None,
        "forgiven_share": None,
        "peak_rss_mb": max(r.peak_rss_bytes for r in runs) / 2**20 if runs else None,
        "prefix_match": None,
    }
    decode_s = sum(r.decode_seconds for r in runs)
    if arm.backend == "flyspec" and decode_s > 0:
        row["decode_tokens_per_s"] = sum(r.decode_tokens for r in runs) / decode_s
    if arm.method != "target" and runs:
        if arm.backend == "flyspec":
            counts = sum((r.counts for r in runs if r.counts is not None), AcceptanceCounts())
            if counts.num_drafts:
                row["mean_acceptance_length"] = counts.mean_acceptance_length
                row["acceptance_rate"] = counts.acceptance_rate
                row["forgiven_share"] = counts.forgiven_share
        else:
            forwards = sum(r.target_forwards or 0 for r in runs)
            row["mean_acceptance_length"] = tokens / forwards if forwards else None
    if reference is not None and runs:
        row["prefix_match"] = prefix_match(runs[0].outputs, reference)
    return row


def find(rows: Iterable[dict[str, Any]], **criteria: Any) -> dict[str, Any] | None:
    """The first row whose fields equal all `criteria` (None when there is none)."""
    for row in rows:
        if all(row.get(k) == v for k, v in criteria.items()):
            return row
    return None


def _ratio(name: str, num: dict[str, Any] | None, den: dict[str, Any] | None) -> dict[str, Any] | None:
    if num is None or den is None or not num["tokens_per_s"] or not den["tokens_per_s"]:
        return None
    out: dict[str, Any] = {
        "name": name,
        "numerator": num["label"],
        "denominator": den["label"],
        "value": num["tokens_per_s"] / den["tokens_per_s"],
    }
    if num["mean_acceptance_length"] and den["mean_acceptance_length"]:
        out["acceptance_gain"] = num["mean_acceptance_length"] / den["mean_acceptance_length"] - 1
    return out


def _format(row: dict[str, Any]) -> str | None:
    return row.get("quantization")


def _twin(
    rows: Iterable[dict[str, Any]], row: dict[str, Any], quantization: str | None
) -> dict[str, Any] | None:
    """The arm measuring the same configuration as `row` in another weight format."""
    keys = ("backend", "method", "batch_size", "drafter", "k", "fly_window", "lossless_prefix")
    return next(
        (r for r in rows if _format(r) == quantization and all(r.get(k) == row.get(k) for k in keys)), None
    )


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every comparison the report discusses, as tokens/s ratios (see the module docstring)."""
    ours = [r for r in rows if r["backend"] == "flyspec"]
    hf = [r for r in rows if r["backend"] == "hf"]
    formats = list(dict.fromkeys(_format(r) for r in ours))
    base = {
        (q, b): next(
            (r for r in ours if r["method"] == "target" and r["batch_size"] == b and _format(r) == q), None
        )
        for q in formats
        for b in sorted({r["batch_size"] for r in rows})
    }
    out: list[dict[str, Any] | None] = [
        _ratio("flyspec target-only / hf generate (batch 1)", base.get((None, 1)), find(hf, method="target"))
    ]
    for row in ours:
        one = base.get((_format(row), 1))
        if row["method"] == "target" and row["batch_size"] > 1:
            prefix = f"{_format(row)} " if _format(row) else ""
            out.append(_ratio(f"{prefix}target-only batch {row['batch_size']} / batch 1", row, one))
            if one is not None and row["decode_tokens_per_s"] and one["decode_tokens_per_s"]:
                out.append(
                    {
                        "name": f"{prefix}target-only batch {row['batch_size']} / batch 1, decode only",
                        "numerator": row["label"],
                        "denominator": one["label"],
                        "value": row["decode_tokens_per_s"] / one["decode_tokens_per_s"],
                    }
                )
    for row in ours:
        if row["method"] == "target":
            continue
        b = row["batch_size"]
        out.append(_ratio(f"{row['label']} / target-only", row, base.get((_format(row), b))))
        if row["method"] == "standard" and b == 1 and _format(row) is None:
            peer = find(hf, method="standard", drafter=row["drafter"], k=row["k"])
            out.append(_ratio(f"{row['label']} / hf assisted", row, peer))
        if row["method"] in lossy_policy_names():
            std = next(
                (
                    r
                    for r in ours
                    if r["method"] == "standard"
                    and r["drafter"] == row["drafter"]
                    and r["k"] == row["k"]
                    and r["batch_size"] == b
                    and _format(r) == _format(row)
                ),
                None,
            )
            out.append(_ratio(f"{row['label']} / standard", row, std))
    for row in ours:
        if _format(row) is not None:
            out.append(_ratio(f"{row['label']} / unquantized", row, _twin(ours, row, None)))
            if row["method"] != "target":
                bf_target = base.get((None, row["batch_size"]))
                out.append(_ratio(f"{row['label']} / unquantized target-only", row, bf_target))
    for row in hf:
        if row["method"] == "standard":
            out.append(_ratio(f"{row['label']} / hf generate", row, find(hf, method="target")))
    return [r for r in out if r is not None]


def _value(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    r = _ratio("", num, den)
    return None if r is None else r["value"]


def batch_scaling(
    rows: list[dict[str, Any]], *, drafter: str | None, headline_k: int | None
) -> list[dict[str, Any]]:
    """Per weight format, for standard and each lossy method (FLy: default window) with each lossless
    prefix at the headline K: tokens/s over target-only of the same format per batch size."""
    ours = [r for r in rows if r["backend"] == "flyspec"]
    out = []
    for q in dict.fromkeys(_format(r) for r in ours):
        mine = [r for r in ours if _format(r) == q]
        series = dict.fromkeys(
            (r["method"], r.get("lossless_prefix") or 0) for r in mine if r["method"] != "target"
        )
        for method, prefix in series:
            points = []
            for row in sorted(mine, key=lambda r: r["batch_size"]):
                if row["method"] != method or row["k"] != headline_k or row["drafter"] != drafter:
                    continue
                if (row.get("lossless_prefix") or 0) != prefix:
                    continue
                if row["fly_window"] is not None and not row["default_window"]:
                    continue
                value = _value(row, find(mine, method="target", batch_size=row["batch_size"]))
                if value is not None:
                    points.append({"batch_size": row["batch_size"], "speedup": value, "label": row["label"]})
            if points:
                below = [p["batch_size"] for p in points if p["speedup"] < 1.0]
                out.append(
                    {
                        "method": method,
                        **({"lossless_prefix": prefix} if prefix else {}),
                        "quantization": q,
                        "k": headline_k,
                        "points": points,
                        "stops_paying_at": min(below, default=None),
                    }
                )
    return out

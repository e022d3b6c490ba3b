"""Numbers of a finished sweep: one row per arm, the ratios between arms, and the report that holds them.

The goals these numbers are judged against live in BENCHMARKS.md, not here: this module measures.

JSON layout (`flyspec bench --json FILE`; schema "flyspec.bench/3"; older reports render too: "/2" rows
described a FLy arm by `fly_window`, `default_window` and `fly_threshold` instead of `settings` and
`tag`, and "/1" reports had a `targets` list as well, which is ignored):

- `command`: the command line; `machine`: CPU, cores, memory, library versions, load average;
  `settings`: model, drafters, methods, policies (the `--policies` grid, expanded), dtype, device,
  dataset, prompts (ids and sha256), max_tokens, repeats, ignore_eos, warm-up tokens;
- `results`: one object per arm (`BenchRow`): `label`, `backend` ("flyspec" | "hf"), `method` ("target"
  | "standard" | a lossy policy's name), `batch_size`, `drafter`, `k`, `settings` (a lossy arm's policy
  settings, resolved: its `speculative_config` fields), `tag` (those that differ from the policy's
  defaults, as in the label; "" at the defaults), `lossless_prefix`, `quantization`, `requests` (per
  run), `repeats`, `generated_tokens`, `seconds` (both summed over runs), `tokens_per_s` (their ratio),
  `tokens_per_s_runs` (one per repetition), `decode_tokens_per_s` (flyspec only: tokens after each
  request's first, over the time from a wave's first first-token to its last finish, so prompt
  processing is left out), `mean_acceptance_length` (tokens per verification step; for the peer, tokens
  per target forward), `acceptance_rate`, `forgiven_share` (forgiven / accepted draft tokens: the lossy
  share), `peak_rss_mb` (largest resident set size sampled while the arm ran), `prefix_match` (mean
  share of each output that equals flyspec target-only batch-1 output before the first difference);
  fields that do not apply are null;
- `ratios` (`Ratio`): `name`, `numerator`, `denominator` (arm labels), `value` (tokens/s ratio) and,
  where both arms speculate, `acceptance_gain` (relative gain in mean acceptance length); an arm is
  compared with target-only of its own weight format, a lossy arm also with standard speculative decoding
  of the same drafter, K, batch size and format, and a quantized arm with its unquantized twin;
- `batch_scaling` (`Scaling`): per weight format, speculative method and lossless prefix (lossy arms at
  their policy's defaults), tokens/s relative to target-only at each batch size and `stops_paying_at`
  (the first batch size where it falls below 1, or null);
- `breakdown`: per profiled arm, seconds and shares of decode time per engine part
  (see flyspec.bench.breakdown); `peak_rss_mb`: the process's peak; `load_s`: seconds spent loading
  models and building engines (outside every timing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flyspec.bench.runner import Measurement
from flyspec.bench.sweep import Arm
from flyspec.outputs import AcceptanceCounts

SCHEMA = "flyspec.bench/3"
READABLE_SCHEMAS = ("flyspec.bench/1", "flyspec.bench/2", SCHEMA)
"""Schemas `--from-json` renders (module docstring)."""


@dataclass
class BenchRow:
    """The result of one arm (the fields are described in the module docstring)."""

    label: str
    backend: str
    method: str
    batch_size: int
    drafter: str | None
    k: int | None
    settings: dict[str, Any]
    tag: str
    lossless_prefix: int
    quantization: str | None
    requests: int
    repeats: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float | None
    tokens_per_s_runs: list[float | None]
    decode_tokens_per_s: float | None = None
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None
    forgiven_share: float | None = None
    peak_rss_mb: float | None = None
    prefix_match: float | None = None

    @property
    def lossy(self) -> bool:
        """Whether the arm verified with a lossy policy."""
        return self.method not in ("target", "standard")

    @property
    def at_defaults(self) -> bool:
        """A lossy arm at its policy's defaults (a prefix aside), or any other arm."""
        return not self.tag

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the row."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRow:
        """A row of a saved report, of any readable schema: a "/1" or "/2" FLy row's window and threshold
        become its settings, and a non-default window its tag."""
        data = dict(data)
        window, default, threshold = (
            data.pop(k, None) for k in ("fly_window", "default_window", "fly_threshold")
        )
        if "settings" not in data:
            data["settings"] = {}
            data["tag"] = ""
            if window is not None:
                data["settings"] = {"fly_window_size": window, "fly_entropy_threshold": threshold}
                data["tag"] = "" if default else f"W={window}"
        data.setdefault("lossless_prefix", 0)
        data["lossless_prefix"] = data["lossless_prefix"] or 0
        data.setdefault("quantization", None)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Ratio:
    """One comparison: `numerator`'s tokens/s over `denominator`'s (arm labels), and, where both arms
    speculate, the relative gain in mean acceptance length."""

    name: str
    numerator: str
    denominator: str
    value: float
    acceptance_gain: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.acceptance_gain is None:
            del out["acceptance_gain"]
        return out


@dataclass
class ScalingPoint:
    batch_size: int
    speedup: float
    label: str


@dataclass
class Scaling:
    """One speculative series: tokens/s over target-only of the same format at each batch size."""

    method: str
    quantization: str | None
    k: int | None
    points: list[ScalingPoint]
    stops_paying_at: int | None
    lossless_prefix: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not self.lossless_prefix:
            del out["lossless_prefix"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scaling:
        points = [ScalingPoint(**p) for p in data["points"]]
        return cls(
            data["method"],
            data.get("quantization"),
            data.get("k"),
            points,
            data.get("stops_paying_at"),
            data.get("lossless_prefix") or 0,
        )


@dataclass
class BenchReport:
    """One sweep's report (module docstring): the rows, the ratios and the batch scaling as objects; the
    machine, the settings and the breakdown as the JSON objects they are written as."""

    command: str
    finished_at: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    results: list[BenchRow]
    ratios: list[Ratio]
    batch_scaling: list[Scaling]
    breakdown: dict[str, dict[str, Any]] = field(default_factory=dict)
    peak_rss_mb: float | None = None
    load_s: float | None = None
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the report (`--json`)."""
        return {
            "schema": self.schema,
            "command": self.command,
            "finished_at": self.finished_at,
            "machine": self.machine,
            "settings": self.settings,
            "results": [r.to_dict() for r in self.results],
            "ratios": [r.to_dict() for r in self.ratios],
            "batch_scaling": [s.to_dict() for s in self.batch_scaling],
            "breakdown": self.breakdown,
            "peak_rss_mb": self.peak_rss_mb,
            "load_s": self.load_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchReport:
        """A saved report of any readable schema (its `targets`, in "/1", ignored)."""
        return cls(
            command=data["command"],
            finished_at=data["finished_at"],
            machine=data["machine"],
            settings=data["settings"],
            results=[BenchRow.from_dict(r) for r in data["results"]],
            ratios=[Ratio(**r) for r in data["ratios"]],
            batch_scaling=[Scaling.from_dict(s) for s in data["batch_scaling"]],
            breakdown=data.get("breakdown") or {},
            peak_rss_mb=data.get("peak_rss_mb"),
            load_s=data.get("load_s"),
            schema=data["schema"],
        )


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
) -> BenchRow:
    """The result row of one arm from its timed runs."""
    tokens = sum(r.tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    row = BenchRow(
        label=arm.label,
        backend=arm.backend,
        method=arm.method,
        batch_size=arm.batch_size,
        drafter=arm.drafter,
        k=arm.k,
        settings=dict(arm.settings),
        tag=arm.tag,
        lossless_prefix=arm.lossless_prefix,
        quantization=arm.quantization,
        requests=requests,
        repeats=len(runs),
        generated_tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else None,
        tokens_per_s_runs=[r.tokens / r.seconds if r.seconds > 0 else None for r in runs],
        peak_rss_mb=max(r.peak_rss_bytes for r in runs) / 2**20 if runs else None,
    )
    decode_s = sum(r.decode_seconds for r in runs)
    if arm.backend == "flyspec" and decode_s > 0:
        row.decode_tokens_per_s = sum(r.decode_tokens for r in runs) / decode_s
    if arm.method != "target" and runs:
        if arm.backend == "flyspec":
            counts = sum((r.counts for r in runs if r.counts is not None), AcceptanceCounts())
            if counts.num_drafts:
                row.mean_acceptance_length = counts.mean_acceptance_length
                row.acceptance_rate = counts.acceptance_rate
                row.forgiven_share = counts.forgiven_share
        else:
            forwards = sum(r.target_forwards or 0 for r in runs)
            row.mean_acceptance_length = tokens / forwards if forwards else None
    if reference is not None and runs:
        row.prefix_match = prefix_match(runs[0].outputs, reference)
    return row


def find(rows: Iterable[BenchRow], **criteria: Any) -> BenchRow | None:
    """The first row whose fields equal all `criteria` (None when there is none)."""
    for row in rows:
        if all(getattr(row, k) == v for k, v in criteria.items()):
            return row
    return None


def _ratio(name: str, num: BenchRow | None, den: BenchRow | None) -> Ratio | None:
    if num is None or den is None or not num.tokens_per_s or not den.tokens_per_s:
        return None
    gain = None
    if num.mean_acceptance_length and den.mean_acceptance_length:
        gain = num.mean_acceptance_length / den.mean_acceptance_length - 1
    return Ratio(name, num.label, den.label, num.tokens_per_s / den.tokens_per_s, gain)


def _twin(rows: Iterable[BenchRow], row: BenchRow, quantization: str | None) -> BenchRow | None:
    """The arm measuring the same configuration as `row` in another weight format."""
    keys = ("backend", "method", "batch_size", "drafter", "k", "settings", "lossless_prefix")
    return next(
        (
            r
            for r in rows
            if r.quantization == quantization and all(getattr(r, k) == getattr(row, k) for k in keys)
        ),
        None,
    )


def ratios(rows: list[BenchRow]) -> list[Ratio]:
    """Every comparison the report discusses, as tokens/s ratios (see the module docstring)."""
    ours = [r for r in rows if r.backend == "flyspec"]
    hf = [r for r in rows if r.backend == "hf"]
    formats = list(dict.fromkeys(r.quantization for r in ours))
    base = {
        (q, b): find(ours, method="target", batch_size=b, quantization=q)
        for q in formats
        for b in sorted({r.batch_size for r in rows})
    }
    out: list[Ratio | None] = [
        _ratio("flyspec target-only / hf generate (batch 1)", base.get((None, 1)), find(hf, method="target"))
    ]
    for row in ours:
        one = base.get((row.quantization, 1))
        if row.method == "target" and row.batch_size > 1:
            prefix = f"{row.quantization} " if row.quantization else ""
            out.append(_ratio(f"{prefix}target-only batch {row.batch_size} / batch 1", row, one))
            if one is not None and row.decode_tokens_per_s and one.decode_tokens_per_s:
                out.append(
                    Ratio(
                        f"{prefix}target-only batch {row.batch_size} / batch 1, decode only",
                        row.label,
                        one.label,
                        row.decode_tokens_per_s / one.decode_tokens_per_s,
                    )
                )
    for row in ours:
        if row.method == "target":
            continue
        b = row.batch_size
        out.append(_ratio(f"{row.label} / target-only", row, base.get((row.quantization, b))))
        if row.method == "standard" and b == 1 and row.quantization is None:
            peer = find(hf, method="standard", drafter=row.drafter, k=row.k)
            out.append(_ratio(f"{row.label} / hf assisted", row, peer))
        if row.lossy:
            std = find(
                ours,
                method="standard",
                drafter=row.drafter,
                k=row.k,
                batch_size=b,
                quantization=row.quantization,
            )
            out.append(_ratio(f"{row.label} / standard", row, std))
    for row in ours:
        if row.quantization is not None:
            out.append(_ratio(f"{row.label} / unquantized", row, _twin(ours, row, None)))
            if row.method != "target":
                out.append(
                    _ratio(f"{row.label} / unquantized target-only", row, base.get((None, row.batch_size)))
                )
    for row in hf:
        if row.method == "standard":
            out.append(_ratio(f"{row.label} / hf generate", row, find(hf, method="target")))
    return [r for r in out if r is not None]


def batch_scaling(rows: list[BenchRow], *, drafter: str | None, headline_k: int | None) -> list[Scaling]:
    """Per weight format, for standard and each lossy method at its policy's defaults, with each lossless
    prefix, at the headline K: tokens/s over target-only of the same format per batch size."""
    ours = [r for r in rows if r.backend == "flyspec"]
    out = []
    for q in dict.fromkeys(r.quantization for r in ours):
        mine = [r for r in ours if r.quantization == q]
        series = dict.fromkeys((r.method, r.lossless_prefix) for r in mine if r.method != "target")
        for method, prefix in series:
            points = []
            for row in sorted(mine, key=lambda r: r.batch_size):
                if (row.method, row.k, row.drafter, row.lossless_prefix) != (
                    method,
                    headline_k,
                    drafter,
                    prefix,
                ):
                    continue
                if not row.at_defaults:
                    continue
                value = _ratio("", row, find(mine, method="target", batch_size=row.batch_size))
                if value is not None:
                    points.append(ScalingPoint(row.batch_size, value.value, row.label))
            if points:
                below = [p.batch_size for p in points if p.speedup < 1.0]
                out.append(Scaling(method, q, headline_k, points, min(below, default=None), prefix))
    return out

"""The load-time kernel check: each weight format's matmuls timed against bfloat16 on this CPU, on the
model's own layer shapes, at the row counts the engine will run.

Why: a format is only worth loading where its kernel is fast, and that depends on the CPU. On an AMD
EPYC without AMX, oneDNN once ran our int8 matmul on its reference kernel, about 400x slower than
bfloat16, and nothing noticed until a demo sat for 15 minutes in its warm-up. On an AVX2-only AMD EPYC
(Zen 3), int8 took 1.77x bfloat16's time for one row but 0.18x for the 32 rows the demo's draft runs
at. So every load measures first (about a second; cached per CPU signature, torch version, thread count,
kernel sources and shapes in `$FLYSPEC_CACHE/kernel-checks/`, so a later start reads a file):

- `quantization="auto"` scores each format by its time for the engine's real decode passes
  (`Workload`, from `engine_rows`: the draft at `max_num_seqs` rows, the target at (K+1) x
  `max_num_seqs` rows, each weighted by the configured batch, and both at one row, weight 1) and takes
  the fastest, if it is clearly faster than bfloat16 (`MIN_SPEEDUP`). A format that is slower than
  bfloat16 at one row but faster where the engine runs is the right choice; one that runs a library's
  reference kernel never is. float32 weights are a candidate where bfloat16 has no hardware support.
  One log line per model names the choice and how many times faster than bfloat16 it measured;
- an explicitly requested format that is slower than bfloat16 for that work, or runs a reference
  kernel, is still used but logs one warning naming the kernel and the ratio.

The kernel names come from oneDNN's own verbose log of one call (e.g. `brg_matmul:avx512_core_vnni`),
and for int4 from which of its kernels is built (`int4_kernel`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from flyspec import cpuinfo
from flyspec.assets import cache_dir
from flyspec.models import int4_kernel, int8_kernel
from flyspec.models.packed_linear import PackedLinear, pack_reason
from flyspec.models.quantization import Float32Linear, Int4Linear, Int8Linear

FORMATS = ("int8", "int4")
SLOWER_THAN_BF16 = 1.05
"""A format whose time exceeds bfloat16's times this is 'slower than bf16' (5% above 1: repeated
one-second checks on an idle 2-core machine differ by a few percent)."""
MIN_SPEEDUP = 1.05
"""`auto` changes the weights only for a gain above the noise of the check: a quantized format changes
the model's outputs, and float32 doubles its memory."""

_REPEATS = 7
_log = logging.getLogger("flyspec.kernels")
_warned: set[tuple[str, str]] = set()
_SOURCES = (
    Path(__file__),
    Path(__file__).with_name("quantization.py"),
    Path(__file__).with_name("packed_linear.py"),
    Path(__file__).with_name("csrc") / "int4_matmul.cpp",
    Path(__file__).with_name("csrc") / "int8_matmul.cpp",
)
# The libraries' own ISA switches: a measurement under one does not stand for another.
_ENV_KEYS = (
    "ONEDNN_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "FLYSPEC_INT4_KERNEL",
    "FLYSPEC_INT8_KERNEL",
)
PACKED = "bf16-packed"
"""bfloat16 with prepacked weights (models/packed_linear.py): the same numbers as bf16, another layout."""
MAX_ROWS = 256
"""Row counts are capped here: beyond it every format is bound by arithmetic and the ratios stay put,
while the measurement would take seconds."""


def _rows(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class Workload:
    """The decode passes a model runs in the engine: each row count with its weight in the score."""

    weights: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, rows: Workload | Iterable[int]) -> Workload:
        """`rows` as a Workload: a Workload as it is, plain row counts each with weight 1."""
        if isinstance(rows, Workload):
            return rows
        return cls(tuple((r, 1.0) for r in sorted(set(rows))))

    @property
    def rows(self) -> tuple[int, ...]:
        """The row counts, ascending."""
        return tuple(r for r, _ in self.weights)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows)

    def describe(self) -> str:
        """E.g. '160 rows, weight 32; 1 row, weight 1'."""
        return "; ".join(f"{_rows(r)}, weight {w:g}" for r, w in sorted(self.weights, reverse=True))


def engine_rows(num_speculative_tokens: int, max_running: int, *, draft: bool = False) -> Workload:
    """The decode passes a model runs in the engine configured for `max_running` sequences: a full batch
    (the target scores 1 + K tokens per sequence, a draft model proposes one at a time; capped at
    MAX_ROWS), weighted by the configured batch, and one row, weight 1: a lone sequence's pass, e.g. a
    target-only request or one whose drafter proposed nothing. Weighted so, a format that is slow for one
    row but fast where the engine is configured to run wins, as it should."""
    per_sequence = 1 if draft else 1 + num_speculative_tokens
    full = min(MAX_ROWS, per_sequence * max_running)
    weights = {1: 1.0}
    weights[full] = weights.get(full, 0.0) + float(max_running)
    return Workload(tuple(sorted(weights.items())))


def bf16_in_hardware() -> bool:
    """Whether the CPU (as emulated) has bfloat16 arithmetic (AVX-512 BF16 or AMX); elsewhere bfloat16
    matmuls are emulated in float32 and a float32 copy of the weights is a candidate format."""
    return cpuinfo.has_flags("avx512_bf16") or cpuinfo.has_flags("amx_bf16")


def candidate_formats() -> tuple[str, ...]:
    """The formats `auto` measures on this CPU: int8 and int4, and float32 where bf16 is emulated."""
    return FORMATS if bf16_in_hardware() else (*FORMATS, "float32")


@dataclass(frozen=True)
class FormatCheck:
    """One format's measurement: its kernel and its time over bfloat16's at each row count."""

    format: str
    kernel: str
    ratios: dict[int, float]

    @property
    def reference_kernel(self) -> bool:
        """True when a library's reference (unoptimised) kernel ran: oneDNN names them `ref*`."""
        return any(word.startswith("ref") for word in re.split(r"[\s,+]+", self.kernel))

    @property
    def slower_than_bf16(self) -> bool:
        """True when the format took longer than bfloat16 at any measured row count."""
        return any(r > SLOWER_THAN_BF16 for r in self.ratios.values())

    @property
    def usable(self) -> bool:
        """Worth considering: no reference kernel ran."""
        return not self.reference_kernel

    def describe(self) -> str:
        """E.g. "int8 (oneDNN gemm:jit): time 0.18x bf16's at 32 rows, 1.77x at 1 row"."""
        parts = [
            f"time {ratio:.2f}x bf16's at {_rows(rows)}" if i == 0 else f"{ratio:.2f}x at {_rows(rows)}"
            for i, (rows, ratio) in enumerate(sorted(self.ratios.items(), reverse=True))
        ]
        return f"{self.format} ({self.kernel}): {', '.join(parts)}"


@dataclass(frozen=True)
class KernelCheck:
    """Every format's measurement on one model's shapes at the given row counts, and the workload they
    are scored for (not part of the cached measurement)."""

    cpu: str
    rows: tuple[int, ...]
    bf16_kernel: str
    bf16_ms: dict[int, float]
    formats: dict[str, FormatCheck]
    seconds: float
    packed: FormatCheck | None = None
    packed_unavailable: str | None = None
    from_cache: bool = False
    workload: Workload | None = field(default=None, compare=False)

    @property
    def pack_bf16(self) -> bool:
        """Whether bfloat16 weights should be prepacked: oneDNN can pack them here and that measured no
        slower than the plain layout at any row count (the same numbers, so no reason to risk it)."""
        return self.packed is not None and self.packed.usable and not self.packed.slower_than_bf16

    def time_ratio(self, check: FormatCheck) -> float:
        """The format's time for the workload over plain bfloat16's: each row count's time weighted by
        the workload (bf16's own times in milliseconds turn the per-row ratios into times)."""
        weights = dict((self.workload or Workload.of(self.rows)).weights)
        bf16 = sum(w * self.bf16_ms[r] for r, w in weights.items())
        return sum(w * check.ratios[r] * self.bf16_ms[r] for r, w in weights.items()) / bf16

    def _baseline(self) -> float:
        """The time ratio of the bfloat16 the loader keeps when no format is chosen."""
        return self.time_ratio(self.packed) if self.pack_bf16 else 1.0  # type: ignore[arg-type]

    def fastest(self) -> str | None:
        """The format with the shortest time for the workload among those that run no reference kernel,
        or None (keep bfloat16) when none is at least MIN_SPEEDUP times faster than the bfloat16 the
        loader would keep (prepacked where that is as fast)."""
        usable = [c for c in self.formats.values() if c.usable]
        if not usable:
            return None
        best = min(usable, key=self.time_ratio)
        return best.format if self.time_ratio(best) * MIN_SPEEDUP <= self._baseline() else None

    def choice(self, chosen: str | None) -> str:
        """The choice in words with its measured gain, e.g. 'int8, 3.10 times faster than bf16'."""
        bf16 = "prepacked bf16" if self.pack_bf16 else "bf16"
        if chosen is not None:
            gain = self._baseline() / self.time_ratio(self.formats[chosen])
            return f"{chosen}, {gain:.2f} times faster than {bf16}"
        usable = [c for c in self.formats.values() if c.usable]
        if not usable:
            return f"none ({bf16}: every format runs a reference kernel)"
        best = min(usable, key=self.time_ratio)
        gain = self._baseline() / self.time_ratio(best)
        return f"none ({bf16}: the fastest format, {best.format}, is {gain:.2f} times as fast)"

    def summary(self) -> str:
        """One line per format, for logs and `flyspec bench`."""
        checks = [*self.formats.values(), *([self.packed] if self.packed is not None else [])]
        parts = [c.describe() for c in checks]
        if self.packed_unavailable is not None:
            parts.append(f"{PACKED}: unavailable ({self.packed_unavailable})")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        """JSON-ready form (the cache file: the measurement, without the workload)."""
        data = asdict(self)
        data.pop("from_cache")
        data.pop("workload")
        return data

    @classmethod
    def from_dict(cls, data: dict) -> KernelCheck:
        """Inverse of to_dict (JSON turns the row keys into strings; they come back as ints)."""

        def one(f: dict) -> FormatCheck:
            return FormatCheck(f["format"], f["kernel"], {int(r): v for r, v in f["ratios"].items()})

        return cls(
            cpu=data["cpu"],
            rows=tuple(data["rows"]),
            bf16_kernel=data["bf16_kernel"],
            bf16_ms={int(r): v for r, v in data["bf16_ms"].items()},
            formats={name: one(f) for name, f in data["formats"].items()},
            seconds=data["seconds"],
            packed=None if data["packed"] is None else one(data["packed"]),
            packed_unavailable=data["packed_unavailable"],
            from_cache=True,
        )


@contextlib.contextmanager
def _stdout_to(path: Path) -> Iterator[None]:
    """Send the process's file descriptor 1 to `path` (oneDNN's verbose log is written there by C code)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def onednn_kernels(fn: Callable[[], object]) -> list[str]:
    """The oneDNN implementations that one call of `fn` executed (empty when it ran none), from
    oneDNN's verbose log, e.g. ['brg_matmul:avx512_core_vnni']."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "onednn.log"
        with _stdout_to(log), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            fn()
        lines = log.read_text(errors="replace").splitlines()
    names = [line.split(",")[6] for line in lines if ",exec," in line and len(line.split(",")) > 6]
    return list(dict.fromkeys(names))


def _kernel_name(fmt: str, call: Callable[[], object]) -> str:
    if fmt == "int4":
        return int4_kernel.describe()
    if fmt == "int8" and int8_kernel.describe() is not None:
        return int8_kernel.describe()  # type: ignore[return-value]
    onednn = onednn_kernels(call)
    if fmt == PACKED:
        return f"oneDNN {', '.join(onednn)}, prepacked"
    if onednn:
        return f"oneDNN {', '.join(onednn)}"
    return {"bf16": "aten", "float32": "aten/MKL"}.get(fmt, "unknown")


def _layers(fmt: str, shapes: Sequence[tuple[int, int]]) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    layers: list[Callable[[torch.Tensor], torch.Tensor]] = []
    for n, k in shapes:
        weight = torch.randn(n, k, generator=generator).mul_(0.02)
        if fmt == "bf16":
            w = weight.to(torch.bfloat16)
            layers.append(lambda x, w=w: F.linear(x, w))
        elif fmt == PACKED:
            layers.append(PackedLinear(weight.to(torch.bfloat16), None))
        elif fmt == "float32":
            layers.append(Float32Linear(weight, None, torch.bfloat16))
        elif fmt == "int8":
            layers.append(Int8Linear(weight, None, torch.bfloat16))
        else:
            layers.append(Int4Linear(weight, None, torch.bfloat16, prefill_copy=False))
    return layers


def _time_pass(layers: list[Callable], inputs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer, x in zip(layers, inputs, strict=True):
        layer(x)
    return time.perf_counter() - start


def measure(
    shapes: Sequence[tuple[int, int]], rows: Iterable[int], formats: Sequence[str] = FORMATS
) -> KernelCheck:
    """Time one pass over `shapes` ([out, in] weights) in bfloat16, in bfloat16 with prepacked weights
    (where oneDNN can pack them) and in each format at each row count (best of a few repeats, formats
    taking turns), and name the kernels that ran."""
    started = time.perf_counter()
    rows = tuple(sorted(set(rows)))
    for problem in cpuinfo.emulation_problems():
        if ("emulation", problem) not in _warned:
            _warned.add(("emulation", problem))
            _log.warning("%s: the emulation is incomplete: %s", cpuinfo.ISA_ENV, problem)
    unpackable = pack_reason()
    order = ("bf16", *(() if unpackable else (PACKED,)), *formats)
    layers = {fmt: _layers(fmt, shapes) for fmt in order}
    best: dict[tuple[str, int], float] = {}
    paired: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        generator = torch.Generator().manual_seed(1)
        kernels = {}
        for fmt in order:
            x = torch.randn(max(rows), shapes[0][1], generator=generator).to(torch.bfloat16)
            kernels[fmt] = _kernel_name(fmt, lambda fmt=fmt, x=x: layers[fmt][0](x))
        for r in rows:
            inputs = [torch.randn(r, k, generator=generator).to(torch.bfloat16) for _, k in shapes]
            for fmt in order:  # warm-up: first calls build primitives and caches
                _time_pass(layers[fmt], inputs)
            for repeat in range(_REPEATS):
                times = {}
                for fmt in order[repeat % len(order) :] + order[: repeat % len(order)]:
                    times[fmt] = _time_pass(layers[fmt], inputs)
                    best[fmt, r] = min(best.get((fmt, r), times[fmt]), times[fmt])
                for fmt in order[1:]:
                    paired.setdefault((fmt, r), []).append(times[fmt] / times["bf16"])
    # Each ratio is the median over repeats of the format's time over bfloat16's in the same repeat: a
    # burst of other work on a shared machine slows both sides of a pair, and the median drops the pairs
    # it hit unevenly.
    checks = {
        fmt: FormatCheck(fmt, kernels[fmt], {r: round(statistics.median(paired[fmt, r]), 4) for r in rows})
        for fmt in order[1:]
    }
    packed = checks.pop(PACKED, None)
    if "int4" in checks and "int8" in checks:  # int4 layers run prompts through their int8 copy
        int4 = checks["int4"]
        checks["int4"] = FormatCheck("int4", f"{int4.kernel} + int8 prefill {kernels['int8']}", int4.ratios)
    return KernelCheck(
        cpu=cpuinfo.describe_cpu(),
        rows=rows,
        bf16_kernel=kernels["bf16"],
        bf16_ms={r: round(1e3 * best["bf16", r], 4) for r in rows},
        formats=checks,
        seconds=round(time.perf_counter() - started, 3),
        packed=packed,
        packed_unavailable=unpackable,
    )


def _cache_path(shapes: Sequence[tuple[int, int]], rows: Sequence[int], formats: Sequence[str]) -> Path:
    key = json.dumps(
        {
            "cpu": cpuinfo.cpu_signature(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in _ENV_KEYS},
            "sources": [hashlib.sha256(p.read_bytes()).hexdigest() for p in _SOURCES],
            "shapes": sorted(map(list, shapes)),
            "rows": sorted(set(rows)),
            "formats": list(formats),
        },
        sort_keys=True,
    )
    return cache_dir() / "kernel-checks" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def check(
    shapes: Sequence[tuple[int, int]],
    rows: Workload | Iterable[int],
    formats: Sequence[str] = FORMATS,
) -> KernelCheck:
    """`measure`, or its cached result for this CPU, torch version, thread count, kernel sources, shapes
    and rows, scored for `rows` (a Workload, or row counts of equal weight). An unreadable cache entry is
    measured again; an unwritable cache is only logged; a measurement taken while the load average
    exceeds the usable cores is used but not cached."""
    workload = Workload.of(rows)
    path = _cache_path(shapes, workload.rows, formats)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return replace(KernelCheck.from_dict(json.loads(path.read_text())), workload=workload)
    result = replace(measure(shapes, workload.rows, formats), workload=workload)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load > cores:
        # Other work on the machine can make any kernel look slow: measure again at the next load.
        _log.info("kernel check not cached: the machine is busy (load average %.1f on %d cores)", load, cores)
        return result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        _log.debug("kernel check not cached (%s)", exc)
    return result


def resolve_quantization(
    requested: str | None,
    shapes: Sequence[tuple[int, int]],
    rows: Workload | Iterable[int],
    device: torch.device,
    label: str = "model",
) -> tuple[str | None, KernelCheck | None]:
    """The format to load for `requested` (None, "auto", "int8" or "int4") and the check behind it,
    scored for the engine's decode passes `rows` (a Workload from `engine_rows`, or row counts of equal
    weight).

    "auto" on a CPU takes `KernelCheck.fastest()` (possibly "float32" where bfloat16 is emulated) and logs
    one line: the choice, how many times faster than bfloat16 it measured, and the numbers; on another
    device it is None (the quantized kernels are CPU kernels). An explicit format is kept; if the check
    finds it slower than bfloat16 for that work or on a reference kernel, one warning per format and CPU
    says so.
    """
    if requested is None or (requested == "auto" and device.type != "cpu"):
        return None, None
    result = check(shapes, rows, candidate_formats())
    numbers = f"{result.summary()} (bf16: {result.bf16_kernel}; {result.cpu})"
    work = (result.workload or Workload.of(result.rows)).describe()
    if requested == "auto":
        chosen = result.fastest()
        _log.info(
            "quantization=auto for %s: %s for the engine's decode passes (%s). Measured: %s",
            label,
            result.choice(chosen),
            work,
            numbers,
        )
        return chosen, result
    fmt = result.formats[requested]
    ratio = result.time_ratio(fmt)
    if (fmt.reference_kernel or ratio > SLOWER_THAN_BF16) and (requested, result.cpu) not in _warned:
        _warned.add((requested, result.cpu))
        why = "runs a reference kernel" if fmt.reference_kernel else "is slower than bfloat16"
        _log.warning(
            "quantization=%r %s on this CPU: %.2f times bf16's time for the engine's decode passes (%s): "
            "%s; quantization='auto' would choose %s",
            requested,
            why,
            ratio,
            work,
            fmt.describe(),
            result.fastest() or "none",
        )
    return requested, result

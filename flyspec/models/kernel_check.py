"""The load-time kernel check: each weight format's matmuls timed against bfloat16 on this CPU, on the
model's own layer shapes, at the row counts the engine will run.

Why: a quantized format is only worth loading where its kernel is fast, and that depends on the CPU. On
an AMD EPYC without AMX, oneDNN once ran our int8 matmul on its reference kernel, about 400x slower than
bfloat16, and nothing noticed until a demo sat for 15 minutes in its warm-up. So every quantized load
measures first (about a second; cached per CPU, torch version, thread count and shapes in
`$FLYSPEC_CACHE/kernel-checks/`):

- `quantization="auto"` takes the fastest format that is never slower than bfloat16 at the measured row
  counts and runs no reference kernel, judged at the largest row count (the configured batch); none of
  them means the weights stay as loaded;
- an explicitly requested format that is slower than bfloat16, or runs a reference kernel, is still used
  but logs one warning naming the kernel and the ratio.

The kernel names come from oneDNN's own verbose log of one call (e.g. `brg_matmul:avx512_core_vnni`),
and for int4 from which of its two kernels is built (`int4_kernel`).
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flyspec import cpuinfo
from flyspec.assets import cache_dir
from flyspec.models import int4_kernel
from flyspec.models.packed_linear import PackedLinear, pack_reason
from flyspec.models.quantization import Int4Linear, Int8Linear

FORMATS = ("int8", "int4")
SLOWER_THAN_BF16 = 1.05
"""A format whose time at some measured row count exceeds bfloat16's times this is 'slower than bf16'
(5% above 1: repeated one-second checks on an idle 2-core machine differ by a few percent)."""

_REPEATS = 7
_log = logging.getLogger("flyspec.kernels")
_warned: set[tuple[str, str]] = set()
_SOURCES = (
    Path(__file__),
    Path(__file__).with_name("quantization.py"),
    Path(__file__).with_name("packed_linear.py"),
    Path(__file__).with_name("csrc") / "int4_matmul.cpp",
)
PACKED = "bf16-packed"
"""bfloat16 with prepacked weights (models/packed_linear.py): the same numbers as bf16, another layout."""


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
        """Worth using: no reference kernel and nowhere slower than bfloat16."""
        return not self.reference_kernel and not self.slower_than_bf16

    def describe(self) -> str:
        """E.g. 'int8 (oneDNN brg_matmul:avx512_core_vnni): 0.31x bf16 at 1 row, 0.45x at 80 rows'."""
        parts = [
            f"{ratio:.2f}x bf16 at {rows} row{'s' if rows != 1 else ''}"
            if i == 0
            else f"{ratio:.2f}x at {rows}"
            for i, (rows, ratio) in enumerate(sorted(self.ratios.items()))
        ]
        return f"{self.format} ({self.kernel}): {', '.join(parts)}"


@dataclass(frozen=True)
class KernelCheck:
    """Every format's measurement on one model's shapes at the given row counts."""

    cpu: str
    rows: tuple[int, ...]
    bf16_kernel: str
    bf16_ms: dict[int, float]
    formats: dict[str, FormatCheck]
    seconds: float
    packed: FormatCheck | None = None
    packed_unavailable: str | None = None
    from_cache: bool = False

    @property
    def pack_bf16(self) -> bool:
        """Whether bfloat16 weights should be prepacked: oneDNN can pack them here and that measured no
        slower than the plain layout."""
        return self.packed is not None and self.packed.usable

    def fastest(self) -> str | None:
        """The usable quantized format with the lowest ratio at the largest row count, or None (keep
        bfloat16: no quantized format is usable, or prepacked bfloat16 is at least as fast)."""
        usable = [c for c in self.formats.values() if c.usable]
        if not usable:
            return None
        best = min(usable, key=lambda c: c.ratios[max(self.rows)])
        if self.pack_bf16 and self.packed.ratios[max(self.rows)] <= best.ratios[max(self.rows)]:  # type: ignore[union-attr]
            return None
        return best.format

    def summary(self) -> str:
        """One line per format, for logs and `flyspec bench`."""
        checks = [*self.formats.values(), *([self.packed] if self.packed is not None else [])]
        parts = [c.describe() for c in checks]
        if self.packed_unavailable is not None:
            parts.append(f"{PACKED}: unavailable ({self.packed_unavailable})")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        """JSON-ready form (the cache file)."""
        data = asdict(self)
        data.pop("from_cache")
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
    onednn = onednn_kernels(call)
    if fmt == "bf16":
        return f"oneDNN {', '.join(onednn)}" if onednn else "aten"
    if fmt == PACKED:
        return f"oneDNN {', '.join(onednn)}, prepacked"
    if fmt == "int8":
        return f"oneDNN {', '.join(onednn)}" if onednn else "unknown"
    if int4_kernel.library() is not None:
        return "flyspec int4 VNNI kernel"
    return f"torch _weight_int4pack_mm_for_cpu ({int4_kernel.unavailable_reason()})"


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
    shapes: Sequence[tuple[int, int]], rows: Sequence[int], formats: Sequence[str] = FORMATS
) -> KernelCheck:
    """Time one pass over `shapes` ([out, in] weights) in bfloat16, in bfloat16 with prepacked weights
    (where oneDNN can pack them) and in each format at each row count (best of a few repeats, formats
    taking turns), and name the kernels that ran."""
    started = time.perf_counter()
    rows = tuple(sorted(set(rows)))
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
            "sources": [hashlib.sha256(p.read_bytes()).hexdigest() for p in _SOURCES],
            "shapes": sorted(map(list, shapes)),
            "rows": sorted(set(rows)),
            "formats": list(formats),
        },
        sort_keys=True,
    )
    return cache_dir() / "kernel-checks" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def check(
    shapes: Sequence[tuple[int, int]], rows: Sequence[int], formats: Sequence[str] = FORMATS
) -> KernelCheck:
    """`measure`, or its cached result for this CPU, torch version, thread count, kernel sources, shapes
    and rows. An unreadable cache entry is measured again; an unwritable cache is only logged; a
    measurement taken while the load average exceeds the usable cores is used but not cached."""
    path = _cache_path(shapes, rows, formats)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return KernelCheck.from_dict(json.loads(path.read_text()))
    result = measure(shapes, rows, formats)
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
    rows: Sequence[int],
    device: torch.device,
    label: str = "model",
) -> tuple[str | None, KernelCheck | None]:
    """The format to load for `requested` (None, "auto", "int8" or "int4") and the check behind it.

    "auto" on a CPU takes `KernelCheck.fastest()` and logs its choice with the numbers; on another device
    it is None (the quantized kernels are CPU kernels). An explicit format is kept; if the check finds
    it slower than bfloat16 or on a reference kernel, one warning per format and CPU says so.
    """
    if requested is None or (requested == "auto" and device.type != "cpu"):
        return None, None
    result = check(shapes, rows)
    numbers = f"{result.summary()} (bf16: {result.bf16_kernel}; {result.cpu})"
    if requested == "auto":
        chosen = result.fastest()
        keep = "none (prepacked bfloat16 is as fast)" if result.pack_bf16 else "none (none beats bfloat16)"
        _log.info(
            "quantization=auto for the %s: %s, measured at %s rows: %s",
            label,
            chosen or keep,
            "/".join(map(str, result.rows)),
            numbers,
        )
        return chosen, result
    fmt = result.formats[requested]
    if not fmt.usable and (requested, result.cpu) not in _warned:
        _warned.add((requested, result.cpu))
        why = "runs a reference kernel" if fmt.reference_kernel else "is slower than bfloat16"
        _log.warning(
            "quantization=%r %s on this CPU: %s; quantization='auto' would choose %s",
            requested,
            why,
            fmt.describe(),
            result.fastest() or "none",
        )
    return requested, result


MAX_ROWS = 256
"""Row counts are capped here: beyond it every format is bound by arithmetic and the ratios stay put,
while the measurement would take seconds."""


def engine_rows(num_speculative_tokens: int, max_running: int, *, draft: bool = False) -> tuple[int, int]:
    """The row counts a model's decode passes run at: one sequence and a full batch of `max_running`
    (capped at MAX_ROWS). The target scores 1 + K tokens per sequence per pass; a draft model proposes
    one token at a time."""
    per_sequence = 1 if draft else 1 + num_speculative_tokens
    return per_sequence, min(MAX_ROWS, per_sequence * max_running)

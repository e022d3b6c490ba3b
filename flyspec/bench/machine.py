"""A description of the machine and software a benchmark ran on, for the JSON and BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from flyspec import cpuinfo


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def describe_machine(device: str) -> dict[str, Any]:
    """CPU model, its ISA flags that decide the kernels (AVX2, AVX-512 VNNI/BF16, AMX) and core counts,
    memory, OS, Python/torch/transformers versions, torch threads, the
    accelerator when `device` is CUDA, the flyspec git commit and the load average now."""
    import psutil
    import torch
    import transformers

    info: dict[str, Any] = {
        "cpu": cpuinfo.cpu_model(),
        "cpu_isa": cpuinfo.isa_flags(),
        "cpu_amx": cpuinfo.has_amx(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "flyspec_commit": _git_commit(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def cpu_label(machine: dict[str, Any]) -> str:
    """The CPU of a recorded run for a table: model, ISA flags and cores, e.g. 'AMD EPYC (avx2,
    avx512_vnni, avx512_bf16; no AMX; 2 usable cores)'. Runs recorded before the flags were say so."""
    isa = machine.get("cpu_isa")
    if isa is None:
        flags = "ISA flags not recorded"
    else:
        flags = ", ".join(isa) or "no AVX2"
        flags += "" if machine.get("cpu_amx") else "; no AMX"
    return f"{machine['cpu']} ({flags}; {machine['usable_cores']} usable cores)"

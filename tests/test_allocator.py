"""glibc's thresholds set once per engine process (flyspec/engine/allocator.py): a large tensor freed and
allocated again comes back from the heap without faulting its pages in again; the user's own settings
win."""

from __future__ import annotations

import ctypes.util
import os
import resource
import subprocess
import sys

import pytest

from flyspec.engine import allocator

glibc = pytest.mark.skipif(
    sys.platform != "linux" or "libc.so.6" not in str(ctypes.util.find_library("c")),
    reason="glibc only",
)

_REUSE = """
import resource, torch
from flyspec.engine.allocator import keep_step_memory
print(keep_step_memory() if {keep} else False)
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):  # the first round faults the heap in
    before = faults()
    for _ in range(10):
        held = [torch.ones(3 << 20) for _ in range(4)]  # four 12 MB tensors alive at once, as a step's
        del held  # activations are, then freed together
    print(faults() - before)
"""


def _run(keep: bool, env: dict[str, str] | None = None) -> tuple[str, int]:
    code = _REUSE.format(keep=keep)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    words = out.stdout.split()
    return words[0], int(words[-1])


@glibc
def test_a_freed_12_mb_tensor_comes_back_without_faults() -> None:
    """With the thresholds set, four 12 MB tensors allocated and freed together, ten times, fault almost
    nothing after the first round. The control is glibc at its starting mmap threshold (128 KB): every
    12 MB tensor is a fresh mapping, faulted in again every time (10 x 4 x 3,072 pages). Left to its
    dynamic threshold glibc lands on either side (0 or 122,560 faults in three identical runs on AMD EPYC
    Zen 5, by whether the freed 48 MB sat at the top of the heap, above its trim threshold), which is
    why the engine pins both thresholds."""
    kept, faults = _run(keep=True)
    assert kept == "True"
    assert faults < 1000
    starting = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    _, default_faults = _run(keep=False, env=starting)
    assert default_faults > 10 * 4 * 2000


def test_the_users_malloc_settings_win(monkeypatch) -> None:
    """MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in the environment: nothing is changed."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    allocator.keep_step_memory.cache_clear()
    try:
        assert allocator.keep_step_memory() is False
    finally:
        allocator.keep_step_memory.cache_clear()


def test_ru_minflt_counts_this_process() -> None:
    """The counter the tests and `python -m flyspec.bench.faults` read is the process's own."""
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt > 0

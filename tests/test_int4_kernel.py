"""Building and loading our int4 kernel (flyspec/models/int4_kernel.py): compiled once into the cache,
loaded from there afterwards, and torch's int4 kernel in its place, with the reason, where it cannot be
built. (Its arithmetic and row independence are in tests/test_quantization.py.)"""

from __future__ import annotations

import logging
import re
import subprocess

import pytest
import torch

from flyspec.models import int4_kernel
from flyspec.models.quantization import Int4Linear, quantize_per_group_int4


@pytest.fixture(autouse=True)
def fresh_library():
    int4_kernel.library.cache_clear()
    yield
    int4_kernel.library.cache_clear()


def test_the_kernel_is_built_once_into_the_cache_and_loaded_from_there(tmp_path, monkeypatch) -> None:
    """The first use compiles csrc/int4_matmul.cpp into $FLYSPEC_CACHE/kernels/; a new process (here: a
    cleared cache of the loader) loads that file without compiling again."""
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    if int4_kernel.library() is None:
        pytest.skip(f"our int4 kernel cannot be built here: {int4_kernel.unavailable_reason()}")
    (built,) = (tmp_path / "kernels").glob("int4_matmul-*.so")
    stamp = built.stat().st_mtime_ns
    int4_kernel.library.cache_clear()
    commands = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: commands.append(cmd) or real_run(cmd, **kw))
    assert int4_kernel.library() is not None
    assert all("-o" not in cmd for cmd in commands)  # only `c++ --version`, for the cache key
    assert list((tmp_path / "kernels").glob("int4_matmul-*.so")) == [built]
    assert built.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    ("setup", "reason"),
    [("no compiler", "no C\\+\\+ compiler found"), ("broken compiler", "false failed")],
)
def test_without_a_working_compiler_int4_uses_torchs_kernel(
    setup: str, reason: str, tmp_path, monkeypatch, caplog
) -> None:
    """No compiler on PATH, or one that fails: `library()` is None with the reason (also logged as a
    warning), and an Int4Linear built then computes with torch's kernel on the same int4 weights."""
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    if setup == "no compiler":
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        monkeypatch.setenv("CXX", "false")
    with caplog.at_level(logging.WARNING, logger="flyspec.models.int4_kernel"):
        assert int4_kernel.library() is None
    assert re.search(reason, int4_kernel.unavailable_reason())
    assert "using torch's int4 kernel" in caplog.text
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    layer = Int4Linear(weight, None, torch.float32, prefill_copy=False)
    codes, pairs = quantize_per_group_int4(weight, 64)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, pairs))

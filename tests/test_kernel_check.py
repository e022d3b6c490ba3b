"""The load-time kernel check (flyspec/models/kernel_check.py) and quantization="auto".

The ratio test is the guard the issue tracker asked for after int8 fell to oneDNN's reference kernel on an
AMD EPYC (about 400x slower than bfloat16) and nothing noticed: on whatever CPU runs the tests, each
quantized format's matmuls at 1 and 16 rows must take at most 1.5x bfloat16's time on the same shapes,
measured side by side in one process (a ratio, never an absolute time). A second test proves that this
check fails where a fast path collapses, by forcing the old int8 call.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from tiny_llm import save_tiny

from flyspec import cpuinfo
from flyspec.llm import LLM
from flyspec.models import kernel_check
from flyspec.models.kernel_check import FormatCheck, KernelCheck, Workload, engine_rows
from flyspec.models.loader import load_model

# The decoder layers of Qwen2.5-0.5B (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864): big enough that
# the weights stream from memory as in real decoding, small enough to measure in under a second.
QWEN_05B_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
MAX_RATIO = 1.5


def test_every_quantized_format_is_no_slower_than_1_5x_bfloat16_on_this_cpu() -> None:
    """int8, int4 and prepacked bfloat16 matmuls at 1 and 16 rows take at most 1.5x plain bfloat16's time
    on the same shapes, and no format runs a reference kernel. Fails on any CPU where a format's fast path
    collapses."""
    best: dict[str, float] = {}
    for _ in range(3):  # a burst of other work can slow one attempt; a slow kernel is slow in all three
        result = kernel_check.measure(QWEN_05B_SHAPES, rows=(1, 16))
        checks = [*result.formats.values(), *([result.packed] if result.packed else [])]
        for fmt in checks:
            assert not fmt.reference_kernel, f"{fmt.describe()} on {result.cpu}"
            best[fmt.format] = min(best.get(fmt.format, math.inf), max(fmt.ratios.values()))
        if max(best.values()) <= MAX_RATIO:
            break
    assert max(best.values()) <= MAX_RATIO, f"{best} on {result.cpu}: {result.summary()}"


_OLD_INT8_CALL = textwrap.dedent(
    """
    import json, sys, torch
    from flyspec.models import kernel_check, quantization

    def signed_activations(self, x):
        # The int8 call before the fix: signed codes with zero point 0.
        x_q, x_scale = quantization.quantize_per_token(x.reshape(-1, self.in_features))
        y = torch.ops.onednn.qlinear_pointwise(
            x_q, 1.0, 0, self.packed, self.weight_scale, self._zero_points, None, 1.0, 0,
            torch.float32, "none", [], "",
        ).mul_(x_scale)
        return y.to(self.out_dtype).view(*x.shape[:-1], self.out_features)

    quantization.Int8Linear.forward = signed_activations
    result = kernel_check.measure([(256, 256), (512, 256)], rows=(1, 16), formats=("int8",))
    print(json.dumps(result.to_dict()))
    """
)


@pytest.mark.skipif("avx512_vnni" not in cpuinfo.isa_flags(), reason="needs an AVX-512 VNNI CPU")
def test_the_ratio_check_fails_for_the_old_int8_call() -> None:
    """With the old int8 call forced (signed activations), oneDNN's VNNI path has no kernel for it and runs
    `ref_int8`: the check names that kernel, marks the format unusable, and the ratio test's bound fails.
    AMX is switched off for this child (ONEDNN_MAX_CPU_ISA), so the same happens on Intel AMX machines,
    where AMX would otherwise run the signed call fast."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _OLD_INT8_CALL], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    result = KernelCheck.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))
    int8 = result.formats["int8"]
    assert int8.reference_kernel and "ref_int8" in int8.kernel
    assert not int8.usable
    assert max(int8.ratios.values()) > MAX_RATIO, int8.describe()


def _check(
    rows: tuple[int, ...] = (1, 16), bf16_ms: dict[int, float] | None = None, **formats: tuple[str, dict]
) -> KernelCheck:
    return KernelCheck(
        cpu="test CPU",
        rows=rows,
        bf16_kernel="oneDNN brg_matmul",
        bf16_ms=bf16_ms or {1: 1.0, 16: 2.0},
        formats={name: FormatCheck(name, kernel, ratios) for name, (kernel, ratios) in formats.items()},
        seconds=0.0,
    )


def test_auto_takes_the_format_with_the_shortest_time_for_the_workload() -> None:
    """'auto' scores each format by its time summed over the workload's row counts (each row count's
    time is its ratio times bfloat16's milliseconds there, times its weight), among formats that run no
    reference kernel, and keeps bfloat16 unless the best is at least MIN_SPEEDUP times faster."""
    fast = ("oneDNN brg_matmul:avx512_core_vnni", {1: 0.4, 16: 0.5})
    # Equal weights, bf16 at 1 / 2 ms: int8 0.4 + 1.0 = 1.4 ms, int4 0.2 + 1.4 = 1.6 ms.
    assert _check(int8=fast, int4=("flyspec int4", {1: 0.2, 16: 0.7})).fastest() == "int8"
    assert _check(int8=fast, int4=("flyspec int4", {1: 0.2, 16: 0.3})).fastest() == "int4"
    # Slower than bfloat16 for one row but fastest over the work: chosen (the old rule vetoed it).
    assert _check(int8=fast, int4=("flyspec int4", {1: 1.1, 16: 0.1})).fastest() == "int4"
    # The weights decide: a full batch weighted 16 against one row makes 16 rows' times count.
    workload = Workload(((1, 1.0), (16, 16.0)))
    slow_one_row = _check(int8=("oneDNN", {1: 3.0, 16: 0.5}), int4=("flyspec int4", {1: 0.3, 16: 0.8}))
    assert slow_one_row.fastest() == "int4"
    assert replace(slow_one_row, workload=workload).fastest() == "int8"
    # A reference kernel is never chosen, whatever it measured.
    assert _check(int8=("oneDNN ref_int8:any", {1: 0.1, 16: 0.1})).fastest() is None
    assert (
        _check(int4=("flyspec int4 + int8 prefill oneDNN ref_int8:any", {1: 0.1, 16: 0.1})).fastest() is None
    )
    assert _check(int8=("oneDNN brg_matmul", {1: 1.1, 16: 0.9})).fastest() is None  # 0.97: within noise
    assert _check(int8=("oneDNN brg_matmul", {1: 1.03, 16: 0.8})).fastest() == "int8"


def test_auto_on_the_issues_recorded_draft_check_takes_int8_where_the_old_rule_took_int4() -> None:
    """The check recorded for the demo's 0.5B draft on an AVX2-only AMD EPYC (Zen 3): int8 took 0.18x
    bfloat16's time at 32 rows and 1.77x at one row, int4 0.37x at 32 rows. The demo runs the draft at
    32 rows, where int8 is twice as fast as int4, yet the old rule ("never slower than bfloat16 at any
    measured row count") vetoed int8 and chose int4. Scored for the engine's draft passes at
    max_num_seqs=32, int8 wins for any one-row time of int4 and any bfloat16 time at one row up to its
    time at 32 rows (the issue did not record those)."""
    workload = engine_rows(4, 32, draft=True)
    assert dict(workload.weights) == {1: 1.0, 32: 32.0}
    for int4_one_row in (0.1, 0.5, 1.0):
        for bf16_one_row in (0.1, 0.5, 1.0):
            recorded = KernelCheck(
                cpu="AMD EPYC 7B13 (avx2, fma; no AMX)",
                rows=(1, 32),
                bf16_kernel="aten",
                bf16_ms={1: bf16_one_row, 32: 1.0},
                formats={
                    "int8": FormatCheck("int8", "oneDNN gemm:jit", {1: 1.77, 32: 0.18}),
                    "int4": FormatCheck(
                        "int4", "torch _weight_int4pack_mm_for_cpu", {1: int4_one_row, 32: 0.37}
                    ),
                },
                seconds=1.0,
                workload=workload,
            )
            old_rule = min(
                (c for c in recorded.formats.values() if not c.reference_kernel and not c.slower_than_bf16),
                key=lambda c: c.ratios[32],
            )
            assert old_rule.format == "int4"
            assert recorded.fastest() == "int8"
            assert recorded.choice("int8").startswith(
                "int8, "
            ) and "times faster than bf16" in recorded.choice("int8")


def test_engine_rows_weigh_the_configured_batch_against_one_row() -> None:
    """The target's full batch is (K+1) x max_num_seqs rows (capped), the draft's max_num_seqs, each weighted
    by the configured batch; one row has weight 1, and a batch of one is that row with both weights."""
    assert dict(engine_rows(4, 32).weights) == {1: 1.0, 160: 32.0}
    assert dict(engine_rows(4, 64).weights) == {1: 1.0, kernel_check.MAX_ROWS: 64.0}
    assert dict(engine_rows(0, 1).weights) == {1: 2.0}
    assert dict(engine_rows(4, 1).weights) == {1: 1.0, 5: 1.0}
    assert dict(engine_rows(4, 1, draft=True).weights) == {1: 2.0}


def test_an_explicit_format_slower_than_bfloat16_is_kept_with_one_warning(monkeypatch, caplog) -> None:
    """An explicit int8 that the check finds on a reference kernel still loads (the user asked for it), with
    one warning naming the kernel and the ratio; asking again does not repeat it."""
    slow = _check(
        int8=("oneDNN ref_int8:any", {1: 380.0, 16: 412.0}), int4=("flyspec int4", {1: 0.3, 16: 0.6})
    )
    monkeypatch.setattr(kernel_check, "check", lambda *args, **kwargs: slow)
    monkeypatch.setattr(kernel_check, "_warned", set())
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="flyspec.kernels"):
        for _ in range(2):
            chosen, _ = kernel_check.resolve_quantization("int8", [(8, 8)], (1, 16), cpu)
            assert chosen == "int8"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ref_int8:any" in warnings[0] and "412.00x" in warnings[0] and "would choose int4" in warnings[0]


def test_auto_off_the_cpu_loads_unquantized_without_measuring(monkeypatch) -> None:
    """The quantized kernels run on the CPU: "auto" on CUDA means the weights as loaded, and no check runs."""
    monkeypatch.setattr(kernel_check, "check", lambda *a, **k: pytest.fail("no check off the CPU"))
    assert kernel_check.resolve_quantization("auto", [(8, 8)], (1, 16), torch.device("cuda")) == (None, None)


def test_the_check_is_cached_per_cpu_shapes_and_rows(tmp_path, monkeypatch) -> None:
    """A second check with the same shapes and rows reads the cached measurement (same numbers, marked
    from_cache); other rows measure afresh; a corrupt cache file is measured again, not trusted."""
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_check.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    shapes = [(64, 64), (128, 64)]
    first = kernel_check.check(shapes, (1, 4))
    again = kernel_check.check(shapes, (1, 4))
    assert not first.from_cache and again.from_cache
    assert again.formats == first.formats and again.bf16_ms == first.bf16_ms
    assert not kernel_check.check(shapes, (1, 8)).from_cache
    (path,) = [
        p for p in (tmp_path / "kernel-checks").iterdir() if json.loads(p.read_text())["rows"] == [1, 4]
    ]
    path.write_text("{not json")
    assert not kernel_check.check(shapes, (1, 4)).from_cache


def test_auto_loads_what_the_check_chose_and_logs_why(tmp_path, monkeypatch, caplog) -> None:
    """load_model(quantization='auto') measures on the model's own layer shapes, loads the format the check
    found fastest (or none), records the check, and logs the choice with the numbers; an engine started
    with 'auto' runs on it."""
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path / "cache"))
    folder = save_tiny(tmp_path / "m", seed=0)
    with caplog.at_level(logging.INFO, logger="flyspec.kernels"):
        loaded = load_model(str(folder), dtype="bfloat16", quantization="auto", kernel_rows=(1, 8))
    assert loaded.kernel_check is not None
    assert loaded.quantization == loaded.kernel_check.fastest()
    assert loaded.kernel_check.rows == (1, 8)
    assert set(loaded.kernel_check.formats) == set(kernel_check.candidate_formats())
    assert any("quantization=auto" in r.getMessage() and "bf16" in r.getMessage() for r in caplog.records)
    llm = LLM(str(folder), dtype="bfloat16", quantization="auto", max_num_seqs=2)
    assert llm.generate(["w1 w2"], use_tqdm=False)[0].outputs[0].token_ids


def test_a_check_measured_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch) -> None:
    """With the load average above the usable cores, the measurement is used but not written to the
    cache, so the next load measures again instead of keeping numbers that other work distorted."""
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_check.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    shapes = [(64, 64)]
    assert not kernel_check.check(shapes, (1, 4)).from_cache
    assert not kernel_check.check(shapes, (1, 4)).from_cache
    assert not (tmp_path / "kernel-checks").exists() or not list((tmp_path / "kernel-checks").iterdir())


_CHECK_IN_CHILD = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # every log line reaches the terminal
    from flyspec import cpuinfo
    from flyspec.models import kernel_check
    result = kernel_check.check([(64, 64), (128, 64)], (1, 4), kernel_check.candidate_formats())
    print(json.dumps({"int4": result.formats["int4"].kernel, "problems": cpuinfo.emulation_problems()}))
    """
)
_NOISY_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then exec g++ --version; fi
for i in $(seq 40); do echo "int4_matmul.cpp:$i:1: error: NOISY COMPILER LINE $i" >&2; done
echo "NOISY COMPILER STDOUT"
"""


@pytest.mark.parametrize("compiler", ["succeeds", "fails"])
def test_the_kernel_check_without_avx512_prints_no_compiler_output(compiler: str, tmp_path) -> None:
    """With the AVX-512 path unavailable (FLYSPEC_CPU_ISA=avx2, what an AVX2-only AMD Zen 3 reports), a
    kernel check in a fresh cache builds the int4 kernel for AVX2, and a compiler that prints 40 lines of
    errors (then builds, or fails) puts none of them on the terminal: they go to the build log in the
    cache. A failed build says so in one warning, falls back to torch's kernel, and is not retried by
    the next start, which names the failure in its kernel description without printing it again."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ for the compiler wrapper")
    fake = tmp_path / "noisy-c++"
    fake.write_text(_NOISY_COMPILER + ('exec g++ "$@"\n' if compiler == "succeeds" else "exit 1\n"))
    fake.chmod(0o755)
    env = {
        **os.environ,
        "FLYSPEC_CPU_ISA": "avx2",
        "FLYSPEC_CACHE": str(tmp_path / "cache"),
        "CXX": str(fake),
    }
    for key in (
        "ONEDNN_MAX_CPU_ISA",
        "ATEN_CPU_CAPABILITY",
        "MKL_ENABLE_INSTRUCTIONS",
        "FLYSPEC_INT4_KERNEL",
    ):
        env.pop(key, None)
    runs = [
        subprocess.run(
            [sys.executable, "-c", _CHECK_IN_CHILD], capture_output=True, text=True, env=env, timeout=300
        )
        for _ in range(1 if compiler == "succeeds" else 2)
    ]
    for out in runs:
        assert out.returncode == 0, out.stderr
        terminal = out.stdout + out.stderr
        assert "NOISY" not in terminal and "error:" not in terminal, terminal[-3000:]
    result = json.loads(runs[0].stdout.strip().splitlines()[-1])
    assert result["problems"] == []  # oneDNN, torch and MKL were capped to AVX2 as well
    (log,) = (tmp_path / "cache" / "kernels").glob("int4_matmul-*.log")
    assert log.read_text().count("NOISY COMPILER LINE") == 40 and "-mavx2" in log.read_text()
    assert "-mavx512" not in log.read_text()
    if compiler == "succeeds":
        assert result["int4"].startswith("flyspec int4 kernel (avx2)")
        return
    assert result["int4"].startswith("torch _weight_int4pack_mm_for_cpu")
    warning = [line for line in runs[0].stderr.splitlines() if "few-row kernel is unavailable" in line]
    assert len(warning) == 1 and str(log) in warning[0], runs[0].stderr[-3000:]
    again = json.loads(runs[1].stdout.strip().splitlines()[-1])["int4"]
    assert again.startswith("torch _weight_int4pack_mm_for_cpu") and "failed" in again, again
    assert log.read_text().count("NOISY COMPILER LINE") == 40  # not rebuilt

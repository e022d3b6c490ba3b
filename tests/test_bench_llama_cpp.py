"""`flyspec bench --peer llama.cpp` (flyspec/bench/llama_cpp.py): the skip line with the install command
when llama.cpp is absent, the table's ratios, flyspec's prefill-free decode rate on a real engine, and,
marked slow, a whole run on the zoo's smallest model (against llama.cpp's real benches where `make
peers` installed them, else with llama.cpp's rows skipped and the command named)."""

from __future__ import annotations

import json

import pytest
from tiny_llm import save_tiny

from flyspec.bench import llama_cpp
from flyspec.bench.peers import peers_dir
from flyspec.llm import LLM


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_a_missing_llama_cpp_is_skipped_with_the_command_that_installs_it(
    isa: str, tmp_path, monkeypatch
) -> None:
    """No binaries under the peers folder: one line names what is missing and how to install it; with
    FLYSPEC_CPU_ISA=avx2 it is the AVX2-only build that is looked for and named."""
    monkeypatch.setenv("FLYSPEC_CPU_ISA", isa)
    line = llama_cpp.missing(tmp_path)
    assert line is not None and line.startswith("llama.cpp: skipped, not installed")
    assert "llama-bench" in line and "llama-batched-bench" in line
    if isa == "avx2":
        assert "llama.cpp-avx2" in line and "LLAMA_CPU_ISA=avx2 bash scripts/peers/llama_cpp.sh" in line
    else:
        assert "make peers" in line
    folder = llama_cpp.llama_cpp_dir(tmp_path) / "bin"
    folder.mkdir(parents=True)
    for name in ("llama-bench", "llama-batched-bench"):
        (folder / name).touch()
    assert llama_cpp.missing(tmp_path) is None


def test_the_table_names_the_cpu_and_divides_the_best_arm_by_llama_cpp() -> None:
    """A report read back from JSON (string keys) renders one row per number of sequences with the CPU,
    llama.cpp's tool, and the best target-only and SD arm over llama.cpp."""
    arm = {
        "quantization": "int8",
        "weights": {},
        "by_sequences": {"1": {"tokens_per_s": 5.0}, "16": {"tokens_per_s": 30.0}},
    }
    int4 = {
        "quantization": "int4",
        "weights": {},
        "by_sequences": {"1": {"tokens_per_s": 12.0}, "16": {"tokens_per_s": 20.0}},
    }
    report = {
        "cpu": "AMD EPYC 7B13 (avx2, fma; no AMX)",
        "threads": 2,
        "model": "m",
        "draft": "d",
        "k": 4,
        "n_gen": 64,
        "prompt_tokens_mean": 120,
        "sequences": [1, 16],
        "flyspec": {
            "flyspec int8 target-only": {**arm, "method": "target"},
            "flyspec int4 target-only": {**int4, "method": "target"},
            "flyspec int8 SD": {**arm, "method": "standard"},
        },
        "llama_cpp": {"build": "b11434", "gguf": "m.gguf", "tokens_per_s": {"1": 10.0, "16": 24.0}},
    }
    text = llama_cpp.render(json.loads(json.dumps(report)))
    assert "AMD EPYC 7B13 (avx2, fma; no AMX)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 16 ")]
    assert "10.00 (llama-bench tg)" in rows[0] and "**1.20x** | **0.50x**" in rows[0]
    assert "24.00 (batched-bench S_TG)" in rows[1] and "**1.25x** | **1.25x**" in rows[1]


def test_the_decode_rate_leaves_out_the_prefill(tmp_path) -> None:
    """On a real engine (tiny random model), the rate counts B x (n - 1) tokens over the difference of an
    n-token and a 1-token generate, which is shorter than the whole n-token call."""
    llm = LLM(
        str(save_tiny(tmp_path / "m", seed=0)), dtype="float32", max_num_seqs=4, enable_prefix_caching=False
    )
    prompts = [[5, 6, 7, 8] * (i + 1) for i in range(3)]
    rate = llama_cpp.decode_rate(llm, prompts, n_gen=6, repeats=2)
    assert rate["tokens_per_s"] == pytest.approx(3 * 5 / rate["decode_seconds"])
    assert 0 < rate["decode_seconds"] < rate["seconds_with_prefill"]


@pytest.mark.slow
def test_a_whole_run_on_the_smallest_zoo_model(tmp_path) -> None:
    """`run` on SmolLM2-135M (its zoo GGUF for llama.cpp, its safetensors for flyspec, itself as the draft)
    at 1 and 2 sequences: every flyspec arm has a rate at each; llama.cpp has both tools' rates where it is
    installed, else the report carries the skip line with the install command."""
    report = llama_cpp.run(
        model="smollm2-135m-instruct",
        draft="smollm2-135m-instruct",
        formats=("int8",),
        sequences=[1, 2],
        k=2,
        n_gen=4,
        repeats=1,
        threads=2,
        dtype="bfloat16",
        seed=0,
        dataset="gsm8k",
        root=peers_dir(),
        logs=tmp_path / "logs",
    )
    assert set(report["flyspec"]) == {"flyspec int8 target-only", "flyspec int8 SD"}
    for arm in report["flyspec"].values():
        assert all(arm["by_sequences"][b]["tokens_per_s"] > 0 for b in (1, 2))
    if report["llama_cpp"] is None:
        assert "not installed" in report["llama_cpp_skipped"]
    else:
        assert all(report["llama_cpp"]["tokens_per_s"][b] > 0 for b in (1, 2))
        assert [r["when"] for r in report["llama_cpp"]["runs"]] == ["before", "after"]
    assert "|" in llama_cpp.render(json.loads(json.dumps(report)))

"""`flyspec bench --peer llama.cpp` (flyspec/bench/llama_cpp.py): the skip line with the install command
when llama.cpp is absent, the table's ratios, flyspec's prefill-free decode rate on a real engine, and,
marked slow, a whole run on the zoo's smallest model (against llama.cpp's real benches where `make
peers` installed them, else with llama.cpp's rows skipped and the command named)."""

from __future__ import annotations

import json
from typing import Any

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


def test_the_table_names_the_cpu_and_takes_the_best_arms_paired_ratio() -> None:
    """A report read back from JSON (string keys) renders one row per number of sequences with the CPU,
    llama.cpp's tool and the range of its runs, and for the best target-only and SD arm the ratio to the
    llama.cpp runs measured right around it."""

    def cell(rate: float, around: list[float]) -> dict:
        return {
            "tokens_per_s": rate,
            "llama_cpp_tokens_per_s": around,
            "vs_llama_cpp": rate / (sum(around) / 2),
        }

    def arm(method: str, one: dict, sixteen: dict) -> dict:
        return {
            "quantization": "int8",
            "method": method,
            "weights": {},
            "by_sequences": {1: one, 16: sixteen},
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
            "flyspec int8 target-only": arm("target", cell(5.0, [10.0, 10.0]), cell(30.0, [20.0, 28.0])),
            "flyspec int4 target-only": arm("target", cell(12.0, [8.0, 12.0]), cell(20.0, [24.0, 24.0])),
            "flyspec int8 SD": arm("standard", cell(5.0, [9.0, 11.0]), cell(12.0, [24.0, 24.0])),
        },
        "llama_cpp": {
            "build": "b11434",
            "gguf": "m.gguf",
            "runs": {1: [{"tokens_per_s": t} for t in (10.0, 10.0, 8.0, 12.0, 9.0, 11.0)], 16: []},
        },
    }
    report["llama_cpp"]["runs"][16] = [{"tokens_per_s": t} for t in (20.0, 28.0, 24.0, 24.0, 24.0, 24.0)]
    text = llama_cpp.render(json.loads(json.dumps(report)))
    assert "AMD EPYC 7B13 (avx2, fma; no AMX)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 16 ")]
    assert "10.00 (llama-bench tg; 8.00-12.00)" in rows[0] and rows[0].endswith("| **1.20x** | **0.50x** |")
    assert "24.00 (batched-bench S_TG; 20.00-28.00)" in rows[1] and rows[1].endswith(
        "| **1.25x** | **0.50x** |"
    )


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


class _ScriptedLLM:
    """Answers generate() with max_tokens tokens per prompt and advances a fake clock by the next of the
    scripted call durations (warm-up first), so decode_rate's arithmetic is checked without timing."""

    def __init__(self, durations: list[float]) -> None:
        self.durations, self.clock = list(durations), 0.0

    def generate(self, prompts: list, params: Any, use_tqdm: bool = False) -> list:
        from types import SimpleNamespace

        self.clock += self.durations.pop(0)
        out = SimpleNamespace(token_ids=[0] * params.max_tokens)
        return [SimpleNamespace(outputs=[out]) for _ in prompts]


def test_a_disturbed_pair_is_measured_again_and_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-token run slowed by another process can take longer than the n-token run after it: that pair
    is measured again (up to RETRIES more) instead of ending the whole comparison, and its difference is
    never used; when no pair has a positive difference the error says so."""
    llm = _ScriptedLLM([0.1, 5.0, 3.0, 1.0, 3.0])  # warm-up, disturbed pair (5.0 > 3.0), clean pair
    monkeypatch.setattr(llama_cpp.time, "perf_counter", lambda: llm.clock)
    rate = llama_cpp.decode_rate(llm, [[1, 2]], n_gen=9, repeats=1)
    assert rate["decode_seconds"] == pytest.approx(2.0) and rate["tokens_per_s"] == pytest.approx(8 / 2.0)
    llm = _ScriptedLLM([0.1] + [5.0, 3.0] * (1 + llama_cpp.RETRIES))
    monkeypatch.setattr(llama_cpp.time, "perf_counter", lambda: llm.clock)
    with pytest.raises(RuntimeError, match="no measurable time"):
        llama_cpp.decode_rate(llm, [[1, 2]], n_gen=9, repeats=1)
    assert llm.durations == []


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
        n_gen=16,  # at 4 the decode time of a 135M model can drown in the noise of the 1-token run
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
        for arm in report["flyspec"].values():  # llama.cpp right before and after each measurement
            assert all(len(arm["by_sequences"][b]["llama_cpp_tokens_per_s"]) == 2 for b in (1, 2))
    assert "|" in llama_cpp.render(json.loads(json.dumps(report)))

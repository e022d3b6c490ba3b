"""`flyspec bench --peer llama.cpp` (flyspec/bench/llama_cpp.py): the skip line with the install command
when llama.cpp is absent, the table's ratios, the typed report that reads and writes the saved
benchmarks/llama-cpp-*.json unchanged, the comparison as the sweep's arms on the sweep's runner (one
engine per column, prefix caching off, released before the next), flyspec's prefill-free decode rate on
a real engine, the command's option checks and a whole command on tiny models without llama.cpp, and,
marked slow, a whole run on the zoo's smallest model (against llama.cpp's real benches where `make
peers` installed them, else with llama.cpp's rows skipped and the command named)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import pytest
from tiny_llm import save_perturbed, save_tiny

from flyspec.bench import llama_cpp, llama_cpp_tools
from flyspec.bench.llama_cpp import LlamaCppSettings, column_label, plan
from flyspec.bench.llama_cpp_report import DecodeRate, FlyspecColumn, LlamaCppReport, LlamaCppRuns, render
from flyspec.bench.peers import peers_dir
from flyspec.bench.runner import BenchRunner, engine_keys
from flyspec.bench.sweep import Arm
from flyspec.llm import LLM

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_a_missing_llama_cpp_is_skipped_with_the_command_that_installs_it(
    isa: str, tmp_path, monkeypatch
) -> None:
    """No binaries under the peers folder: one line names what is missing and how to install it; with
    FLYSPEC_CPU_ISA=avx2 it is the AVX2-only build that is looked for and named."""
    monkeypatch.setenv("FLYSPEC_CPU_ISA", isa)
    line = llama_cpp_tools.missing(tmp_path)
    assert line is not None and line.startswith("llama.cpp: skipped, not installed")
    assert "llama-bench" in line and "llama-batched-bench" in line
    if isa == "avx2":
        assert "llama.cpp-avx2" in line and "LLAMA_CPU_ISA=avx2 bash scripts/peers/llama_cpp.sh" in line
    else:
        assert "make peers" in line
    folder = llama_cpp_tools.llama_cpp_dir(tmp_path) / "bin"
    folder.mkdir(parents=True)
    for name in ("llama-bench", "llama-batched-bench"):
        (folder / name).touch()
    assert llama_cpp_tools.missing(tmp_path) is None


def test_the_table_names_the_cpu_and_takes_the_best_arms_paired_ratio() -> None:
    """A report read back from JSON (string keys) renders one row per number of sequences with the CPU,
    llama.cpp's tool and the range of its runs, and for the best target-only and SD arm the ratio to the
    llama.cpp runs measured right around it."""

    def cell(rate: float, around: list[float]) -> dict:
        return {
            "tokens_per_s": rate,
            "decode_seconds": 1.0,
            "seconds_with_prefill": 2.0,
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
        "machine": {},
        "repeats": 1,
        "llama_cpp_skipped": None,
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
    text = render(LlamaCppReport.from_dict(json.loads(json.dumps(report))))
    assert "AMD EPYC 7B13 (avx2, fma; no AMX)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 16 ")]
    assert "10.00 (llama-bench tg; 8.00-12.00)" in rows[0] and rows[0].endswith("| **1.20x** | **0.50x** |")
    assert "24.00 (batched-bench S_TG; 20.00-28.00)" in rows[1] and rows[1].endswith(
        "| **1.25x** | **0.50x** |"
    )


def test_sd_against_llama_cpps_sd_reads_back_and_renders() -> None:
    """llama.cpp's speculative decoding at one sequence (its runs, drafted and accepted tokens) and
    flyspec's SD column's ratio to the two runs around it survive JSON and render as one line; a build
    without llama-speculative-simple renders its skip line instead."""
    sd_runs = [{"tokens_per_s": t, "drafted": 40, "accepted": 30} for t in (20.0, 30.0)]
    peer = LlamaCppRuns("t.gguf", "b11434", {1: [{"tokens_per_s": 10.0}]}, sd_runs=sd_runs)
    peer.finish()
    sd = DecodeRate(30.0, 2.0, 2.5, [10.0, 10.0], 3.0, [20.0, 30.0], 30.0 / 25.0)
    report = LlamaCppReport(
        "cpu", {}, "m", "d", 4, 64, [1], 2, 1, 100, None,
        flyspec={"flyspec int4 SD": FlyspecColumn("int4", "standard", {}, {1: sd})}, llama_cpp=peer,
    )  # fmt: skip
    back = LlamaCppReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.llama_cpp is not None and back.llama_cpp.sd_tokens_per_s == 25.0
    line = render(back).splitlines()[-1]
    assert line.startswith("SD against SD at one sequence") and "llama.cpp 25.00 tok/s (20.00-30.00" in line
    assert "60 of 80 draft tokens accepted" in line and "flyspec int4 SD 30.00 tok/s (**1.20x**)" in line
    skipped = LlamaCppRuns("t.gguf", "b", peer.runs, sd_skipped="llama.cpp SD: skipped, missing")
    report.llama_cpp = skipped
    assert render(report).splitlines()[-1] == "llama.cpp SD: skipped, missing"


SAVED = (
    "llama-cpp-native.json",
    "llama-cpp-zen4.json",
    "llama-cpp-zen4-avx2.json",
    "llama-cpp-zen5.json",
    "llama-cpp-zen5-hugepages.json",
    "llama-cpp-zen5-avx2.json",
)


@pytest.mark.parametrize("name", SAVED)
def test_a_saved_report_reads_and_writes_back_unchanged(name: str) -> None:
    """The typed report reads a saved comparison (benchmarks/, where BENCHMARKS.md's tables come from)
    with integer numbers of sequences and writes it back byte for byte, keys in the same order: a new
    run's JSON has the old layout. Its table has one row per number of sequences, each with both ratios."""
    text = (ROOT / "benchmarks" / name).read_text()
    report = LlamaCppReport.from_dict(json.loads(text))
    assert json.dumps(report.to_dict(), indent=2) == json.dumps(json.loads(text), indent=2)
    assert all(isinstance(b, int) for column in report.flyspec.values() for b in column.by_sequences)
    rows = [line for line in render(report).splitlines() if line[:3].strip("| ").isdigit()]
    assert len(rows) == len(report.sequences) and all(row.count("x**") == 2 for row in rows)


def test_the_comparison_is_the_sweeps_arms_one_engine_per_column() -> None:
    """The default comparison is the sweep's arms: per weight format, target-only and SD (the draft at K,
    standard verification) at 1, 16 and 32 sequences. The sweep's runner puts each column on one engine
    of 32 slots, and the columns keep the names the saved reports use."""
    arms = plan(LlamaCppSettings(model="t", draft="d"))
    labels = list(dict.fromkeys(column_label(a) for a in arms))
    assert labels == [
        "flyspec int8 target-only", "flyspec int8 SD", "flyspec int4 target-only", "flyspec int4 SD",
    ]  # fmt: skip
    keys = engine_keys(arms)
    for label in labels:
        column = [a for a in arms if column_label(a) == label]
        assert [a.batch_size for a in column] == [1, 16, 32] and len({keys[a.label] for a in column}) == 1
    assert len(set(keys.values())) == 4
    runner = BenchRunner("t", arms, dtype="bfloat16", device="cpu", ignore_eos=True, prefix_caching=False)
    assert set(runner.slots.values()) == {32}
    sd = next(a for a in arms if a.method == "standard")
    assert sd.speculative_config() == {"num_speculative_tokens": 4, "method": "draft_model", "model": "d"}
    unquantized = plan(LlamaCppSettings(model="t", draft="d", formats=(None,), sequences=(1,)))
    assert [column_label(a) for a in unquantized] == ["flyspec bf16 target-only", "flyspec bf16 SD"]


def test_the_runners_engine_prefills_every_call_and_is_released(tmp_path) -> None:
    """The rate's 1-token run must prefill as its n-token run does: with prefix_caching=False the runner's
    engine shares no block of a prompt asked twice (the sweep's default shares them). release() frees the
    engine (nothing holds it any more) before the next is built."""
    from flyspec.sampling_params import SamplingParams

    target = str(save_tiny(tmp_path / "m", seed=0))
    arm = Arm("flyspec", "target", 1)
    prompt, params = [[5, 6, 7, 8] * 12], SamplingParams(temperature=0, max_tokens=2)
    for caching in (True, False):
        runner = BenchRunner(
            target, [arm], dtype="float32", device="cpu", ignore_eos=True, prefix_caching=caching
        )
        llm = runner.engine_for(arm)
        for _ in range(2):
            llm.generate(prompt, params, use_tqdm=False)
        assert (llm.stats.prefix_cache_hits > 0) == caching
    freed = weakref.ref(llm)
    del llm
    runner.release()
    assert freed() is None and runner.engine_for(arm) is not None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--draft", "a", "--draft", "b"], "--peer llama.cpp: give one draft model"),
        (["--draft", "ngram"], "--peer llama.cpp: give one draft model"),
        (["--k", "2,4"], "--peer llama.cpp: give one K"),
        (["--max-tokens", "1"], "--max-tokens: at least 2 with --peer llama.cpp"),
        (["--quantization", "int2"], "--quantization 'int2': with --peer llama.cpp, a comma list of"),
        (["--json", "/absent-folder/x.json"], "--json /absent-folder/x.json: folder /absent-folder does not"),
    ],
)
def test_the_commands_options_are_checked_before_anything_loads(options: list[str], message: str) -> None:
    """An option `--peer llama.cpp` cannot take as given is a ValueError naming it (the command line
    prints it as one line), before any model loads."""
    from typer.testing import CliRunner

    from flyspec.cli import app

    result = CliRunner().invoke(app, ["bench", "--peer", "llama.cpp", "--model", "absent", *options])
    assert isinstance(result.exception, ValueError) and message in str(result.exception)


def test_the_command_on_tiny_models_without_llama_cpp(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`flyspec bench --peer llama.cpp` on tiny models with no llama.cpp installed: the skip line with
    the install command on stderr, each column's prefill-free rate at 1 and 2 sequences (without
    llama.cpp's fields), the JSON in the saved reports' layout and the table with "-" for llama.cpp."""
    from typer.testing import CliRunner

    from flyspec.cli import app

    monkeypatch.setenv("FLYSPEC_PEERS", str(tmp_path / "peers"))
    target = save_tiny(tmp_path / "target", seed=3)
    draft = save_perturbed(target, tmp_path / "draft", seed=5, noise=0.003)
    out_json, out_md = tmp_path / "llama.json", tmp_path / "llama.md"
    args = [
        "bench", "--peer", "llama.cpp", "--model", str(target), "--draft", str(draft), "--batch-sizes", "1,2",
        "--k", "2", "--max-tokens", "8", "--quantization", "none", "--dtype", "float32",
        "--json", str(out_json), "--markdown", str(out_md),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "llama.cpp: skipped, not installed" in result.stderr and "make peers" in result.stderr
    data = json.loads(out_json.read_text())
    saved = list(json.loads((ROOT / "benchmarks" / SAVED[0]).read_text()))
    assert list(data) == [*saved, "memory_read_gbps"] and data["memory_read_gbps"] > 0.1
    assert data["llama_cpp"] is None and data["sequences"] == [1, 2] and data["k"] == 2
    assert list(data["flyspec"]) == ["flyspec bf16 target-only", "flyspec bf16 SD"]
    timing = ["tokens_per_s", "decode_seconds", "seconds_with_prefill"]
    for label, column in data["flyspec"].items():
        assert list(column) == ["quantization", "method", "weights", "by_sequences"]
        assert list(column["by_sequences"]) == ["1", "2"]
        for b, rate in column["by_sequences"].items():
            one_target = (b, label) == ("1", "flyspec bf16 target-only")
            traffic = ["weight_bytes", "weight_gbps"] if one_target else []
            assert list(rate) == timing + traffic
            assert rate["tokens_per_s"] > 0
    # The one-sequence traffic: every projection's float32 weights and biases, and the lm_head (the
    # embedding table where the head is tied to it: it multiplies by the whole table), times tokens/s.
    from safetensors.torch import load_file

    tensors = {name: t for f in target.glob("*.safetensors") for name, t in load_file(f).items()}
    read = [t for name, t in tensors.items() if "_proj." in name or name == "lm_head.weight"]
    if "lm_head.weight" not in tensors:
        read.append(tensors["model.embed_tokens.weight"])
    expected = sum(t.numel() * 4 for t in read)
    one = data["flyspec"]["flyspec bf16 target-only"]["by_sequences"]["1"]
    assert one["weight_bytes"] == expected == LLM(str(target), dtype="float32").target_weight_bytes
    assert one["weight_gbps"] == pytest.approx(expected * one["tokens_per_s"] / 1e9)
    assert "draft" in data["flyspec"]["flyspec bf16 SD"]["weights"]
    table = out_md.read_text()
    assert table in result.stdout and "| 1 | - | " in table and "| 2 | - | " in table
    assert "One sequence against the memory bandwidth: this machine read" in table


def test_the_decode_rate_leaves_out_the_prefill(tmp_path) -> None:
    """On a real engine (tiny random model), the rate counts B x (n - 1) tokens over the difference of an
    n-token and a 1-token generate, which is shorter than the whole n-token call."""
    llm = LLM(
        str(save_tiny(tmp_path / "m", seed=0)), dtype="float32", max_num_seqs=4, enable_prefix_caching=False
    )
    prompts = [[5, 6, 7, 8] * (i + 1) for i in range(3)]
    rate = llama_cpp.decode_rate(llm, prompts, n_gen=6, repeats=2)
    assert rate.tokens_per_s == pytest.approx(3 * 5 / rate.decode_seconds)
    assert 0 < rate.decode_seconds < rate.seconds_with_prefill


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
    assert rate.decode_seconds == pytest.approx(2.0) and rate.tokens_per_s == pytest.approx(8 / 2.0)
    llm = _ScriptedLLM([0.1] + [5.0, 3.0] * (1 + llama_cpp.RETRIES))
    monkeypatch.setattr(llama_cpp.time, "perf_counter", lambda: llm.clock)
    with pytest.raises(RuntimeError, match="no measurable time"):
        llama_cpp.decode_rate(llm, [[1, 2]], n_gen=9, repeats=1)
    assert llm.durations == []


@pytest.mark.slow
def test_a_whole_run_on_the_smallest_zoo_model(tmp_path) -> None:
    """`run` on SmolLM2-135M (its zoo GGUF for llama.cpp, its safetensors for flyspec, itself as the draft)
    at 1 and 2 sequences: every flyspec arm has a rate at each; llama.cpp has both tools' rates where it is
    installed, and its speculative decoding around flyspec's SD at one sequence (the same chat-templated
    prompt, tokenized by llama.cpp to the same length), else the report carries the skip line with the
    install command."""
    settings = LlamaCppSettings(
        model="smollm2-135m-instruct",
        draft="smollm2-135m-instruct",
        formats=("int8",),
        sequences=(1, 2),
        k=2,
        n_gen=16,  # at 4 the decode time of a 135M model can drown in the noise of the 1-token run
        threads=2,
    )
    report = llama_cpp.run(settings, root=peers_dir(), logs=tmp_path / "logs")
    assert set(report.flyspec) == {"flyspec int8 target-only", "flyspec int8 SD"}
    for column in report.flyspec.values():
        assert all(column.by_sequences[b].tokens_per_s > 0 for b in (1, 2))
    if report.llama_cpp is None:
        assert "not installed" in report.llama_cpp_skipped
    else:
        assert all(report.llama_cpp.tokens_per_s[b] > 0 for b in (1, 2))
        for column in report.flyspec.values():  # llama.cpp right before and after each measurement
            assert all(len(column.by_sequences[b].llama_cpp_tokens_per_s) == 2 for b in (1, 2))
        # llama.cpp's own SD around flyspec's SD at one sequence: the same prompt, as many tokens, drafts
        sd_runs = report.llama_cpp.sd_runs
        assert len(sd_runs) == 2 and report.flyspec["flyspec int8 SD"].by_sequences[1].vs_llama_cpp_sd
        prompt_tokens = len(llama_cpp._prompts(settings)[0][0])
        assert all(r["decoded_tokens"] >= 16 and r["prompt_tokens"] == prompt_tokens for r in sd_runs)
        assert all(0 < r["accepted"] <= r["drafted"] for r in sd_runs)  # a model drafting for itself
        assert "SD against SD at one sequence" in render(report)
    assert "|" in render(LlamaCppReport.from_dict(json.loads(json.dumps(report.to_dict()))))

"""`flyspec generate` and `flyspec capacity`: output, the --json contract, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_llm import save_tiny
from typer.testing import CliRunner

from flyspec.cli import app


def flyspec(*args: str) -> subprocess.CompletedProcess:
    """Run the real console entry point (flyspec.cli.main) in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", "from flyspec.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # a tiny model; threads only contend on a busy CPU
    )


def capacity_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["capacity", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("budget", "seqs", "k", "expected", "binding"),
    [
        ("512", "128", "9", 51, "budget"),
        ("512", "64", "5", 64, "max_num_seqs"),
        ("512", "128", "5", 85, "budget"),
    ],
)
def test_capacity_json_on_the_published_examples(budget, seqs, k, expected, binding) -> None:
    """The last stdout line is JSON with max_running, tokens_per_decode_request (1 + K) and binding."""
    out = capacity_json(
        "--max-num-batched-tokens", budget, "--max-num-seqs", seqs, "--num-speculative-tokens", k
    )
    assert (out["max_running"], out["tokens_per_decode_request"], out["binding"]) == (
        expected,
        int(k) + 1,
        binding,
    )


def test_capacity_lookahead_and_extra_draft_slots() -> None:
    """A lookahead drafter can bind; --extra-draft-slots shows the before/after comparison in words and
    in the JSON (the published 85 -> 51 when 4 draft slots are also charged)."""
    budget = ["--max-num-batched-tokens", "512", "--max-num-seqs", "128"]
    out = capacity_json(*budget, "--num-speculative-tokens", "1", "--num-lookahead-tokens", "5")
    assert (out["max_running"], out["binding"]) == (102, "lookahead")
    compare = [*budget, "--num-speculative-tokens", "5", "--extra-draft-slots", "4"]
    result = CliRunner().invoke(app, ["capacity", *compare])
    assert result.exit_code == 0
    assert "at most 85 of max_num_seqs=128" in result.stdout
    assert "only 51 running requests instead of 85" in result.stdout
    out = capacity_json(*compare)
    assert out["max_running"] == 85
    assert out["with_extra_draft_slots"] == {
        "max_running": 51,
        "tokens_per_decode_request": 10,
        "binding": "budget",
    }


def test_capacity_error_is_one_line_without_traceback() -> None:
    """A budget below one request's charge exits 2 with one 'error:' line naming what to raise."""
    proc = flyspec(
        "capacity", "--max-num-batched-tokens", "4", "--max-num-seqs", "8", "--num-speculative-tokens", "4"
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: max_num_batched_tokens=4: must be at least the 5 tokens one decode request charges; "
        "raise max_num_batched_tokens to at least 5"
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny(tmp_path_factory.mktemp("cli") / "tiny", seed=0))


def test_generate_prints_text_and_stats_then_json(tiny: str) -> None:
    """`flyspec generate` with a speculative config prints the text, a stats line (tokens/s, mean
    acceptance length, acceptance rate, forgiven tokens), and with --json a final JSON object."""
    spec = json.dumps({"model": tiny, "num_speculative_tokens": 3})
    proc = flyspec("generate", tiny, "w1 w2 w3", "--speculative-config", spec, "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert lines[0] == summary["text"] and summary["text"]
    assert len(summary["token_ids"]) == summary["num_tokens"] <= 8
    assert summary["acceptance_rate"] == 1.0 and summary["num_forgiven_tokens"] == 0
    assert summary["mean_acceptance_length"] > 1.0
    stats = lines[-2]
    for phrase in ("tokens/s", "mean acceptance length", "acceptance rate", "forgiven tokens 0"):
        assert phrase in stats


def test_generate_chat_and_bad_config_errors(tiny: str) -> None:
    """--chat wraps the prompt in the chat template; an unknown speculative_config key is one error line."""
    proc = flyspec("generate", tiny, "w1", "--chat", "--max-tokens", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]) <= 3
    bad = flyspec("generate", tiny, "w1", "--speculative-config", '{"num_speculative_tokens": 2, "k": 1}')
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.startswith("error: speculative_config has unknown key(s) 'k'")
    assert "Traceback" not in bad.stderr

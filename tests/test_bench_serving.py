"""`flyspec bench-serve`: the load generator against a real flyspec server, the peer process manager,
the server plans for vLLM and llama.cpp, the report, and the skip line for a peer that is not installed.

No peer is needed: flyspec's own server on a tiny random-weight model is the server under test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_llm import save_tiny

from flyspec import assets
from flyspec.bench import serving
from flyspec.bench.peers import (
    ArmSpec,
    PlanInputs,
    ServerPlan,
    TreeMemory,
    assembled_gguf,
    missing_peer,
    plan_servers,
    start_server,
)
from flyspec.bench.serving_bench import requests_for
from flyspec.bench.serving_report import flyspec_ratio, render_markdown, target_ratio
from flyspec.cli.bench_serve import parse_levels, parse_names

FLYSPEC = str(Path(sys.executable).with_name("flyspec"))
K = 2
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("serving_models") / "target", seed=0, arch="qwen2")


@pytest.fixture(scope="module")
def spec_server(tiny_target: Path) -> Iterator[str]:
    """An in-process flyspec server whose draft is the target itself (greedy: every draft is accepted)."""
    from flyspec.config import EngineConfig
    from flyspec.engine.engine import LLMEngine
    from flyspec.server.app import build_app
    from flyspec.server.background import serve_in_background

    config = EngineConfig(
        model=str(tiny_target),
        speculative_config={"model": str(tiny_target), "num_speculative_tokens": K},
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
    )
    app = build_app(LLMEngine(config), served_model_name="tiny")
    with serve_in_background(app) as server:
        yield server.base_url


PROMPTS = [[1, 10 + i, 20 + i, 30 + i] for i in range(6)]


def test_level_gets_exactly_max_tokens_per_request_and_plausible_timings(spec_server: str) -> None:
    """With ignore_eos every request streams exactly max_tokens tokens, counted from the usage chunk (a
    speculative server sends several tokens per chunk, so chunk counting would undercount); TTFT comes
    before the end, and aggregate tokens/s is all tokens over the level's wall time."""
    level = serving.run_level_sync(spec_server, "tiny", PROMPTS, 2, 12)
    assert len(level.requests) == len(PROMPTS)
    for r in level.requests:
        assert r.error is None
        assert r.output_tokens == 12 and r.tokens_from_usage
        assert r.finish_reason == "length"
        assert 0 < r.ttft_s < r.e2e_s
    s = serving.summarize(level)
    assert s["output_tokens"] == 12 * len(PROMPTS) and s["short_requests"] == 0 and s["errors"] == 0
    assert s["tokens_per_s"] == pytest.approx(12 * len(PROMPTS) / level.wall_s)
    assert s["tokens_per_chunk"] > 1.5  # draft == target: K + 1 tokens per verification step
    assert s["tokens_counted_from"] == "usage"


def test_concurrency_bounds_the_requests_in_flight(spec_server: str) -> None:
    """At concurrency 3, no instant has more than 3 requests in flight, and some instant has 3."""
    level = serving.run_level_sync(spec_server, "tiny", PROMPTS, 3, 8)
    spans = [(r.sent_at_s, r.sent_at_s + r.e2e_s) for r in level.requests]
    in_flight = [sum(s <= t < e for s, e in spans) for t, _ in spans]
    assert max(in_flight) == 3


def test_early_stop_is_counted_short_not_padded(spec_server: str) -> None:
    """A server that ends a request before max_tokens (here: told to stop at the first token) has it
    counted as short, and its tokens/s uses the tokens it sent."""
    stop_at_any_word = {"stop_token_ids": list(range(4, 256))}
    level = serving.run_level_sync(spec_server, "tiny", PROMPTS[:2], 1, 12, stop_at_any_word)
    s = serving.summarize(level)
    assert s["short_requests"] == 2 and s["errors"] == 0
    assert s["output_tokens"] == sum(r.output_tokens for r in level.requests) < 24


def test_server_errors_are_reported_and_left_out_of_timings(spec_server: str) -> None:
    """A request the server rejects (prompt longer than max_model_len) is an error with the server's
    message; it adds no tokens and no timings."""
    too_long = [1] * (MAX_MODEL_LEN + 1)
    level = serving.run_level_sync(spec_server, "tiny", [too_long, PROMPTS[0]], 2, 4)
    s = serving.summarize(level)
    assert s["errors"] == 1 and "HTTP 400" in s["first_error"]
    assert s["output_tokens"] == 4 and s["requests"] == 2


def test_acceptance_comes_from_the_servers_metrics(spec_server: str) -> None:
    """Mean acceptance length and acceptance rate over one level, from flyspec's spec_decode counters
    before and after: with the target as its own draft, greedy, every draft token is accepted."""
    before = serving.spec_counters(spec_server)
    serving.run_level_sync(spec_server, "tiny", PROMPTS[:2], 2, 9)
    after = serving.spec_counters(spec_server)
    acc = serving.acceptance(before, after)
    assert acc["acceptance_rate"] == pytest.approx(1.0)
    assert acc["mean_acceptance_length"] == pytest.approx(K + 1)
    assert serving.acceptance(None, after) == {"mean_acceptance_length": None, "acceptance_rate": None}


def test_served_model_is_the_first_listed(spec_server: str) -> None:
    """Requests carry the name the server lists, whatever it is."""
    assert serving.served_model(spec_server) == "tiny"


def _inputs(root: Path, **kw) -> PlanInputs:
    base = dict(
        target_dir=Path("/m/target"),
        draft_dir=Path("/m/draft"),
        target_gguf=Path("/g/target.gguf"),
        draft_gguf=Path("/g/draft.gguf"),
        k=4,
        max_concurrency=32,
        max_model_len=1024,
        threads=2,
        root=root,
    )
    return PlanInputs(**{**base, **kw})


def test_plans_run_each_method_for_every_peer_that_supports_it(tmp_path: Path) -> None:
    """Servers are started method by method (target, draft_model, ngram), peer by peer within a method;
    FLy shares flyspec's draft-model start as a second arm; llama.cpp has no ngram plan; vLLM gets its
    documented CPU set-up and no prefix caching; llama.cpp gets a fixed draft length and one slot per
    concurrent request."""
    plans = plan_servers(
        ("flyspec", "vllm", "llama.cpp"), ("target", "draft_model", "fly", "ngram"), _inputs(tmp_path)
    )
    assert [p.label for p in plans] == [
        "flyspec target", "vllm target", "llama.cpp target",
        "flyspec draft_model", "vllm draft_model", "llama.cpp draft_model",
        "flyspec ngram", "vllm ngram",
    ]  # fmt: skip
    by = {p.label: p for p in plans}
    fly = by["flyspec draft_model"]
    assert [a.name for a in fly.arms] == ["standard", "fly"]
    assert [a.extra_body for a in fly.arms] == [{"verification": "standard"}, {"verification": "fly"}]
    assert (
        json.loads(fly.argv[fly.argv.index("--speculative-config") + 1])["rejection_sample_method"] == "fly"
    )
    vllm = by["vllm draft_model"]
    assert (
        vllm.argv[0] == str(tmp_path / "vllm" / "bin" / "vllm") and "--no-enable-prefix-caching" in vllm.argv
    )
    spec = json.loads(vllm.argv[vllm.argv.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4}
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert vllm.argv[vllm.argv.index("--max-num-seqs") + 1] == "32"
    llama = list(by["llama.cpp draft_model"].argv)
    assert llama[llama.index("-np") + 1] == "32" and llama[llama.index("-c") + 1] == str(32 * 1024)
    assert (
        llama[llama.index("-md") + 1] == "/g/draft.gguf"
        and llama[llama.index("--spec-draft-n-max") + 1] == "4"
    )
    assert by["llama.cpp target"].arms[0].extra_body == {"cache_prompt": False}
    assert "GGUF" in by["llama.cpp target"].weights


def test_quantized_peers_are_flyspec_serve_with_quantized_weights(tmp_path: Path) -> None:
    """flyspec is the server with bf16 weights as loaded (--quantization none: the server's own default is
    auto); flyspec-int8, -int4 and -auto are the same command with that --quantization, labelled with
    their weight format, planned right after flyspec within each method."""
    peers = ("flyspec", "flyspec-int8", "flyspec-int4", "flyspec-auto")
    plans = plan_servers(peers, ("target", "draft_model"), _inputs(tmp_path))
    assert [p.label for p in plans] == [
        "flyspec target", "flyspec-int8 target", "flyspec-int4 target", "flyspec-auto target",
        "flyspec draft_model", "flyspec-int8 draft_model", "flyspec-int4 draft_model",
        "flyspec-auto draft_model",
    ]  # fmt: skip
    plain, int8, int4, auto = plans[:4]
    base = list(plain.argv[: plain.argv.index("--quantization")])
    assert list(plain.argv) == [*base, "--quantization", "none"]
    assert list(int8.argv) == [*base, "--quantization", "int8"]
    assert list(int4.argv) == [*base, "--quantization", "int4"]
    assert list(auto.argv) == [*base, "--quantization", "auto"]
    assert int8.weights.startswith("int8") and int4.weights.startswith("int4")
    assert auto.weights.startswith("the kernel check's choice") and plain.weights == "bfloat16 safetensors"
    for peer in peers:
        assert missing_peer(peer, tmp_path) is None


def test_fly_alone_plans_only_flyspecs_fly_arm(tmp_path: Path) -> None:
    """--methods fly: one flyspec start serving FLy only; the peers have no FLy to compare."""
    plans = plan_servers(("flyspec", "vllm", "llama.cpp"), ("fly",), _inputs(tmp_path))
    assert [(p.label, [a.name for a in p.arms]) for p in plans] == [("flyspec draft_model", ["fly"])]


def test_every_lossy_policy_is_served_the_second_on_a_start_of_its_own(tmp_path: Path) -> None:
    """Any registered lossy policy is a serving method: the first rides on flyspec's draft-model start
    beside standard verification, each further one gets its own draft-model start (one engine holds
    one policy), after the methods the peers share; the peers never run a lossy policy."""
    plans = plan_servers(("flyspec", "vllm"), ("draft_model", "typical", "fly"), _inputs(tmp_path))
    assert [(p.label, [a.name for a in p.arms]) for p in plans] == [
        ("flyspec draft_model", ["standard", "typical"]),
        ("vllm draft_model", ["standard"]),
        ("flyspec fly", ["fly"]),
    ]
    fly = plans[2]
    spec = json.loads(fly.argv[fly.argv.index("--speculative-config") + 1])
    assert spec == {"model": "/m/draft", "num_speculative_tokens": 4, "rejection_sample_method": "fly"}
    assert fly.arms[0].extra_body == {"verification": "fly"}


def test_missing_peer_line_says_how_to_install(tmp_path: Path) -> None:
    """A peer whose binary is absent is named with the path looked for and `make peers`; flyspec is
    always there; an executable at the expected path counts as installed."""
    assert missing_peer("flyspec", tmp_path) is None
    for peer in ("vllm", "llama.cpp"):
        line = missing_peer(peer, tmp_path)
        assert (
            line is not None and line.startswith(f"{peer}: skipped, not installed") and "make peers" in line
        )
    binary = tmp_path / "vllm" / "bin" / "vllm"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert missing_peer("vllm", tmp_path) is None


def test_cli_skips_uninstalled_peers_with_the_hint_and_stops_when_nothing_is_left(
    tiny_target: Path, tmp_path: Path
) -> None:
    """With no peer installed, asking for vLLM and llama.cpp prints one skip line each (stderr) and
    ends with a one-line error, not a traceback and not a fake result."""
    env = {**os.environ, "FLYSPEC_PEERS": str(tmp_path / "none")}
    cmd = [
        FLYSPEC,
        "bench-serve",
        "--peer",
        "vllm,llama.cpp",
        "--model",
        str(tiny_target),
        "--methods",
        "target",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["vllm", "llama.cpp"]
    assert all("make peers" in line for line in lines[:2])
    assert lines[-1] == "error: nothing to run: every requested peer was skipped (see above)"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: parse_names("--peer", "flyspec,sglang", ("flyspec", "vllm")),
            "'sglang' is not one of flyspec, vllm",
        ),
        (lambda: parse_levels("1,0"), "every level must be >= 1"),
        (lambda: parse_levels("1,x"), "must be a comma list of integers"),
    ],
)
def test_bad_options_name_the_option(call, message: str) -> None:
    """Option mistakes are ValueErrors that name the option and the rule."""
    with pytest.raises(ValueError, match=message):
        call()


def test_requests_per_level_fill_whole_waves() -> None:
    """Each level sends `waves` full waves, and at least `min_requests` requests (batch 1 too)."""
    assert [requests_for(c, 2, 8) for c in (1, 16, 32)] == [8, 32, 64]


def test_zoo_gguf_is_assembled_once_with_the_zoo_sha256(tmp_path: Path) -> None:
    """llama.cpp gets the zoo's GGUF file as shipped: the copy hashes to the zoo's sha256, and a second
    call reuses it instead of copying again."""
    entry = assets.ZOO["smollm2-135m-instruct"]
    path = assembled_gguf(entry.name, tmp_path)
    assert path == tmp_path / "gguf" / f"{entry.name}.gguf"
    assert assets.sha256_of([path]) == entry.sha256
    stamp = path.stat().st_mtime_ns
    assert assembled_gguf(entry.name, tmp_path) == path and path.stat().st_mtime_ns == stamp


def test_start_failure_reports_exit_code_and_log_tail(tmp_path: Path) -> None:
    """A server that dies before it is healthy is an error carrying its exit code and last log lines."""
    plan = ServerPlan(
        "flyspec",
        "target",
        "x",
        (ArmSpec("target"),),
        (sys.executable, "-c", "print('no weights here'); raise SystemExit(3)"),
    )
    with (
        pytest.raises(RuntimeError, match="exited with code 3") as info,
        start_server(plan, tmp_path / "s.log", 60),
    ):
        pass
    assert "no weights here" in str(info.value)


def test_tree_memory_counts_child_processes(tmp_path: Path) -> None:
    """The sampled peak covers the whole process tree: a child holding 200 MB is counted."""
    code = (
        "import subprocess, sys; "
        "subprocess.run([sys.executable, '-c', 'b = bytearray(200 << 20); import time; time.sleep(1.5)'])"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    memory = TreeMemory(proc.pid, interval_s=0.1)
    memory.start()
    proc.wait(timeout=30)
    memory.stop()
    assert memory.peak_rss > 200 << 20
    assert memory.peak_pss is None or memory.peak_pss > 200 << 20


def _row(peer: str, method: str, arm: str, c: int, tps: float) -> dict:
    keys = (
        "per_request_tokens_per_s",
        "ttft_mean_s",
        "ttft_p99_s",
        "itl_mean_s",
        "tpot_mean_s",
        "e2e_mean_s",
    )
    return {
        "peer": peer, "method": method, "arm": arm, "weights": "w", "concurrency": c, "tokens_per_s": tps,
        "short_requests": 0, "errors": 0, "mean_acceptance_length": None, **dict.fromkeys(keys, 1.0),
    }  # fmt: skip


def test_report_ratios_are_flyspec_over_the_peer_on_the_same_arm() -> None:
    """flyspec / this compares the same method, arm and concurrency; vs own target divides by the same
    server family's target-only; the Markdown carries both, the command and the skip lines."""
    rows = [
        _row("flyspec", "target", "target", 16, 30.0),
        _row("vllm", "target", "target", 16, 40.0),
        _row("flyspec", "draft_model", "standard", 16, 27.0),
        _row("flyspec", "draft_model", "fly", 16, 33.0),
        _row("vllm", "draft_model", "standard", 16, 45.0),
        _row("flyspec-int8", "target", "target", 16, 50.0),
        _row("flyspec-int4", "target", "target", 16, 20.0),
    ]
    assert flyspec_ratio(rows, rows[1], "tokens_per_s") == pytest.approx(0.75)
    assert flyspec_ratio(rows, rows[1], "tokens_per_s", "flyspec-int8") == pytest.approx(1.25)
    assert flyspec_ratio(rows, rows[1], "tokens_per_s", "flyspec-int4") == pytest.approx(0.5)
    assert flyspec_ratio(rows, rows[5], "tokens_per_s") is None  # our own int8 row has no ratio to us
    assert flyspec_ratio(rows, rows[4], "tokens_per_s") == pytest.approx(0.6)
    assert flyspec_ratio(rows, rows[0], "tokens_per_s") is None
    assert target_ratio(rows, rows[4]) == pytest.approx(45 / 40)
    assert target_ratio(rows, rows[3]) == pytest.approx(1.1)
    report = {
        "finished_at": "now",
        "command": ["flyspec", "bench-serve"],
        "machine": {"cpu": "cpu", "usable_cores": 2, "memory_gb": 24, "load_average_start": [0.1]},
        "settings": {"model": "m", "draft": "d", "k": 4, "num_prompts": 64, "dataset": "gsm8k",
                     "prompts_sha256": "ab" * 32, "max_tokens": 128, "concurrency": [16], "repeats": 1},
        "results": rows,
        "servers": [{"label": "vllm target", "weights": "w", "start_s": 150.0, "peak_rss_bytes": 9e9}],
        "skipped": ["llama.cpp: skipped, not installed: run `make peers`"],
    }  # fmt: skip
    md = render_markdown(report)
    # Columns: flyspec, -int8, -int4, -auto over this row, then over target-only.
    assert "| vllm (w) | standard | 16 | 45.00 | 0.60x | - | - | - | 1.12x |" in md
    assert "| vllm (w) | target | 16 | 40.00 | 0.75x | 1.25x | 0.50x | - | - |" in md
    assert "`flyspec bench-serve`" in md and "- llama.cpp: skipped" in md
    assert "| vllm target | w | 150 | 9.0 | - | ok |" in md


@pytest.mark.slow  # starts `flyspec serve` as a process: imports torch and loads a model, ~10 s
def test_cli_runs_flyspec_end_to_end_with_json_and_markdown(tiny_target: Path, tmp_path: Path) -> None:
    """`flyspec bench-serve --peer flyspec` starts the server itself, waits for it, measures two levels
    of real requests (every one exactly max_tokens long), records its start time and peak memory,
    stops it (no process left on the port), and writes JSON and Markdown from the same report."""
    out_json, out_md = tmp_path / "serve.json", tmp_path / "SERVE.md"
    env = {**os.environ, "FLYSPEC_PEERS": str(tmp_path / "peers")}
    cmd = [
        FLYSPEC, "bench-serve", "--peer", "flyspec", "--methods", "target", "--model", str(tiny_target),
        "--dtype", "float32", "--concurrency", "1,2", "--max-tokens", "5", "--min-requests", "2",
        "--warmup-tokens", "2", "--max-model-len", "256", "--json", str(out_json), "--markdown", str(out_md),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out_json.read_text())
    assert [(r["peer"], r["arm"], r["concurrency"]) for r in report["results"]] == [
        ("flyspec", "target", 1),
        ("flyspec", "target", 2),
    ]
    for row in report["results"]:
        assert (
            row["errors"] == 0 and row["short_requests"] == 0 and row["output_tokens"] == 5 * row["requests"]
        )
        assert row["tokens_per_s"] > 0 and row["ttft_mean_s"] > 0
    (server,) = report["servers"]
    assert "error" not in server and server["start_s"] > 0 and server["peak_rss_bytes"] > 100e6
    assert Path(server["log"]).is_file()
    port = int(Path(server["log"]).read_text().split("--port ")[1].split()[0])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    markdown = out_md.read_text()
    assert "## Serving" in markdown and "| flyspec (float32 safetensors) | target | 2 |" in markdown
    assert report["settings"]["requests_per_level"] == {"1": 2, "2": 4}

"""`flyspec serve` as a user runs it: a real process, a real port, logs, and a clean Ctrl-C shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_llm import save_tiny

FLYSPEC = str(Path(sys.executable).with_name("flyspec"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_logs_serves_and_stops(tmp_path: Path) -> None:
    """`flyspec serve` with a FLy config binds 127.0.0.1, logs the capacity line and the lossy warning,
    serves under the MODEL argument as name (default --served-model-name) behind --api-key, reports the
    lossy gauge, and exits 0 on SIGINT."""
    target = str(save_tiny(tmp_path / "target", seed=0))
    port = _free_port()
    spec = {"model": target, "num_speculative_tokens": 2, "rejection_sample_method": "fly"}
    cmd = [
        FLYSPEC,
        "serve",
        target,
        "--port",
        str(port),
        "--api-key",
        "k1",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--speculative-config",
        json.dumps(spec),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    log: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("Uvicorn running" in line for line in log):
            assert proc.poll() is None, "".join(log)
            assert time.monotonic() < deadline, "".join(log)
            with contextlib.suppress(queue.Empty):
                log.append(lines.get(timeout=1))
        text = "".join(log)
        assert "at most 4 of max_num_seqs=4 requests can run" in text
        assert "FLy verification is lossy" in text
        assert f"http://127.0.0.1:{port}" in text
        url = f"http://127.0.0.1:{port}"
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}).json()
        assert [m["id"] for m in models["data"]] == [target]
        assert httpx.get(f"{url}/v1/models").status_code == 401
        body = {"model": target, "prompt": "w1 w2", "max_tokens": 3}
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(f"{url}/metrics").text
        assert f'flyspec:lossy_verification_enabled{{model_name="{target}"}} 1.0' in metrics
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "num_speculative_tokens=0",
        ),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "fly": 1}'], "fly"),
        (["--port", "70000"], "--port=70000"),
        (["--log-level", "loud"], "--log-level='loud'"),
        (["--max-request-bytes", "0"], "--max-request-bytes=0"),
        (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes='lots'"),
        (["--request-read-timeout", "0"], "--request-read-timeout=0.0"),
        (["--grammar-timeout", "-1"], "--grammar-timeout=-1.0"),
    ],
)
def test_serve_config_mistakes_are_one_line_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    """Config mistakes exit with code 2 and one `error: ...` line naming the problem, before any model
    loads (the model path does not even exist)."""
    env = {k: v for k, v in os.environ.items() if k != "FLYSPEC_API_KEY"}  # a stray key must not interfere
    r = subprocess.run(
        [FLYSPEC, "serve", str(tmp_path / "absent"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_kv_cache_memory_takes_bytes_or_units() -> None:
    """--kv-cache-memory-bytes reads plain bytes and k/M/G/T units, decimal or with iB binary."""
    from flyspec.cli.options import parse_memory_bytes

    assert parse_memory_bytes(None) is None
    assert parse_memory_bytes("4294967296") == parse_memory_bytes("4GiB") == 4 * 2**30
    assert parse_memory_bytes("512M") == parse_memory_bytes("512MB") == 512 * 10**6
    assert parse_memory_bytes("1.5g") == 1_500_000_000
    with pytest.raises(ValueError, match="at least one byte"):
        parse_memory_bytes("0")


@contextlib.contextmanager
def _serving(args: list[str], timeout: float = 180) -> Iterator[tuple[str, list[str]]]:
    """Run `flyspec serve ARGS --port P` until the block ends; yields its URL and its log lines so far."""
    port = _free_port()
    proc = subprocess.Popen(
        [FLYSPEC, "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    log: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while not any("Uvicorn running" in line for line in log):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            with contextlib.suppress(queue.Empty):
                log.append(lines.get(timeout=1))
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # a fresh server process, 32 concurrent generations and a bounded schemathesis run
def test_serve_defaults_admit_32_concurrent_requests_and_pass_schemathesis(tmp_path: Path) -> None:
    """With the default --max-num-seqs and --max-num-batched-tokens (and K=4 speculation), 32 concurrent
    requests never wait for a slot: the admission cap is 64, and every one of the 32 gets a slot at the
    first step after it arrives. Then schemathesis fuzzes every operation of /openapi.json (bounded in
    examples and time): no server error, every status, content type and header documented, the error
    shape as declared, wrong methods answered 405 with Allow, a bad key 401.

    positive_data_acceptance is left out: the server refuses some schema-valid bodies on purpose (a model
    it does not serve, a prompt longer than max_model_len, fields not supported yet), each with a 400 the
    schema documents."""
    target = str(save_tiny(tmp_path / "target", seed=0))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    args = [target, "--api-key", "k", "--dtype", "float32", "--speculative-config", spec]
    headers = {"Authorization": "Bearer k"}
    with _serving(args) as (url, log):
        assert "at most 64 of max_num_seqs=64 requests can run" in "".join(log)
        assert (
            f'flyspec:max_running_requests{{model_name="{target}"}} 64.0' in httpx.get(f"{url}/metrics").text
        )
        body = {
            "model": target,
            "prompt": "w1 w2 w3",
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0.8,
        }
        with ThreadPoolExecutor(32) as pool:
            statuses = list(
                pool.map(
                    lambda i: (
                        httpx.post(
                            f"{url}/v1/completions", json={**body, "seed": i}, headers=headers, timeout=300
                        ).status_code
                    ),
                    range(32),
                )
            )
        assert statuses == [200] * 32
        samples = {
            s.name + json.dumps(s.labels, sort_keys=True): s.value
            for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            for s in family.samples
        }
        label = {"model_name": target}
        queue_count = samples["flyspec:request_queue_time_seconds_count" + json.dumps(label)]
        assert queue_count == 32
        # Admitted at the first step after arrival: queued no longer than one step of the batch.
        quick = samples[
            "flyspec:request_queue_time_seconds_bucket" + json.dumps({**label, "le": "1.0"}, sort_keys=True)
        ]
        assert quick == 32

        result = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "run",
                f"{url}/openapi.json",
                "-H",
                "Authorization: Bearer k",
                "--checks",
                "all",
                "--exclude-checks",
                "positive_data_acceptance",
                "--max-examples",
                "10",
                "--max-time",
                "40",
                "--seed",
                "19",
                "--workers",
                "1",
                "--generation-database",
                "none",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

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
from pathlib import Path

import httpx
import pytest
from tiny_llm import save_tiny

FLYSPEC = str(Path(sys.executable).with_name("flyspec"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a fresh process imports torch and loads two models: about 10 s on 2 shared cores
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
        assert "flyspec:lossy_verification_enabled 1.0" in httpx.get(f"{url}/metrics").text
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

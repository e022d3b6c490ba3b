"""`flyspec serve` as a background process for tests: a real server on a free loopback port, ready once
/health answers, stopped at the end (SIGTERM, then SIGKILL after 30 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flyspec.bench.peers import free_port, wait_ready

FLYSPEC = str(Path(sys.executable).parent / "flyspec")


def start(
    argv: Sequence[str],
    url: str,
    log: Path,
    *,
    timeout_s: float = 240,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """Start `argv` (a server listening at `url`) with its output in `log`, and wait until it answers
    /health; RuntimeError with the log's last lines when it exits first or is not ready in time."""
    with open(log, "w") as out:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, timeout_s, log)
    except RuntimeError:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it is still running after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def flyspec_serve(
    args: Sequence[str], log: Path, *, timeout_s: float = 240, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`flyspec serve ARGS --port P` until the block ends; yields its root URL once it is ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start([FLYSPEC, "serve", *args, "--port", str(port)], url, log, timeout_s=timeout_s, env=env)
    try:
        yield url
    finally:
        stop(proc)


def tiny_args(target: str, speculative_config: dict[str, Any] | None = None, name: str = "tiny") -> list[str]:
    """`flyspec serve` arguments for a tiny checkpoint: served as `name`, float32 (the checkpoints'
    dtype), 4 sequences at once, with `speculative_config` when given."""
    args = [target, "--served-model-name", name, "--dtype", "float32", "--max-num-seqs", "4"]
    return args + (["--speculative-config", json.dumps(speculative_config)] if speculative_config else [])

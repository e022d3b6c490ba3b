"""Every code block of README.md and docs/*.md runs, as a user would copy it (tests/doc_blocks.py finds the
blocks and holds the rules that adapt them).

- Python blocks run in a fresh interpreter, with the small zoo model where they name the Qwen pair and
  budgets of seconds (`max_tokens`, `max_questions`). A block must be self-contained: the docs define
  every name they use.
- Shell blocks run command by command through the real programs (`flyspec`, `python`, `pytest` and
  `lm_eval` of this interpreter's bin folder, `curl`), in a fresh folder that has the repository's
  Makefile, pyproject.toml, scripts/ and tests/ linked in, so what a command writes lands there.
  Endpoints the docs name (`http://gpu1:8000/v1`, `localhost:8000`) become one loopback `flyspec serve`
  of the small model with FLy over an n-gram drafter, shared by every block; a block's own
  `flyspec serve` line starts that server in the background on a free port, later lines of the block
  use it, and it is stopped at the block's end (it must still be alive then). The benchmark commands
  (`flyspec bench`, `flyspec bench-serve`) run on a tiny random-weight checkpoint made once per
  session: they show that every documented option runs end to end, not a speed. Files a command names
  that the block does not create (arms in base.json / fly.json, a judge dataset, lm-eval output
  folders) are made by FILES below with real content; the lm-eval folders by lm-eval itself against
  the shared server. `make X` runs as `make -n X`: the target exists and its recipe parses; running it
  would recurse into CI itself (`make test`) or take an hour (`make bench`, `make peers`).
- A command passes with exit code 0, or a non-zero code the docs promise for it (`gate report` exits 1
  on FAIL, 2 with --strict on INCONCLUSIVE) with no traceback. Anything else fails the test with the
  command as documented, as run, and its output. A block the harness cannot run fails with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import serve_process
from doc_blocks import (
    NOT_CODE,
    PORT,
    PYTHON,
    SERVER,
    SMALL_MODEL,
    TINY_MODEL,
    Block,
    DocBlockError,
    adapt,
    allowed_exit_codes,
    command_words,
    expand,
    find_blocks,
    shell_commands,
    substitute,
)
from lm_eval_tasks import generation_task
from zoo import zoo_model

from flyspec.bench.peers import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LINKED = ("Makefile", "pyproject.toml", "scripts", "tests")
COMMAND_TIMEOUT_S = 600
SERVER_START_S = 300
BLOCKS = find_blocks(REPO)
CODE_BLOCKS = [b for b in BLOCKS if not b.declared_not_code]


def _env(workdir: Path) -> dict[str, str]:
    """The environment of every command: this checkout's code and programs first, nothing downloaded,
    one thread per process (the tests' machine is shared), and no benchmark peers (vLLM, llama.cpp):
    `bench-serve` skips them with the command that installs them, as on a fresh clone."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(workdir / ".hf"),
        FLYSPEC_PEERS=str(workdir / ".peers"),
    )
    return env


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The loopback server that stands in for every endpoint the docs name: the small model with FLy
    over an n-gram drafter, so the `verification` of a request picks standard or FLy."""
    root = tmp_path_factory.mktemp("docs-server")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "fly"}
    args = [SMALL_MODEL, "--speculative-config", json.dumps(spec)]
    with serve_process.flyspec_serve(
        args, root / "serve.log", timeout_s=SERVER_START_S, env=_env(root)
    ) as url:
        yield url


# --- Files the docs' commands expect ------------------------------------------------------------------

ENGINE_ARM = {
    "kind": "engine",
    "model": SMALL_MODEL,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
}


# FLy at its most lenient (window 1, any entropy), so that some answers differ from the baseline's and
# what follows a difference (a judge's verdicts, lost and gained counts) runs too.
LENIENT_FLY = {"rejection_sample_method": "fly", "fly_window_size": 1, "fly_entropy_threshold": 0.0}


def _arm(verification: dict[str, object]) -> Callable[[Path, re.Match[str], str, dict[str, str]], None]:
    def write(path: Path, match: re.Match[str], server: str, env: dict[str, str]) -> None:
        spec = {**ENGINE_ARM["speculative_config"], **verification}
        path.write_text(json.dumps({**ENGINE_ARM, "speculative_config": spec}))

    return write


def _judge_questions(path: Path, match: re.Match[str], server: str, env: dict[str, str]) -> None:
    """Open-ended chat questions for the judge (grader `judge`)."""
    asks = ("What is a cache?", "Name a prime number.", "Say hello politely.", "Why is the sky blue?")
    rows = [
        {"id": f"chat-{i}", "messages": [{"role": "user", "content": ask}], "grader": "judge"}
        for i, ask in enumerate(asks)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# The answer is the last number of the output.
LAST_NUMBER = {
    "last-number": [{"function": "regex", "regex_pattern": r"(\d+)\D*$"}, {"function": "take_first"}]
}


def _lm_eval_log(path: Path, match: re.Match[str], server: str, env: dict[str, str]) -> None:
    """An lm-eval `--output_path` folder written by lm-eval itself: its local-completions client answers
    four arithmetic questions on the shared server, with lossless (`standard`) or FLy verification as
    the folder's name says (the request field `verification`, passed through generation_kwargs)."""
    tasks = path.parent / f".tasks-{path.name}"
    tasks.mkdir(parents=True)
    data = tasks / "arithmetic.jsonl"
    pairs = ((2, 3), (4, 4), (10, 7), (6, 1))
    data.write_text(
        "".join(
            json.dumps({"question": f"Q: What is {a} + {b}?\nA:", "answer": str(a + b)}) + "\n"
            for a, b in pairs
        )
    )
    task = generation_task(
        "arithmetic",
        data,
        until="\n",
        max_gen_toks=8,
        filters=LAST_NUMBER,
        generation={"verification": match.group(1)},
    )
    (tasks / "arithmetic.yaml").write_text(task)
    model_args = (
        f"base_url={server}/v1/completions,model={SMALL_MODEL},tokenizer={zoo_model(SMALL_MODEL)},"
        "tokenizer_backend=huggingface,tokenized_requests=False,max_retries=1"
    )
    argv = ["lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks", "arithmetic"]
    argv += ["--include_path", str(tasks), "--log_samples", "--output_path", str(path)]
    done = subprocess.run(argv, cwd=path.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"lm_eval for {path} failed:\n{done.stderr[-3000:]}"


# A path a command names (matched whole, a trailing slash ignored) -> how to make it when it is missing.
FILES: tuple[tuple[str, Callable[[Path, re.Match[str], str, dict[str, str]], None]], ...] = (
    (r"base\.json", _arm({"rejection_sample_method": "standard"})),
    (r"fly\.json", _arm(LENIENT_FLY)),
    (r"chats\.jsonl", _judge_questions),
    (r"lm-eval-out/(standard|fly)", _lm_eval_log),
)


# --- Running a block ----------------------------------------------------------------------------------


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else f"...{text[-n:]}"


def _report(what: str, argv: list[str], done: subprocess.CompletedProcess[str] | None = None) -> str:
    text = f"{what}\n  ran: {shlex.join(argv)}"
    if done is not None:
        errors = "".join(line for line in done.stderr.splitlines(True) if line.startswith("error:"))
        text += (
            f"\n  exit code {done.returncode}\n  stdout: {_tail(done.stdout)}\n  stderr: {_tail(done.stderr)}"
        )
        text += f"\n  {errors[:3000]}" if errors else ""
    return text


class ShellBlock:
    """Runs a shell block's commands in order, keeping its variables and its own servers."""

    def __init__(
        self, block: Block, workdir: Path, shared: Callable[[], str], tiny: Callable[[], str]
    ) -> None:
        self.block, self.workdir, self.shared, self.tiny = block, workdir, shared, tiny
        self.env = _env(workdir)
        self.variables: dict[str, str] = {}  # set by the block's own lines (`export KEY=...`)
        self.own_server: str | None = None
        self.servers: list[tuple[subprocess.Popen, Path]] = []

    def run(self) -> None:
        try:
            for argv in shell_commands(self.block.text):
                self.command(argv)
            for proc, log in self.servers:
                assert proc.poll() is None, f"the block's server exited early:\n{log.read_text()[-3000:]}"
        finally:
            for proc, _ in self.servers:
                serve_process.stop(proc)

    def server(self) -> str:
        return self.own_server or self.shared()

    def command(self, documented: list[str]) -> None:
        argv = [expand(token, self.variables) for token in documented]
        if argv[0] == "export":
            argv = argv[1:]
        n = 0  # leading NAME=VALUE words: for this command, or for the block when nothing follows
        while n < len(argv) and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[n]):
            n += 1
        assigned = dict(token.split("=", 1) for token in argv[:n])
        if n == len(argv):
            self.variables.update(assigned)
            return
        env = {**self.env, **self.variables, **assigned}
        argv = adapt(argv[n:])
        where = f"{self.block.where}: {shlex.join(documented)}"
        if command_words(argv).startswith("flyspec serve"):
            self.start_server(argv, env, where)
            return
        argv = [token.replace(SERVER, self.server()) if SERVER in token else token for token in argv]
        argv = [token.replace(TINY_MODEL, self.tiny()) if TINY_MODEL in token else token for token in argv]
        self.make_files(argv, env)
        start = time.monotonic()
        try:
            done = subprocess.run(
                argv, cwd=self.workdir, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
            )
        except FileNotFoundError:
            raise DocBlockError(_report(f"{where}\n  {argv[0]}: command not found", argv)) from None
        print(f"$ {shlex.join(argv)}\n{_tail(done.stdout, 1500)}")
        print(f"[exit code {done.returncode} after {time.monotonic() - start:.1f} s]")
        codes = allowed_exit_codes(argv)
        if done.returncode not in codes or (done.returncode and "Traceback (most recent" in done.stderr):
            raise AssertionError(_report(f"{where}\n  allowed exit codes {sorted(codes)}", argv, done))

    def start_server(self, argv: list[str], env: dict[str, str], where: str) -> None:
        port = free_port()
        argv = [token.replace(PORT, str(port)) for token in argv]
        log = self.workdir / f"serve-{port}.log"
        url = f"http://127.0.0.1:{port}"
        try:
            proc = serve_process.start(argv, url, log, timeout_s=SERVER_START_S, env=env, cwd=self.workdir)
        except RuntimeError as exc:
            raise AssertionError(_report(f"{where}\n  {exc}", argv)) from None
        self.servers.append((proc, log))
        self.own_server = url

    def make_files(self, argv: list[str], env: dict[str, str]) -> None:
        for token in argv:
            for pattern, make in FILES:
                match = re.fullmatch(pattern, token.rstrip("/"))
                if match and not (self.workdir / token).exists():
                    make(self.workdir / token, match, self.server(), env)


def _run_python(block: Block, workdir: Path, shared: Callable[[], str]) -> None:
    source = substitute(block.text)
    if SERVER in source:
        source = source.replace(SERVER, shared())
    (workdir / "block.py").write_text(source)
    argv = [sys.executable, "block.py"]
    done = subprocess.run(
        argv, cwd=workdir, env=_env(workdir), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    assert done.returncode == 0, _report(f"{block.where}: the Python block failed", argv, done)


@pytest.mark.slow
@pytest.mark.parametrize("block", CODE_BLOCKS, ids=[b.test_id for b in CODE_BLOCKS])
def test_doc_block_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The block runs as documented (module docstring): Python blocks exit 0; every shell command exits
    0 or with a code the docs promise for it; a block's server stays up until its end."""
    zoo_model(SMALL_MODEL)
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)

    def shared() -> str:
        return request.getfixturevalue("shared_server")

    def tiny() -> str:
        return request.getfixturevalue("tiny_models").get(seed=0, max_position_embeddings=1024)

    if block.kind == PYTHON:
        _run_python(block, tmp_path, shared)
    else:
        ShellBlock(block, tmp_path, shared, tiny).run()


# --- The harness itself (fast) ------------------------------------------------------------------------


def test_every_block_is_code_or_declared_text() -> None:
    """Each block of the docs is Python, shell commands the harness can run, or declared non-code by its
    info string; none is left out silently (the slow test runs every code block)."""
    problems = []
    for block in CODE_BLOCKS:
        try:
            if block.kind != PYTHON and not shell_commands(block.text):
                problems.append(f"{block.where}: a shell block without a command")
        except DocBlockError as exc:
            problems.append(str(exc))
    assert not problems, "\n".join(problems)
    assert len(CODE_BLOCKS) > 10 and all(b.kind == NOT_CODE for b in BLOCKS if b.declared_not_code)


def test_shell_commands_read_as_bash_reads_them() -> None:
    """Backslash-newline joins lines, an open quote continues on the next line (a JSON argument written
    over two lines), comments go; a pipe, `&&` or `$(...)` is refused with the reason."""
    text = (
        "# a comment\n"
        "flyspec serve m --port 8000 \\\n"
        '    --speculative-config \'{"a": 1,\n'
        '                           "b": 2}\'  # trailing\n'
        "curl -s localhost:8000/v1/models\n"
    )
    assert shell_commands(text) == [
        [
            "flyspec",
            "serve",
            "m",
            "--port",
            "8000",
            "--speculative-config",
            '{"a": 1,\n                           "b": 2}',
        ],
        ["curl", "-s", "localhost:8000/v1/models"],
    ]
    for bad in ("flyspec models list | head", "make a && make b", "echo $(whoami)", "flyspec x > out"):
        with pytest.raises(DocBlockError, match="shell syntax"):
            shell_commands(bad)
    with pytest.raises(DocBlockError, match=r"\$KEY is used but never set"):
        expand("$KEY", {})


def test_rules_adapt_commands() -> None:
    """The rules: the Qwen pair and remote endpoints are replaced, a budget flag is lowered where given
    and added where a default would run long, `make` only plans; a gate command's documented exit codes
    are allowed, another command's are not."""
    argv = adapt(
        shlex.split(
            "flyspec gate pilot --store g.db --dataset gsm8k --limit 200 --baseline "
            '\'{"base_urls": ["http://gpu1:8000/v1"], "model": "qwen"}\''
        )
    )
    assert argv[argv.index("--limit") + 1] == "4" and "--max-questions" not in argv
    assert argv[argv.index("--max-tokens") + 1] == "8"
    assert json.loads(argv[argv.index("--baseline") + 1]) == {
        "base_urls": [f"{SERVER}/v1"],
        "model": SMALL_MODEL,
    }
    assert adapt(["flyspec", "generate", "qwen2.5-coder-1.5b-instruct", "hi"])[2] == SMALL_MODEL
    assert adapt(["flyspec", "serve", "x"])[-2:] == ["--port", PORT]
    assert adapt(["make", "test"]) == ["make", "-n", "test"]
    bench = adapt(["flyspec", "bench-serve", "--concurrency", "1,16,32"])
    assert bench[bench.index("--concurrency") + 1] == "1" and bench[bench.index("--model") + 1] == TINY_MODEL
    assert allowed_exit_codes(["flyspec", "gate", "report", "--store", "g.db"]) == {0, 1}
    assert allowed_exit_codes(["flyspec", "gate", "compare", "a", "b", "--strict"]) == {0, 1, 2}
    assert allowed_exit_codes(["flyspec", "gate", "pilot"]) == {0}
    assert substitute('LLM(model="qwen2.5-coder-0.5b-instruct"); SamplingParams(max_tokens=64)') == (
        f'LLM(model="{SMALL_MODEL}"); SamplingParams(max_tokens=16)'
    )

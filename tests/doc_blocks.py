"""The code blocks of README.md and docs/*.md, and the rules that make each one runnable here.

Read by tests/test_docs.py. A block is found with a CommonMark parser (markdown-it-py), fenced or
indented. Its info string says what it is: `python`, a shell (`bash`, `sh`, `shell`, or none at all), or
not code (`text`, `json`). Anything else fails loudly, as does a shell line the harness cannot run as one
plain command (a pipe, a redirection, command substitution).

The docs name the real models and machines (the Qwen pair, `http://gpu1:8000/v1`, budgets of hours).
The rules below, regular expressions and flag settings rather than per-block edits, turn them into the
small zoo model (a tiny random checkpoint for the benchmarks), a loopback server, and budgets of
seconds, so a block added tomorrow runs without a change here as long as it names things the rules
know; one that names something new fails, naming it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from markdown_it import MarkdownIt

SMALL_MODEL = "smollm2-135m-instruct"
SERVER = "{server}"  # a loopback server's root URL, filled in when the command runs
PORT = "{port}"  # the port a block's own `flyspec serve` listens on
# A tiny random-weight checkpoint folder (tests/tiny_llm.py), filled in when the command runs: the
# benchmarks' blocks measure nothing here, they show that every documented option runs end to end, and
# each of their server starts on the small zoo model cost seconds of loading and quantizing.
TINY_MODEL = "{tiny_model}"

PYTHON = "python"
SHELL = "shell"
NOT_CODE = "text"
# An info string's first word -> what the block is; a plain ``` fence or an indented block is a shell.
KINDS = {"python": PYTHON, "bash": SHELL, "sh": SHELL, "shell": SHELL, "": SHELL}
KINDS |= {"text": NOT_CODE, "json": NOT_CODE}


class DocBlockError(Exception):
    """A block the harness cannot run, with the reason."""


@dataclass(frozen=True)
class Block:
    """One code block: its file (relative to the repository), the line of its first text line, its
    info string ('' for an indented block) and its text."""

    file: str
    line: int
    info: str
    text: str
    index: int

    @property
    def language(self) -> str:
        """The info string's first word, lower case ('' when there is none)."""
        return self.info.split()[0].lower() if self.info.strip() else ""

    @property
    def declared_not_code(self) -> bool:
        """Declared text by its info string (```text, ```json): not run."""
        return KINDS.get(self.language) == NOT_CODE

    @property
    def kind(self) -> str:
        """PYTHON, SHELL or NOT_CODE; DocBlockError for an info string the harness does not know."""
        if self.language not in KINDS:
            raise DocBlockError(
                f"{self.where}: ```{self.language} is neither code the harness runs (python, bash) nor "
                f"declared non-code ({', '.join(k for k, v in KINDS.items() if v == NOT_CODE)})"
            )
        return KINDS[self.language]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def test_id(self) -> str:
        """file:index:Lline:first-words, e.g. README.md:1:L64:from_flyspec_import_LLM (a `-k` expression)."""
        first = next((s for s in self.text.splitlines() if s.strip()), "")
        words = re.sub(r"[^A-Za-z0-9.]+", "_", first).strip("_")[:48]
        return f"{self.file}:{self.index}:L{self.line}:{words}"


def doc_files(root: Path) -> list[Path]:
    """README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def find_blocks(root: Path) -> list[Block]:
    """Every code block of the documentation, in file order."""
    parser = MarkdownIt("commonmark")
    blocks = []
    for path in doc_files(root):
        index = 0
        for token in parser.parse(path.read_text(encoding="utf-8")):
            if token.type in ("fence", "code_block") and token.map is not None:
                line = token.map[0] + (2 if token.type == "fence" else 1)
                rel = path.relative_to(root).as_posix()
                blocks.append(Block(rel, line, token.info.strip(), token.content, index))
                index += 1
    return blocks


# --- Shell blocks: commands as bash would read them -----------------------------------------------------

OPERATORS = set("();<>|&")


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block as argument lists: a backslash-newline joins lines, a quote left open
    continues on the next line (as bash reads them), comments are dropped. DocBlockError for shell syntax
    beyond one plain command per line (pipes, redirections, `&&`, subshells, command substitution)."""
    commands, pending = [], ""
    for line in text.splitlines():
        pending += line + "\n"
        if pending.endswith("\\\n"):
            pending = pending[:-2]
            continue
        try:
            argv = _split(pending)
        except ValueError:  # an open quote: the command continues on the next line
            continue
        _check_plain(pending, argv)
        if argv:
            commands.append(argv)
        pending = ""
    if pending.strip():
        raise DocBlockError(f"unterminated command (an open quote?): {pending.strip()!r}")
    return commands


def _split(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _check_plain(line: str, argv: list[str]) -> None:
    for token in argv:
        if set(token) <= OPERATORS or "$(" in token or "`" in token:
            raise DocBlockError(
                f"{line.strip()!r}: {token!r} is shell syntax the harness does not run; write one plain "
                "command per line"
            )


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand(token: str, variables: dict[str, str]) -> str:
    """`$NAME` and `${NAME}` from the block's own assignments; DocBlockError for one it never set."""

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise DocBlockError(
                f"${name} is used but never set in the block: set it there (export {name}=...)"
            )
        return variables[name]

    return _VARIABLE.sub(value, token)


# --- The rules ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Replace `pattern` by `replacement` in a shell token or in Python source."""

    pattern: str
    replacement: str
    why: str

    def apply(self, text: str) -> str:
        return re.sub(self.pattern, self.replacement, text)


TEXT_RULES = (
    Rule(r"qwen2\.5-coder-(?:1\.5b|0\.5b)-instruct", SMALL_MODEL, "the Qwen pair -> the small zoo model"),
    Rule(r'"model": "(?:qwen|judge-model)"', f'"model": "{SMALL_MODEL}"', "served model names -> ours"),
    Rule(
        r"(?:https?://)?(?:localhost|127\.0\.0\.1|gpu\d+|judge-host):8000",
        SERVER,
        "remote endpoints -> the loopback server",
    ),
    Rule(r"^\.venv/bin/", "", "the Makefile's venv -> this interpreter's bin folder (first on PATH)"),
    Rule(r'"max_questions": \d+', '"max_questions": 4', "gate budgets in Python -> seconds"),
    Rule(r'"max_tokens": \d+', '"max_tokens": 16', "answer lengths -> a few tokens"),
    Rule(r"\bmax_tokens=\d+", "max_tokens=16", "answer lengths -> a few tokens"),
)


def substitute(text: str) -> str:
    """`text` with every TEXT_RULES rule applied."""
    for rule in TEXT_RULES:
        text = rule.apply(text)
    return text


@dataclass(frozen=True)
class Flag:
    """For commands whose leading words match `command`: set `flag` to `value` where it is given; with
    `add`, also where it is not (unless one of `unless` is)."""

    command: str
    flag: str
    value: str
    add: bool = False
    unless: tuple[str, ...] = ()

    def apply(self, argv: list[str]) -> list[str]:
        if not re.match(self.command + r"(\s|$)", command_words(argv)):
            return argv
        out = list(argv)
        for i, token in enumerate(out):
            if token == self.flag:
                out[i + 1 : i + 2] = [self.value]
                return out
            if token.startswith(self.flag + "="):
                out[i] = f"{self.flag}={self.value}"
                return out
        if self.add and not any(t == u or t.startswith(u + "=") for t in out for u in self.unless):
            out += [self.flag, self.value]
        return out


def command_words(argv: list[str]) -> str:
    """The leading words of a command before its first option: 'flyspec gate run'."""
    words = []
    for token in argv:
        if token.startswith("-"):
            break
        words.append(token)
    return " ".join(words)


GATE = r"flyspec gate (?:run|pilot|tune)"
BENCH = r"flyspec bench"
SERVE_BENCH = r"flyspec bench-serve"
BENCH_SCRIPT = r"python scripts/bench_policies\.py"
# Per command: flag -> value, set where the flag is given and added where it is not (budgets of hours ->
# seconds, and the small models where a command's default is the Qwen pair); GIVEN_ONLY flags are only
# lowered where given (the command's default is already small). Applied in this order.
TINY_PAIR = {"--model": TINY_MODEL, "--draft": TINY_MODEL}
FEW_TOKENS = {"--max-tokens": "8", "--warmup-tokens": "4"}
BUDGETS = {
    GATE: {"--max-tokens": "8", "--max-questions": "4", "--limit": "4", "--max-minutes": "5"},
    # each of up to 12 settings answers the questions
    r"flyspec gate tune": {"--max-questions": "2", "--calibration-questions": "1"},
    r"flyspec generate": {"--max-tokens": "16"},
    r"flyspec serve": {"--port": PORT},  # a block's own server: a free loopback port
    BENCH: {**TINY_PAIR, **FEW_TOKENS, "--batch-sizes": "1", "--num-prompts": "2"},
    SERVE_BENCH: {**TINY_PAIR, **FEW_TOKENS, "--concurrency": "1", "--waves": "1", "--min-requests": "1"},
    BENCH_SCRIPT: {
        "--target": SMALL_MODEL,
        "--draft": SMALL_MODEL,
        "--batch-sizes": "1",
        "--num-prompts": "2",
        "--max-tokens": "8",
        "--repeats": "1",
        "--questions": "1",
        "--gate-max-tokens": "8",
    },
}
GIVEN_ONLY = {
    (GATE, "--limit"),
    (GATE, "--max-minutes"),
    (BENCH, "--batch-sizes"),
    (SERVE_BENCH, "--concurrency"),
}
FLAGS = tuple(
    Flag(command, flag, value, (command, flag) not in GIVEN_ONLY, ("--limit",) * (flag == "--max-questions"))
    for command, flags in BUDGETS.items()
    for flag, value in flags.items()
)

# Programs whose run is replaced: `make X` only plans the recipe (running it would recurse into CI or a
# 40-minute benchmark); curl fails on an HTTP error status instead of printing the error body.
PROGRAMS = {"make": ["make", "-n"], "curl": ["curl", "--fail-with-body", "--show-error"]}


@dataclass(frozen=True)
class ExitCodes:
    """Non-zero exit codes the docs promise for a command: `codes` always, `strict` with --strict."""

    command: str
    codes: frozenset[int]
    strict: frozenset[int] = field(default_factory=frozenset)
    why: str = ""


EXIT_CODES = (
    ExitCodes(
        r"flyspec gate (?:run|compare|tune|report)",
        frozenset({1}),
        frozenset({2}),
        "README: 0 PASS, 1 FAIL (tune: no setting passed), 2 INCONCLUSIVE with --strict",
    ),
)


def allowed_exit_codes(argv: list[str]) -> set[int]:
    """0, and the non-zero codes the docs promise for this command."""
    codes = {0}
    for rule in EXIT_CODES:
        if re.match(rule.command + r"(\s|$)", command_words(argv)):
            codes |= rule.codes | (rule.strict if "--strict" in argv else set())
    return codes


def adapt(argv: list[str]) -> list[str]:
    """A documented command as the harness runs it: TEXT_RULES on every token, then FLAGS, then
    PROGRAMS (placeholders SERVER and PORT are filled in by the runner)."""
    out = [substitute(token) for token in argv]
    for flag in FLAGS:
        out = flag.apply(out)
    if out and out[0] in PROGRAMS:
        out = PROGRAMS[out[0]] + out[1:]
    return out

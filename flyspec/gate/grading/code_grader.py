"""Code answers: what a coding question's reference holds, how the program is taken from a model's output,
and how it is put together with the tests before ``flyspec.gate.grading.code_exec`` runs it.

The reference answer of a ``code`` question is a JSON object (``CodeTask``), so it travels through the
gate store like any other reference string:

- ``tests``: code that raises (an ``assert``) when the program is wrong; for HumanEval its ``check``
  function followed by ``check(entry_point)``, for MBPP the setup code and the ``assert`` lines;
- ``entry_point``: the function under test, used to pick the right code block (may be null);
- ``prefix``: code placed before the model's (HumanEval's prompt: its imports, helper functions and the
  function's stub), so that a model that answers with only the function still has the helpers, and a
  model that continues the stub (completion style) gets the signature.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import asdict, dataclass

from flyspec.gate.grading.code_exec import CodeRun

_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}
# A fence opens at the start of a line (models indent fences inside lists) and closes at a line holding
# only backticks, or at the end of a truncated output.
_FENCE = re.compile(
    r"^[ \t]*```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL
)
_CODE_START = re.compile(r"^(?:import |from |def |class |@|async def )", re.MULTILINE)


@dataclass(frozen=True)
class CodeTask:
    """The reference of a code question: the tests, the function under test and the code before it."""

    tests: str
    entry_point: str | None = None
    prefix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tests, str) or not self.tests.strip():
            raise ValueError("code answer: 'tests' must be a non-empty string of Python test code")
        if self.entry_point is not None and (
            not isinstance(self.entry_point, str) or not self.entry_point.isidentifier()
        ):
            raise ValueError(
                f"code answer: 'entry_point'={self.entry_point!r} must be a Python function name or null"
            )
        if not isinstance(self.prefix, str):
            raise ValueError("code answer: 'prefix' must be a string (code placed before the model's)")

    def to_answer(self) -> str:
        """The canonical JSON string stored as the question's reference answer."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_answer(cls, answer: str | dict[str, object]) -> CodeTask:
        """Parse a reference answer (JSON text or an already-parsed object); ValueError names the problem."""
        if isinstance(answer, str):
            try:
                answer = json.loads(answer)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"code answer: must be a JSON object with 'tests' (and optional 'entry_point', "
                    f"'prefix'); it is not JSON ({exc.msg})"
                ) from None
        if not isinstance(answer, dict):
            raise ValueError(f"code answer: must be an object with 'tests', got {type(answer).__name__}")
        unknown = set(answer) - {"tests", "entry_point", "prefix"}
        if unknown:
            raise ValueError(f"code answer: unknown field(s) {', '.join(sorted(unknown))}")
        if "tests" not in answer:
            raise ValueError("code answer: 'tests' is missing")
        return cls(answer["tests"], answer.get("entry_point"), answer.get("prefix", ""))  # type: ignore[arg-type]


def _defines(code: str, entry_point: str) -> bool:
    pattern = rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\("
    return re.search(pattern, code, re.MULTILINE) is not None


def _compiles(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def extract_code(output: str, entry_point: str | None = None) -> str:
    """The program in a model's output.

    With markdown fences: among the Python (or untagged) blocks, the last one that defines
    ``entry_point``; else the only block; else all of them joined. Without fences: the output itself, or,
    when it does not parse, the text from its first ``import``/``from``/``def``/``class`` line on (prose
    before the code dropped).
    """
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(output)]
    if blocks:
        python = [body for tag, body in blocks if tag in _PYTHON_TAGS] or [body for _, body in blocks]
        if entry_point is not None:
            defining = [body for body in python if _defines(body, entry_point)]
            if defining:
                return defining[-1]
        return python[0] if len(python) == 1 else "\n\n".join(python)
    if _compiles(output):
        return output
    start = _CODE_START.search(output)
    return output[start.start() :] if start else output


def build_run(code: str, task: CodeTask) -> CodeRun:
    """What the sandbox runs: the program (``prefix`` then the candidate's code) and the tests.

    Code that defines the entry point is a whole function and goes after the prefix (overriding its
    stub); anything else continues the prefix directly (a completion of the stub's body). The tests run
    apart from the program, with the prefix's own definitions and the program's entry point
    (flyspec/gate/grading/code_exec.py).
    """
    if task.entry_point is not None and not _defines(code, task.entry_point):
        program = task.prefix + code
    else:
        program = f"{task.prefix}\n\n{code}" if task.prefix else code
    return CodeRun(program, task.tests, task.prefix, task.entry_point)

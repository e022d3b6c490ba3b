"""The gate's questions: the Question record, reading dataset files row by row (JSONL, gzipped too, a JSON
list or a CSV with a header, every problem one ValueError naming the file and line), and the seeded order a
run answers them in (docs/gate.md, "Which questions, in which order": any prefix of it is a simple random
sample of the registered questions, the same on every machine)."""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

QuestionKey = tuple[str, str]
Row = dict[str, object]
"""One row of a dataset file: a JSON object, or a CSV row by its header's names."""


@dataclass(frozen=True)
class Question:
    """One gate question: exactly one of ``prompt`` (plain text) or ``messages`` (chat) is set.

    ``answer`` is the reference as the grader reads it: a number or string, a ``code`` question's JSON
    tests (``flyspec.gate.grading.code_exec.CodeTask``), or empty for ``equivalent_to_baseline``.
    """

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


def text_field(row: Row, names: tuple[str, ...], where: str, what: str) -> str:
    """The first of ``names`` (any letter case) with a non-blank value, as text (a number is accepted);
    ValueError naming ``what``."""
    lowered = {str(k).lower(): v for k, v in row.items()}
    value = next((v for n in names if (v := lowered.get(n.lower())) is not None and str(v).strip()), None)
    if value is None:
        raise ValueError(f"{where}: row has no {what} (looked for {', '.join(names)})")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{where}: {what} must be text, got {type(value).__name__} {value!r:.60}")
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
    """The run's questions in the order they are answered.

    ``excluded`` (dataset, id) pairs are dropped first; ``limit`` keeps the first N of each dataset's
    order; ``max_questions`` keeps the first N of the interleaved order. ValueError when a dataset has
    no question left or fewer questions remain than ``max_questions`` asks for.
    """
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

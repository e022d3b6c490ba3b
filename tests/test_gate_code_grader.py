"""Code graded by execution: HumanEval's own canonical solutions pass and broken ones fail, the program is
found in a model's markdown, MBPP files load and grade, and bad code references are refused."""

from __future__ import annotations

import ast
import gzip
import json
import time
from pathlib import Path

import pytest

from flyspec.gate.data.questions import dataset_info, load_dataset
from flyspec.gate.grading.code_exec import CodeRun, CodeTask, SandboxLimits, build_run, extract_code, run_many
from flyspec.gate.grading.graders import check_reference, grade

# Generous wall clock (the machine may be busy), short CPU limit (a corrupted solution may loop).
LIMITS = SandboxLimits(timeout_s=30, cpu_s=4)
# Problems whose prompt carries helper functions or imports the answer needs, plus a spread of others.
SAMPLE = ("HumanEval/0", "HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/50", "HumanEval/163")


def _raw_rows() -> dict[str, dict[str, str]]:
    with gzip.open(dataset_info("humaneval").path, "rt", encoding="utf-8") as handle:
        return {row["task_id"]: row for row in map(json.loads, handle)}


class _ReturnNone(ast.NodeTransformer):
    def visit_Return(self, node: ast.Return) -> ast.Return:
        return ast.copy_location(ast.Return(value=ast.Constant(None)), node)


def _as_chat_answer(code: str) -> str:
    return f"Here is the implementation:\n\n```python\n{code}\n```\n\nIt runs in linear time."


def _canonical_and_corrupted(ids: list[str] | None) -> tuple[list[str], list[CodeRun], list[CodeRun]]:
    """Programs for each question: the canonical body as a completion, and the whole function with every
    `return` made `return None`, written the way a chat model answers (a fenced block after prose)."""
    rows = _raw_rows()
    questions = [q for q in load_dataset("humaneval") if ids is None or q.id in ids]
    good, bad = [], []
    for q in questions:
        task = CodeTask.from_answer(q.answer)
        row = rows[q.id]
        good.append(build_run(extract_code(row["canonical_solution"], task.entry_point), task))
        broken = ast.unparse(_ReturnNone().visit(ast.parse(row["prompt"] + row["canonical_solution"])))
        bad.append(build_run(extract_code(_as_chat_answer(broken), task.entry_point), task))
    return [q.id for q in questions], good, bad


def test_humaneval_dataset_shape() -> None:
    """164 chat questions whose prompt shows the function stub in a python fence, whose reference holds
    the tests ending in check(entry_point) and the prompt as prefix, with distinct prompt hashes."""
    questions = load_dataset("humaneval")
    assert len(questions) == 164 and questions[0].id == "HumanEval/0" and questions[0].dataset == "humaneval"
    rows = _raw_rows()
    for q in questions:
        task = CodeTask.from_answer(q.answer)
        assert q.grader == "code" and task.entry_point == rows[q.id]["entry_point"] == q.meta["entry_point"]
        assert task.prefix == rows[q.id]["prompt"] and task.tests.endswith(f"check({task.entry_point})")
        content = q.messages[0]["content"]  # type: ignore[index]
        assert "```python\n" in content and rows[q.id]["prompt"].strip() in content
        check_reference(q.grader, q.answer)
    assert len({q.prompt_hash for q in questions}) == 164


def test_humaneval_sample_canonical_pass_corrupted_fail() -> None:
    """Fast version of the full check: on six problems (helpers in the prompt included), canonical
    solutions grade right and return-None corruptions grade wrong."""
    ids, good, bad = _canonical_and_corrupted(list(SAMPLE))
    results = run_many(good + bad, LIMITS, workers=2)
    assert [r.passed for r in results[: len(ids)]] == [True] * len(ids), results
    assert [r.passed for r in results[len(ids) :]] == [False] * len(ids)


@pytest.mark.slow
def test_humaneval_all_164_canonical_pass_and_corrupted_fail() -> None:
    """All 164 canonical solutions grade right; all 164 with every `return` replaced by `return None`
    grade wrong (one of them, prime_fib, then loops and is stopped by the CPU limit)."""
    ids, good, bad = _canonical_and_corrupted(None)
    start = time.monotonic()
    passed = run_many(good, LIMITS)
    canonical_s = time.monotonic() - start
    failed = run_many(bad, LIMITS)
    print(
        f"164 canonical: {canonical_s:.1f} s; 164 corrupted: {time.monotonic() - start - canonical_s:.1f} s"
    )
    assert [i for i, r in zip(ids, passed, strict=True) if not r.passed] == []
    assert [i for i, r in zip(ids, failed, strict=True) if r.passed] == []


def test_grade_code_end_to_end_on_model_style_answers() -> None:
    """Through grade('code', ...): a chat answer with only decode_cyclic (its helper encode_cyclic lives
    in the prompt) is right; the same answer with a bug is wrong with the assertion as detail; an
    answer with no code is wrong; the same output always gets the same grade."""
    question = next(q for q in load_dataset("humaneval") if q.id == "HumanEval/38")
    right = _as_chat_answer("def decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))")
    wrong = _as_chat_answer("def decode_cyclic(s: str):\n    return encode_cyclic(s)")
    first = grade("code", right, question.answer)
    assert first.correct and first.extracted is not None and first.extracted.startswith("def decode_cyclic")
    assert first.detail == "passed"
    bad = grade("code", wrong, question.answer)
    assert not bad.correct and bad.detail is not None and bad.detail.startswith("failed")
    assert not grade("code", "I am not able to help with that.", question.answer).correct
    assert grade("code", right, question.answer) == first


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("```python\ndef f(x):\n    return x\n```", "def f(x):\n    return x\n"),
        ("Sure!\n```py\ndef f(x):\n    return x\n```\nDone.", "def f(x):\n    return x\n"),
        # the block that defines the entry point wins over an example-usage block
        (
            "```python\ndef f(x):\n    return 1\n```\nUsage:\n```python\nprint(f(2))\n```",
            "def f(x):\n    return 1\n",
        ),
        # a later corrected version wins over the first attempt
        (
            "```python\ndef f(x):\n    return 1\n```\nBetter:\n```python\ndef f(x):\n    return 2\n```",
            "def f(x):\n    return 2\n",
        ),
        # shell blocks are not the program
        ("```bash\npip install x\n```\n```python\ndef f(x):\n    return 3\n```", "def f(x):\n    return 3\n"),
        # a truncated answer: the fence never closes
        ("```python\ndef f(x):\n    return 4", "def f(x):\n    return 4"),
        # raw code, and prose before raw code
        ("def f(x):\n    return 5\n", "def f(x):\n    return 5\n"),
        ("Here it is:\ndef f(x):\n    return 6\n", "def f(x):\n    return 6\n"),
        # a completion of the stub's body stays as it is
        ("    return x * 2\n", "    return x * 2\n"),
    ],
)
def test_extract_code(output: str, expected: str) -> None:
    """The program is the right fenced block (python or untagged, the one defining the entry point, the
    last such), an unclosed fence's rest, or the raw text without leading prose."""
    assert extract_code(output, "f") == expected


def test_build_run_whole_function_or_completion() -> None:
    """A whole function goes after the prefix (overriding its stub); a body continues the stub; the tests
    and the prefix go to the harness, apart from the program."""
    task = CodeTask(tests="assert f(2) == 4", entry_point="f", prefix='def f(x):\n    """Double."""\n')
    whole = build_run("def f(x):\n    return 2 * x\n", task)
    body = build_run("    return 2 * x\n", task)
    assert whole.program.index('"""Double."""') < whole.program.index("return 2 * x")
    assert body.program.startswith('def f(x):\n    """Double."""\n    return 2 * x')
    assert (whole.tests, whole.prefix, whole.entry_point) == ("assert f(2) == 4", task.prefix, "f")
    assert "assert" not in whole.program
    results = run_many([whole, body, build_run("    return x\n", task)], LIMITS, workers=2)
    assert [r.passed for r in results] == [True, True, False]


def _mbpp_rows() -> list[dict[str, object]]:
    return [
        {
            "task_id": 11,
            "text": "Write a python function to remove the first and last occurrence of a given character.",
            "code": "def remove_Occ(s, ch):\n    i = s.find(ch)\n    j = s.rfind(ch)\n"
            "    if i == -1:\n        return s\n    if i == j:\n        return s[:i] + s[i + 1:]\n"
            "    return s[:i] + s[i + 1:j] + s[j + 1:]",
            "test_list": [
                'assert remove_Occ("hello","l") == "heo"',
                'assert remove_Occ("abcda","a") == "bcd"',
                'assert remove_Occ("PHP","P") == "H"',
            ],
            "test_setup_code": "",
            "challenge_test_list": [],
        },
        {
            "task_id": 12,
            "text": "Write a function to compute the hypotenuse.",
            "code": "import math\ndef hyp(a, b):\n    return math.hypot(a, b)",
            "test_list": ["assert math.isclose(hyp(3, 4), 5.0)"],
            "test_setup_code": "import math",
            "challenge_test_list": [],
        },
    ]


def test_mbpp_jsonl_and_sanitized_json(tmp_path: Path) -> None:
    """MBPP's mbpp.jsonl (text, test_setup_code) and sanitized-mbpp.json (prompt, test_imports) load as
    code questions whose prompt shows the tests; the entry point comes from the reference code even
    when a test wraps the call (math.isclose); reference code grades right, a wrong body wrong."""
    rows = _mbpp_rows()
    jsonl = tmp_path / "mbpp.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sanitized = [
        {
            "source_file": "x",
            "task_id": r["task_id"],
            "prompt": r["text"],
            "code": r["code"],
            "test_imports": [r["test_setup_code"]] if r["test_setup_code"] else [],
            "test_list": r["test_list"],
        }
        for r in rows
    ]
    json_path = tmp_path / "sanitized-mbpp.json"
    json_path.write_text(json.dumps(sanitized, indent=2))
    for spec, name in ((f"mbpp:{jsonl}", "mbpp"), (f"mbpp:{json_path}", "sanitized-mbpp")):
        questions = load_dataset(spec)
        assert [q.id for q in questions] == ["11", "12"] and questions[0].dataset == name
        tasks = [CodeTask.from_answer(q.answer) for q in questions]
        assert [t.entry_point for t in tasks] == ["remove_Occ", "hyp"]
        assert 'assert remove_Occ("PHP","P") == "H"' in questions[0].messages[0]["content"]  # type: ignore[index]
        assert "import math" in tasks[1].tests
        outputs = [_as_chat_answer(str(r["code"])) for r in rows]
        assert [grade("code", o, q.answer).correct for o, q in zip(outputs, questions, strict=True)] == [
            True
        ] * 2
        assert not grade(
            "code", _as_chat_answer("def hyp(a, b):\n    return a + b"), questions[1].answer
        ).correct


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ("not json", "not JSON"),
        ('["assert 1"]', "must be an object"),
        ("{}", "'tests' is missing"),
        ('{"tests": "  "}', "'tests' must be a non-empty string"),
        ('{"tests": "assert f()", "entry_point": "f()"}', "must be a Python function name"),
        ('{"tests": "assert f()", "timeout": 3}', r"unknown field\(s\) timeout"),
    ],
)
def test_bad_code_references(answer: str, message: str) -> None:
    """A code reference that cannot be graded is refused before the run, naming the problem."""
    with pytest.raises(ValueError, match=message):
        check_reference("code", answer)

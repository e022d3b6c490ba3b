"""Rules of the team's standards that code can check (the import rules are tests/test_import_rules.py):

1. The package names no document outside the repository: a "SPEC 11.2" in a comment or docstring points
   at a file a reader of this repository does not have (docs/ pages are the references in code).
2. No function of the command line (`flyspec/cli/`) has more than 40 lines of body (its docstring left
   out): a command parses its options, calls the package and prints, and whatever is longer belongs in
   the package. `cli/demo.py` is not there yet (the demo's own change): it is expected to fail, strictly,
   so the change that shortens it must say so here.
3. A run's stored registration is read in one place: ``registration["`` and ``registration.get(`` appear
   only in `flyspec/gate/data/spec.py` (the typed ``Registration`` and its reader of every stored
   layout); everything else reads ``RunRecord.registered``.
4. No code outside `flyspec/gate/grading/` compares a grader's name (``q.grader == "judge"``, ``grader in
   ("code", ...)``): it asks the grader's record (``model_graded``, ``pairwise``, ``sandboxed``,
   ``reference``), so a grader registered from outside (a rubric judge) needs no edit elsewhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flyspec"
CLI = PACKAGE / "cli"

OUTSIDE_DOCUMENT = re.compile(r"\bSPEC\b")
"""The spec of the project, outside the repository, as code used to cite it ("SPEC 11.2", "SPEC.md");
`FLYSPEC_CACHE` or `SPECULATION_MODES` are names, not references."""

MAX_CLI_BODY = 40


def outside_references(root: Path) -> list[str]:
    """`path:line: text` of every line under `root` that cites the outside spec (text files only)."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:  # a compiled library or another binary file
            continue
        found += [
            f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if OUTSIDE_DOCUMENT.search(line)
        ]
    return found


def test_the_package_names_no_document_outside_the_repository() -> None:
    """No file of the package cites the spec outside the repository."""
    assert outside_references(PACKAGE) == []


def test_the_outside_reference_check_can_fail(tmp_path: Path) -> None:
    """The check finds a citation in a comment or a docstring and leaves names that contain the word."""
    (tmp_path / "a.py").write_text('"""The ledger (SPEC 11.2)."""\nFLYSPEC_CACHE = SPECULATION_MODES\n')
    (tmp_path / "b.cpp").write_text("// see SPEC.md\n#define FLYSPEC_INT4_AVX2 1\n")
    (tmp_path / "c.so").write_bytes(b"\xff\xfe SPEC 1")
    assert [line.split(":", 1)[1] for line in outside_references(tmp_path)] == [
        '1: """The ledger (SPEC 11.2)."""',
        "1: // see SPEC.md",
    ]


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the last (blank lines and comments
    between them count)."""
    body = function.body
    first = body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]
    if not body:
        return 0
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def long_functions(path: Path, limit: int = MAX_CLI_BODY) -> list[str]:
    """`name (n lines)` of every function, nested ones included, whose body is longer than `limit`."""
    tree = ast.parse(path.read_text())
    return [
        f"{node.name} ({body_lines(node)} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and body_lines(node) > limit
    ]


@pytest.mark.parametrize("path", sorted(CLI.glob("*.py")), ids=lambda p: p.name)
def test_no_cli_function_has_more_than_40_lines_of_body(path: Path) -> None:
    """Each module of the command line: no function body over 40 lines."""
    assert long_functions(path) == []


def test_the_body_length_check_can_fail(tmp_path: Path) -> None:
    """A docstring does not count, every other line does, nested functions are checked on their own, and
    41 lines are one too many."""
    statements = "".join(f"    x{i} = {i}\n" for i in range(40))
    path = tmp_path / "m.py"
    documented = f'def ok():\n    """Doc.\n\n    More doc."""\n{statements}\n\n'
    path.write_text(f"{documented}def long():\n{statements}    # a comment\n    return 1\n")
    assert long_functions(path) == ["long (42 lines)"]
    nested = "".join(f"        y{i} = {i}\n" for i in range(41))
    path.write_text(f"def outer():\n    def inner():\n{nested}    return inner\n")
    assert long_functions(path) == ["outer (43 lines)", "inner (41 lines)"]


# ------------------------------------------------------------------- the registration, read in one place

REGISTRATION_READ = re.compile(r"registration\[\"|registration\.get\(")
REGISTRATION_MODULE = PACKAGE / "gate" / "data" / "spec.py"


def registration_reads(root: Path) -> list[str]:
    """`path:line` of every read of a stored registration by key under `root`."""
    return [
        f"{path}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if REGISTRATION_READ.search(line)
    ]


def test_the_registration_is_read_in_one_module() -> None:
    """Only the registration's module reads the stored JSON by key."""
    places = registration_reads(PACKAGE)
    assert {Path(p.rsplit(":", 1)[0]) for p in places} - {REGISTRATION_MODULE} == set(), places


def test_the_registration_read_check_can_fail(tmp_path: Path) -> None:
    """A key read in either spelling is found; the typed record's attributes are not."""
    (tmp_path / "a.py").write_text(
        'x = run.registration["margin"]\ny = run.registration.get("judge")\nz = run.registered.margin\n'
    )
    assert [p.split(":", 1)[1] for p in registration_reads(tmp_path)] == ["1", "2"]


# ------------------------------------------------------------------------------- grader names, compared

GRADING = PACKAGE / "gate" / "grading"


def _grader_names() -> tuple[set[str], set[str]]:
    """The registered graders' names, and the names of the grading package's constants that hold one."""
    from flyspec.gate.grading import graders

    names = set(graders.graders())
    constants = {k for k, v in vars(graders).items() if k.isupper() and isinstance(v, str) and v in names}
    return names, constants


def _names_a_grader(node: ast.expr, names: set[str], constants: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.partition(":")[0] in names
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_grader(e, names, constants) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in constants
    return isinstance(node, ast.Attribute) and node.attr in constants


def grader_comparisons(root: Path, skip: Path | None = None) -> list[str]:
    """`path:line: code` of every comparison (==, !=, in, not in) of something about a grader with a
    grader's name (a string, a collection of them, or a constant holding one) under `root`."""
    names, constants = _grader_names()
    found = []
    for path in sorted(root.rglob("*.py")):
        if skip is not None and path.is_relative_to(skip):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            about = [o for o in operands if "grader" in ast.unparse(o).lower()]
            named = [o for o in operands if _names_a_grader(o, names, constants)]
            if about and named and any(a is not n for a in about for n in named):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_grader_name_is_compared_outside_grading() -> None:
    """Outside flyspec/gate/grading/ no code compares a grader's name."""
    assert grader_comparisons(PACKAGE, skip=GRADING) == []


def test_the_grader_comparison_check_can_fail(tmp_path: Path) -> None:
    """Each way the package once compared a grader's name is found (a literal, the constant, a collection,
    an argument after the colon); comparisons of other things with the same words are not."""
    (tmp_path / "a.py").write_text(
        "from flyspec.gate.grading.graders import JUDGE\n"
        'if q.grader == "judge": pass\n'
        "if grader != JUDGE: pass\n"
        'if "code" not in graders: pass\n'
        'if question.grader in ("math", "gsm8k"): pass\n'
        'if q.grader == "equivalent_to_baseline:json": pass\n'
        'if kind == "judge": pass\n'
        "if q.grader == other.grader: pass\n"
        "if grader_named(q.grader)[0].model_graded: pass\n"
    )
    assert [line.split(":")[1] for line in grader_comparisons(tmp_path)] == ["2", "3", "4", "5", "6"]

"""Rules of the team's standards that code can check (the import rules are tests/test_import_rules.py):

1. The package names no document outside the repository: a "SPEC 11.2" in a comment or docstring points
   at a file a reader of this repository does not have (docs/ pages are the references in code).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flyspec"

OUTSIDE_DOCUMENT = re.compile(r"\bSPEC\b")
"""The spec of the project, outside the repository, as code used to cite it ("SPEC 11.2", "SPEC.md");
`FLYSPEC_CACHE` or `SPECULATION_MODES` are names, not references."""


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

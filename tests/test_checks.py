"""flyspec.checks: the value checks the package writes once (integer not bool, finite number in range,
JSON inline or in a file)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flyspec.checks import is_int, is_number, load_json


def test_is_int_refuses_bools_and_non_integers_and_applies_the_lower_bound() -> None:
    """True and False are ints to Python but never an integer setting; floats, even whole ones, are not
    ints; ``at_least`` is inclusive."""
    assert is_int(0) and is_int(-3) and is_int(5, 5)
    assert not is_int(True) and not is_int(False, 0)
    assert not is_int(2.0) and not is_int("2") and not is_int(None)
    assert not is_int(4, 5)


def test_is_number_is_finite_and_keeps_each_bound_open_or_closed() -> None:
    """Bools, NaN and infinities are never numbers; ``above``/``below`` exclude the bound and
    ``at_least``/``at_most`` include it."""
    assert is_number(0) and is_number(0.5) and is_number(-2)
    for bad in (True, math.nan, math.inf, -math.inf, "1", None):
        assert not is_number(bad)
    assert is_number(1, above=0, at_most=1) and not is_number(0, above=0, at_most=1)
    assert is_number(0, at_least=0) and not is_number(-1e-9, at_least=0)
    assert is_number(0.49, above=0, below=0.5) and not is_number(0.5, above=0, below=0.5)


def test_load_json_reads_inline_json_or_a_file_and_names_the_problem(tmp_path: Path) -> None:
    """Text starting with one of ``inline``'s characters is parsed as JSON; anything else must be a file
    holding JSON; each failure is one ValueError starting with ``who``."""
    assert load_json(' {"a": 1} ', "arm 'b'") == {"a": 1}
    assert load_json("[1, 2]", "--candidates", inline="[") == [1, 2]
    path = tmp_path / "arm.json"
    path.write_text('{"model": "m"}', encoding="utf-8")
    assert load_json(str(path), "arm 'b'") == {"model": "m"} == load_json(path, "arm 'b'")
    with pytest.raises(
        ValueError, match=r"^arm 'b': 'nope' is neither a JSON object nor an existing JSON file$"
    ):
        load_json("nope", "arm 'b'")
    with pytest.raises(ValueError, match=r"^--candidates: 'x' is neither a JSON list nor"):
        load_json("x", "--candidates", inline="[", expected="a JSON list")
    with pytest.raises(ValueError, match=r"^arm 'b': invalid JSON \(Expecting .* at position 1\)$"):
        load_json("{nope", "arm 'b'")
    path.write_text("{bad", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^arm 'b': invalid JSON"):
        load_json(str(path), "arm 'b'")

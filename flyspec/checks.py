"""Checks of given values that many parts of the package make, each written once here.

Standard library only (no torch), so any module may use them. Python's ``bool`` is a subclass of ``int``:
``True`` would pass for the integer 1 and ``False`` for 0, which no caller means, so these checks refuse
bools. The callers keep their own error messages (each names its setting and rule); these only answer
yes or no.
"""

from __future__ import annotations

import ipaddress
import json
import math
from pathlib import Path
from typing import Any


def is_int(value: object, at_least: int | None = None) -> bool:
    """True for an ``int`` that is not a ``bool``, and at least ``at_least`` when that is given."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return at_least is None or value >= at_least


def is_number(
    value: object,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
) -> bool:
    """True for a finite ``int`` or ``float`` that is not a ``bool`` and lies within the bounds given:
    ``above`` and ``below`` exclusive, ``at_least`` and ``at_most`` inclusive."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return (
        (above is None or value > above)
        and (at_least is None or value >= at_least)
        and (below is None or value < below)
        and (at_most is None or value <= at_most)
    )


def load_json(spec: str | Path, who: str, *, inline: str = "{", expected: str = "a JSON object") -> Any:
    """JSON given inline (text that starts with one of the characters of ``inline``) or as the path of a
    file holding it. ValueError, prefixed with ``who``, when it is neither or is not valid JSON."""
    text = str(spec).strip()
    if not text.startswith(tuple(inline)):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"{who}: {text!r} is neither {expected} nor an existing JSON file")
        text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{who}: invalid JSON ({exc.msg} at position {exc.pos})") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

"""The arms being compared and the executors that answer for them (docs/gate.md, "Arms"), and the registry
of their kinds, the only code that knows them all: a kind is a module (``engine.py``, ``endpoint.py``) with
``KIND``, ``KEYS``, ``parse`` and ``executors`` (docs/architecture.md, "A kind of arm"). ``judge.py`` is
the judge's endpoint: not an arm, but called like one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyspec.gate.arms import endpoint, engine
from flyspec.gate.arms.base import Arm, ArmSpec, Executor, Settings, load_arm_spec

GroupArms = Callable[[list[Any]], list[Executor]]
"""A kind's ``executors(arms)``: its arms (each its module's own class) grouped into executors."""


@dataclass(frozen=True)
class ArmKind:
    """How one kind of arm is parsed and answered."""

    parse: Callable[[str, Settings], Arm]
    executors: GroupArms


KINDS: dict[str, ArmKind] = {
    engine.KIND: ArmKind(engine.parse, engine.executors),
    endpoint.KIND: ArmKind(endpoint.parse, endpoint.executors),
}


def register_arm_kind(kind: str, parse: Callable[[str, Settings], Arm], executors: GroupArms) -> None:
    """Register a kind of arm from outside the package (docs/architecture.md, "Adding to the gate");
    ValueError for a taken kind."""
    known = KINDS.get(kind)
    if known is not None and (known.parse, known.executors) != (parse, executors):
        raise ValueError(f"arm kind {kind!r} is registered already")
    KINDS[kind] = ArmKind(parse, executors)


def parse_arm(name: str, spec: ArmSpec) -> Arm:
    """Validate an arm given as a dict, a JSON object string or a JSON file (``kind`` may be omitted: an
    arm with ``base_url(s)`` is an endpoint, otherwise an engine); ValueError names the arm, the field,
    the value and the rule."""
    data = load_arm_spec(spec, name)
    implied = endpoint.KIND if ("base_urls" in data or "base_url" in data) else engine.KIND
    kind = data.get("kind") or implied
    if not isinstance(kind, str) or kind not in KINDS:
        allowed = " or ".join(repr(k) for k in KINDS)
        raise ValueError(f"arm {name!r}: kind={kind!r}: must be {allowed}")
    return KINDS[kind].parse(name, data)


def make_executors(arms: list[Arm]) -> list[Executor]:
    """The executors of ``arms``, kind by kind in registration order (engines first)."""
    return [ex for kind, k in KINDS.items() for ex in k.executors([a for a in arms if a.kind == kind])]

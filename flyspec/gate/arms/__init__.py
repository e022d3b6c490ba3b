"""The arms being compared and the executors that answer for them (docs/gate.md, "Arms"), and the registry
of their kinds, the only code that knows them all: a kind is a module (``engine.py``, ``endpoint.py``) with
``KIND``, ``KEYS``, ``parse`` and ``executors`` (docs/architecture.md, "A kind of arm"). ``judge.py`` is
the judge's endpoint: not an arm, but called like one.
"""

from __future__ import annotations

from collections.abc import Callable

from flyspec.gate.arms import endpoint, engine
from flyspec.gate.arms.base import Arm, ArmSpec, Executor, Settings, load_arm_spec

ParseArm = Callable[[str, Settings], Arm]
GroupArms = Callable[..., list[Executor]]
"""A kind's ``executors(arms)``: its arms (each its module's own class) grouped into executors."""

KINDS: dict[str, tuple[ParseArm, GroupArms]] = {
    engine.KIND: (engine.parse, engine.executors),
    endpoint.KIND: (endpoint.parse, endpoint.executors),
}


def register_arm_kind(kind: str, parse: ParseArm, executors: GroupArms) -> None:
    """Register a kind of arm from outside the package (docs/architecture.md, "Adding to the gate");
    ValueError for a taken kind."""
    if KINDS.setdefault(kind, (parse, executors)) != (parse, executors):
        raise ValueError(f"arm kind {kind!r} is registered already")


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
    parse, _ = KINDS[kind]
    return parse(name, data)


def make_executors(arms: list[Arm]) -> list[Executor]:
    """The executors of ``arms``, kind by kind in registration order (engines first)."""
    return [ex for kind, (_, group) in KINDS.items() for ex in group([a for a in arms if a.kind == kind])]

"""The settings of a run as the command line and ``--config`` files give them, stated once: each field of
``RunSettings``, ``GateOptions`` (flyspec/gate/runs/settings.py) and ``TuneOptions``
(flyspec/gate/runs/tune_settings.py) that a command takes carries a ``Flag`` in its metadata (its option,
its help, the commands that show it, its type there and how its value becomes the field's), the way vLLM's
``EngineArgs`` fields make their own command-line arguments. The command line (flyspec/cli/settings.py)
generates its options from them; ``options_from_flags`` turns what was given into the typed settings.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import TypeVar

COMMANDS = ("run", "pilot", "tune")
"""The commands whose options are settings: ``gate run``, ``gate pilot`` and ``gate tune``."""
RUNS = ("run", "pilot")
T = TypeVar("T")
OptionType = type | types.GenericAlias
"""A setting's type on the command line: ``str``, ``int``, ``float``, ``bool`` or ``list[str]``."""


@dataclass(frozen=True)
class Flag:
    """How one setting is given: ``option`` (``--margin``), ``help`` (``helps``: another text on the named
    commands), the ``commands`` that show it, its ``type`` on the command line (``str``, ``int``,
    ``float``, ``bool``, ``list[str]``), ``parse`` (the given value into the field's; None: as given),
    ``negate`` (a switch that sets the field to False: ``--fixed``, ``--no-progress``), ``config`` (a
    ``--config`` file may set it) and ``required``, the commands that need it though the field has a
    default (a gate run's candidate)."""

    option: str
    help: str
    commands: tuple[str, ...] = COMMANDS
    type: OptionType = str
    helps: Mapping[str, str] = field(default_factory=dict)
    parse: Callable[..., object] | None = None
    negate: bool = False
    config: bool = True
    required: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Its name in a ``--config`` file (``--exclude-run``: ``exclude_run``)."""
        return self.option.removeprefix("--").removeprefix("no-").replace("-", "_")

    def help_for(self, command: str) -> str:
        return self.helps.get(command, self.help)

    def value(self, given: object) -> object:
        """The field's value for a given value."""
        if self.negate:
            return not given
        return self.parse(given) if self.parse is not None else given


def flag(option: str, help: str, **settings: object) -> dict[str, Flag]:
    """A field's metadata: its ``Flag`` (``settings``: Flag's other fields)."""
    return {"flag": Flag(option, help, **settings)}


def is_required(item: Field[object]) -> bool:
    """Whether a field has no default (the settings every run needs: store, datasets, baseline, margin)."""
    return item.default is MISSING and item.default_factory is MISSING


def flags(options: type, command: str | None = None) -> list[tuple[str, Flag]]:
    """``(field, flag)`` of each setting of ``options`` (on ``command``: those it shows), in the order the
    command shows them: the settings every run needs, then the command's own, then the shared ones."""
    every = [(f, f.metadata["flag"]) for f in fields(options) if "flag" in f.metadata]
    shown = [(f, x) for f, x in every if command is None or command in x.commands]
    own = set(getattr(options, "__annotations__", {}))
    first = [(f.name, x) for f, x in shown if is_required(f)]
    mine = [(f.name, x) for f, x in shown if not is_required(f) and f.name in own]
    rest = [(f.name, x) for f, x in shown if not is_required(f) and f.name not in own]
    return first + mine + rest


def config_keys(options: type) -> list[str]:
    """The keys a ``--config`` file may hold: every setting's option name a file may set."""
    return [x.key for _, x in flags(options) if x.config]


def read_config(options: type, path: Path) -> dict[str, object]:
    """A ``--config`` file's settings by option name; a list setting may be spelt in the plural and given
    as one string. ValueError for a file that is not a JSON object or holds an unknown key."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must hold a JSON object")
    for _, x in flags(options):
        if x.type == list[str]:
            if x.key + "s" in data and x.key not in data:
                data[x.key] = data.pop(x.key + "s")
            if isinstance(data.get(x.key), str):
                data[x.key] = [data[x.key]]
    allowed = config_keys(options)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    return data


def options_from_flags(
    options: type[T], command: str, given: Mapping[str, object], config: Path | None = None, **fixed: object
) -> T:
    """The settings of ``command`` from its options (``given``, by field name; None, an empty list or an
    unset switch: not given) over a ``--config`` file's: a given option overrides the file, and what
    neither sets keeps the field's default. ``fixed``: fields the command sets itself (a run's kind)."""
    by_key = read_config(options, config) if config is not None else {}
    for name, x in flags(options, command):
        value = given.get(name)
        if not (value is None or value is False or value == []):  # 0 is given; an unset switch is not
            by_key[x.key] = value
    for item in fields(options):  # type: ignore[arg-type]
        x = item.metadata.get("flag")
        needed = x is not None and (is_required(item) or command in x.required)
        if needed and by_key.get(x.key) in (None, []):
            raise ValueError(f"{x.option} is required (on the command line or in --config)")
    values = {name: x.value(by_key[x.key]) for name, x in flags(options) if by_key.get(x.key) is not None}
    return options(**values, **fixed)

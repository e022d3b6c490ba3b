"""Command options generated from a run's settings: each field of ``GateOptions`` or ``TuneOptions`` that a
command takes says how in its ``Flag`` (flyspec/gate/runs/settings.py), and ``settings_command`` makes those
the command's options, so each option is stated once, on its field.

typer reads a command's options from its signature; the generated command's signature is the settings'
options, then ``--config`` where the command reads one, then the function's own parameters (``--json``,
``--strict``). The function is called with one typed settings object in place of the settings' options.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer

from flyspec.gate.runs.settings import Flag, flags, is_required, options_from_flags

KEYWORD = inspect.Parameter.KEYWORD_ONLY
Config = Annotated[Path | None, typer.Option("--config", help="JSON file with any of these settings.")]


def _parameter(name: str, flag: Flag, command: str, needed: bool) -> inspect.Parameter:
    """One setting as a typer option: a switch, a required option (a command without --config takes the
    settings every run needs on its command line), or an optional one (unset: the field's default)."""
    option = typer.Option(flag.option, help=flag.help_for(command))
    if flag.type is bool:
        return inspect.Parameter(name, KEYWORD, default=False, annotation=Annotated[bool, option])
    if needed:
        return inspect.Parameter(name, KEYWORD, annotation=Annotated[flag.type, option])
    return inspect.Parameter(name, KEYWORD, default=None, annotation=Annotated[flag.type | None, option])


def settings_command(
    options: type, command: str, *, config: bool = False, **fixed: Any
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command whose first parameter takes the settings (``options``, e.g. ``GateOptions``) as
    ``command`` (``run``, ``pilot``, ``tune``) gives them; ``config``: it also reads a ``--config`` file;
    ``fixed``: fields the command sets itself (``kind="pilot"``)."""
    shown = flags(options, command)
    needed = set() if config else {f.name for f in fields(options) if is_required(f)}
    generated = [_parameter(name, flag, command, name in needed) for name, flag in shown]

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        own = [
            p.replace(kind=KEYWORD)
            for p in list(inspect.signature(function, eval_str=True).parameters.values())[1:]
        ]
        extra = [inspect.Parameter("config", KEYWORD, default=None, annotation=Config)] if config else []

        @functools.wraps(function)
        def run(**values: Any) -> None:
            given = {name: values.pop(name) for name, _ in shown}
            path = values.pop("config", None)
            function(options_from_flags(options, command, given, path, **fixed), **values)

        run.__signature__ = inspect.Signature([*generated, *extra, *own])  # type: ignore[attr-defined]
        return run

    return decorate

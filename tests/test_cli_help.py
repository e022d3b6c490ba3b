"""The command line's own output: `--help` of every command exits 0 with a usage line, and its prose
paragraphs flow to the terminal's width instead of breaking where the source wrapped them (typer's "rich"
markup mode kept those breaks, so at 80 columns a sentence broke mid-line and resumed on the next); the
log goes to stderr as it is when a record is emitted."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from flyspec.cli import app

COMMANDS = [
    [],
    ["generate"],
    ["serve"],
    ["bench"],
    ["bench-serve"],
    ["bench-shadow"],
    ["capacity"],
    ["demo"],
    ["gate"],
    ["gate", "plan"],
    ["gate", "run"],
    ["gate", "pilot"],
    ["gate", "report"],
    ["gate", "compare"],
    ["gate", "tune"],
    ["gate", "label"],
    ["gate", "shadow"],
    ["models"],
    ["models", "list"],
    ["models", "prepare"],
]


def _help(command: list[str], columns: int) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": str(columns), "NO_COLOR": "1"})
    assert result.exit_code == 0, (command, result.output)
    return result.output


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "flyspec")
def test_every_command_has_help(command: list[str]) -> None:
    out = _help(command, 100)
    assert "Usage:" in out and "Traceback" not in out


def _walk(command: typer.core.TyperCommand, path: list[str]) -> list[tuple[list[str], Any]]:
    """This command and each of its subcommands, at any depth: (the words that name it, its command)."""
    found = [(path, command)]
    for name, sub in getattr(command, "commands", {}).items():
        found += _walk(sub, [*path, name])
    return found


EVERY_COMMAND = _walk(typer.main.get_command(app), [])


def test_the_walk_reaches_every_listed_command() -> None:
    assert {tuple(c) for c in COMMANDS} <= {tuple(path) for path, _ in EVERY_COMMAND}


def _type_shown(out: str, opts: list[str]) -> str | None:
    """The `<type>` that the help row of the option named ``opts`` shows after its names, or None."""
    names = ",".join(o for o in opts if o.startswith("--")) or opts[0]
    row = re.compile(rf"^│\s{{1,4}}(?:\*\s{{1,4}})?{re.escape(names)}(?:\s+-[\w-]+)*\s+(<[^>]*>)?")
    shown = [m.group(1) for m in map(row.match, out.splitlines()) if m]
    assert len(shown) == 1, (names, out)
    return shown[0]


@pytest.mark.parametrize(
    ("command", "cli"), EVERY_COMMAND, ids=[" ".join(p) or "flyspec" for p, _ in EVERY_COMMAND]
)
def test_flags_are_shown_as_flags(command: list[str], cli: typer.core.TyperCommand) -> None:
    """A boolean flag (`--json`, `--strict`, `--help`, `--enable-prefix-caching/--no-...`) takes no value,
    so its help row shows no type (typer 0.29 showed `--json <bool>` for each); an option that takes a
    value still shows its type (`--store <str>`)."""
    out = _help(command, 250)
    options = [p for p in cli.get_params(typer.Context(cli)) if isinstance(p, typer.core.TyperOption)]
    assert any(o.opts == ["--help"] for o in options)
    for option in options:
        shown = _type_shown(out, option.opts)
        assert (shown is None) == option.is_flag, (option.opts, shown)


@pytest.mark.parametrize(
    ("command", "sentence"),
    [
        ([], "forgiven share and peak RSS for target-only, standard and lossy"),
        (["demo"], "the lossless baseline (standard speculative decoding), the draft model alone (a control"),
        (["gate", "run"], "0 PASS, 1 FAIL, 2 INCONCLUSIVE with --strict (else 0); 130 after Ctrl-C"),
    ],
)
def test_paragraphs_flow_to_the_terminal_width(command: list[str], sentence: str) -> None:
    """At 200 columns each of these sentences, wrapped across two source lines, fits on one line."""
    lines = [" ".join(line.strip(" │").split()) for line in _help(command, 200).splitlines()]
    assert any(sentence in line for line in lines), "\n".join(lines)


def test_the_log_follows_stderr_when_it_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's log handler writes to stderr as it is when a record is emitted: a stream that
    was stderr when logging was configured (a test's capture, a redirect) and is closed later takes no
    record ("I/O operation on closed file" once filled later tests' output)."""
    import io
    import logging

    from flyspec.cli.logs import configure_logging

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    configure_logging()
    log = logging.getLogger("flyspec.test")
    log.info("to the first")
    first.close()
    monkeypatch.setattr("sys.stderr", second)
    log.info("to the second")
    assert second.getvalue().endswith("to the second\n")

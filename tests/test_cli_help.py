"""The command line's own output: `--help` of every command exits 0 with a usage line, and its prose
paragraphs flow to the terminal's width instead of breaking where the source wrapped them (typer's "rich"
markup mode kept those breaks, so at 80 columns a sentence broke mid-line and resumed on the next); the
log goes to stderr as it is when a record is emitted."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flyspec.cli import app

COMMANDS = [
    [],
    ["generate"],
    ["serve"],
    ["bench"],
    ["bench-serve"],
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


@pytest.mark.parametrize(
    ("command", "sentence"),
    [
        ([], "forgiven share and peak RSS for target-only, standard and lossy"),
        (["demo"], "the target alone, whichever this machine runs faster), the draft model alone"),
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

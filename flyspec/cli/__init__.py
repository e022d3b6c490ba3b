"""The `flyspec` command line.

Each area defines its commands in its own module; this file only assembles them. Those modules import
torch and transformers inside the command functions, so `flyspec --help` stays fast. User mistakes
surface as one line on stderr and a non-zero exit code, never as a traceback.
"""

from __future__ import annotations

import sys

from flyspec.cli import interrupt
from flyspec.cli.bench import bench
from flyspec.cli.bench_serve import bench_serve
from flyspec.cli.bench_shadow import bench_shadow
from flyspec.cli.capacity import capacity_command
from flyspec.cli.demo import demo
from flyspec.cli.gate import gate_app
from flyspec.cli.gate_shadow import shadow_command
from flyspec.cli.generate import generate
from flyspec.cli.logs import configure_logging
from flyspec.cli.models import models_app
from flyspec.cli.options import App
from flyspec.cli.serve import serve

app = App(
    name="flyspec",
    help="Fast and safe speculative decoding: an engine with standard and FLy verification, "
    "an OpenAI-compatible server, and a paired quality gate that decides whether lossy decoding is safe.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("generate")(generate)
app.command("serve")(serve)
app.command("bench")(bench)
app.command("bench-serve")(bench_serve)
app.command("bench-shadow")(bench_shadow)
app.command("capacity")(capacity_command)
gate_app.command("shadow")(shadow_command)
app.add_typer(gate_app, name="gate")
app.add_typer(models_app, name="models")
app.command("demo")(demo)


def _caused_by_ctrl_c(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def main() -> None:
    """Entry point: run the app and turn user errors into one clear line on stderr."""
    configure_logging()
    interrupt.arm()
    try:
        app()
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        interrupt.leave(130, "interrupted")
    except SystemExit as exc:
        # typer turns Ctrl-C into exit code 130; a command that paused on Ctrl-C exits 130 itself.
        if exc.code == 130:
            interrupt.leave(130, "interrupted" if _caused_by_ctrl_c(exc) else None)
        raise

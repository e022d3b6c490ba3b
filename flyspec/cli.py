"""The `flyspec` command line.

Each area registers its own commands from its own module (imports of heavy libraries such as torch stay
inside the command functions, so `flyspec --help` is fast). User mistakes surface as one line on stderr
and a non-zero exit code, never as a traceback.
"""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    name="flyspec",
    help="Fast and safe speculative decoding: an engine with standard and FLy verification, "
    "an OpenAI-compatible server, and a paired quality gate that decides whether lossy decoding is safe.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Command registrations (one line per area; each module defines its commands on `app` or a sub-app).
# --- registrations start ---
# --- registrations end ---


def main() -> None:
    """Entry point: run the app and turn user errors into one clear line on stderr."""
    try:
        app()
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)

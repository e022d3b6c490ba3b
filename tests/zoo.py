"""Zoo models for the tests that need real weights: prepared on first use, never skipped.

`make test` prepares them before pytest starts (`make models`), so this is a no-op there; a bare `pytest`
on a fresh clone prepares them here instead (about two minutes). A missing asset package is an error
that names its install command, not a skip: a command fixes it.
"""

from __future__ import annotations

from pathlib import Path

from flyspec import assets

SMOLLM2 = "smollm2-135m-instruct"
QWEN_05B = "qwen2.5-coder-0.5b-instruct"


def zoo_model(name: str) -> Path:
    """The prepared folder of zoo model `name`, preparing it now if needed."""
    return assets.prepare(name, show_progress=False)

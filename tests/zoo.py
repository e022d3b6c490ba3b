"""Zoo models for the tests that need real weights: prepared on first use, never skipped.

`make test` prepares SmolLM2 before pytest starts (`make models`) and `make test-all` both models
(`make models-all`), so this is a no-op there; a bare `pytest` on a fresh clone prepares them here
instead (about two minutes). A missing asset package is an error that names its install command, not a
skip: a command fixes it.

The fast tier (tests not marked slow) may load SmolLM2 only: a fast test that asks for another zoo model
fails, naming the rule, since `make test` does not prepare it (tests/conftest.py tells this module which
tier the running test is in).
"""

from __future__ import annotations

from pathlib import Path

from flyspec import assets

SMOLLM2 = "smollm2-135m-instruct"
QWEN_05B = "qwen2.5-coder-0.5b-instruct"
FAST_TIER_MODELS = frozenset({SMOLLM2})

running_slow_test = True  # set by tests/conftest.py before each test's fixtures


def zoo_model(name: str) -> Path:
    """The prepared folder of zoo model `name`, preparing it now if needed."""
    if name not in FAST_TIER_MODELS and not running_slow_test:
        raise RuntimeError(
            f"{name} is for slow tests only: `make test` prepares {', '.join(sorted(FAST_TIER_MODELS))}; "
            "mark this test @pytest.mark.slow (the real Qwen tests run in `make test-all`)"
        )
    return assets.prepare(name, show_progress=False)

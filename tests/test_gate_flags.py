"""The gate's settings on the command line and in --config files, stated once on the settings' fields
(flyspec/gate/runs/settings.py): the options `gate run`, `gate pilot` and `gate tune` show are generated from
the fields, a --config file takes the keys it always took, and what is given becomes one typed object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer.main

from flyspec.cli.gate import gate_app
from flyspec.gate.runs.settings import GateOptions, config_keys, flags, options_from_flags
from flyspec.gate.runs.tune import TuneOptions

CONFIG_KEYS = {
    "store", "dataset", "limit", "max_questions", "baseline", "candidate", "margin", "alpha", "sequential",
    "max_minutes", "temperature", "top_p", "max_tokens", "seed", "order_seed", "run", "shuffle_seed",
    "exclude_run", "judge", "gold_rate", "judge_all", "population", "alpha_budget", "control",
    "control_alpha", "control_margin",
}  # fmt: skip
"""The keys a --config file took before the options were generated (cli/gate.py's list then)."""
ARM = '{"base_url": "http://127.0.0.1:9/v1", "model": "a"}'


def _options(command: str) -> set[str]:
    """The options of a `gate` command as typer builds them."""
    group = typer.main.get_command(gate_app)
    return {name for p in group.commands[command].params for name in p.opts}  # type: ignore[attr-defined]


def test_each_command_shows_exactly_its_fields_flags() -> None:
    """Every option of `gate run`, `gate pilot` and `gate tune` but its own (--config, --json, --strict,
    --help) comes from a field's flag, and every flag on a command is one of its options."""
    own = {"--config", "--json", "--strict", "--help"}
    for command, options in (("run", GateOptions), ("pilot", GateOptions), ("tune", TuneOptions)):
        generated = {flag.option for _, flag in flags(options, command)}
        assert _options(command) - own == generated, command
    assert "--sequential" not in _options("pilot") and "--fixed" in _options("tune")


def test_a_config_file_takes_the_keys_it_always_took(tmp_path: Path) -> None:
    """A --config file may set the same keys as before, a list in the plural or as one string; a flag
    overrides the file; an unknown key is refused naming the allowed ones; a setting every run needs that
    neither gives is a one-line error naming its option."""
    assert set(config_keys(GateOptions)) == CONFIG_KEYS
    config = tmp_path / "gate.json"
    config.write_text(
        json.dumps(
            {
                "store": "s.db",
                "datasets": "gsm8k",
                "baseline": ARM,
                "candidate": ARM,
                "margin": 0.05,
                "exclude_runs": ["a"],
                "control": {"draft": ARM},
                "max_minutes": 0.5,
            }
        )  # fmt: skip
    )
    given = {"margin": 0.02, "max_minutes": None, "sequential": False, "exclude_runs": []}
    options = options_from_flags(GateOptions, "run", given, config, kind="gate")
    assert (options.datasets, options.margin, options.max_minutes) == (("gsm8k",), 0.02, 0.5)
    assert options.exclude_runs == ("a",) and options.controls == {"draft": ARM} and not options.sequential
    config.write_text(json.dumps({"store": "s.db", "runs": 1}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) runs; allowed: store, dataset"):
        options_from_flags(GateOptions, "run", {}, config, kind="gate")
    config.write_text(json.dumps({"store": "s.db", "dataset": ["gsm8k"], "baseline": ARM, "margin": 0.05}))
    with pytest.raises(ValueError, match=r"^--candidate is required \(on the command line or in --config\)"):
        options_from_flags(GateOptions, "run", {}, config, kind="gate")
    assert options_from_flags(GateOptions, "pilot", {}, config, kind="pilot").candidate is None


def test_given_values_become_the_typed_fields() -> None:
    """A zero is a value (not 'unset'); a switch that negates sets its field off; comma lists and aliases
    parse into the field's type; what is not given keeps the field's default."""
    tuned = options_from_flags(
        TuneOptions,
        "tune",
        {"store": "s.db", "datasets": ["gsm8k"], "baseline": ARM, "margin": 0.05, "windows": "3,2",
         "thresholds": "0.5", "order": "given", "order_by": "tokens-per-s", "calibration_questions": 0,
         "sequential": True, "progress": True, "seed": 0},
    )  # fmt: skip
    assert (tuned.windows, tuned.thresholds, tuned.order_by) == ((3, 2), (0.5,), "tokens_per_s")
    assert tuned.calibration_questions == 0 and tuned.sequential is False and tuned.progress is False
    assert tuned.temperature == 0.0 and tuned.max_tokens == 512
    with pytest.raises(ValueError, match="--windows 'x': give comma-separated ints"):
        options_from_flags(TuneOptions, "tune", {"store": "s", "datasets": ["d"], "baseline": ARM,
                                                 "margin": 0.05, "windows": "x"})  # fmt: skip

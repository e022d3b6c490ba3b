"""Verification policies of installed distributions (flyspec/spec_decode/policies/plugins.py): a policy
offered through the `flyspec.verification_policies` entry-point group is known to every new process,
`flyspec serve` included, with no call to `register_policy`; a plugin that does not load is an error
naming its entry point where its name is used, and nothing else.

Each "installed distribution" is real metadata: a folder on the subprocess's PYTHONPATH holding a module
and a `*.dist-info` folder (METADATA and entry_points.txt), which `importlib.metadata` reads as it reads
any installed package. Everything runs in new processes, as a user's commands do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from serve_process import FLYSPEC, flyspec_serve, tiny_args
from tiny_llm import save_perturbed, save_tiny

from flyspec.spec_decode.policies.plugins import GROUP

PLUGIN_MODULE = '''
"""A verification policy that only an entry point registers: keep a natively rejected draft token when
P_i(d_i) >= plugged_min_ratio * Q_i(d_i)."""

from dataclasses import dataclass

from flyspec.spec_decode.policies.base import VerificationPolicy, config_field, number_rule


@dataclass(frozen=True)
class PluggedRatio(VerificationPolicy):
    name = "plugged"
    title = "Plugged ratio"
    forgives = "accepted draft tokens whose target/draft probability ratio reached plugged_min_ratio"

    min_ratio: float = config_field(
        "plugged_min_ratio",
        rule=number_rule("it must be a finite number in (0, 1]", lambda r: 0 < r <= 1),
        short="r",
        default=0.5,
    )

    def forgiven(self, drafts):
        return drafts.candidates & (drafts.p_draft >= self.min_ratio * drafts.q_draft)
'''


def _distribution(root: Path, name: str, entry_points: dict[str, str]) -> None:
    """An installed distribution `name` 0.1 under `root`: its METADATA and its entry points in GROUP."""
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = [f"[{GROUP}]", *(f"{key} = {value}" for key, value in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def plugged(tmp_path: Path) -> Path:
    """A folder with the plugin's module and its distribution, flyspec-plugged, declaring `plugged`."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "flyspec_plugged.py").write_text(PLUGIN_MODULE)
    _distribution(root, "flyspec-plugged", {"plugged": "flyspec_plugged:PluggedRatio"})
    return root


@pytest.fixture
def broken(plugged: Path) -> Path:
    """`plugged`'s folder plus flyspec-broken, whose entry points cannot load: a module that does not
    exist, and a name that is not the policy's."""
    _distribution(
        plugged,
        "flyspec-broken",
        {"broken": "flyspec_absent_module:Policy", "misnamed": "flyspec_plugged:PluggedRatio"},
    )
    return plugged


def _env(site: Path | None) -> dict[str, str]:
    """This process's environment with `site` first on PYTHONPATH (None: without it)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*([str(site)] if site else []), *paths])
    return env


PROBE = """
import json
from flyspec.config import SpeculativeConfig, policy_names
from flyspec.spec_decode.policies import plugin_failures

out = {"names": list(policy_names()), "failures": list(plugin_failures())}
fly = SpeculativeConfig(method="ngram", num_speculative_tokens=3, rejection_sample_method="fly")
out["fly"] = [fly.fly_window_size, getattr(fly, "plugged_min_ratio", "absent")]
try:
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, rejection_sample_method="plugged")
    out["plugged"] = [cfg.plugged_min_ratio, cfg.fly_window_size, cfg.is_lossy]
except ValueError as exc:
    out["plugged"] = str(exc)
print(json.dumps(out))
"""


def _probe(site: Path | None) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", PROBE], env=_env(site), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_a_new_process_knows_an_installed_policy_by_its_entry_point(plugged: Path) -> None:
    """With the distribution on its path, a new Python process lists `plugged` after the built-in
    policies and builds a config with it: its field reads as an attribute at its default, FLy's reads None;
    without the distribution the same process knows no `plugged` (so the entry point is what made it)."""
    seen = _probe(plugged)
    assert seen["names"] == ["standard", "fly", "typical", "plugged"] and seen["failures"] == []
    assert seen["plugged"] == [0.5, None, True]
    assert seen["fly"] == [2, None]
    unseen = _probe(None)
    assert "plugged" not in unseen["names"] and unseen["fly"] == [2, "absent"]
    assert unseen["plugged"].startswith("rejection_sample_method='plugged' is invalid: it must be one of")


def test_a_broken_plugin_fails_where_its_name_is_used_and_nowhere_else(broken: Path) -> None:
    """Two entry points that cannot load (a missing module; an entry point named otherwise than its
    policy) leave every other policy working, the good plugin's included; asking for a broken one by name
    is an error naming its entry point, its distribution and why, and `flyspec serve` says so in one
    line on stderr and exits 2 before loading any model."""
    seen = _probe(broken)
    assert seen["names"] == ["standard", "fly", "typical", "plugged"]
    assert seen["plugged"] == [0.5, None, True] and seen["fly"] == [2, None]
    assert len(seen["failures"]) == 2
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    for name, needles in (
        ("broken", ["broken = flyspec_absent_module:Policy", "ModuleNotFoundError"]),
        ("misnamed", ["misnamed = flyspec_plugged:PluggedRatio", "whose name is 'plugged'"]),
    ):
        run = subprocess.run(
            [FLYSPEC, "serve", "absent", "--speculative-config",
             json.dumps({**spec, "rejection_sample_method": name})],
            env=_env(broken), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert lines[0].startswith(f"error: rejection_sample_method={name!r} is invalid: its plugin did not")
        for needle in [*needles, f"group {GROUP}", "distribution flyspec-broken 0.1"]:
            assert needle in lines[0], lines[0]


def test_an_unknown_key_names_the_plugins_that_did_not_load(broken: Path) -> None:
    """A key no loaded policy owns may be a broken plugin's field: the unknown-key error lists the
    entry points that did not load."""
    script = textwrap.dedent(
        """
        from flyspec.config import SpeculativeConfig
        try:
            SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "broken_x": 1})
        except ValueError as exc:
            print(exc)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=_env(broken), capture_output=True, text=True, timeout=120
    )
    assert run.stdout.startswith("speculative_config has unknown key(s) 'broken_x'"), run.stderr
    assert "a verification policy plugin did not load: entry point broken = " in run.stdout


def test_flyspec_serve_runs_a_policy_from_an_entry_point(plugged: Path, tmp_path: Path) -> None:
    """`flyspec serve` started as a new process with `rejection_sample_method="plugged"` (tiny random
    models: a target often unsure, a draft close to it): it logs the plugin's lossy warning, accepts
    `verification: "plugged"` on a request, and its forgiveness shows in /metrics (standard verification
    forgives nothing), beside the lossy gauge."""
    target = save_tiny(tmp_path / "target", seed=3, std=0.25)
    draft = save_perturbed(target, tmp_path / "draft", seed=5, noise=0.003)
    spec = {
        "model": str(draft),
        "num_speculative_tokens": 3,
        "rejection_sample_method": "plugged",
        "plugged_min_ratio": 0.001,
    }
    log = tmp_path / "serve.log"
    with flyspec_serve(tiny_args(str(target), spec), log, env=_env(plugged)) as url:
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "verification": "plugged"}
        for i in range(6):  # enough drafts for a forgiveness to show in the counter
            reply = httpx.post(f"{url}/v1/completions", json={**body, "prompt": f"w{i} w{2 * i}"}, timeout=60)
            assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "Plugged ratio verification is lossy" in log.read_text()
    assert 'flyspec:lossy_verification_enabled{model_name="tiny"} 1.0' in metrics
    counter = "flyspec:spec_decode_num_forgiven_tokens_total"
    forgiven = [line for line in metrics.splitlines() if line.startswith(counter)]
    assert forgiven and float(forgiven[0].split()[-1]) > 0

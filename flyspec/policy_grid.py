"""Grids of verification-policy settings: the JSON syntax `flyspec gate tune --policies` and
`flyspec bench --policies` share (docs/gate.md, "Choosing a lossy setting: `gate tune`";
docs/performance.md).

A grid is a JSON object, or a list of them, whose list values are expanded into every combination (keys
in the order given, the last varying fastest): each combination is a fragment of a `speculative_config`,
e.g. ``[{"rejection_sample_method": "fly", "fly_window_size": [3, 1], "lossless_prefix_tokens": [0, 32]},
{"rejection_sample_method": "typical", "lossless_prefix_tokens": [0, 32]}]`` is six fragments. A fragment
names its policy (``rejection_sample_method``) or sets fields of exactly one registered policy.
"""

from __future__ import annotations

import itertools
from typing import Any

from flyspec.checks import load_json
from flyspec.config import policy_owning

__all__ = ["expand_grid", "policy_of"]


def expand_grid(spec: str | dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    """The fragments of a policy grid (module docstring): a JSON object or list of objects (inline, a
    file, or already parsed) whose list values are expanded into every combination, in order."""
    data = (
        load_json(spec, "--policies", inline="[{", expected="a JSON object or list")
        if isinstance(spec, str)
        else spec
    )
    blocks = [data] if isinstance(data, dict) else data
    if not isinstance(blocks, list) or not blocks:
        raise ValueError("--policies: give a JSON object or a non-empty list of them")
    out: list[dict[str, Any]] = []
    for i, block in enumerate(blocks, 1):
        if not isinstance(block, dict) or not block:
            raise ValueError(f"--policies: grid {i} must be a non-empty JSON object, got {block!r:.80}")
        axes = [value if isinstance(value, list) else [value] for value in block.values()]
        empty = [key for key, values in zip(block, axes, strict=True) if not values]
        if empty:
            raise ValueError(f"--policies: grid {i}: {empty[0]} lists no value")
        out.extend(dict(zip(block, combo, strict=True)) for combo in itertools.product(*axes))
    return out


def policy_of(fragment: dict[str, Any]) -> str | None:
    """The policy a fragment asks for: the one it names, else the one whose fields it sets; None when
    it names none and sets the fields of no policy or of several."""
    if "rejection_sample_method" in fragment:
        return fragment["rejection_sample_method"]
    owners = {owner.name for owner in map(policy_owning, fragment) if owner is not None}
    return owners.pop() if len(owners) == 1 else None

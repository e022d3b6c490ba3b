"""What a benchmark runs: the arms (one decoding configuration at one batch size) and how a sweep is planned.

Planning rule (one rule for every sweep, so a reader can predict the arm list from the command):

- batch size 1: target-only; standard speculative decoding at every K; every lossy setting at the
  headline K;
- every larger batch size: target-only, standard and every lossy setting, at the headline K only;
- the lossy settings: each lossy verification policy named in `methods` at its defaults, then each
  fragment of the `policies` grid (flyspec/policy_grid.py, the syntax of `gate tune --policies`: a
  registered policy and its settings), each once per lossless prefix asked for (default: none) unless
  the fragment sets `lossless_prefix_tokens` itself; a setting given twice runs once;
- each drafter (a draft model, or "ngram" for prompt lookup) gets its own standard and lossy arms;
- with a peer: the peer's target-only generation at batch 1, and its assisted generation at batch 1 with
  the same drafter at every K;
- every weight format asked for (`quantizations`, e.g. unquantized and "int8") gets all of the flyspec
  arms above (the peer runs the unquantized weights only). A format "T/D" quantizes the target as T and
  the draft as D (e.g. "int8/int4"; "none" for unquantized); its target-only arms run T.

This module imports neither torch nor transformers: plans are validated before any weights load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flyspec.config import (
    LOSSLESS_PREFIX_FIELD,
    QUANTIZATION_METHODS,
    SpeculativeConfig,
    lossy_policy_names,
    policy_owning,
    verification_policy,
)
from flyspec.policy_grid import policy_of

BACKENDS = ("flyspec", "hf")
PEERS = ("hf",)
NGRAM = "ngram"


def method_names() -> tuple[str, ...]:
    """What `--methods` may name: target-only, standard and every registered lossy policy."""
    return ("target", "standard", *lossy_policy_names())


@dataclass(frozen=True)
class Arm:
    """One measured configuration.

    backend: "flyspec" (this engine) or "hf" (transformers `generate`). method: "target" (no
    speculation), "standard" (lossless verification; for hf, assisted generation) or a lossy policy's
    name. drafter: a draft model name or path, or "ngram"; None for target-only. k: draft tokens per step
    (None for target-only). settings: a lossy arm's policy settings, resolved (its `SpeculativeConfig`
    fields, e.g. {"fly_window_size": 3, ...}); tag: those of them that differ from the policy's defaults
    at this K, as the label shows them (e.g. "W=1"; "" at the defaults). lossless_prefix: a lossy arm's
    lossless_prefix_tokens (0 = none). show_drafter: put the drafter's short name in the label (set when
    a sweep has several drafters). quantization: the weight format of the engine's target and draft
    ("int8", "int4", "T/D" for target T and draft D, or None for the weights as loaded).
    """

    backend: str
    method: str
    batch_size: int
    drafter: str | None = None
    k: int | None = None
    settings: dict[str, Any] = field(default_factory=dict, hash=False)
    tag: str = ""
    lossless_prefix: int = 0
    show_drafter: bool = False
    quantization: str | None = None

    @property
    def lossy(self) -> bool:
        """Whether the arm verifies with a lossy policy."""
        return self.method not in ("target", "standard")

    @property
    def at_defaults(self) -> bool:
        """A lossy arm at its policy's defaults without a prefix: the engine a user would run."""
        return self.lossy and not self.tag and not self.lossless_prefix

    @property
    def label(self) -> str:
        """A short unique name, e.g. "flyspec fly K=4 W=1 b=1", "flyspec typical K=4 prefix=16 b=1",
        "flyspec int8 target-only b=16" or "hf assisted K=4 b=1"."""
        name = "target-only" if self.method == "target" else self.method
        if self.backend == "hf":
            name = {"target": "generate", "standard": "assisted"}[self.method]
        parts = [self.backend, *([self.quantization] if self.quantization else []), name]
        if self.drafter == NGRAM or (self.drafter is not None and self.show_drafter):
            parts.append(self.drafter.rstrip("/").rsplit("/", 1)[-1])
        if self.k is not None:
            parts.append(f"K={self.k}")
        if self.tag:
            parts.append(self.tag)
        if self.lossless_prefix:
            parts.append(f"prefix={self.lossless_prefix}")
        parts.append(f"b={self.batch_size}")
        return " ".join(parts)

    def speculative_config(self) -> dict[str, Any] | None:
        """The engine's speculative config for this arm (None for target-only)."""
        if self.method == "target":
            return None
        config: dict[str, Any] = {"num_speculative_tokens": self.k}
        if self.drafter == NGRAM:
            config["method"] = "ngram"
        else:
            config.update(method="draft_model", model=self.drafter)
        if self.lossy:
            config.update(rejection_sample_method=self.method, **self.settings)
        if self.lossless_prefix:
            config[LOSSLESS_PREFIX_FIELD] = self.lossless_prefix
        return config

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus the label (show_drafter only shapes the label)."""
        fields = asdict(self)
        del fields["show_drafter"]
        return {"label": self.label, **fields}


@dataclass(frozen=True)
class LossySetting:
    """One lossy verifier of a sweep: a policy, its resolved settings, their tag (see Arm) and the
    lossless prefix."""

    method: str
    settings: dict[str, Any] = field(hash=False)
    tag: str
    prefix: int

    @property
    def key(self) -> str:
        """Equal for equal settings, whatever their order."""
        return json.dumps([self.method, self.settings, self.prefix], sort_keys=True)


def split_format(fmt: str | None) -> tuple[str | None, str | None]:
    """A sweep weight format as (target quantization, draft quantization for SpeculativeConfig): "int8"
    -> ("int8", None) (the draft follows the target), "int8/int4" -> ("int8", "int4"), "none/int4" ->
    (None, "int4"), "int8/none" -> ("int8", "none")."""
    if fmt is None or "/" not in fmt:
        return fmt, None
    target, draft = fmt.split("/", 1)
    return (None if target == "none" else target), draft


def _valid_format(fmt: str | None) -> bool:
    target, draft = split_format(fmt)
    return target in (None, *QUANTIZATION_METHODS) and draft in (None, "none", *QUANTIZATION_METHODS)


def parse_int_list(field: str, text: str, minimum: int = 1) -> list[int]:
    """ "1,4,8" -> [1, 4, 8]; ValueError naming the option for anything else (duplicates removed, order
    kept)."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise ValueError(
                f"{field}={text!r}: {part!r} is not an integer (use a list like 1,4,8)"
            ) from None
        if value < minimum:
            raise ValueError(f"{field}={text!r}: every value must be >= {minimum}, got {value}")
        if value not in values:
            values.append(value)
    return values


def _check_lists(
    methods: Sequence[str],
    batch_sizes: Sequence[int],
    peer: str | None,
    quantizations: Sequence[str | None],
    lossless_prefixes: Sequence[int],
) -> None:
    """ValueError naming the first list option of a sweep that breaks its rule."""
    bad_q = [q for q in quantizations if not _valid_format(q)]
    if bad_q or not quantizations or len(set(quantizations)) != len(quantizations):
        raise ValueError(
            f"quantization={list(quantizations)}: each must be none or one of "
            f"{', '.join(QUANTIZATION_METHODS)}, or TARGET/DRAFT of those (e.g. int8/int4), each once"
        )
    allowed = method_names()
    if any(m not in allowed for m in methods):
        raise ValueError(f"methods={','.join(methods)!r}: each must be one of {', '.join(allowed)}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes={list(batch_sizes)}: need at least one batch size, each >= 1")
    if peer is not None and peer not in PEERS:
        raise ValueError(f"peer={peer!r}: must be one of {', '.join(PEERS)}")
    if (
        not lossless_prefixes
        or any(p < 0 for p in lossless_prefixes)
        or len(set(lossless_prefixes)) != len(lossless_prefixes)
    ):
        raise ValueError(f"lossless_prefixes={list(lossless_prefixes)}: each must be an integer >= 0, once")


def _check_speculation(
    speculative: bool, ks: Sequence[int], headline_k: int, drafters: Sequence[str], peer: str | None
) -> None:
    """ValueError naming the first K or drafter option of a sweep that breaks its rule."""
    if speculative or peer is not None:
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"k={list(ks)}: need at least one K, each >= 1")
        if headline_k not in ks:
            raise ValueError(f"headline_k={headline_k} must be one of the swept K values {list(ks)}")
        if speculative and not drafters:
            raise ValueError("speculative methods need at least one drafter (--draft MODEL or --draft ngram)")
    if len(set(drafters)) != len(drafters):
        raise ValueError(f"drafters={list(drafters)}: each drafter may be given once")


def _grid_setting(index: int, fragment: dict[str, Any], k: int) -> tuple[LossySetting, int | None]:
    """One `policies` fragment at the headline K: its setting (prefix 0) and the prefix it sets itself
    (None when it sets none). ValueError naming the fragment for a key that is not a verification setting,
    a lossless policy or a broken rule."""
    where = f"--policies: setting {index} ({json.dumps(fragment)})"
    if not isinstance(fragment, dict):
        raise ValueError(f"{where}: must be a JSON object")
    verifying = ("rejection_sample_method", LOSSLESS_PREFIX_FIELD)
    stray = [key for key in fragment if key not in verifying and policy_owning(key) is None]
    if stray:
        raise ValueError(
            f"{where}: {stray[0]!r} is not a verification setting; a bench grid sets "
            "rejection_sample_method, a policy's fields and lossless_prefix_tokens (K comes from --k and "
            "--headline-k)"
        )
    method = policy_of(fragment)
    if method is None:
        raise ValueError(f"{where}: name its policy with rejection_sample_method")
    try:
        spec = SpeculativeConfig.from_dict(
            {**fragment, "method": NGRAM, "num_speculative_tokens": k, "rejection_sample_method": method}
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not spec.is_lossy:
        raise ValueError(f"{where}: {method!r} is lossless; list it in --methods instead")
    policy = spec.policy
    tag = " ".join(policy.label_parts(spec.policy_settings, policy.resolve_config({}, k)))
    prefix = spec.lossless_prefix_tokens if fragment.get(LOSSLESS_PREFIX_FIELD) is not None else None
    return LossySetting(method, spec.policy_settings, tag, 0), prefix


def lossy_settings(
    methods: Sequence[str],
    policies: Sequence[dict[str, Any]],
    headline_k: int,
    lossless_prefixes: Sequence[int],
) -> list[LossySetting]:
    """The sweep's lossy settings at the headline K, in order, each once (module docstring)."""
    out: dict[str, LossySetting] = {}

    def add(setting: LossySetting, prefixes: Sequence[int]) -> None:
        for prefix in prefixes:
            one = LossySetting(setting.method, setting.settings, setting.tag, prefix)
            out.setdefault(one.key, one)

    for method in (m for m in methods if m not in ("target", "standard")):
        try:  # each lossy policy's own rules for the headline K (e.g. FLy needs K >= 2)
            settings = verification_policy(method).resolve_config({}, headline_k)
        except ValueError as exc:
            raise ValueError(
                f"headline_k={headline_k}: {method}: {exc} (drop {method} from --methods)"
            ) from None
        add(LossySetting(method, settings, "", 0), lossless_prefixes)
    for index, fragment in enumerate(policies, 1):
        setting, prefix = _grid_setting(index, fragment, headline_k)
        add(setting, lossless_prefixes if prefix is None else [prefix])
    return list(out.values())


def plan_arms(
    *,
    methods: Sequence[str],
    batch_sizes: Sequence[int],
    ks: Sequence[int],
    headline_k: int,
    drafters: Sequence[str],
    peer: str | None,
    policies: Sequence[dict[str, Any]] = (),
    quantizations: Sequence[str | None] = (None,),
    lossless_prefixes: Sequence[int] = (0,),
) -> list[Arm]:
    """The sweep's arms, by the rule in the module docstring. Raises ValueError naming a bad option."""
    _check_lists(methods, batch_sizes, peer, quantizations, lossless_prefixes)
    if not methods and not policies:
        raise ValueError("methods: nothing to measure; name methods or give a --policies grid")
    speculative = any(m != "target" for m in methods) or bool(policies)
    _check_speculation(speculative, ks, headline_k, drafters, peer)
    lossy = lossy_settings(methods, policies, headline_k, lossless_prefixes) if speculative else []
    show = len(drafters) > 1
    arms: list[Arm] = []
    for q in quantizations:
        for batch in sorted(batch_sizes):
            if "target" in methods:
                arms.append(Arm("flyspec", "target", batch, quantization=q))
            swept = ks if batch == 1 else [headline_k]
            for drafter in drafters:
                for k in swept:
                    if "standard" in methods:
                        arms.append(
                            Arm("flyspec", "standard", batch, drafter, k, show_drafter=show, quantization=q)
                        )
                    if k != headline_k:
                        continue
                    arms.extend(
                        Arm("flyspec", s.method, batch, drafter, k, s.settings, s.tag, s.prefix, show, q)
                        for s in lossy
                    )
    if peer is not None:
        arms.append(Arm(peer, "target", 1))
        for drafter in drafters:
            arms.extend(Arm(peer, "standard", 1, drafter, k, show_drafter=show) for k in ks)
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise ValueError(f"drafters={list(drafters)}: two drafters share a short name; rename one folder")
    return arms

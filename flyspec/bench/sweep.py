"""What a benchmark runs: the arms (one decoding configuration at one batch size) and how a sweep is planned.

Planning rule (one rule for every sweep, so a reader can predict the arm list from the command):

- batch size 1: target-only; standard speculative decoding at every K; each lossy verification policy
  asked for (FLy, typical acceptance) at the headline K with its default settings, FLy also with every
  extra window asked for;
- every larger batch size: target-only, standard and each lossy policy (FLy: default window), at the
  headline K only;
- each lossy arm once per lossless prefix asked for (default: none);
- each drafter (a draft model, or "ngram" for prompt lookup) gets its own standard and lossy arms;
- with a peer: the peer's target-only generation at batch 1, and its assisted generation at batch 1 with
  the same drafter at every K;
- every weight format asked for (`quantizations`, e.g. unquantized and "int8") gets all of the flyspec
  arms above (the peer runs the unquantized weights only). A format "T/D" quantizes the target as T and
  the draft as D (e.g. "int8/int4"; "none" for unquantized); its target-only arms run T.

This module imports neither torch nor transformers: plans are validated before any weights load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from flyspec.config import (
    QUANTIZATION_METHODS,
    SpeculativeConfig,
    lossy_policy_names,
    verification_policy,
)

LOSSY_METHODS = lossy_policy_names()
DEFAULT_FLY_ENTROPY_THRESHOLD = 0.3

METHODS = ("target", "standard", *LOSSY_METHODS)
WINDOWED = "fly"
"""The policy whose window the sweep varies (`extra_windows`, `fly_threshold`)."""
BACKENDS = ("flyspec", "hf")
PEERS = ("hf",)
NGRAM = "ngram"


@dataclass(frozen=True)
class Arm:
    """One measured configuration.

    backend: "flyspec" (this engine) or "hf" (transformers `generate`). method: "target" (no
    speculation), "standard" (lossless verification; for hf, assisted generation) or a lossy policy's
    name ("fly", "typical": its default settings). drafter: a draft model name or path, or "ngram"; None
    for target-only. k: draft tokens per step (None for target-only). fly_window: the resolved FLy window
    W (None unless method is "fly"). default_window: whether fly_window is the default min(6, K - 1).
    show_drafter: put the drafter's short name in the label (set when a sweep has several drafters).
    quantization: the weight format of the engine's target and draft ("int8", "int4", "T/D" for target
    T and draft D, or None for the weights as loaded). lossless_prefix: a lossy arm's
    lossless_prefix_tokens (0 = none).
    """

    backend: str
    method: str
    batch_size: int
    drafter: str | None = None
    k: int | None = None
    fly_window: int | None = None
    default_window: bool = False
    fly_threshold: float = DEFAULT_FLY_ENTROPY_THRESHOLD
    show_drafter: bool = False
    quantization: str | None = None
    lossless_prefix: int = 0

    @property
    def lossy(self) -> bool:
        """Whether the arm verifies with a lossy policy."""
        return self.method in LOSSY_METHODS

    @property
    def label(self) -> str:
        """A short unique name, e.g. "flyspec fly K=4 W=3 b=1", "flyspec typical K=4 prefix=16 b=1",
        "flyspec int8 target-only b=16" or "hf assisted K=4 b=1"."""
        name = "target-only" if self.method == "target" else self.method
        if self.backend == "hf":
            name = {"target": "generate", "standard": "assisted"}[self.method]
        parts = [self.backend, *([self.quantization] if self.quantization else []), name]
        if self.drafter == NGRAM or (self.drafter is not None and self.show_drafter):
            parts.append(self.drafter.rstrip("/").rsplit("/", 1)[-1])
        if self.k is not None:
            parts.append(f"K={self.k}")
        if self.fly_window is not None:
            parts.append(f"W={self.fly_window}")
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
            config["rejection_sample_method"] = self.method
        if self.fly_window is not None:
            config.update(fly_window_size=self.fly_window, fly_entropy_threshold=self.fly_threshold)
        if self.lossless_prefix:
            config["lossless_prefix_tokens"] = self.lossless_prefix
        return config

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus the label (show_drafter only shapes the label)."""
        fields = asdict(self)
        del fields["show_drafter"]
        return {"label": self.label, **fields}


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


def default_window(k: int) -> int:
    """The FLy window the engine uses when fly_window_size is unset, for this K (from SpeculativeConfig)."""
    config = SpeculativeConfig(method=NGRAM, num_speculative_tokens=k, rejection_sample_method=WINDOWED)
    return config.policy_settings["fly_window_size"]


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
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods={','.join(methods)!r}: each must be one of {', '.join(METHODS)}")
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
    methods: Sequence[str],
    ks: Sequence[int],
    headline_k: int,
    extra_windows: Sequence[int],
    drafters: Sequence[str],
    peer: str | None,
) -> None:
    """ValueError naming the first K, window or drafter option of a sweep that breaks its rule."""
    speculative = [m for m in methods if m != "target"]
    if speculative or peer is not None:
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"k={list(ks)}: need at least one K, each >= 1")
        if headline_k not in ks:
            raise ValueError(f"headline_k={headline_k} must be one of the swept K values {list(ks)}")
        if speculative and not drafters:
            raise ValueError("speculative methods need at least one drafter (--draft MODEL or --draft ngram)")
    # Each lossy policy's own rules for the headline K (e.g. FLy needs K >= 2).
    for method in (m for m in methods if m in LOSSY_METHODS):
        try:
            verification_policy(method).resolve_config({}, headline_k)
        except ValueError as exc:
            raise ValueError(
                f"headline_k={headline_k}: {method}: {exc} (drop {method} from --methods)"
            ) from None
    if WINDOWED in methods:
        bad = [w for w in extra_windows if w >= headline_k or w < 1]
        if bad:
            raise ValueError(
                f"fly_windows={list(extra_windows)}: each window must satisfy 1 <= W < the headline K "
                f"({headline_k})"
            )
    if len(set(drafters)) != len(drafters):
        raise ValueError(f"drafters={list(drafters)}: each drafter may be given once")


def plan_arms(
    *,
    methods: Sequence[str],
    batch_sizes: Sequence[int],
    ks: Sequence[int],
    headline_k: int,
    extra_windows: Sequence[int],
    drafters: Sequence[str],
    peer: str | None,
    fly_threshold: float = DEFAULT_FLY_ENTROPY_THRESHOLD,
    quantizations: Sequence[str | None] = (None,),
    lossless_prefixes: Sequence[int] = (0,),
) -> list[Arm]:
    """The sweep's arms, by the rule in the module docstring. Raises ValueError naming a bad option."""
    _check_lists(methods, batch_sizes, peer, quantizations, lossless_prefixes)
    _check_speculation(methods, ks, headline_k, extra_windows, drafters, peer)
    lossy = [m for m in methods if m in LOSSY_METHODS]
    show = len(drafters) > 1
    arms: list[Arm] = []
    batches = sorted(batch_sizes)
    for q in quantizations:
        for batch in batches:
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
                    for method in lossy:
                        for prefix in lossless_prefixes:
                            arms.extend(
                                _lossy_arms(
                                    method, batch, drafter, k, extra_windows, fly_threshold, show, q, prefix
                                )
                            )
    if peer is not None:
        arms.append(Arm(peer, "target", 1))
        for drafter in drafters:
            arms.extend(Arm(peer, "standard", 1, drafter, k, show_drafter=show) for k in ks)
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise ValueError(f"drafters={list(drafters)}: two drafters share a short name; rename one folder")
    return arms


def _lossy_arms(
    method: str,
    batch: int,
    drafter: str,
    k: int,
    extra_windows: Sequence[int],
    fly_threshold: float,
    show: bool,
    quantization: str | None,
    prefix: int,
) -> list[Arm]:
    """One lossy policy's arms at the headline K: its defaults, and for FLy every extra window at batch 1."""
    common = dict(show_drafter=show, quantization=quantization, lossless_prefix=prefix)
    if method != WINDOWED:
        return [Arm("flyspec", method, batch, drafter, k, **common)]  # type: ignore[arg-type]
    windows = [default_window(k)]
    if batch == 1:
        windows += [w for w in extra_windows if w != windows[0]]
    return [
        Arm("flyspec", method, batch, drafter, k, w, w == windows[0], fly_threshold, **common)  # type: ignore[arg-type]
        for w in windows
    ]

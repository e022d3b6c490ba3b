"""The settings of `flyspec gate shadow`'s traffic layer, checked once here (ValueError naming the option
and its rule)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flyspec.checks import is_int
from flyspec.gate.arms.base import ArmSpec
from flyspec.gate.arms.registry import parse_arm
from flyspec.gate.shadow.admission import PairBudget, SamplingRule
from flyspec.gate.shadow.redact import Redactor
from flyspec.gate.shadow.spend import SpendCaps

if TYPE_CHECKING:
    from flyspec.gate.arms.endpoint import OpenAIArm

DEFAULT_QUEUE_SIZE = 256
DEFAULT_MAX_REQUEST_BYTES = 1 << 20


def endpoint_arm(name: str, spec: ArmSpec) -> OpenAIArm:
    """An endpoint arm from the same JSON as `gate run` takes (dict, JSON string or JSON file); the shadow
    process forwards HTTP, so an engine arm is refused."""
    arm = parse_arm(name, spec)
    if arm.kind != "openai":
        raise ValueError(
            f"--{name}: gate shadow forwards traffic to OpenAI-compatible endpoints; give "
            '{"base_urls": [...], "model": ...}, not an arm of kind ' + repr(arm.kind)
        )
    return arm


@dataclass(frozen=True)
class ShadowSettings:
    """baseline / candidate: endpoint arms (``endpoint_arm``). sample: the mirrored share of eligible
    requests, drawn by ``SamplingRule(sample, sample_seed)``. max_pairs: stop mirroring after this many
    pairs (None: never). candidate_concurrency: candidate requests in flight at most.
    max_candidate_requests_per_minute / max_candidate_tokens_per_minute: spend caps (None: none).
    redact: regular expressions masked before storing or asking the candidate. queue_size: copies waiting
    for a worker at most (more are skipped as ``queue_full``). max_request_bytes: longer request bodies
    are not mirrored (``too_long``)."""

    baseline: OpenAIArm
    candidate: OpenAIArm
    sample: float = 1.0
    sample_seed: int = 0
    max_pairs: int | None = None
    candidate_concurrency: int = 4
    max_candidate_requests_per_minute: int | None = None
    max_candidate_tokens_per_minute: int | None = None
    redact: tuple[str, ...] = field(default_factory=tuple)
    queue_size: int = DEFAULT_QUEUE_SIZE
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        for option, value in (
            ("--candidate-concurrency", self.candidate_concurrency),
            ("queue_size", self.queue_size),
            ("max_request_bytes", self.max_request_bytes),
        ):
            if not is_int(value, 1):
                raise ValueError(f"{option}={value!r}: must be a positive integer")
        # Build each checked part once, so a bad value fails here, before the server starts.
        self.rule()
        self.budget()
        self.caps()
        self.redactor()

    def rule(self) -> SamplingRule:
        """The registered sampling rule."""
        return SamplingRule(self.sample, self.sample_seed)

    def budget(self) -> PairBudget:
        """A fresh pair budget."""
        return PairBudget(self.max_pairs)

    def caps(self) -> SpendCaps:
        """Fresh per-minute caps."""
        return SpendCaps(self.max_candidate_requests_per_minute, self.max_candidate_tokens_per_minute)

    def redactor(self) -> Redactor:
        """The compiled --redact patterns."""
        return Redactor(self.redact)

"""A judged run's registered gold-label rule (``Registration.gold``: runs, reports, labelling and the alpha
ledger read it the same way; flyspec/gate/stats/judged.py has the statistics)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flyspec.gate.grading.graders import model_graded
from flyspec.gate.stats.judged import GOLD_DRAW, GOLD_DRAWS, gold_selected

DEFAULT_GOLD_RATE = 0.2


@dataclass(frozen=True)
class Gold:
    """A judged run's registered gold-label rule: ``rate`` (the share of differing pairs drawn), ``seed``
    (of the draw), ``source`` (``exact``: the question's own grader labels it at once; ``human``: a person
    labels it with ``flyspec gate label``), ``every_question`` (the judge grades every question, not only
    those with grader ``judge``) and ``draw``, the version of the draw (``gold_draw``): 2 for every new run;
    1, the defective draw that picked a prefix of the question order, for runs registered before it was
    fixed (a registration without the key), which recompute their decisions with it under a warning."""

    rate: float
    seed: int
    source: str
    every_question: bool = False
    draw: int = GOLD_DRAW

    def to_dict(self) -> dict[str, Any]:
        out = {"rate": self.rate, "seed": self.seed, "source": self.source, "all": self.every_question}
        # Draw 1 was registered without the key, so such a run's resume compares equal.
        return out if self.draw == 1 else {**out, "draw": self.draw}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Gold:
        """The rule as registered (a registration without the ``draw`` key is draw 1)."""
        draw = int(data.get("draw", 1))
        if draw not in GOLD_DRAWS:
            raise ValueError(f"gold-label draw {draw} is unknown to this flyspec (it knows {GOLD_DRAWS})")
        rate, seed, source = float(data["rate"]), int(data["seed"]), str(data["source"])
        return cls(rate, seed, source, bool(data.get("all")), draw)

    @property
    def defective(self) -> bool:
        """True for draw 1: its drawn pairs were a prefix of the order, not a random subset."""
        return self.draw == 1

    def selected(self, dataset: str, question_id: str) -> bool:
        return gold_selected(self.seed, dataset, question_id, self.rate, self.draw)

    def judged(self, grader: str) -> bool:
        """Whether a question with this grader is graded by the judge."""
        return self.every_question or model_graded(grader)

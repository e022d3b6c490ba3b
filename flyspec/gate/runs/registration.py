"""What every kind of run registers before its first answer, written once for ``gate run``/``gate pilot``
(flyspec/gate/runs/runner.py) and ``gate tune`` (flyspec/gate/runs/tune.py): the settings, the arms'
identities, the datasets' hashes, the question order and what was left out. Each kind adds its own keys
(a run its design and comparisons, a tune its settings and test order); the stored layout is the one runs
have always registered, so older runs resume.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from flyspec.gate.data.datasets import Question, dataset_info
from flyspec.gate.data.order import QuestionKey, select_questions
from flyspec.gate.runs.loop import Datasets
from flyspec.gate.runs.options import RunSettings

ORDER_RULE = "sha256(seed:dataset:id) ascending"


def question_pool(
    datasets: Datasets, settings: RunSettings, excluded: Collection[QuestionKey], limit: int | None = None
) -> list[Question]:
    """Every question of the datasets in the registered order (docs/gate.md, "Which questions, in which
    order"), without ``excluded``; ``limit``: the first N of each dataset's order."""
    by_dataset = {name: qs for name, (_, qs) in datasets.items()}
    return select_questions(by_dataset, seed=settings.question_order_seed, limit=limit, excluded=excluded)


@dataclass(frozen=True)
class Registration:
    """The registration keys a run and a tune share (typed here, written by ``common``)."""

    settings: RunSettings
    identities: dict[str, dict[str, Any]]
    datasets: Datasets

    def common(self) -> dict[str, Any]:
        """Margin, alpha, seeds, sampling, the arms' identities and the alpha budget when one is set."""
        o = self.settings
        out: dict[str, Any] = {
            "margin": float(o.margin),
            "alpha": float(o.alpha),
            "seed": o.seed,
            "sampling": {"temperature": o.temperature, "top_p": o.top_p, "max_tokens": o.max_tokens},
            "arms": self.identities,
            "shuffle_seed": o.shuffle_seed,
        }
        if o.alpha_budget is not None:
            out["alpha_budget"] = float(o.alpha_budget)
        return out

    def dataset_hashes(self, questions: Sequence[Question] | None = None) -> dict[str, dict[str, Any]]:
        """Each dataset's sha256 and size; with ``questions``, how many of them the run registered."""
        counts: dict[str, int] = {name: 0 for name in self.datasets}
        for q in questions or ():
            counts[q.dataset] += 1
        return {
            name: {
                "sha256": dataset_info(spec).sha256,
                **({"questions": counts[name]} if questions is not None else {}),
                "available": len(qs),
            }
            for name, (spec, qs) in self.datasets.items()
        }

    def order(self, pool: int, rule: str = ORDER_RULE) -> dict[str, Any]:
        """How the questions were ordered, and the number they were drawn from."""
        return {"seed": self.settings.question_order_seed, "rule": rule, "pool": pool}

    @staticmethod
    def excluded(runs: Sequence[str], questions: int) -> dict[str, Any]:
        """Which runs' questions were left out, and how many."""
        return {"runs": list(runs), "questions": questions}

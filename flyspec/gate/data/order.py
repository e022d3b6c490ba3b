"""Which questions a run answers, and in which order.

Every run answers its questions in a seeded random order: question ``q`` of dataset ``d`` gets the key
``sha256(f"{seed}:{d}:{q.id}")`` and questions are taken in key order. Over several datasets that is a
uniformly random interleave of each dataset's own random order, so:

- any prefix of the order is a simple random sample of the registered questions, which is what a
  confidence sequence monitored along the order needs (docs/gate.md, "Which questions, in which order");
- ``--limit N`` takes the first N of each dataset's random order and ``--max-questions N`` the first N of
  the interleave, never the first N lines of a file (files are often sorted by source or difficulty);
- the order is the same on every machine and Python version (a hash, not a library's shuffle), and a
  dataset's order does not change when another dataset is registered beside it.

Questions that other runs in the store have used (every pilot, and the runs named by ``--exclude-run``)
are left out before the order is taken, so a later run answers questions nobody has looked at yet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from flyspec.gate.data.datasets import Question

QuestionKey = tuple[str, str]


def order_key(seed: int, dataset: str, question_id: str) -> str:
    """The sort key of one question in the run's order."""
    return hashlib.sha256(f"{seed}:{dataset}:{question_id}".encode()).hexdigest()


def in_order(questions: Iterable[Question], seed: int) -> list[Question]:
    """``questions`` in the seeded random order."""
    return sorted(questions, key=lambda q: order_key(seed, q.dataset, q.id))


def select_questions(
    by_dataset: dict[str, list[Question]],
    *,
    seed: int,
    limit: int | None = None,
    max_questions: int | None = None,
    excluded: set[QuestionKey] | frozenset[QuestionKey] = frozenset(),
) -> list[Question]:
    """The run's questions in the order they are answered.

    ``excluded`` (dataset, id) pairs are dropped first; ``limit`` keeps the first N of each dataset's
    order; ``max_questions`` keeps the first N of the interleaved order. ValueError when a dataset has
    no question left or fewer questions remain than ``max_questions`` asks for.
    """
    chosen: list[Question] = []
    for name, questions in by_dataset.items():
        pool = [q for q in questions if (name, q.id) not in excluded]
        if not pool:
            raise ValueError(
                f"dataset {name!r}: all {len(questions)} questions were used by earlier runs in this store "
                "(pilots and --exclude-run); use another dataset or another store"
            )
        ordered = in_order(pool, seed)
        chosen.extend(ordered if limit is None else ordered[:limit])
    ordered = in_order(chosen, seed)
    if max_questions is not None:
        if max_questions > len(ordered):
            left = "" if not excluded else f" once the {len(excluded)} questions of earlier runs are left out"
            raise ValueError(
                f"max_questions={max_questions}: the registered datasets hold {len(ordered)} questions{left}"
            )
        ordered = ordered[:max_questions]
    return ordered

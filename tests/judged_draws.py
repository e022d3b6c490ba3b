"""The gate's own question order and gold-label draw, for simulated judged runs.

A simulated run r gets seed ``r`` for its question order and its gold draw (a gate run's default: the
order seed is the run's seed), over questions ``q0, q1, ...`` of one dataset. Its order is
``flyspec.gate.data.questions.in_order`` and each question's draw number is
``flyspec.gate.stats.judged.gold_draw``: exactly what a registered run uses, so a draw that depends on the
order shows up in the simulation instead of being replaced by an independent random generator. Draw 1,
the draw earlier runs registered (it hashed the same string as the order, so it drew a prefix of it), is
kept here only, so that the tests show they fail on an order-correlated draw.
``flyspec.gate.stats.simulation.judged_runs`` takes both (``orders``, ``draws``).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from flyspec.gate.data.questions import Question, in_order
from flyspec.gate.stats.judged import GOLD_DRAW, gold_draw

DATASET = "sim"


@lru_cache(maxsize=8)
def run_draws(runs: int, questions: int, draw: int) -> tuple[np.ndarray, np.ndarray]:
    """``(orders, draws)``, each runs x questions: the index of the question at each place of run r's
    order, and that question's gold-draw number (a pair is drawn when it is below the rate). Cached: the
    arrays are shared, never to be written."""
    pool = [Question(f"q{i}", "1", "exact", DATASET, prompt=str(i)) for i in range(questions)]
    index = {q.id: i for i, q in enumerate(pool)}
    orders = np.empty((runs, questions), dtype=np.int64)
    draws = np.empty((runs, questions))
    for seed in range(runs):
        ordered = in_order(pool, seed)
        orders[seed] = [index[q.id] for q in ordered]
        draws[seed] = [_draw(seed, q.id, draw) for q in ordered]
    orders.flags.writeable = draws.flags.writeable = False
    return orders, draws


def _draw(seed: int, question_id: str, draw: int) -> float:
    """The gate's draw (``GOLD_DRAW``), or draw 1: the first 8 bytes of the question order's own digest."""
    if draw == GOLD_DRAW:
        return gold_draw(seed, DATASET, question_id)
    digest = hashlib.sha256(f"{seed}:{DATASET}:{question_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64

"""What a sequential decision claims: about the method on questions like these (``superpopulation``, the
default) or about exactly the registered questions in this run's outputs (``finite``), in plain words
(docs/statistics.md, "Which target to use: what a PASS claims"). Kept apart from the monitor
(flyspec/gate/stats/monitor.py) so that the settings that choose a claim read it without loading the
statistics."""

from __future__ import annotations

SUPERPOPULATION = "superpopulation"
FINITE = "finite"
POPULATIONS = (SUPERPOPULATION, FINITE)
CLAIMS = {
    "superpopulation": (
        "The claim is about the method on questions like these: the per-question differences are treated "
        "as a random sample, so the verdict covers other questions drawn the same way and another run of "
        "these (run-to-run variation in the outputs included)."
    ),
    "finite": (
        "The claim is about these {n} questions as answered in this run: it holds for the mean over exactly "
        "this set with these outputs, and says nothing about other questions or another run of the same "
        "questions (the set was declared the whole population with --population finite)."
    ),
}
"""One plain sentence per population: what a sequential run's decision speaks about (docs/statistics.md,
"Which target to use: what a PASS claims")."""


def claim(population: str, population_size: int | None = None) -> str:
    """The plain-words claim of a sequential run over this population (``CLAIMS``)."""
    if population not in POPULATIONS:
        raise ValueError(f"population={population!r}: one of {', '.join(POPULATIONS)}")
    return CLAIMS[population].format(n=population_size if population_size is not None else "N")

"""The CPU a shadow run's worker spends while a run with many stored pairs keeps receiving a few: store N
pairs graded against production (no HTTP: pairs handed to the run as the mirror hands them), reopen the run
as a restarted `flyspec gate shadow` would, then feed 2 pairs a second for 10 s and report the process's
CPU time per wall second. The worker shares the proxy's interpreter lock, so this is CPU taken from the
relay. Run it with the code to measure on PYTHONPATH:

    PYTHONPATH=. .venv/bin/python benchmarks/shadow_worker_cpu.py 2000 8000
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from flyspec.gate.shadow.mirror import ShadowSettings, endpoint_arm
from flyspec.gate.shadow.pairs import ArmAnswer, MirroredPair
from flyspec.gate.shadow.run import ShadowPlan, ShadowRun, shadow_registration

ARM = {"base_urls": ["http://127.0.0.1:9"], "model": "m"}  # never asked
GRADER = "equivalent_to_baseline:last_number"


def _pair(i: int) -> MirroredPair:
    answer = ArmAnswer(f"x {i % 7}", 200, 0.1, prompt_tokens=3, completion_tokens=4)
    request = {"messages": [{"role": "user", "content": f"question {i}"}]}
    return MirroredPair(time.time(), "proxy", "/chat/completions", request, answer, answer)


def _run(store: Path) -> ShadowRun:
    settings = ShadowSettings(
        baseline=endpoint_arm("baseline", ARM), candidate=endpoint_arm("candidate", ARM)
    )
    # Equal answers at a tiny margin: the run stays INCONCLUSIVE, as a long real run before it decides.
    plan = ShadowPlan("bench", 0.0001, 0.025, None, grader=GRADER)
    registration = shadow_registration(
        plan, settings.baseline, settings.candidate, settings.rule().describe()
    )
    run = ShadowRun(store, plan, registration)
    run.start()
    return run


def measure(stored: int) -> float:
    """Percent of a core the process spends over 10 s of 2 pairs a second, with ``stored`` pairs before."""
    folder = Path(tempfile.mkdtemp())
    os.environ["FLYSPEC_GATE_LEDGER"] = str(folder / "ledger.sqlite")  # not a look anyone decides on
    run = _run(folder / "shadow.db")
    for i in range(stored):
        run(_pair(i))
    run.close()
    run = _run(folder / "shadow.db")
    time.sleep(3)  # a restarted process walks what is stored once
    cpu, wall = time.process_time(), time.monotonic()
    for i in range(20):
        run(_pair(stored + i))
        time.sleep(0.5)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    run.close()
    return 100 * cpu / wall


if __name__ == "__main__":
    for n in map(int, sys.argv[1:] or ["2000"]):
        print(f"{n} pairs stored: {measure(n):.1f}% of a core with 2 pairs a second arriving", flush=True)

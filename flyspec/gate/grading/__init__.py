"""Grading: how a model's output becomes right or wrong. The graders and the judge's rule (``graders.py``),
and code answers with the sandbox that runs them against their tests (``code_exec.py`` and its two
processes)."""

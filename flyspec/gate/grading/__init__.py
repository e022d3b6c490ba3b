"""Grading: how a model's output becomes right or wrong. The graders (``graders.py``), the code sandbox
that runs a ``code`` answer against its tests (``code_grader.py``, ``code_exec.py`` and its two processes)
and the judge's rule for open-ended answers (``judge.py``)."""

"""Running the gate: the settings (``settings.py``; how a command gives them: ``flags.py``), the plan of every
kind of run (``plan.py``: arms, datasets, questions), the runner every run shares (``run.py``: register,
answer; ``gate run``, ``gate pilot``, ``flyspec demo``), ``gate tune`` (``tune.py``; its options and
candidates: ``tune_settings.py``), one answering session (``session.py``), the executors driven at once
(``dispatch.py``), the judge's pairs (``judging.py``), questions left out and the alpha ledger's checks
(``exclusion.py``) and the progress bar (``progress.py``)."""

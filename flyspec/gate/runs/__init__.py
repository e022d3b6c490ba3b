"""Running the gate: the settings (``options.py``), ``gate run``/``gate pilot`` (``runner.py``), ``gate
tune`` (``tune.py``, ``tune_settings.py``), one answering session (``session.py``), the executors driven at
once (``dispatch.py``), the judge's pairs (``judging.py``), questions left out (``exclusion.py``) and the
progress bar (``progress.py``)."""

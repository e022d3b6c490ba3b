"""Running the gate: the settings (``options.py``), the run loop every run shares (``loop.py``), ``gate
run``/``gate pilot``/``flyspec demo`` (``runner.py``), ``gate tune`` (``tune.py``, ``tune_settings.py``), one
answering session (``session.py``), the executors driven at once (``dispatch.py``), the judge's pairs
(``judging.py``), questions left out and the alpha ledger's checks (``exclusion.py``) and the progress bar
(``progress.py``)."""

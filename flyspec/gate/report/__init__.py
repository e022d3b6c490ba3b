"""Reports: a run's numbers and JSON (``model.py``), built from the store by ``build.py`` (the decision by
``decisions.py``, the words by ``advice.py``), printed as markdown and HTML by ``markdown.py``; a tune's
report (``tune_report.py``)."""

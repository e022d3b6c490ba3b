"""Reports: a gate run's or pilot's numbers (``model.py``, ``comparisons.py``, ``speeds.py``, built from the
store by ``report.py``, the decision by ``decisions.py``), how they read in markdown and HTML
(``render.py``, ``wording.py``), and a ``gate tune``'s report (``tune_report.py``)."""

"""Reports: a gate run's or pilot's numbers and their JSON (``model.py``), built once from the store by
``build.py`` (the paired rows and the decision by ``decisions.py``, the words and the forecast by
``advice.py``), printed by ``markdown.py`` and ``html.py``; a ``gate tune``'s report (``tune_report.py``)."""

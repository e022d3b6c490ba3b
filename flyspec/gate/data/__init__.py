"""The questions a run asks and the answers it keeps: dataset readers (``datasets.py``, ``code_datasets.py``,
``rows.py``), the question record (``questions.py``), the seeded question order (``order.py``) and the SQLite
store with its lock (``store.py``, ``lock.py``)."""

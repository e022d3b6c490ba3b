"""The questions a run asks and the answers it keeps: the question record, row reading and seeded order
(``questions.py``), the dataset readers (``datasets.py``), the records a run registers and their one codec
(``spec.py``, ``codec.py``), and the SQLite store (``store.py``, its tables in ``schema.py``, its lock in
``lock.py``) with the per-user alpha ledger (``ledger.py``)."""

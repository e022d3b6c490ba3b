"""The questions a run asks (questions.py), what it registers (spec.py), the SQLite store that
keeps its answers (store.py, storefile.py), what they come to (results.py) and the per-user alpha ledger
(ledger.py)."""

"""``gate compare``: existing per-sample logs (lm-eval, Inspect, a gate store) read (``evallogs.py``),
paired question by question (``pairing.py``) and decided like a gate run (``compare.py``)."""

"""``gate compare``: existing per-sample logs (lm-eval, Inspect, a gate store) read (``evallogs.py``),
paired question by question and decided like a fixed gate run (``compare.py``)."""

"""The arms being compared and the executors that answer for them: the shared vocabulary (``base.py``),
this package's in-process engine (``engine.py``) and any OpenAI-compatible endpoint (``endpoint.py``)."""

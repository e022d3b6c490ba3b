"""The arms being compared and the executors that answer for them (docs/gate.md, "Arms").

``base.py`` holds what every kind shares (``Sampling``, ``Job``, ``Completion``, the ``Arm`` and ``Executor``
protocols); each kind is one module: this package's engine in-process (``engine.py``) and any
OpenAI-compatible endpoint (``endpoint.py``); ``registry.py`` is the only code that knows the kinds
(``parse_arm``, ``make_executors``). ``judge.py`` is the judge's endpoint: not an arm, but called like one.
An arm is given as a dict, a JSON object string or a JSON file; ``kind`` may be omitted (an arm with
``base_url(s)`` is an endpoint, otherwise an engine).
"""

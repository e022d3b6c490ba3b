"""Live traffic for the gate (`flyspec gate shadow`, docs/shadow.md): the traffic layer.

An OpenAI-compatible proxy in front of production (proxy.py) and a mirror sink for copies sent by nginx,
Envoy or Istio; a registered sampling rule, eligibility and spend caps (admission.py, spend.py); a bounded
queue and workers that ask the candidate after the client has its answer (mirror.py) and hand each
``MirroredPair`` (pairs.py) to a sink callable, such as the SQLite pair store (pair_store.py).

This package uses the gate's arms; nothing in the gate imports it (the CLI does).
"""

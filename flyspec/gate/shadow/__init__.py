"""Live traffic for the gate (`flyspec gate shadow`, docs/shadow.md).

The traffic: an OpenAI-compatible proxy in front of production (proxy.py) and a mirror sink for copies
sent by nginx, Envoy or Istio; a registered sampling rule, eligibility and spend caps (admission.py,
spend.py); a bounded queue and workers that ask the candidate after the client has its answer
(mirror.py) and hand each ``MirroredPair`` (pairs.py) to a sink callable.

The run: ``ShadowRun`` (run.py), the sink that makes the pairs a registered gate run in the gate's store
(registration.py; the pair records in pair_store.py, grading and judging in worker.py), and its
/decision, /status and gauges (status.py, metrics.py).

This package uses the gate's arms, data, grading, stats, the runs' judged pairs and the report's build;
nothing in the gate imports it (the CLI does).
"""

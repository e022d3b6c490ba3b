"""Live traffic for the gate (`flyspec gate shadow`, docs/shadow.md): the proxy and mirror sink
(proxy.py), what is mirrored and how (mirror.py), the pairs and their table (pairs.py), the registered
run they feed (run.py), its /decision, /status and gauges (status.py) and the labelling page (label.py).
Nothing in the gate imports it (the CLI does)."""

"""Live traffic for the gate (`flyspec gate shadow`, docs/shadow.md): the app with its proxy, mirror sink,
/decision and /status (proxy.py), what is mirrored and how (mirror.py), the pairs and their table
(pairs.py), the registered run they feed (run.py) and the labelling page (label.py). Nothing in the gate
imports it (the CLI does)."""

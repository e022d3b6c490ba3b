"""How slow this machine is right now, measured by a separate process, for latency bounds in tests.

A latency bound measured against a quiet machine fails when another process (a model being prepared, a
compile, another test run) takes the CPU in the middle of the test. `Reference` runs in its own process,
sharing nothing with the test (not its GIL, not a server's event loop), and records, every 20 ms, the
round trip of a trivial HTTP request on loopback to its own server and the time of a fixed piece of pure
Python work. A test compares what it measured against this reference over the same window: a server
that stalls its event loop slows its own requests, not the reference's.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

_PROBE = r"""
import http.server, sys, threading, time, urllib.request

class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_port}/"
with open(sys.argv[1], "w") as out:
    while True:
        t0 = time.monotonic()
        urllib.request.urlopen(url, timeout=60).read()
        t1 = time.monotonic()
        sum(i * i for i in range(20_000))
        out.write(f"{t0} {t1 - t0} {time.monotonic() - t1}\n")
        out.flush()
        time.sleep(0.02)
"""


class Reference:
    """The reference process, running while the `with` block runs (see the module docstring)."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Reference:
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(self.log)])
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def _samples(self, start: float, end: float) -> list[tuple[float, float]]:
        """(round trip, work) of the samples taken between monotonic times `start` and `end`."""
        rows = [line.split() for line in self.log.read_text().splitlines()]
        samples = [(float(rtt), float(work)) for t0, rtt, work in rows if start <= float(t0) <= end]
        assert len(samples) >= 5, f"the reference took {len(samples)} samples in {end - start:.1f} s"
        return samples

    def slowest_round_trip(self, start: float, end: float) -> float:
        """The slowest loopback round trip between `start` and `end` (time.monotonic() values)."""
        return max(rtt for rtt, _ in self._samples(start, end))

    def median_work(self, start: float, end: float) -> float:
        """The median time of the fixed work between `start` and `end`: how much CPU one thread gets."""
        return statistics.median(work for _, work in self._samples(start, end))

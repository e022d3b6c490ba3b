"""Run a server app on a loopback port from inside a Python process (tests, benchmarks, the gate).

The socket is bound before uvicorn starts, so port 0 (any free port) has no race between picking the
port and listening on it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI


@dataclass
class BackgroundServer:
    """A running server: `base_url` is e.g. "http://127.0.0.1:43121" (no /v1 suffix)."""

    host: str
    port: int

    @property
    def base_url(self) -> str:
        """The root URL of the server."""
        return f"http://{self.host}:{self.port}"


@contextmanager
def serve_in_background(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0
) -> Iterator[BackgroundServer]:
    """Serve `app` with uvicorn on a thread until the block exits, then shut it down gracefully."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="flyspec-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    try:
        yield BackgroundServer(host, port)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()

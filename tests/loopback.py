"""A FastAPI app served on loopback by a real uvicorn server in a background thread, for tests that need
an OpenAI-compatible endpoint whose answers they script."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from flyspec.bench.peers import free_port


@contextmanager
def serve_app(app: FastAPI, timeout: float = 20.0) -> Iterator[str]:
    """Serve ``app`` on a free loopback port; yields its ``/v1`` base URL and stops it afterwards."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert time.monotonic() < deadline, "the loopback server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)

"""Shared pieces of the shadow tests: scripted upstreams (flyspec/bench/scripted_openai.py, fixed answers,
enough for proxy mechanics) and the shadow app, each served by a real uvicorn server on loopback."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from loopback import serve_app

from flyspec.bench.scripted_openai import Script, scripted_app
from flyspec.gate.shadow.pair_store import SqlitePairStore
from flyspec.gate.shadow.proxy import create_shadow_app
from flyspec.gate.shadow.settings import ShadowSettings, endpoint_arm


@contextmanager
def upstream(script: Script) -> Iterator[str]:
    """A scripted server for ``script``; yields its root URL."""
    with serve_app(scripted_app(script)) as v1:
        yield v1.removesuffix("/v1")


def arm(url: str, model: str, **extra: Any) -> dict[str, Any]:
    """An endpoint arm's JSON object."""
    return {"base_urls": [url], "model": model, **extra}


@contextmanager
def shadow(
    store: Path, baseline: dict[str, Any], candidate: dict[str, Any], **settings: Any
) -> Iterator[Any]:
    """The shadow app in front of ``baseline``, storing pairs in ``store``; yields (root URL, store)."""
    options = ShadowSettings(
        baseline=endpoint_arm("baseline", baseline),
        candidate=endpoint_arm("candidate", candidate),
        **settings,
    )
    pairs = SqlitePairStore(store)
    try:
        with serve_app(create_shadow_app(options, pairs)) as v1:
            yield v1.removesuffix("/v1"), pairs
    finally:
        pairs.close()


def wait_pairs(pairs: SqlitePairStore, count: int, timeout: float = 20.0) -> None:
    """Wait until ``count`` pairs are stored."""
    deadline = time.monotonic() + timeout
    while pairs.count() < count:
        assert time.monotonic() < deadline, f"{pairs.count()} pairs stored, expected {count}"
        time.sleep(0.02)


def metric(root: str, name: str) -> float:
    """One sample's value from the shadow app's /metrics (``name`` with its labels, as printed)."""
    for line in httpx.get(root + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def skipped(root: str, reason: str) -> float:
    """flyspec_shadow_skipped_total for ``reason``."""
    return metric(root, f'flyspec_shadow_skipped_total{{reason="{reason}"}}')


def stored(store: Path) -> list[dict[str, Any]]:
    """The stored pairs, oldest first, their JSON columns decoded."""
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT source, route, request, baseline, candidate FROM shadow_pairs ORDER BY id")
        return [
            {
                "source": s,
                "route": r,
                "request": json.loads(q),
                "baseline": json.loads(b),
                "candidate": json.loads(c),
            }
            for s, r, q, b, c in rows.fetchall()
        ]

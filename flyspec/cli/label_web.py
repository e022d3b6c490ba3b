"""`flyspec gate label --web`: the labelling page (flyspec/gate/shadow/label.py) for a store's judged
run, served on its own by uvicorn until Ctrl-C; the terminal `gate label` keeps working on the same queue."""

from __future__ import annotations

from pathlib import Path

from flyspec.gate.data.results import gold_rule
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import label_progress
from flyspec.gate.shadow.label import check_label_host, label_requests, label_router


def serve_label_page(store: Path, run_id: str | None, host: str, port: int, token: str | None) -> None:
    """Serve the labelling page of ``run_id`` (the latest judged run when None) on ``host:port``."""
    import uvicorn
    from fastapi import FastAPI

    check_label_host(host, token)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port={port} is invalid: it must be in 0..65535")
    if not store.exists():
        raise ValueError(f"--store {store}: no such file")
    with GateStore(store) as opened:
        run, _ = gold_rule(opened, run_id)  # a clear error now, not on the first page load
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(
        label_router(store, run.run_id, token, progress=label_progress, requests=label_requests(store))
    )
    query = "?token=TOKEN" if token else ""
    address = f"http://{host}:{port}/label{query}"
    print(f"gate label: run {run.run_id!r}: the labelling page is at {address} (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")

"""The labelling page's JSON API (flyspec/gate/shadow/label.py) on a real judged run, through FastAPI's
TestClient: the same queue as `flyspec gate label`, labels stored with the labeller and the time, a label
for a pair that does not wait refused 409, a second labeller counted as agreement, the token, the page's
Content-Security-Policy, and `gate label --web` refusing to serve off loopback without a token."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from label_runs import hostile_run

from flyspec.bench.peers import free_port
from flyspec.gate.data.results import gold_rule, pending, request_texts
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import build_report, label_progress
from flyspec.gate.shadow.label import check_label_host, label_router


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return hostile_run(tmp_path_factory.mktemp("label"), questions=20)


@pytest.fixture
def client(run: tuple[Path, str], tmp_path: Path) -> Iterator[tuple[TestClient, Path, str]]:
    """A client of the page on a copy of the run's store (each test labels its own)."""
    store = tmp_path / "labels.db"
    store.write_bytes(run[0].read_bytes())
    app = FastAPI()
    app.include_router(label_router(store, run[1], None, progress=label_progress))
    with TestClient(app) as c:
        yield c, store, run[1]


Client = tuple[TestClient, Path, str]
GATE_LABEL = [sys.executable, "-c", "from flyspec.cli import main; main()", "gate", "label"]


def _terminal_queue(store: Path, run_id: str) -> list[tuple[str, str, str, str]]:
    with GateStore(store) as opened:
        run, gold = gold_rule(opened, run_id)
        todo = pending(opened, run, gold, request_texts(run))
    return [(p.question.dataset, p.question.question_id, p.answer_a, p.answer_b) for p in todo]


def _label(c: TestClient, pair: dict, key: str, labeller: str, second: bool = False):  # type: ignore[no-untyped-def]
    body = {"dataset": pair["dataset"], "question_id": pair["question_id"], "key": key, "labeller": labeller}
    return c.post("/label/api/labels", json={**body, "second": second})


def test_the_page_shows_the_terminal_queue_blind_and_stores_labels(
    client: Client,
) -> None:
    """The page's waiting pairs are `gate label`'s, in its order with its sides; nothing names an arm; a
    label is stored with the labeller's name and time and maps back to baseline/candidate; the report
    counts it."""
    c, store, run_id = client
    view = c.get("/label/api/queue", params={"labeller": "ann"}).json()
    pairs = view["pairs"]
    assert [(p["dataset"], p["question_id"], p["a"], p["b"]) for p in pairs] == _terminal_queue(store, run_id)
    assert len(pairs) == 4 and {p["mode"] for p in pairs} == {"gold"}
    assert all(
        set(p) == {"dataset", "question_id", "position", "request", "reference", "a", "b", "mode"}
        for p in pairs
    )
    assert view["progress"]["labelled"] == 0 and view["progress"]["waiting"] == 4
    assert view["progress"]["decision"] is None  # drawn pairs wait: no decision yet
    first = pairs[0]
    hostile_is_a = "pwned" in first["a"]
    reply = _label(c, first, "b" if hostile_is_a else "a", "ann")
    assert reply.status_code == 200 and reply.json()["stored"] == "gold"
    assert reply.json()["progress"]["labelled"] == 1 and reply.json()["progress"]["waiting"] == 3
    with GateStore(store) as opened:
        (label,) = opened.labels(run_id).values()
    assert label.value == -1  # the baseline's answer (the one without the hostile text) is better
    assert label.detail["labeller"] == "ann" and label.detail["labelled_at"].startswith("20")
    assert label.detail["shown_as_a"] == ("candidate" if hostile_is_a else "baseline")
    assert len(_terminal_queue(store, run_id)) == 3
    report = build_report(store, run_id)
    assert report.gold is not None and report.gold.labelled == 1 and report.gold.agreement == 1.0


def test_a_label_for_a_pair_that_does_not_wait_is_refused_409(client: Client) -> None:
    c, store, run_id = client
    first = c.get("/label/api/queue", params={"labeller": "ann"}).json()["pairs"][0]
    assert _label(c, first, "e", "ann").status_code == 200
    again = _label(c, first, "a", "bob")
    assert again.status_code == 409 and "ann labelled it already" in again.json()["error"]
    never = _label(c, {"dataset": "open", "question_id": "q1"}, "a", "ann")  # identical answers: not drawn
    assert never.status_code == 409 and "is not waiting for a label" in never.json()["error"]
    bad = _label(c, first, "x", "ann")
    assert bad.status_code == 400 and "key 'x'" in bad.json()["error"]
    nameless = _label(c, first, "a", " ")
    assert nameless.status_code == 400 and "give your name" in nameless.json()["error"]
    with GateStore(store) as opened:
        (label,) = opened.labels(run_id).values()
    assert label.value == 0 and label.detail["labeller"] == "ann"  # never replaced


def test_two_labellers_on_one_pair_show_as_agreement(client: Client) -> None:
    """A pair labelled by ann is offered to bob as a second label (not to ann); bob's label is stored beside
    the gold one, never replacing it, and counted as agreement or not."""
    c, store, run_id = client
    pairs = c.get("/label/api/queue", params={"labeller": "ann"}).json()["pairs"]
    one, two = pairs[0], pairs[1]
    assert _label(c, one, "a", "ann").status_code == 200
    assert _label(c, two, "a", "ann").status_code == 200
    assert all(
        p["mode"] == "gold" for p in c.get("/label/api/queue", params={"labeller": "ann"}).json()["pairs"]
    )
    bobs = c.get("/label/api/queue", params={"labeller": "bob"}).json()["pairs"]
    assert [p["mode"] for p in bobs] == ["gold", "gold", "second", "second"]
    assert _label(c, bobs[2], "a", "bob", second=True).status_code == 200
    reply = _label(c, bobs[3], "b", "bob", second=True)
    assert reply.status_code == 200 and reply.json()["progress"]["labellers"] == {"twice": 2, "agreed": 1}
    assert _label(c, bobs[3], "a", "bob", second=True).status_code == 409
    assert _label(c, one, "a", "ann", second=True).status_code == 409  # not a second opinion of oneself
    with GateStore(store) as opened:
        assert {label.detail["labeller"] for label in opened.labels(run_id).values()} == {"ann"}
        assert [s.detail["labeller"] for s in opened.second_labels(run_id)] == ["bob", "bob"]


def test_the_token_and_the_page_headers(run: tuple[Path, str]) -> None:
    app = FastAPI()
    app.include_router(label_router(run[0], None, "s3cret", progress=label_progress))
    with TestClient(app) as c:
        assert c.get("/label").status_code == 401
        assert c.get("/label/api/queue", headers={"X-Label-Token": "wrong"}).status_code == 401
        assert c.post("/label/api/labels", json={}).status_code == 401
        page = c.get("/label", params={"token": "s3cret"})
        assert page.status_code == 200 and '<script src="/label/static/label.js"' in page.text
        assert page.headers["content-security-policy"] == "default-src 'self'; script-src 'self'"
        assert c.get("/label/api/queue", headers={"X-Label-Token": "s3cret"}).status_code == 200
        assert c.get("/label/static/label.js").status_code == 200  # the same for everyone
        assert "<script>" not in page.text.split("</head>")[1]  # no inline script in the page itself
    open_app = FastAPI()
    open_app.include_router(label_router(run[0], None, None, progress=label_progress))
    with TestClient(open_app) as c:
        assert c.get("/label/static/label.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/label/static/other.js").status_code == 404


def test_off_loopback_needs_a_token() -> None:
    check_label_host("127.0.0.1", None)
    check_label_host("::1", None)
    check_label_host("0.0.0.0", "t")
    with pytest.raises(
        ValueError, match="not loopback: the labelling page is then served only with --label-token"
    ):
        check_label_host("0.0.0.0", None)
    with pytest.raises(ValueError, match="--label-token is empty"):
        check_label_host("127.0.0.1", " ")


def test_gate_label_web_refuses_a_public_host_without_a_token(run: tuple[Path, str]) -> None:
    command = [*GATE_LABEL, "--store", str(run[0]), "--web", "--host", "0.0.0.0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--host 0.0.0.0 is not loopback" in done.stderr


def test_gate_label_web_serves_the_page_on_loopback(run: tuple[Path, str]) -> None:
    """`flyspec gate label --store S --web` serves the run's queue (the terminal's) until stopped."""
    port = free_port()
    command = [*GATE_LABEL, "--store", str(run[0]), "--web", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        assert f"http://127.0.0.1:{port}/label" in server.stdout.readline()
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/label/api/queue", params={"labeller": "x"})
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline and server.poll() is None, "the page never answered"
                time.sleep(0.1)
        waiting = [(p["dataset"], p["question_id"], p["a"], p["b"]) for p in reply.json()["pairs"]]
        assert waiting == _terminal_queue(run[0], run[1])
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_reading_is_built_again_only_when_the_run_changes(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page asks for the decision and advice after every label, and a long sequential run's report
    simulates its advice for seconds: the reading is kept while the run's rows are unchanged, and read
    again (with the new count) after a label or a second label."""
    import flyspec.gate.report.build as progress_module

    c, store, run_id = client
    builds: list[str] = []
    real = progress_module.build_report

    def counted(path: Path, run: str):  # type: ignore[no-untyped-def]
        builds.append(run)
        return real(path, run)

    monkeypatch.setattr(progress_module, "build_report", counted)
    first = label_progress(store, run_id)
    assert label_progress(store, run_id) == first and len(builds) == 1
    pairs = c.get("/label/api/queue", params={"labeller": "ann"}).json()["pairs"]
    assert len(builds) == 1  # the queue's progress is the kept reading
    assert _label(c, pairs[0], "b" if "pwned" in pairs[0]["a"] else "a", "ann").status_code == 200
    assert len(builds) == 2 and label_progress(store, run_id)["judge_agreement"] == 1.0
    assert _label(c, pairs[0], "a", "bob", second=True).status_code == 200
    assert len(builds) == 3

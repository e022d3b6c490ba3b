"""`flyspec gate shadow`'s proxy mechanics against real uvicorn servers on loopback.

The baseline and candidate are scripted servers (flyspec/bench/scripted_openai.py: fixed answers, streamed
or whole, usage and acceptance counters included), enough to check what a client receives and what is
stored; tests/test_shadow_serve.py drives real `flyspec serve` processes.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import httpx
import pytest
from shadow_harness import arm, metric, shadow, skipped, stored, upstream, wait_pairs

from flyspec.bench.peers import free_port
from flyspec.bench.scripted_openai import Script

CHAT = {"model": "base", "messages": [{"role": "user", "content": "What is 6 x 7?"}], "max_tokens": 16}


def _same(a: httpx.Response, b: httpx.Response) -> None:
    assert (a.status_code, a.content, a.headers["content-type"]) == (
        b.status_code,
        b.content,
        b.headers["content-type"],
    )


def test_answers_pass_through_unchanged_and_pairs_are_stored(tmp_path) -> None:
    """Whole and streamed answers, chat and completions, and /v1/models reach the client byte for byte as
    the baseline sent them; each mirrored pair holds both answers' text, token counts and acceptance."""
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand")) as cand,
        shadow(tmp_path / "s.db", arm(base, "base"), arm(cand, "cand")) as (root, pairs),
    ):
        bodies = [
            ("/v1/chat/completions", CHAT),
            ("/v1/chat/completions", {**CHAT, "stream": True}),
            ("/v1/completions", {"model": "base", "prompt": "6 x 7 =", "max_tokens": 8}),
            ("/v1/completions", {"model": "base", "prompt": "6 x 7 =", "stream": True}),
        ]
        for path, body in bodies:
            _same(httpx.post(root + path, json=body), httpx.post(base + path, json=body))
        _same(httpx.get(root + "/v1/models"), httpx.get(base + "/v1/models"))
        # Routes the proxy does not pair go to the baseline as they are (here: one it does not serve).
        embeddings = {"model": "base", "input": "hi"}
        _same(
            httpx.post(root + "/v1/embeddings", json=embeddings),
            httpx.post(base + "/v1/embeddings", json=embeddings),
        )
        wait_pairs(pairs, 4)
        assert metric(root, "flyspec_shadow_pairs_total") == 4
    rows = stored(tmp_path / "s.db")
    assert [(r["route"], r["baseline"]["streamed"]) for r in rows] == [
        ("/chat/completions", False),
        ("/chat/completions", True),
        ("/completions", False),
        ("/completions", True),
    ]
    for row in rows:
        assert row["source"] == "proxy"
        assert row["baseline"]["text"] == Script("base").text()
        assert row["candidate"]["text"] == Script("cand").text()
        assert row["baseline"]["prompt_tokens"] == 11 and row["candidate"]["completion_tokens"] == 11
        assert row["candidate"]["acceptance"]["num_forgiven_tokens"] == 1
        assert row["request"]["model"] == "base"  # stored as the client sent it
    assert rows[1]["baseline"]["first_token_s"] is not None


def test_a_down_or_slow_candidate_changes_nothing_for_the_client(tmp_path) -> None:
    """A candidate that refuses connections or answers after its timeout leaves the client's answer and
    its timing alone; each such pair is stored with the candidate's error (a wrong answer), not dropped."""
    direct = None
    with upstream(Script("base")) as base, upstream(Script("slow", delay_s=5.0)) as slow:
        direct = httpx.post(base + "/v1/chat/completions", json=CHAT)
        down = arm(f"http://127.0.0.1:{free_port()}", "cand")
        for name, cand in (("down", down), ("slow", arm(slow, "slow", timeout=1.0))):
            with shadow(tmp_path / f"{name}.db", arm(base, "base"), cand) as (root, pairs):
                start = time.monotonic()
                for _ in range(3):
                    _same(httpx.post(root + "/v1/chat/completions", json=CHAT), direct)
                # Three answers well before a single slow candidate answer (5 s) or timeout (1 s).
                assert time.monotonic() - start < 1.0
                wait_pairs(pairs, 3)
            errors = [r["candidate"]["error"] for r in stored(tmp_path / f"{name}.db")]
            assert all(errors) and len(errors) == 3
            assert all(("Connect" if name == "down" else "Timeout") in e for e in errors), errors


def test_malformed_and_ineligible_requests_are_answered_by_the_baseline_and_counted(tmp_path) -> None:
    """A body that is not JSON gets exactly the baseline's answer and is never mirrored; n > 1, tools, a
    baseline error and a body over the size cap are passed through and counted by reason."""
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand", record=True)) as cand,
        shadow(tmp_path / "s.db", arm(base, "base"), arm(cand, "cand"), max_request_bytes=2000) as (
            root,
            pairs,
        ),
    ):
        malformed = b'{"model": "base", "messages": ['
        headers = {"content-type": "application/json"}
        _same(
            httpx.post(root + "/v1/chat/completions", content=malformed, headers=headers),
            httpx.post(base + "/v1/chat/completions", content=malformed, headers=headers),
        )
        failing = {**CHAT, "messages": [{"role": "user", "content": "FAIL"}]}
        long = {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}
        tools = {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}
        for body in ({**CHAT, "n": 2}, tools, failing, long):
            _same(
                httpx.post(root + "/v1/chat/completions", json=body),
                httpx.post(base + "/v1/chat/completions", json=body),
            )
        httpx.post(root + "/v1/chat/completions", json=CHAT)
        wait_pairs(pairs, 1)
        for reason in ("malformed_body", "n_gt_1", "tools", "baseline_error", "too_long"):
            assert skipped(root, reason) == 1, reason
    assert stored(tmp_path / "s.db")[0]["request"] == CHAT


def test_overflow_is_skipped_and_counted_while_clients_are_served(tmp_path) -> None:
    """With one candidate worker held and a queue of one, further copies overflow: each is counted as
    queue_full, and every client still gets its answer at once."""
    hold = threading.Event()
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand", hold=hold)) as cand,
        shadow(
            tmp_path / "s.db", arm(base, "base"), arm(cand, "cand"), candidate_concurrency=1, queue_size=1
        ) as (
            root,
            pairs,
        ),
    ):
        for i in range(6):
            body = {**CHAT, "seed": i}
            response = httpx.post(root + "/v1/chat/completions", json=body, timeout=5)
            assert response.json()["choices"][0]["message"]["content"] == Script("base").text()
            time.sleep(0.05)  # the worker takes the first copy before the next arrives
        assert skipped(root, "queue_full") == 4
        assert metric(root, "flyspec_shadow_queue_depth") == 1
        hold.set()
        wait_pairs(pairs, 2)


def test_sampling_stop_and_caps(tmp_path) -> None:
    """The sampling rule is deterministic per body; --max-pairs stops mirroring (the proxy keeps serving,
    /metrics says so); a requests-per-minute cap skips what is over it."""
    with upstream(Script("base")) as base, upstream(Script("cand")) as cand:
        with shadow(tmp_path / "a.db", arm(base, "base"), arm(cand, "cand"), sample=0.5, sample_seed=7) as (
            root,
            _,
        ):
            for i in range(40):
                httpx.post(root + "/v1/chat/completions", json={**CHAT, "seed": i})
            for i in range(40):  # the same bodies again: drawn exactly as before
                httpx.post(root + "/v1/chat/completions", json={**CHAT, "seed": i})
            not_sampled = skipped(root, "not_sampled")
            assert not_sampled % 2 == 0 and 10 <= not_sampled / 2 <= 30
        with shadow(tmp_path / "b.db", arm(base, "base"), arm(cand, "cand"), max_pairs=2) as (root, pairs):
            for _ in range(4):
                assert httpx.post(root + "/v1/chat/completions", json=CHAT).status_code == 200
            wait_pairs(pairs, 2)
            assert skipped(root, "stopped") == 2 and metric(root, "flyspec_shadow_mirroring") == 0
        caps = {"max_candidate_requests_per_minute": 1}
        with shadow(tmp_path / "c.db", arm(base, "base"), arm(cand, "cand"), **caps) as (root, pairs):
            for _ in range(3):
                httpx.post(root + "/v1/chat/completions", json=CHAT)
            wait_pairs(pairs, 1)
            deadline = time.monotonic() + 10
            while skipped(root, "over_request_cap") < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    assert len(stored(tmp_path / "b.db")) == 2


def test_mirror_sink_copies_ask_both_arms(tmp_path) -> None:
    """Copies at /mirror/v1/... (nginx) or at /v1/... with a Host ending in -shadow (Envoy, Istio) are
    answered 202 at once; the shadow process asks the baseline and the candidate itself."""
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand")) as cand,
        shadow(tmp_path / "s.db", arm(base, "base"), arm(cand, "cand")) as (root, pairs),
    ):
        assert httpx.post(root + "/mirror/v1/chat/completions", json=CHAT).status_code == 202
        envoy = httpx.post(
            root + "/v1/completions", json={"prompt": "hi"}, headers={"host": "api.local-shadow"}
        )
        assert envoy.status_code == 202
        wait_pairs(pairs, 2)
    rows = stored(tmp_path / "s.db")
    assert {r["route"] for r in rows} == {"/chat/completions", "/completions"}
    assert all(r["source"] == "mirror" and r["baseline"]["text"] == Script("base").text() for r in rows)


def test_redaction_and_a_private_store(tmp_path) -> None:
    """--redact masks matches before the candidate sees the request and before anything is stored; the
    client's answer comes from the unredacted request. The store is created 0600; a store others may
    read is refused."""
    secret = {**CHAT, "messages": [{"role": "user", "content": "my key is sk-12345, what is 6 x 7?"}]}
    cand_script = Script("cand", record=True)
    masks = (r"sk-\d+", r"answer is \d+")
    with (
        upstream(Script("base", record=True)) as base,
        upstream(cand_script) as cand,
        shadow(tmp_path / "s.db", arm(base, "base"), arm(cand, "cand"), redact=masks) as (root, pairs),
    ):
        answer = httpx.post(root + "/v1/chat/completions", json=secret).json()
        assert "42" in answer["choices"][0]["message"]["content"]
        wait_pairs(pairs, 1)
    assert "sk-12345" not in json.dumps(cand_script.bodies) and "[REDACTED]" in json.dumps(cand_script.bodies)
    row = stored(tmp_path / "s.db")[0]
    texts = json.dumps([row["request"], row["baseline"]["text"], row["candidate"]["text"]])
    assert "sk-12345" not in texts and "answer is 42" not in texts
    assert row["baseline"]["text"] == "base: The [REDACTED] because six times seven is forty-two."
    assert stat.S_IMODE(os.stat(tmp_path / "s.db").st_mode) == 0o600
    open_store = tmp_path / "open.db"
    open_store.touch(mode=0o644)
    os.chmod(open_store, 0o644)
    with (
        pytest.raises(ValueError, match="chmod 600"),
        shadow(open_store, arm(base, "base"), arm(base, "base")),
    ):
        pass


def _read_until(response: httpx.Response, marker: bytes) -> None:
    seen = b""
    for chunk in response.iter_raw():
        seen += chunk
        if marker in seen:
            return
    raise AssertionError(f"{marker!r} never came")


def test_a_client_that_hangs_up_at_done_is_paired_one_that_leaves_early_is_counted(tmp_path) -> None:
    """The official openai client closes its connection at `data: [DONE]`, before the stream's end: that
    answer is whole and is paired. A client that leaves before [DONE] is counted as client_disconnected."""
    body = {**CHAT, "stream": True}
    with (
        upstream(Script("base", gap_s=0.1, linger_s=1.0)) as base,
        upstream(Script("cand")) as cand,
        shadow(tmp_path / "s.db", arm(base, "base"), arm(cand, "cand")) as (root, pairs),
    ):
        with httpx.stream("POST", root + "/v1/chat/completions", json=body) as response:
            _read_until(response, b"data: [DONE]")
        wait_pairs(pairs, 1)
        with httpx.stream("POST", root + "/v1/chat/completions", json={**body, "seed": 1}) as response:
            _read_until(response, b"base:")
        deadline = time.monotonic() + 10
        while skipped(root, "client_disconnected") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert stored(tmp_path / "s.db")[0]["baseline"]["text"] == Script("base").text()


def test_an_unreachable_baseline_is_a_502_in_openai_form(tmp_path) -> None:
    """With production down the proxy can pass nothing on: it answers 502 with an OpenAI-style error
    naming the cause, mirrors nothing, and counts it."""
    with (
        upstream(Script("cand")) as cand,
        shadow(tmp_path / "s.db", arm(f"http://127.0.0.1:{free_port()}", "base"), arm(cand, "cand")) as (
            root,
            _,
        ),
    ):
        response = httpx.post(root + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 502
        assert "the baseline did not answer (ClientConnectorError" in response.json()["error"]["message"]
        assert skipped(root, "baseline_error") == 1


def test_stream_chunks_pass_as_they_arrive(tmp_path) -> None:
    """The baseline pauses 0.3 s between events (about 1.8 s in all): the client reads the first piece
    through the proxy long before the stream ends, so nothing is buffered on the way."""
    with (
        upstream(Script("base", gap_s=0.3)) as base,
        upstream(Script("cand")) as cand,
        shadow(tmp_path / "s.db", arm(base, "base"), arm(cand, "cand")) as (root, pairs),
    ):
        start = time.monotonic()
        with httpx.stream("POST", root + "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
            chunks = response.iter_raw()
            assert b"base:" in next(chunks)
            first = time.monotonic() - start
            assert b"[DONE]" in b"".join(chunks)
        total = time.monotonic() - start
        assert first < 0.6 < 1.5 < total, (first, total)
        wait_pairs(pairs, 1)


def test_a_clients_key_reaches_production_and_each_arms_key_its_arm(tmp_path) -> None:
    """A client's own Authorization header goes to the baseline unchanged; the baseline arm's api_key only
    where the client sends none; the candidate is always asked with its own arm's key, never the
    client's."""
    base, cand = Script("base", record=True), Script("cand", record=True)
    with (
        upstream(base) as base_url,
        upstream(cand) as cand_url,
        shadow(
            tmp_path / "s.db",
            arm(base_url, "base", api_key="arm-base"),
            arm(cand_url, "c", api_key="arm-cand"),
        ) as (root, pairs),
    ):
        httpx.post(root + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client"})
        httpx.post(root + "/v1/chat/completions", json={**CHAT, "seed": 1})
        wait_pairs(pairs, 2)
    assert base.authorizations == ["Bearer client", "Bearer arm-base"]
    assert cand.authorizations == ["Bearer arm-cand", "Bearer arm-cand"]

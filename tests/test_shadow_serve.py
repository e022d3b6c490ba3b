"""`flyspec gate shadow` (a real process) in front of a real `flyspec serve` on SmolLM2, driven by the
official `openai` client: clients get exactly what the server answers directly, streamed and not, and
each pair is stored with the candidate's acceptance counters.

One server plays both arms: the baseline asks for standard verification, the candidate for FLy (its arm's
`extra_body`), as a production fleet and its lossy candidate would differ. Requests run one at a time, so
no two share a batch and greedy answers are reproducible.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import serve_process
from zoo import SMOLLM2, zoo_model

from flyspec.bench.peers import free_port

pytestmark = pytest.mark.slow  # over 20 s on 2 cores: a server load and about a dozen generations

MODEL = "smol"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "fly"}
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _pairs(store: Path, count: int, proxy: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        with sqlite3.connect(store) as db:
            rows = db.execute("SELECT baseline, candidate FROM shadow_pairs ORDER BY id").fetchall()
        if len(rows) >= count:
            return [{"baseline": json.loads(b), "candidate": json.loads(c)} for b, c in rows]
        assert time.monotonic() < deadline, (
            f"{len(rows)} pairs stored, not {count}: " + httpx.get(proxy + "/metrics").text
        )
        time.sleep(0.1)


def _comparable(completion: Any) -> dict[str, Any]:
    """A completion without what differs on every request (its id and creation time)."""
    return {k: v for k, v in completion.model_dump().items() if k not in ("id", "created")}


def _streamed(client: openai.OpenAI, **request: Any) -> tuple[str, Any]:
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def test_openai_client_through_the_shadow_gets_the_baselines_answers(tmp_path: Path) -> None:
    serve_args = [str(zoo_model(SMOLLM2)), "--served-model-name", MODEL, "--dtype", "float32"]
    serve_args += ["--max-num-seqs", "4", "--speculative-config", json.dumps(SPEC)]
    with serve_process.flyspec_serve(serve_args, tmp_path / "serve.log") as server:
        port = free_port()
        proxy = f"http://127.0.0.1:{port}"
        baseline = {"base_urls": [server], "model": MODEL, "extra_body": {"verification": "standard"}}
        candidate = {"base_urls": [server], "model": MODEL, "extra_body": {"verification": "fly"}}
        argv = [serve_process.FLYSPEC, "gate", "shadow", "--baseline", json.dumps(baseline)]
        argv += ["--candidate", json.dumps(candidate), "--store", str(tmp_path / "shadow.db")]
        argv += ["--candidate-concurrency", "1", "--port", str(port)]
        argv += ["--margin", "0.05", "--grader", "equivalent_to_baseline"]
        shadow = serve_process.start(argv, proxy, tmp_path / "shadow.log", timeout_s=60)
        try:
            direct = openai.OpenAI(base_url=server + "/v1", api_key="none")
            through = openai.OpenAI(base_url=proxy + "/v1", api_key="none")
            request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "seed": 3}
            expected = direct.chat.completions.create(**request)
            got = through.chat.completions.create(**request)
            assert _comparable(got) == _comparable(expected)
            first = _pairs(tmp_path / "shadow.db", 1, proxy)[0]
            assert first["baseline"]["text"] == got.choices[0].message.content
            assert first["candidate"]["text"] and first["candidate"]["acceptance"] is not None

            expected_text, expected_usage = _streamed(direct, **request)
            got_text, got_usage = _streamed(through, **request)
            assert (got_text, got_usage) == (expected_text, expected_usage)
            second = _pairs(tmp_path / "shadow.db", 2, proxy)[1]
            assert second["baseline"]["streamed"] and second["baseline"]["text"] == got_text
            assert second["baseline"]["completion_tokens"] == got_usage.completion_tokens

            models = [m.id for m in through.models.list()]
            assert models == [m.id for m in direct.models.list()] == [MODEL]
        finally:
            serve_process.stop(shadow)

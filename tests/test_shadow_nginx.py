"""The nginx snippet of docs/shadow.md with a real nginx (Debian's package, `apt-get install nginx`)
started on loopback: production traffic goes through nginx to the baseline, nginx's `mirror` sends a copy
of each chat/completions request to the shadow process's mirror sink, which asks both arms itself.

The baseline and candidate are scripted servers (fixed answers; flyspec/bench/scripted_openai.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from shadow_harness import arm, shadow, stored, upstream, wait_pairs

from flyspec.bench.peers import free_port
from flyspec.bench.scripted_openai import Script

pytestmark = pytest.mark.slow

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def _config(root: Path, port: int, production: str, shadow_root: str) -> str:
    """The docs' snippet, listening on loopback, inside a minimal configuration that keeps every file under
    ``root``."""
    docs = Path(__file__).parents[1].joinpath("docs", "shadow.md").read_text()
    block = next(b.split("```", 1)[0] for b in docs.split("```text\n")[1:] if "mirror /_flyspec_shadow" in b)
    block = block.replace("PRODUCTION_HOST:PORT", production.removeprefix("http://"))
    block = block.replace("127.0.0.1:8100", shadow_root.removeprefix("http://"))
    assert "listen 80;" in block
    block = block.replace("listen 80;", f"listen 127.0.0.1:{port};")
    temp = " ".join(
        f"{kind}_temp_path {root}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"daemon off; master_process off; pid {root}/nginx.pid; error_log {root}/error.log info;\n"
        f"events {{}}\nhttp {{\naccess_log off; {temp}\n{block}}}\n"
    )


def test_nginx_mirror_feeds_the_sink(tmp_path: Path) -> None:
    if not Path(NGINX).exists():
        pytest.fail("nginx is not installed: run `apt-get install -y nginx` (Debian's package)")
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand")) as cand,
        shadow(tmp_path / "s.db", arm(base, "base"), arm(cand, "cand")) as (shadow_root, pairs),
    ):
        port = free_port()
        config = _config(tmp_path, port, base, shadow_root)
        (tmp_path / "nginx.conf").write_text(config)
        with open(tmp_path / "nginx.out", "w") as out:
            nginx = subprocess.Popen(
                [
                    NGINX,
                    "-p",
                    str(tmp_path),
                    "-c",
                    str(tmp_path / "nginx.conf"),
                    "-e",
                    str(tmp_path / "error.log"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            front = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                try:
                    httpx.get(front + "/v1/models")
                    break
                except httpx.TransportError:
                    assert nginx.poll() is None, (tmp_path / "error.log").read_text()
                    assert time.monotonic() < deadline, "nginx did not start"
                    time.sleep(0.1)
            body = {"model": "base", "messages": [{"role": "user", "content": "6 x 7?"}]}
            answer = httpx.post(front + "/v1/chat/completions", json=body)
            assert answer.content == httpx.post(base + "/v1/chat/completions", json=body).content
            httpx.post(front + "/v1/completions", json={"model": "base", "prompt": "6 x 7 ="})
            assert httpx.get(front + "/v1/models").json()["data"][0]["id"] == "base"
            wait_pairs(pairs, 2)
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)
    rows = stored(tmp_path / "s.db")
    assert sorted(r["route"] for r in rows) == ["/chat/completions", "/completions"]
    assert all(r["source"] == "mirror" for r in rows)
    assert all(r["candidate"]["text"] == Script("cand").text() for r in rows)

"""A judged run with a person's gold-label draw whose candidate writes hostile answers, for the labelling
page's tests (tests/test_label_page.py, tests/test_label_page_browser.py).

A scripted OpenAI-compatible server on loopback: the baseline answers every question with a line and a
fenced code block; the candidate answers the same on most questions and, on every fifth, an answer that
tries to run script three ways (a <script> element, an <img> whose onerror fires, a javascript: link),
each setting ``document.title`` and a window flag; the judge prefers the answer without it.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from loopback import serve_app
from test_gate_label import _dataset, _judged_run

HOSTILE = (
    "<script>window.flyspecPwned = 1; document.title = 'pwned'</script>\n"
    "<img src=x onerror=\"window.flyspecPwned = 2; document.title = 'pwned'\">\n"
    "[click me](javascript:window.flyspecPwned=3) <a href=\"javascript:document.title='pwned'\">here</a>"
)


def _answer(model: str, i: int) -> str:
    if model == "cand" and i % 5 == 0:
        return f"Answer {i}: no\n{HOSTILE}"
    return f"Answer {i}: yes\n```\nprint({i})\n```\nDone."


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": m, "root": m} for m in ("base", "cand", "fair")]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        if body["model"] == "fair":
            a = prompt.split("[Response A]", 1)[1].split("[Response B]", 1)[0]
            text = "Verdict: B" if "pwned" in a else "Verdict: A"
        else:
            text = _answer(body["model"], int(re.search(r"Question (\d+)", prompt).group(1)))  # type: ignore[union-attr]
        return JSONResponse(
            {
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2},
            }
        )

    return app


def hostile_run(folder: Path, questions: int = 40) -> tuple[Path, str]:
    """A finished judged run of ``questions`` open-ended questions with every differing pair drawn for a
    person's gold label (none given yet): the store's path and the run's name."""
    store = folder / "labels.db"
    with serve_app(_app()) as url:
        data = _dataset(folder / "open.jsonl", questions, grader="judge")
        return store, _judged_run(url, store, data, "fair", gold_rate=1.0)

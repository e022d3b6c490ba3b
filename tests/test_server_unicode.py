"""Constrained output with non-ASCII text, end to end on real models (docs/server.md, "Structured output").

Eight request shapes (guided_choice, guided_regex, a JSON-schema enum, structured_outputs; chat and
completions; streamed and not) whose allowed texts hold an accent, CJK and an emoji, each sent with
standard verification and with FLy at its most forgiving (theta 0, W 1), against SmolLM2-135M (with a
noisy copy of itself as the draft, so drafts are often rejected or forgiven). Qwen2.5's 150k byte-level
vocabulary gets the same grammars in tests/test_structured.py (serving it end to end here took 100 s of the
suite's time for no path SmolLM2 does not take). Before the grammar vocabulary was built from the byte
decoder, 5 of the 8 shapes were a 500 on SmolLM2: llguidance read `é` as `Ã©`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from tiny_engine import noisy_pair
from zoo import SMOLLM2, zoo_model

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.server.app import build_app
from flyspec.server.background import serve_in_background

AGGRESSIVE_FLY = {
    "num_speculative_tokens": 3,
    "rejection_sample_method": "fly",
    "fly_window_size": 1,
    "fly_entropy_threshold": 0.0,
}
CHOICES = ["café", "thé", "東京タワー", "🙂👍🏽"]
REGEX = "(café|thé|東京タワー|🙂👍🏽)"
CHAT = [{"role": "user", "content": "Pick one: café, thé, 東京タワー or 🙂👍🏽."}]
PROMPT = "Pick one: café, thé, 東京タワー or 🙂👍🏽. Answer:"
CITY = {
    "type": "object",
    "properties": {"pick": {"type": "string", "enum": CHOICES}},
    "required": ["pick"],
    "additionalProperties": False,
}


def _shapes() -> list[tuple[str, str, dict[str, Any], str]]:
    """(name, route, body, how to read the answer: "choice", "json" or "pick")."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    schema_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": CITY, "strict": True}}
    return [
        ("completions guided_choice", comp, {"prompt": PROMPT, "guided_choice": CHOICES}, "choice"),
        ("chat guided_choice", chat, {"messages": CHAT, "guided_choice": CHOICES}, "choice"),
        ("completions guided_regex", comp, {"prompt": PROMPT, "guided_regex": REGEX}, "choice"),
        (
            "chat structured_outputs.choice",
            chat,
            {"messages": CHAT, "structured_outputs": {"choice": CHOICES}},
            "choice",
        ),
        ("chat json_schema enum", chat, {"messages": CHAT, "response_format": schema_format}, "pick"),
        ("completions guided_json enum", comp, {"prompt": PROMPT, "guided_json": {"enum": CHOICES}}, "json"),
        (
            "chat guided_choice, streamed",
            chat,
            {"messages": CHAT, "guided_choice": CHOICES, "stream": True},
            "choice",
        ),
        (
            "completions guided_regex, streamed",
            comp,
            {"prompt": PROMPT, "guided_regex": REGEX, "stream": True},
            "choice",
        ),
    ]


def _text(route: str, response: httpx.Response) -> tuple[str, str]:
    """(text, finish_reason) of a JSON or streamed answer."""
    chat = route.endswith("chat/completions")
    if not response.headers["content-type"].startswith("text/event-stream"):
        choice = response.json()["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    text, finish = "", None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        for choice in event["choices"]:
            piece = choice["delta"].get("content") if chat else choice["text"]
            assert "\ufffd" not in (piece or ""), event  # never half a character
            text += piece or ""
            finish = choice["finish_reason"] or finish
    return text, finish


def _serve_and_check(engine: LLMEngine) -> None:
    with serve_in_background(build_app(engine, served_model_name="m")) as background:
        for seed, (name, route, body, read) in enumerate(_shapes()):
            for verification in ("standard", "fly"):
                request = {
                    **body,
                    "max_tokens": 24,
                    "temperature": 0.8,
                    "seed": seed,
                    "verification": verification,
                }
                response = httpx.post(f"{background.base_url}{route}", json=request, timeout=600)
                assert response.status_code == 200, (name, verification, response.text)
                text, finish = _text(route, response)
                assert finish == "stop", (name, verification, text)
                if read == "choice":
                    assert text in CHOICES and re.fullmatch(REGEX, text), (name, verification, text)
                elif read == "json":
                    assert json.loads(text) in CHOICES, (name, verification, text)
                else:
                    assert json.loads(text)["pick"] in CHOICES, (name, verification, text)
    assert engine.stats.num_draft_tokens > 0


@pytest.mark.slow  # SmolLM2 twice (target and noisy draft), 16 constrained requests
def test_unicode_constraints_on_smollm2_under_standard_and_aggressive_fly() -> None:
    """Every shape, with standard verification and with FLy, returns one of the allowed texts (streams
    never split a character) and finishes because the grammar completed."""
    smollm2 = str(zoo_model(SMOLLM2))
    target, draft = noisy_pair(smollm2, "float32")
    config = EngineConfig(
        model=smollm2,
        speculative_config={"model": smollm2, **AGGRESSIVE_FLY},
        dtype="float32",
        max_model_len=512,
        max_num_seqs=2,
    )
    _serve_and_check(LLMEngine(config, target=target, draft=draft))

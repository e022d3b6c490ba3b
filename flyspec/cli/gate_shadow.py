"""`flyspec gate shadow`: the traffic layer of gating live traffic (docs/shadow.md).

The options are checked (flyspec/gate/shadow/settings.py) before anything is started; the server runs on
uvicorn until Ctrl-C.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from flyspec.cli.options import opt

_ARM = (
    "an OpenAI-compatible endpoint as the JSON `gate run` takes (or a JSON file): "
    '\'{"base_urls": [...], "model": ...}\''
)

Baseline = Annotated[
    str, typer.Option("--baseline", help=f"Production: {_ARM}. Clients get its answers, unchanged.")
]
Candidate = Annotated[
    str,
    typer.Option(
        "--candidate",
        help=f"The configuration under test: {_ARM}, with its own `extra_body` fields. Asked after the "
        "client has the baseline's answer.",
    ),
]
Store = Annotated[
    Path,
    typer.Option(
        "--store", help="SQLite file for the mirrored pairs, created readable by its owner only (0600)."
    ),
]
Sample = Annotated[
    float, opt("Share of eligible requests mirrored, in (0, 1], drawn by a seeded hash of the request body.")
]
MaxPairs = Annotated[int | None, opt("Stop mirroring after this many pairs (the proxy keeps serving).")]
Concurrency = Annotated[int, opt("Candidate requests in flight at most.")]
TokensPerMinute = Annotated[
    int | None,
    opt("Cap on the candidate's tokens (prompt + completion) per minute; more is skipped, counted."),
]
RequestsPerMinute = Annotated[
    int | None, opt("Cap on candidate requests per minute; more is skipped, counted.")
]
Redact = Annotated[
    list[str] | None,
    opt(
        "Regular expression masked (as [REDACTED]) before anything is stored or sent to the candidate; "
        "repeatable."
    ),
]
Host = Annotated[str, opt("Address to bind.")]
Port = Annotated[int, opt("Port to listen on.")]


def shadow_command(
    baseline: Baseline,
    candidate: Candidate,
    store: Store,
    sample: Sample = 1.0,
    max_pairs: MaxPairs = None,
    candidate_concurrency: Concurrency = 4,
    max_candidate_tokens_per_minute: TokensPerMinute = None,
    max_candidate_requests_per_minute: RequestsPerMinute = None,
    redact: Redact = None,
    host: Host = "127.0.0.1",
    port: Port = 8100,
) -> None:
    """Put an OpenAI-compatible proxy in front of production and mirror a share of its traffic to a candidate.

    Clients change only their base URL to http://HOST:PORT/v1. Every request goes to the baseline and its
    answer (streamed or not, errors included) goes back unchanged; after that, a registered share of the
    eligible requests (chat and completions with one choice, no tools) is asked of the candidate, and each
    pair (request, both answers, timings, token counts, acceptance counters) is stored in --store as it
    completes. A candidate error or timeout is stored as its answer. Proxies that mirror by themselves send
    their copies to /mirror/v1/chat/completions or /mirror/v1/completions (nginx) or to /v1/... with a Host
    ending in -shadow (Envoy, Istio); the shadow process then asks both arms. What is not mirrored is
    counted by reason at /metrics (flyspec_shadow_skipped_total). Judging and the decision come in a later
    release.
    """
    from flyspec.gate.shadow.pair_store import SqlitePairStore
    from flyspec.gate.shadow.proxy import create_shadow_app
    from flyspec.gate.shadow.settings import ShadowSettings, endpoint_arm

    settings = ShadowSettings(
        baseline=endpoint_arm("baseline", baseline),
        candidate=endpoint_arm("candidate", candidate),
        sample=sample,
        max_pairs=max_pairs,
        candidate_concurrency=candidate_concurrency,
        max_candidate_requests_per_minute=max_candidate_requests_per_minute,
        max_candidate_tokens_per_minute=max_candidate_tokens_per_minute,
        redact=tuple(redact or ()),
    )
    if not 0 < port < 65536:
        raise ValueError(f"--port={port}: must be in 1..65535")
    pairs = SqlitePairStore(store)
    app = create_shadow_app(settings, pairs)
    print(
        f"flyspec gate shadow: clients use http://{host}:{port}/v1 (answers from "
        f"{', '.join(settings.baseline.base_urls)}); mirroring {settings.sample:g} of eligible requests to "
        f"{', '.join(settings.candidate.base_urls)} (model {settings.candidate.model}); pairs go to {store}",
        file=sys.stderr,
    )
    import uvicorn

    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        pairs.close()

"""`flyspec gate shadow`: gate live traffic (docs/shadow.md).

The options are checked (flyspec/gate/shadow/mirror.py, run.py) and the run is registered in
the store before anything is started; the server runs on uvicorn until Ctrl-C. The same command resumes
the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flyspec.checks import is_loopback
from flyspec.cli.options import opt

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flyspec.gate.shadow.run import ShadowPlan

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
        "--store",
        help="The gate store (SQLite) of the run: its registration, pairs, verdicts and labels; created "
        "readable by its owner only (0600).",
    ),
]
Margin = Annotated[
    float,
    typer.Option("--margin", help="Tolerated accuracy loss as a fraction (0.02 = 2 points), registered."),
]
Alpha = Annotated[float, opt("One-sided error of the decision, registered.")]
Judge = Annotated[
    str | None,
    opt(
        "The judge endpoint, as `gate run --judge` takes it: "
        '\'{"base_url": "http://HOST:PORT/v1", "model": "NAME"}\' (or a JSON file). Each pair is judged in '
        "both orders; a share --gold-rate is drawn for a person's label."
    ),
]
Grader = Annotated[
    str | None,
    opt(
        "Grade each pair without a judge: equivalent_to_baseline[:normaliser] (exact, strip, whitespace, "
        "lower, json, last_number): the candidate is right where its answer equals production's."
    ),
]
GoldRate = Annotated[
    float | None, opt("Share of differing pairs drawn for a person's gold label (default 0.2), registered.")
]
RunName = Annotated[str, opt("Run name in the store (the same name resumes the run).")]
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
LabelToken = Annotated[
    str | None,
    opt(
        "Token the labelling page (/label) asks for. Without it the page is served only when --host is "
        "loopback (anyone reaching the port could read the traffic)."
    ),
]


def shadow_command(
    baseline: Baseline,
    candidate: Candidate,
    store: Store,
    margin: Margin,
    judge: Judge = None,
    grader: Grader = None,
    alpha: Alpha = 0.025,
    gold_rate: GoldRate = None,
    run: RunName = "shadow",
    sample: Sample = 1.0,
    max_pairs: MaxPairs = None,
    candidate_concurrency: Concurrency = 4,
    max_candidate_tokens_per_minute: TokensPerMinute = None,
    max_candidate_requests_per_minute: RequestsPerMinute = None,
    redact: Redact = None,
    host: Host = "127.0.0.1",
    port: Port = 8100,
    label_token: LabelToken = None,
) -> None:
    """Put an OpenAI-compatible proxy in front of production and mirror a share of its traffic to a candidate.

    Clients change only their base URL to http://HOST:PORT/v1. Every request goes to the baseline and its
    answer (streamed or not, errors included) goes back unchanged; after that, a registered share of the
    eligible requests (chat and completions with one choice, no tools) is asked of the candidate, and each
    pair (request, both answers, timings, token counts, acceptance counters) is stored in --store as it
    completes, as the next question of a gate run registered before the first request (--run in --store).
    With --judge each pair is judged in both orders and a share --gold-rate of the differing pairs is drawn
    for a person's label (`flyspec gate label`); with --grader equivalent_to_baseline[:normaliser] the
    candidate is right where its answer equals production's. A candidate error or timeout is a wrong
    answer there. The decision (the anytime-valid interval against --margin) is at /decision (as `gate
    report --json` gives it), /status and /metrics; mirroring stops once it is PASS or FAIL, or after
    --max-pairs. People give the gold labels at /label (blind, keys A / B / E / S) or with `gate label`.
    Proxies that mirror by themselves send their copies to /mirror/v1/chat/completions or
    /mirror/v1/completions (nginx) or to /v1/... with a Host ending in -shadow (Envoy, Istio); the shadow
    process then asks both arms. What is not mirrored is counted by reason at /metrics
    (flyspec_shadow_skipped_total).
    """
    from flyspec.gate.shadow.mirror import ShadowSettings, endpoint_arm
    from flyspec.gate.shadow.proxy import create_shadow_app
    from flyspec.gate.shadow.run import ShadowRun, shadow_registration

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
    plan = _plan(run, margin, alpha, judge, grader, gold_rate, max_pairs)
    registration = shadow_registration(
        plan, settings.baseline, settings.candidate, settings.rule().describe()
    )
    shadow = ShadowRun(store, plan, registration)
    app = create_shadow_app(settings, shadow)
    labelling = _mount_label_page(app, store, run, f"{host}:{port}", label_token)
    print(
        f"flyspec gate shadow: run {run!r} {'registered' if shadow.new else 'resumed'} in {store} "
        f"({shadow.stored} pairs stored; margin {margin}, alpha {alpha}); clients use "
        f"http://{host}:{port}/v1 (answers from {', '.join(settings.baseline.base_urls)}); mirroring "
        f"{settings.sample:g} of eligible requests to {', '.join(settings.candidate.base_urls)} (model "
        f"{settings.candidate.model}); the decision is at http://{host}:{port}/status; {labelling}",
        file=sys.stderr,
    )
    import uvicorn

    # The run's worker thread grades, stores and walks the decision in pure Python, holding the GIL for up
    # to the default 5 ms switch interval at a time; the proxy's event loop must get it back sooner to pass
    # production's events on without delay.
    sys.setswitchinterval(0.0005)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _plan(
    run: str,
    margin: float,
    alpha: float,
    judge: str | None,
    grader: str | None,
    gold_rate: float | None,
    max_pairs: int | None,
) -> ShadowPlan:
    """The run's plan from the options (ValueError naming the option that does not fit)."""
    from flyspec.gate.arms.judge import parse_judge
    from flyspec.gate.shadow.run import DEFAULT_MAX_PAIRS, ShadowPlan

    if gold_rate is not None and judge is None:
        raise ValueError("--gold-rate: gold labels anchor a judge's verdicts; it goes with --judge only")
    rate = {} if gold_rate is None else {"gold_rate": gold_rate}
    return ShadowPlan(
        run,
        margin,
        alpha,
        parse_judge(judge) if judge is not None else None,
        max_pairs=max_pairs or DEFAULT_MAX_PAIRS,
        grader=grader,
        **rate,
    )


def _mount_label_page(app: FastAPI, store: Path, run: str, address: str, token: str | None) -> str:
    """Serve the labelling page beside the proxy where the rule allows it (loopback, or a token); say
    where it is, or why it is off."""
    from flyspec.gate.report.build import label_progress
    from flyspec.gate.shadow.label import check_label_host, label_requests, label_router

    host = address.rpartition(":")[0]
    if token is None and not is_loopback(host):
        return "the labelling page is off (--host is not loopback: give --label-token to serve it)"
    check_label_host(host, token)
    app.include_router(
        label_router(store, run, token, progress=label_progress, requests=label_requests(store))
    )
    return f"gold labels at http://{address}/label" + ("?token=TOKEN" if token else "")

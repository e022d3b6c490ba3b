"""Engine arms: this package's engine, in-process, answering through the public `LLM.stream` API.

An arm is the fields of ``EngineConfig`` (flyspec/config.py validates them) with an optional
``verification``; its identity is its canonical settings. Arms that differ only in the verifier share ONE
engine started with the lossy policy (docs/gate.md, "Arms"), their jobs for one question side by side in
its batches. The KV cache is sized for the run's work (``size_for_work``) unless the arm sizes it itself;
the size decides no answer's tokens, so it is not part of the identity.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flyspec.config import EngineConfig, verification_fields, verification_policy
from flyspec.gate.arms.base import (
    Completion,
    Executor,
    Job,
    Sampling,
    Served,
    ServedModel,
    Settings,
    unknown_keys,
)
from flyspec.gate.data.questions import Question

if TYPE_CHECKING:
    from flyspec.llm import LLM
    from flyspec.outputs import RequestOutput

KIND = "engine"
KEYS = ("kind", "verification", *(f.name for f in dataclasses.fields(EngineConfig)))
REQUEST_MODES = ("target_only", "draft_only")
"""An engine arm's ``verification``: who decodes its requests in a shared engine (docs/sampling.md):
the target alone (lossless, no drafts) or the draft model alone (every draft token kept: the limit of
lossy verification, a control the gate must catch)."""
# Recorded in every engine arm's settings since the gate's first runs. A field EngineConfig gained later
# (quantization) is recorded only when it is not at its default, so an arm that leaves it unset keeps the
# identity, and a registered run the resume, it had before the field existed.
_ALWAYS_RECORDED = (
    "model",
    "speculative_config",
    "dtype",
    "device",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "seed",
)


@dataclass(frozen=True)
class EngineArm:
    """An in-process engine arm: its validated EngineConfig and that config as a canonical dict."""

    name: str
    config: Settings
    engine_config: EngineConfig = field(compare=False, repr=False)
    verification: str | None = None
    kind = KIND
    settings_visible = True

    @property
    def greedy_repeats(self) -> bool:
        """True only in batch-invariant mode. Otherwise the requests sharing a batch change a request's
        logits in the last bits and a near-tie can flip a token (docs/performance.md), so the baseline
        twice at temperature 0 measures that run-to-run noise."""
        return self.engine_config.batch_invariant

    @property
    def speculative_config(self) -> Settings | None:
        return self.config["speculative_config"]  # type: ignore[return-value]

    def variant(self, name: str, speculative_config: Settings) -> EngineArm:
        """This engine arm under ``name`` with another speculative config (everything else the same)."""
        return parse(name, {**self.public_dict(), "speculative_config": speculative_config})

    def public_dict(self) -> Settings:
        """The arm's full settings (canonical: defaults resolved; ``verification`` only when set, so arms
        registered before request modes existed keep their identity)."""
        mode = {"verification": self.verification} if self.verification is not None else {}
        return {"kind": KIND, **self.config, **mode}

    def identity(self, served: ServedModel | None = None) -> Settings:
        """What decides the arm's outputs, registered before the run: here, every setting."""
        return self.public_dict()


def _default(f: dataclasses.Field[object]) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def parse(name: str, data: Settings) -> EngineArm:
    """An engine arm from its JSON object; ValueError names the arm, the field and the rule."""
    unknown_keys(f"arm {name!r}", data, KEYS, "engine arms take")
    settings = {k: v for k, v in data.items() if k not in ("kind", "verification")}
    mode = data.get("verification")
    if mode is not None and mode not in REQUEST_MODES:
        raise ValueError(
            f"arm {name!r}: verification={mode!r}: must be one of {', '.join(REQUEST_MODES)} (who decodes "
            "the arm's requests), or left out (the engine's verifier)"
        )
    # Unset means "auto", the fastest weight format this CPU runs (an explicit null keeps the weights as
    # loaded); the arm's settings record it, so the run's registration says which was asked for.
    settings.setdefault("quantization", "auto")
    try:
        config = EngineConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"arm {name!r}: {exc}") from None
    resolved: Settings = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if f.name == "speculative_config" and value is not None:
            value = value.to_dict()
        if f.name in _ALWAYS_RECORDED or value != _default(f):
            resolved[f.name] = value
    spec = resolved["speculative_config"]
    if mode is not None and (spec is None or (mode == "draft_only" and spec.get("method") != "draft_model")):
        raise ValueError(
            f"arm {name!r}: verification={mode!r} needs a speculative_config"
            + (" with a draft model (method 'draft_model')" if mode == "draft_only" else "")
            + ": it chooses who decodes the arm's requests in an engine that speculates"
        )
    return EngineArm(name, resolved, config, mode)


def _engine_key(config: Settings) -> str:
    """Everything but the verifier: arms with equal keys can share one engine."""
    spec = config["speculative_config"]
    if spec is not None:
        verifier = verification_fields()
        spec = {k: v for k, v in spec.items() if k not in verifier}
    return json.dumps({**config, "speculative_config": spec}, sort_keys=True)


def is_lossy(config: Settings) -> bool:
    """Whether a canonical engine config verifies with a lossy policy (its policy says so)."""
    spec = config["speculative_config"]
    return spec is not None and verification_policy(spec["rejection_sample_method"]).lossy


def _config_key(arm: EngineArm) -> str:
    return json.dumps(arm.config, sort_keys=True)


def engine_groups(arms: list[EngineArm]) -> list[list[EngineArm]]:
    """Group engine arms into as few engines as possible: arms that differ only in the verifier share one
    engine started with the lossy arm's settings (arms with two different lossy settings cannot). The
    first arm of each group is the one whose config starts the engine."""
    groups: dict[str, list[EngineArm]] = {}
    for arm in arms:
        groups.setdefault(_engine_key(arm.config), []).append(arm)
    out: list[list[EngineArm]] = []
    for members in groups.values():
        lossy_configs = {_config_key(a) for a in members if is_lossy(a.config)}
        if len(lossy_configs) > 1:
            out.extend([a] for a in members)
            continue
        lead = next((a for a in members if is_lossy(a.config)), members[0])
        out.append([lead, *(a for a in members if a is not lead)])
    return out


_PRELOADED: dict[str, LLM] = {}
"""Engines loaded ahead of a run (``preload``), taken over by the executor that runs their arms."""


def size_for_work(executors: Iterable[Executor], questions: Iterable[Question], max_tokens: int) -> None:
    """Size the KV cache of each engine among ``executors`` (not started yet) for its longest request: the
    longest prompt of ``questions`` in its model's tokens (only the tokenizer is loaded) plus ``max_tokens``.
    Other executors, and an engine ``preload`` already loaded (and sized), stay as they are."""
    from flyspec.llm import GenerationRequest, prompt_lengths

    requests = [GenerationRequest(prompt=q.prompt, messages=q.messages) for q in questions]
    for ex in executors:
        if isinstance(ex, EngineExecutor) and _config_key(ex.lead) not in _PRELOADED:
            ex.request_len = max(prompt_lengths(ex.lead.config["model"], requests), default=0) + max_tokens


def preload(
    arms: list[EngineArm], questions: Iterable[Question] | None = None, max_tokens: int | None = None
) -> LLM:
    """Load the one engine ``arms`` will share in a run before it starts, so that a caller can measure it
    first (``flyspec demo``'s speed probe); the run's executor takes it over instead of loading again.
    With the run's ``questions`` and ``max_tokens``, its KV cache is sized for them (``size_for_work``)."""
    (executor,) = executors(arms)
    if questions is not None and max_tokens is not None:
        size_for_work([executor], questions, max_tokens)
    executor.start()
    _PRELOADED[_config_key(executor.lead)] = executor.llm
    return executor.llm


def executors(arms: list[EngineArm]) -> list[EngineExecutor]:
    """As few in-process engines as the arms allow (``engine_groups``)."""
    return [EngineExecutor(group) for group in engine_groups(arms)]


class EngineExecutor:
    """Answers the jobs of one or more engine arms with one engine started from the first arm's config (a
    ``TurnExecutor``); a standard arm in an engine started with a lossy policy asks for
    ``verification="standard"`` per request, which is lossless (docs/verification.md)."""

    drive = "in_turns"

    def __init__(self, arms: list[EngineArm]) -> None:
        self.lead = arms[0]
        self.arms = {arm.name: arm for arm in arms}
        lossy_engine = is_lossy(self.lead.config)
        self.verification = {
            arm.name: arm.verification or ("standard" if lossy_engine and not is_lossy(arm.config) else None)
            for arm in arms
        }
        self.llm: LLM | None = None
        self._prefix_seen = (0, 0)
        # The jobs in flight by request id: `answers` adds and removes them in the driving thread,
        # `cancel` removes them from the caller's, hence the lock.
        self._pending: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.request_len: int | None = None
        """The longest request the run sends (``size_for_work``), or None: the engine's default cache."""

    @property
    def shared(self) -> bool:
        return len(self.arms) > 1

    def describe(self) -> str:
        return f"engine {self.lead.config['model']} for arm(s) {', '.join(self.arms)}"

    def served_models(self) -> Served:
        """Nothing to ask: an engine arm's identity is its settings."""
        return {}

    def start(self) -> None:
        """Load the engine (or take over ``preload``'s) and warm it up now: neither is timed as answering.
        A fresh engine's first steps pay one-time costs (allocations, lazy initialisation) that would skew
        the tokens/s of whichever arm answers first, and a configuration too slow for this CPU stops here
        with the faster options, not after minutes of silence."""
        if self.llm is not None:
            return
        from flyspec.llm import LLM

        self.llm = _PRELOADED.pop(_config_key(self.lead), None)
        if self.llm is None:
            config = self.lead.engine_config
            sized = config.kv_cache_request_len is not None or config.kv_cache_memory_bytes is not None
            if self.request_len is not None and not sized:  # unless the arm sizes the cache itself
                config = dataclasses.replace(config, kv_cache_request_len=self.request_len)
            self.llm = LLM.from_config(config)
            self.llm.warm_up()
        self.take_prefix_cache()  # the warm-up's own prompt is not the run's

    @property
    def max_in_flight(self) -> int:
        """How many requests the engine runs at once (its admission cap)."""
        self.start()
        return self.llm.max_running

    def take_prefix_cache(self) -> tuple[int, int] | None:
        """Prompt tokens looked up in the engine's prefix cache and those shared since the last call (two
        arms sharing the engine send every prompt twice, so about half can be shared)."""
        if self.llm is None:
            return None
        stats = self.llm.stats
        seen, self._prefix_seen = self._prefix_seen, (stats.prefix_cache_queries, stats.prefix_cache_hits)
        return self._prefix_seen[0] - seen[0], self._prefix_seen[1] - seen[1]

    def facts(self) -> dict[str, object]:
        return {
            "kind": KIND,
            "arms": sorted(self.arms),
            "model": self.lead.config["model"],
            "max_in_flight": self.max_in_flight,
            "weights": self.llm.weight_formats,
            "kv_cache_bytes": self.llm.kv_cache_capacity_bytes,
            "verification": {name: v or "engine" for name, v in self.verification.items()},
        }

    def answers(self, jobs: Iterable[Job], sampling: Sampling) -> Iterator[tuple[Job, Completion]]:
        """``TurnExecutor.answers``; ending ``jobs`` early lets the requests in flight finish (they are
        still yielded)."""
        from flyspec.llm import GenerationRequest, RequestRejected
        from flyspec.sampling_params import SamplingParams

        self.start()

        def requests() -> Iterator[GenerationRequest]:
            for job in jobs:
                with self._lock:
                    self._pending[job.request_id] = job
                params = SamplingParams(
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    max_tokens=sampling.max_tokens,
                    seed=job.seed,
                    verification=self.verification[job.arm],
                )
                q = job.question
                yield GenerationRequest(
                    prompt=q.prompt, messages=q.messages, params=params, request_id=job.request_id
                )

        try:
            for out in self.llm.stream(requests()):
                with self._lock:
                    job = self._pending.pop(out.request_id, None)
                if job is not None:  # None: cancelled as it finished; the caller counts it cancelled
                    yield job, _completion(out)
        except RequestRejected as exc:
            job = self._pending[exc.request_id]
            raise ValueError(
                f"arm {job.arm!r} (model {self.lead.config['model']}), question "
                f"{job.question.dataset}/{job.question.id}: {exc.reason}"
            ) from None

    def cancel(self, drop: Callable[[Job], bool]) -> list[Job]:
        """Abort the jobs in flight for which ``drop`` is true (a comparison that has decided needs no more
        answers from its arm: their slots go to the arms still deciding); returns them. Safe from another
        thread than the one driving ``answers``, which yields nothing for them."""
        with self._lock:
            dropped = [job for job in self._pending.values() if drop(job)]
            for job in dropped:
                del self._pending[job.request_id]
                self.llm.abort(job.request_id)
        return dropped


def _completion(out: RequestOutput) -> Completion:
    metrics = out.metrics
    finished = metrics.finished_time if metrics.finished_time is not None else metrics.arrival_time
    first = out.outputs[0]
    return Completion(
        text=first.text,
        finish_reason=first.finish_reason,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(first.token_ids),
        latency_s=max(0.0, finished - metrics.arrival_time),
        source="engine",
        acceptance=metrics.counts,
    )

"""Engine arms: answer gate jobs with one in-process engine through the public `LLM.stream` API.

Work is fed continuously in the run's order: `LLM.stream` pulls the next request the moment a slot frees
up, so the batch stays full and no answer waits for the longest answer of a chunk. When two arms share the
engine (standard vs a lossy policy, differing only in the verifier), the jobs of both arms for one
question arrive side by side, so a pair completes at about the same time. The number in flight is the
engine's admission cap (min(max_num_seqs, max_num_batched_tokens // (1 + K))): more would only wait in the
scheduler's queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from flyspec.gate.arms.base import Completion, EngineArm, Job, Sampling, is_lossy


class EngineExecutor:
    """Answers the jobs of one or more engine arms with one engine started from the first arm's config.

    A standard arm inside an engine started with a lossy policy asks for ``verification="standard"`` per
    request, which is lossless (docs/verification.md).
    """

    def __init__(self, arms: list[EngineArm]) -> None:
        self.lead = arms[0]
        self.arms = {arm.name: arm for arm in arms}
        lossy_engine = is_lossy(self.lead.config)
        self.verification = {
            arm.name: ("standard" if lossy_engine and not is_lossy(arm.config) else None) for arm in arms
        }
        self._llm: Any = None

    @property
    def shared(self) -> bool:
        """Whether several arms share this engine."""
        return len(self.arms) > 1

    def describe(self) -> str:
        """One line for logs: what this executor runs, for which arms."""
        return f"engine {self.lead.config['model']} for arm(s) {', '.join(self.arms)}"

    def prepare(self) -> None:
        """Start the engine (load weights) and warm it up now, so that neither is timed as answering."""
        if self._llm is None:
            from flyspec.llm import LLM

            self._llm = LLM.from_config(self.lead.engine_config)
            # The first steps of a fresh engine pay one-time costs (allocations, lazy initialisation) that
            # would be charged to whichever arm answers first and skew its tokens/s; a configuration too
            # slow for this CPU stops here with the faster options, not after minutes of silence.
            self._llm.warm_up()

    @property
    def max_in_flight(self) -> int:
        """How many requests the engine runs at once (its admission cap)."""
        self.prepare()
        return self._llm.max_running

    def facts(self) -> dict[str, Any]:
        """What the run's notes record about this executor."""
        return {
            "kind": "engine",
            "arms": sorted(self.arms),
            "model": self.lead.config["model"],
            "max_in_flight": self.max_in_flight,
            "verification": {name: v or "engine" for name, v in self.verification.items()},
        }

    def answers(self, jobs: Iterable[Job], sampling: Sampling) -> Iterator[tuple[Job, Completion]]:
        """Answer ``jobs`` (pulled lazily, in order) and yield each answer as soon as it finishes.

        Ending ``jobs`` early lets the requests in flight finish (they are still yielded); closing this
        generator aborts them.
        """
        from flyspec.llm import GenerationRequest, RequestRejected
        from flyspec.sampling_params import SamplingParams

        self.prepare()
        pending: dict[str, Job] = {}

        def requests() -> Iterator[GenerationRequest]:
            for job in jobs:
                pending[job.request_id] = job
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
            for out in self._llm.stream(requests()):
                yield pending.pop(out.request_id), _completion(out)
        except RequestRejected as exc:
            job = pending[exc.request_id]
            raise ValueError(
                f"arm {job.arm!r} (model {self.lead.config['model']}), question "
                f"{job.question.dataset}/{job.question.id}: {exc.reason}"
            ) from None


def _completion(out: Any) -> Completion:
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

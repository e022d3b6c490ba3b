"""What every kind of arm shares: a run's sampling, a job, a completion, and the two protocols a kind
implements: ``Arm`` (its validated settings) and ``Executor`` (what answers its jobs), driven ``"in_turns"``
(``TurnExecutor``: it computes answers itself, taking turns with the others in one thread, so two engines
never compete for the CPU) or ``"concurrently"`` (``ConcurrentExecutor``: it waits on servers on an asyncio
loop) by flyspec/gate/runs/dispatch.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from flyspec.checks import is_int, is_number, load_json
from flyspec.gate.data.questions import Question
from flyspec.outputs import AcceptanceCounts

Settings = dict[str, object]
"""JSON settings as given: an arm's object, its identity and notes, a speculative config (each value is
checked where it is read)."""
ArmSpec = Settings | str | Path
"""An arm as given: its JSON object, that object as a string, or the path of a JSON file."""
ServedModel = Mapping[str, object]
"""What an arm's server reports serving: the ``id`` and ``root`` of its /v1/models card."""
Served = dict[str, ServedModel | None]
"""Per arm name (and a run's ``judge``): the model its server reports serving, None where nothing was
asked (``Executor.served_models``)."""


@dataclass(frozen=True)
class Sampling:
    """Sampling shared by every arm of a run."""

    temperature: float
    top_p: float
    max_tokens: int

    def __post_init__(self) -> None:
        t, p, m = self.temperature, self.top_p, self.max_tokens
        if not is_number(t, at_least=0):
            raise ValueError(f"temperature={t!r}: must be a finite number >= 0 (0 = greedy)")
        if not is_number(p, above=0, at_most=1):
            raise ValueError(f"top_p={p!r}: must be in (0, 1]")
        if not is_int(m, 1):
            raise ValueError(f"max_tokens={m!r}: must be an integer >= 1")


@dataclass(frozen=True)
class Job:
    """One question to answer by one arm in one repeat, with its per-question seed and its position in
    the run's order (0-based)."""

    arm: str
    repeat: int
    question: Question
    seed: int
    position: int

    @property
    def lane(self) -> tuple[str, int]:
        """The arm and repeat this job answers for."""
        return (self.arm, self.repeat)

    @property
    def request_id(self) -> str:
        return f"{self.arm}|{self.repeat}|{self.question.dataset}|{self.question.id}"


@dataclass(frozen=True)
class Completion:
    """What an arm produced for a job, before grading. ``acceptance`` is None where the source reports no
    speculative-decoding counters (never zeros); ``forgiven_reported`` is False where it reports the others
    but not the forgiven count (vLLM); ``system_fingerprint`` is an endpoint response's."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    source: str
    acceptance: AcceptanceCounts | None = None
    forgiven_reported: bool = True
    system_fingerprint: str | None = None


class Arm(Protocol):
    """A validated arm: its name in the run and its settings."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str:
        """The registered kind (``engine``, ``openai``)."""

    @property
    def greedy_repeats(self) -> bool:
        """Whether asking twice at temperature 0 gives the same answers (then a pilot measures nothing)."""

    def identity(self, served: ServedModel | None = None) -> Settings:
        """What decides the arm's outputs, registered before the run (``served``: what its server reports
        serving, ``Executor.served_models``)."""

    def public_dict(self) -> Settings:
        """The arm's full settings for the run's notes (never a secret)."""

    @property
    def settings_visible(self) -> bool:
        """Whether this process sees every setting that decides the outputs (not so for an endpoint)."""

    @property
    def speculative_config(self) -> Settings | None:
        """The speculative config the arm runs, where this process can see it."""

    def variant(self, name: str, speculative_config: Settings) -> Arm:
        """The same arm under ``name`` running ``speculative_config`` (``gate tune``'s settings);
        ValueError for a kind whose server decides what it runs."""


Emit = Callable[[Job, Completion], None]
NextJob = Callable[[], Awaitable[Job | None]]


class Executor(Protocol):
    """Answers the jobs of one or more arms (``arms``, by name)."""

    drive: str
    """``"in_turns"`` or ``"concurrently"`` (module docstring)."""
    arms: dict[str, Arm]

    @property
    def shared(self) -> bool:
        """Whether several arms share it (their requests side by side in the same batches)."""

    @property
    def max_in_flight(self) -> int: ...

    def describe(self) -> str:
        """One line for logs: what it runs, for which arms."""

    def served_models(self) -> Served:
        """Per arm, what its server reports serving; read before the run is registered."""

    def start(self) -> None:
        """Get ready to answer (an engine loads and warms up), so that none of it is timed as answering."""

    def facts(self) -> dict[str, object]:
        """What the run's notes record about it."""

    def take_prefix_cache(self) -> tuple[int, int] | None:
        """(prompt tokens looked up in the prefix cache, those whose KV blocks were shared) since the last
        call, or None where it is not known (an endpoint)."""


class TurnExecutor(Executor, Protocol):
    """An executor driven ``in_turns``."""

    def answers(self, jobs: Iterable[Job], sampling: Sampling) -> Iterator[tuple[Job, Completion]]:
        """Answer ``jobs`` (pulled lazily, in order), yielding each answer as soon as it finishes; closing
        the generator aborts what is in flight."""


class ConcurrentExecutor(Executor, Protocol):
    """An executor driven ``concurrently``."""

    async def serve(self, next_job: NextJob, sampling: Sampling, emit: Emit) -> None:
        """Answer jobs until ``next_job`` returns None, handing each answer to ``emit`` as it arrives."""


def load_arm_spec(spec: ArmSpec, name: str) -> Settings:
    """An arm given as a dict, a JSON object string, or the path of a JSON file, as a dict."""
    if isinstance(spec, dict):
        return dict(spec)
    data = load_json(spec, f"arm {name!r}")
    if not isinstance(data, dict):
        raise ValueError(f"arm {name!r}: must be a JSON object, got {type(data).__name__}")
    return data


def unknown_keys(who: str, data: Mapping[str, object], keys: tuple[str, ...], takes: str) -> None:
    """ValueError naming the keys of ``data`` outside ``keys`` (``who``: ``arm 'x'``; ``takes``: ``engine
    arms take``)."""
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise ValueError(f"{who}: unknown key(s) {', '.join(unknown)}; {takes} {', '.join(keys)}")

"""The settings of a gate run, pilot or tune, stated once for the CLI and the Python API: ``RunSettings``,
``GateOptions`` (``TuneOptions``: flyspec/gate/runs/tune.py). Each field a command takes carries a ``Flag``,
from which the command line (flyspec/cli/settings.py) generates its options, as vLLM's ``EngineArgs`` do.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TypeVar

from flyspec.checks import is_int, is_number
from flyspec.gate.arms.base import ArmSpec, Sampling
from flyspec.gate.stats.decide import FINITE, POPULATIONS, check_margin_alpha
from flyspec.gate.stats.spending import check_budget

COMMANDS = ("run", "pilot", "tune")
RUNS = ("run", "pilot")
T = TypeVar("T")
OptionType = type | types.GenericAlias
OPTION_TYPES: dict[str, OptionType] = {"int": int, "float": float, "bool": bool, "tuple[str, ...]": list[str]}


@dataclass(frozen=True)
class Flag:
    """How one setting is given: its option, help (``helps``: per command), the commands that show it, its
    type there (by default its field's: ``float | None`` is float, ``tuple[str, ...]`` a list, the rest
    str), ``parse`` (given value -> field's), ``negate`` (a switch that sets False), whether a ``--config``
    file may set it, and the commands that require it though the field has a default."""

    option: str
    help: str
    commands: tuple[str, ...] = COMMANDS
    type: OptionType | None = None
    helps: Mapping[str, str] = field(default_factory=dict)
    parse: Callable[..., object] | None = None
    negate: bool = False
    config: bool = True
    required: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Its name in a ``--config`` file (``--exclude-run``: ``exclude_run``)."""
        return self.option.removeprefix("--").removeprefix("no-").replace("-", "_")

    def help_for(self, command: str) -> str:
        return self.helps.get(command, self.help)

    def value(self, given: object) -> object:
        """The field's value for a given value."""
        if self.negate:
            return not given
        return self.parse(given) if self.parse is not None else given


def flag(option: str, help: str, **settings: object) -> dict[str, Flag]:
    """A field's metadata: its ``Flag``."""
    return {"flag": Flag(option, help, **settings)}


def is_required(item: Field[object]) -> bool:
    """Whether a field has no default (the settings every run needs: store, datasets, baseline, margin)."""
    return item.default is MISSING and item.default_factory is MISSING


def flags(options: type, command: str | None = None) -> list[tuple[str, Flag]]:
    """``(field, flag)`` of each setting of ``options`` (on ``command``: those it shows), in the order the
    command shows them: the settings every run needs, then the command's own, then the shared ones."""
    every = [(f, _typed(f, f.metadata["flag"])) for f in fields(options) if "flag" in f.metadata]
    shown = [(f, x) for f, x in every if command is None or command in x.commands]
    own = set(getattr(options, "__annotations__", {}))
    shown.sort(key=lambda pair: 0 if is_required(pair[0]) else 1 if pair[0].name in own else 2)  # stable
    return [(f.name, x) for f, x in shown]


def _typed(item: Field[object], x: Flag) -> Flag:
    if x.type is not None:
        return x
    return replace(x, type=OPTION_TYPES.get(str(item.type).removesuffix(" | None"), str))


def config_keys(options: type) -> list[str]:
    """The keys a ``--config`` file may hold: every setting's option name a file may set."""
    return [x.key for _, x in flags(options) if x.config]


def read_config(options: type, path: Path) -> dict[str, object]:
    """A ``--config`` file's settings by option name; a list setting may be spelt in the plural and given
    as one string. ValueError for a file that is not a JSON object or holds an unknown key."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must hold a JSON object")
    for _, x in flags(options):
        if x.type == list[str]:
            if x.key + "s" in data and x.key not in data:
                data[x.key] = data.pop(x.key + "s")
            if isinstance(data.get(x.key), str):
                data[x.key] = [data[x.key]]
    allowed = config_keys(options)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    return data


def options_from_flags(
    options: type[T], command: str, given: Mapping[str, object], config: Path | None = None, **fixed: object
) -> T:
    """The settings of ``command`` from its options (``given``, by field name; None, an empty list or an
    unset switch: not given) over a ``--config`` file's: a given option overrides the file, and what
    neither sets keeps the field's default. ``fixed``: fields the command sets itself (a run's kind)."""
    by_key = read_config(options, config) if config is not None else {}
    for name, x in flags(options, command):
        value = given.get(name)
        if not (value is None or value is False or value == []):  # 0 is given; an unset switch is not
            by_key[x.key] = value
    for item in fields(options):  # type: ignore[arg-type]
        x = item.metadata.get("flag")
        needed = x is not None and (is_required(item) or command in x.required)
        if needed and by_key.get(x.key) in (None, []):
            raise ValueError(f"{x.option} is required (on the command line or in --config)")
    values = {name: x.value(by_key[x.key]) for name, x in flags(options) if by_key.get(x.key) is not None}
    return options(**values, **fixed)


KINDS = ("gate", "pilot")
RESERVED_ARMS = ("baseline", "candidate", "judge")
CONTROL_SHARE = 5  # a control's default share of alpha is alpha / CONTROL_SHARE
ARM_HELP = 'Arm as a JSON object or a JSON file, e.g. \'{"kind": "engine", "model": "...", ...}\'.'


def controls(values: list[str] | dict[str, ArmSpec]) -> dict[str, ArmSpec]:
    """``--control NAME=ARM`` values (or a config file's object of them) as {name: arm}."""
    if isinstance(values, dict):
        return values
    out: dict[str, ArmSpec] = {}
    for value in values:
        name, sep, arm = value.partition("=")
        if not sep or not name.strip() or not arm.strip():
            raise ValueError(f'--control {value!r}: give NAME=ARM, e.g. draft=\'{{"kind": "engine", ...}}\'')
        if name in out:
            raise ValueError(f"--control: two controls are named {name!r}")
        out[name.strip()] = arm
    return out


def check_int(name: str, value: object, least: int) -> None:
    """An integer >= ``least`` (a seed >= 0, a number of questions >= 1)."""
    if not is_int(value, least):
        raise ValueError(
            f"{name}={value!r}: must be " + ("a positive integer" if least else "an integer >= 0")
        )


@dataclass(frozen=True)
class RunSettings:
    """What every kind of run takes: store, datasets, baseline and margin (positional), the rest by keyword.
    Each field's meaning is its flag's help; ``population=None`` keeps a resumed run's registered claim."""

    store: str | Path = field(
        metadata=flag(
            "--store", "SQLite file holding the run (created if missing; a run resumes where it stopped)."
        )
    )
    datasets: tuple[str, ...] = field(
        metadata=flag(
            "--dataset",
            "gsm8k, math500, humaneval, aime:PATH, gpqa:PATH, mbpp:PATH or a JSONL path; repeat for several.",
        )
    )
    baseline: ArmSpec = field(
        metadata=flag(
            "--baseline",
            "Baseline arm. " + ARM_HELP,
            helps={"tune": "Baseline arm, standard verification. " + ARM_HELP},
        )
    )
    margin: float = field(
        metadata=flag(
            "--margin",
            "Tolerated accuracy loss, fraction in (0, 1), registered before the run.",
            helps={
                "pilot": "The margin you plan to register (fraction), to size the real run.",
                "tune": "Tolerated accuracy loss, fraction in (0, 1), registered.",
            },
        )
    )
    _: KW_ONLY
    alpha: float = field(
        default=0.025,
        metadata=flag(
            "--alpha",
            "One-sided level (default 0.025: 95% interval).",
            helps={"tune": "One-sided level of each test and of the whole tune (default 0.025)."},
        ),
    )
    max_questions: int | None = field(
        default=None,
        metadata=flag(
            "--max-questions",
            "The first N questions of the seeded order over all datasets (a sequential run's maximum; "
            "default: every question).",
            helps={
                "tune": "Test questions: the next N of the seeded order after the calibration ones (default: "
                "all)."
            },
        ),
    )
    max_minutes: float | None = field(
        default=None,
        metadata=flag(
            "--max-minutes",
            "Stop answering after this long (models load first); rerunning the command continues.",
        ),
    )
    temperature: float = field(
        default=0.0,
        metadata=flag("--temperature", "Sampling temperature (default 0)."),
    )
    top_p: float = field(
        default=1.0,
        metadata=flag("--top-p", "Nucleus sampling mass (default 1.0)."),
    )
    max_tokens: int = field(default=512, metadata=flag("--max-tokens", "Answer length cap (default 512)."))
    seed: int = field(
        default=0,
        metadata=flag("--seed", "Run seed; per-question seeds derive from it."),
    )
    order_seed: int | None = field(
        default=None,
        metadata=flag("--order-seed", "Question-order seed (default: --seed)."),
    )
    run_id: str | None = field(
        default=None,
        metadata=flag(
            "--run",
            "Run name in the store (default 'gate').",
            helps={
                "pilot": "Run name in the store (default 'pilot').",
                "tune": "Tune run name in the store (default 'tune').",
            },
        ),
    )
    shuffle_seed: int = field(
        default=0,
        metadata=flag("--shuffle-seed", "GPQA's option order.", commands=()),
    )
    exclude_runs: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--exclude-run",
            "Leave out the questions this run of the store used (repeatable); pilots are always left out. "
            "Fresh questions are not a new look's budget: under the default claim every look at the same "
            "arms counts in the alpha ledger.",
        ),
    )
    population: str | None = field(
        default=None,
        metadata=flag(
            "--population",
            "What a sequential decision claims: 'superpopulation' (default: the method on questions like "
            "these, run-to-run randomness included) or 'finite' (exactly the registered questions in this "
            "run's outputs, nothing beyond them). A resumed run keeps its registered claim.",
            commands=("run", "tune"),
        ),
    )
    alpha_budget: float | None = field(
        default=None,
        metadata=flag(
            "--alpha-budget",
            "The family-wise error of every look at these arms' comparison, on any questions, this run "
            "and later looks together: the chance that any of them wrongly PASSes (default: --alpha, leaving "
            "nothing for a second look; at most 0.05 unless --alpha is larger; set by the first look). E.g. "
            "--alpha 0.0125 --alpha-budget 0.025 keeps 0.0125 for a sequential continuation of an "
            "INCONCLUSIVE fixed run. Looks are kept per user in the alpha ledger ($FLYSPEC_GATE_LEDGER, "
            "default in the flyspec cache) and every report shows the budget and the earlier looks.",
            commands=("run", "tune"),
        ),
    )
    progress: bool = field(
        default=True,
        metadata=flag("--no-progress", "No progress bar.", negate=True, config=False),
    )

    def __post_init__(self) -> None:
        datasets = (self.datasets,) if isinstance(self.datasets, str) else tuple(self.datasets)
        object.__setattr__(self, "datasets", datasets)
        excluded = (self.exclude_runs,) if isinstance(self.exclude_runs, str) else tuple(self.exclude_runs)
        if any(not isinstance(n, str) or not n.strip() for n in excluded):
            raise ValueError(f"exclude_runs={self.exclude_runs!r}: give run names")
        object.__setattr__(self, "exclude_runs", excluded)
        self._check()

    def _check(self) -> None:
        if not self.datasets:
            raise ValueError("datasets: give at least one dataset name or path")
        check_margin_alpha(self.margin, self.alpha)
        self.sampling  # noqa: B018 - validates temperature, top_p and max_tokens
        check_int("seed", self.seed, 0)
        if self.order_seed is not None:
            check_int("order_seed", self.order_seed, 0)
        check_int("shuffle_seed", self.shuffle_seed, 0)
        if self.max_questions is not None:
            check_int("max_questions", self.max_questions, 1)
        if self.max_minutes is not None and not is_number(self.max_minutes, above=0):
            raise ValueError(f"max_minutes={self.max_minutes!r}: must be a positive number of minutes")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id.strip()):
            raise ValueError(f"run={self.run_id!r}: must be a non-empty name")
        if self.alpha_budget is not None:
            check_budget(self.alpha, self.alpha_budget)
        if self.population is not None and self.population not in POPULATIONS:
            raise ValueError(
                f"population={self.population!r}: must be one of {', '.join(POPULATIONS)} (what a sequential "
                "PASS claims: about the method on questions like these, the default, or about exactly the "
                "registered questions in this run's outputs)"
            )

    @property
    def sampling(self) -> Sampling:
        """The sampling every arm uses."""
        return Sampling(self.temperature, self.top_p, self.max_tokens)

    @property
    def question_order_seed(self) -> int:
        """The seed of the question order."""
        return self.seed if self.order_seed is None else self.order_seed


@dataclass(frozen=True)
class GateOptions(RunSettings):
    """One gate run or pilot (``kind``; a pilot without a candidate runs the baseline twice). Arms and the
    judge are dicts, JSON strings or JSON files; each field's meaning is its flag's help."""

    candidate: ArmSpec | None = field(
        default=None,
        metadata=flag(
            "--candidate",
            "Candidate arm. " + ARM_HELP,
            commands=RUNS,
            helps={
                "pilot": "Also run this arm once, to measure its flip rate against the baseline (needed at "
                "temperature 0, where the baseline twice measures nothing). " + ARM_HELP
            },
            required=("run",),
        ),
    )
    kind: str = "gate"
    sequential: bool = field(
        default=False,
        metadata=flag(
            "--sequential",
            "Stop at the first crossing of an anytime-valid confidence sequence (PASS or FAIL), at "
            "--max-questions, at --max-minutes or at Ctrl-C.",
            commands=("run",),
            parse=bool,
        ),
    )
    limit: int | None = field(
        default=None,
        metadata=flag(
            "--limit", "The first N questions of each dataset's seeded random order.", commands=RUNS
        ),
    )
    judge: ArmSpec | None = field(
        default=None,
        metadata=flag(
            "--judge",
            "Judge of the questions with grader 'judge', as a JSON object or file: "
            '{"base_url": "http://HOST:PORT/v1", "model": "NAME", "max_tokens": 512, "seed": 0}. It compares '
            "both arms' answers in both orders (temperature 0).",
            commands=RUNS,
        ),
    )
    gold_rate: float | None = field(
        default=None,
        metadata=flag(
            "--gold-rate",
            "Judged runs: the share of pairs whose answers differ drawn for a gold label (default "
            "0.2), by a hash independent of the question order, registered before the first answer. The "
            "decision is the prediction-powered interval: it rests on those labels (P(PASS) <= alpha at a "
            "true loss of the margin and P(FAIL) <= alpha at no loss, for any judge); the judge's verdicts "
            "only sharpen it as far as the labels show them right.",
            commands=("run",),
        ),
    )
    judge_all: bool = field(
        default=False,
        metadata=flag(
            "--judge-all",
            "The judge grades every question; each question's own grader labels the drawn pairs (to "
            "measure a judge against exact grading). Without it, people label with `gate label`.",
            commands=("run",),
        ),
    )
    controls: dict[str, ArmSpec] = field(
        default_factory=dict,
        metadata=flag(
            "--control",
            "NAME=ARM: also compare an arm known to be worse (e.g. the draft model alone) with the "
            "baseline, a positive control the gate must FAIL; repeatable. Each control takes "
            "--control-alpha of --alpha, so the chance of any wrong decision stays at most --alpha; a "
            "sequential run answers the controls' pairs first and stops asking a control once it decided.",
            commands=("run",),
            type=list[str],
            parse=controls,
        ),
    )
    control_alpha: float | None = field(
        default=None,
        metadata=flag(
            "--control-alpha",
            "Each control's share of --alpha (default: a fifth of it).",
            commands=("run",),
        ),
    )
    control_margin: float | None = field(
        default=None,
        metadata=flag("--control-margin", "The controls' margin (default: --margin).", commands=("run",)),
    )

    def _check(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: must be 'gate' or 'pilot'")
        super()._check()
        if self.limit is not None:
            check_int("limit", self.limit, 1)
        if self.kind == "gate" and self.candidate is None:
            raise ValueError("candidate: a gate run compares two arms; give --candidate")
        if self.sequential and self.kind != "gate":
            raise ValueError("sequential: only `gate run` is sequential; a pilot answers a fixed set")
        if self.sequential and self.limit is not None:
            raise ValueError(
                f"limit={self.limit}: a sequential run takes --max-questions (the first N of the seeded "
                "order over all datasets), not --limit"
            )
        if self.population == FINITE and not self.sequential:
            raise ValueError(
                f"population={self.population!r}: only a sequential run chooses its claim; a fixed run's "
                "interval is about the method (questions drawn at random)"
            )
        if self.controls and self.kind != "gate":
            raise ValueError("controls: only a gate run has controls (comparisons the gate must FAIL)")
        for name in self.controls:
            if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_ARMS:
                raise ValueError(
                    f"controls: name {name!r}: must be an identifier other than {', '.join(RESERVED_ARMS)}"
                )
        share = self.control_alpha_each
        if self.controls and (not is_number(share, above=0) or share * len(self.controls) >= self.alpha):
            raise ValueError(
                f"control_alpha={share!r}: each control's share of alpha must be positive and all of them "
                f"together less than alpha={self.alpha} (the candidate keeps the rest)"
            )
        if self.controls and self.control_margin is not None:
            check_margin_alpha(self.control_margin, share)
        if self.gold_rate is not None and (
            not is_number(self.gold_rate, above=0, at_most=1) or self.judge is None
        ):
            raise ValueError(
                f"gold_rate={self.gold_rate!r}: the share of differing judged pairs drawn for a gold label, "
                "in (0, 1], with a judge (--judge)"
            )
        if self.judge_all and (self.judge is None or self.kind != "gate"):
            raise ValueError("judge_all: a gate run's judge grades every question; give --judge")
        if self.judge is not None and self.controls:
            raise ValueError("controls: a judged run compares one candidate with the baseline")

    @property
    def control_alpha_each(self) -> float:
        """Each control's share of alpha (default a fifth: a control loses far more than the margin)."""
        return self.control_alpha if self.control_alpha is not None else self.alpha / CONTROL_SHARE

    @property
    def candidate_alpha(self) -> float:
        """The candidate's share of alpha: what the controls leave."""
        return self.alpha - self.control_alpha_each * len(self.controls)

    @property
    def name(self) -> str:
        """The run's name in the store."""
        return self.run_id or self.kind

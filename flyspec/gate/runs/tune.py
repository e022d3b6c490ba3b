"""``gate tune``: the most aggressive lossy setting shown non-inferior to standard verification, the chance
of choosing a harmful one at most alpha (docs/gate.md, "Choosing a lossy setting: `gate tune`"): its
options, the settings it chooses among (``speculative_config`` fragments applied to the baseline engine arm,
``{"arm": ARM, "speculative_config": {...}}`` entries, a ``--policies`` grid or the default FLy grid) and its
fixed-sequence family. A calibration run, never graded, fixes the test order by speed; the settings are
then tested in that order, each at the full alpha, until the first that does not PASS.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from flyspec.checks import load_json
from flyspec.config import LOSSLESS_PREFIX_FIELD, SpeculativeConfig, lossy_policy_names, verification_policy
from flyspec.gate.arms import make_executors, parse_arm
from flyspec.gate.arms.base import Arm, Settings, load_arm_spec
from flyspec.gate.data.results import lane_speeds, setting_status
from flyspec.gate.data.spec import (
    BASELINE,
    CalibrationRecord,
    Excluded,
    QuestionOrder,
    Registration,
    SettingRecord,
    TestOrder,
    TuneRecord,
)
from flyspec.gate.data.store import GateStore
from flyspec.gate.data.storefile import StoreLock
from flyspec.gate.runs.progress import announce_sandbox, log
from flyspec.gate.runs.register import population, register, used_questions
from flyspec.gate.runs.run import ORDER_RULE, Chosen, Plan, RunResult, choose, plan, sequential_plan
from flyspec.gate.runs.session import Clock, Session
from flyspec.gate.runs.settings import RunSettings, check_int, flag
from flyspec.gate.stats.decide import PASS, PAUSES
from flyspec.gate.stats.monitor import Monitor, SequentialPlan
from flyspec.policy_grid import expand_grid, policy_of

DEFAULT_THRESHOLDS = (0.6, 0.3)
MAX_DEFAULT_WINDOW = 6
DEFAULT_POLICY = "fly"  # of a fragment that names no policy and sets no policy's fields


def numbers(kind: type[int] | type[float], option: str) -> Callable[[str], tuple[float, ...]]:
    """A parser of comma-separated numbers of ``kind`` given to ``option`` (``3,2,1``)."""

    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ValueError(
                f"{option} {text!r}: give comma-separated {kind.__name__}s, e.g. 3,2,1"
            ) from None
        if not values:
            raise ValueError(f"{option} {text!r}: give at least one value")
        return values

    return parse


ORDERS = ("speed", "given")
ORDER_BY = ("mean_acceptance_length", "tokens_per_s")
DEFAULT_CALIBRATION = 8


@dataclass(frozen=True)
class TuneOptions(RunSettings):
    """One ``gate tune``; the shared settings are RunSettings'. Each field's meaning is its flag's help;
    neither ``candidates`` nor ``policies``: the default FLy grid over ``windows`` x ``thresholds``."""

    candidates: str | list[object] | None = field(
        default=None,
        metadata=flag(
            "--candidates",
            "JSON list (or JSON file) of settings: speculative_config fragments such as "
            '{"fly_window_size": 2, "fly_entropy_threshold": 0.3} applied to the baseline engine arm, or '
            '{"arm": ARM, "speculative_config": {...}} for endpoint arms. Default: the grid of --windows '
            "x --thresholds.",
            commands=("tune",),
        ),
    )
    policies: str | Settings | list[object] | None = field(
        default=None,
        metadata=flag(
            "--policies",
            "A grid over verification policies (JSON or a JSON file): an object, or a list of them, "
            "whose list values are expanded into every combination, e.g. "
            '[{"rejection_sample_method": "fly", "fly_window_size": [3, 1], '
            '"lossless_prefix_tokens": [0, 32]}, {"rejection_sample_method": "typical", '
            '"typical_acceptance_sampler_posterior_threshold": [0.09, 0.3]}] (see docs/gate.md).',
            commands=("tune",),
        ),
    )
    windows: tuple[int, ...] | None = field(
        default=None,
        metadata=flag(
            "--windows",
            "Grid windows, e.g. 3,2,1 (default: min(6, K-1) down to 1).",
            commands=("tune",),
            parse=numbers(int, "--windows"),
        ),
    )
    thresholds: tuple[float, ...] | None = field(
        default=None,
        metadata=flag(
            "--thresholds",
            "Grid entropy thresholds (default: 0.6,0.3).",
            commands=("tune",),
            parse=numbers(float, "--thresholds"),
        ),
    )
    order: str = field(
        default="speed",
        metadata=flag(
            "--order",
            "speed: slowest first, measured on the calibration questions (default); given: the "
            "candidates' order.",
            commands=("tune",),
        ),
    )
    order_by: str = field(
        default="mean_acceptance_length",
        metadata=flag(
            "--order-by",
            "Speed measure of --order speed: mean_acceptance_length (default) or tokens_per_s.",
            commands=("tune",),
            parse=lambda by: by.replace("-", "_"),
        ),
    )
    calibration_questions: int = field(
        default=DEFAULT_CALIBRATION,
        metadata=flag(
            "--calibration-questions",
            "Questions that measure speed (never graded, never test questions; default 8); 0 only with "
            "--order given.",
            commands=("tune",),
        ),
    )
    sequential: bool = field(
        default=True,
        metadata=flag(
            "--fixed",
            "Fixed-size tests on every test question instead of sequential tests (default).",
            commands=("tune",),
            negate=True,
        ),
    )

    def _check(self) -> None:
        super()._check()
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r}: must be one of {', '.join(ORDERS)}")
        if self.order_by not in ORDER_BY:
            raise ValueError(f"order_by={self.order_by!r}: must be one of {', '.join(ORDER_BY)}")
        check_int("calibration_questions", self.calibration_questions, 0)
        if self.calibration_questions == 0 and self.order == "speed":
            raise ValueError(
                "calibration_questions=0: the order by speed is measured on calibration questions; give "
                "at least 1, or --order given"
            )
        grid = self.windows is not None or self.thresholds is not None
        given = [
            name
            for name, value in (("candidates", self.candidates), ("policies", self.policies))
            if value is not None
        ] + (["windows/thresholds"] if grid else [])
        if len(given) > 1:
            raise ValueError(f"give one of candidates, policies or a grid (windows, thresholds), not {given}")

    @property
    def name(self) -> str:
        """The tune run's name in the store (its calibration run is ``NAME/calibration``)."""
        return self.run_id or "tune"

    @property
    def calibration_run(self) -> str:
        return f"{self.name}/calibration"


@dataclass(frozen=True)
class TuneSetting(SettingRecord):
    """One candidate as registered, and the arm that runs it."""

    arm: Arm

    @property
    def record(self) -> SettingRecord:
        """The setting as the tune registers it."""
        return SettingRecord(self.id, self.label, self.speculative_config)


def label(spec: Mapping[str, object], reference: Mapping[str, object] | None) -> str:
    """The policy's label of its settings (FLy: ``W=2, theta=0.3``), then ``prefix=L`` for a lossless
    prefix and whatever else differs from the baseline's config (e.g. ``K=5``)."""
    parts = [verification_policy(spec["rejection_sample_method"]).label(spec)]
    if spec.get(LOSSLESS_PREFIX_FIELD):
        parts.append(f"prefix={spec[LOSSLESS_PREFIX_FIELD]}")
    k = spec.get("num_speculative_tokens")
    if reference is not None and k != reference.get("num_speculative_tokens"):
        parts.append(f"K={spec.get('num_speculative_tokens')}")
    return ", ".join(parts)


def _lossy_spec(data: object, where: str) -> Settings:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: speculative_config must be a JSON object, got {type(data).__name__}")
    try:
        spec = SpeculativeConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not spec.is_lossy:
        methods = ", ".join(repr(m) for m in lossy_policy_names())
        raise ValueError(
            f"{where}: a candidate must verify with a lossy policy (rejection_sample_method one of {methods})"
        )
    # Unset keys (null) are left out: the config is printed for pasting, and absent means the default.
    return {key: value for key, value in spec.to_dict().items() if value is not None}


def _setting(index: int, entry: object, baseline: Arm, reference: Settings | None) -> TuneSetting:
    setting_id = f"s{index + 1}"
    where = f"candidate {index + 1}"
    if not isinstance(entry, dict) or not entry:
        raise ValueError(f"{where}: must be a non-empty JSON object, got {entry!r:.80}")
    if "arm" in entry:
        unknown = sorted(set(entry) - {"arm", "speculative_config"})
        if unknown or "speculative_config" not in entry:
            raise ValueError(
                f"{where}: an entry with an arm takes exactly 'arm' and 'speculative_config' (the config "
                f"that arm runs, for the report){f'; unknown: {unknown}' if unknown else ''}"
            )
        spec = _lossy_spec(entry["speculative_config"], where)
        arm = parse_arm(setting_id, load_arm_spec(entry["arm"], setting_id))
        if arm.settings_visible and _lossy_spec(arm.speculative_config, where) != spec:
            raise ValueError(f"{where}: the engine arm's speculative_config differs from the one given")
    elif reference is None or not baseline.settings_visible:
        raise ValueError(
            f"{where}: with an endpoint baseline every candidate needs its own arm: "
            '{"arm": {...}, "speculative_config": {...}}'
        )
    else:
        policy = policy_of(entry) or DEFAULT_POLICY
        spec = _lossy_spec({**reference, "rejection_sample_method": policy, **entry}, where)
        arm = baseline.variant(setting_id, spec)
    return TuneSetting(setting_id, label(spec, reference), spec, arm)


def parse_settings(baseline: Arm, candidates: list[object]) -> list[TuneSetting]:
    """Validate the candidates (in the order given) against a baseline engine arm that verifies with
    standard speculative decoding (an endpoint's config is not visible here); ValueError naming the entry
    for a bad or repeated one."""
    reference = baseline.speculative_config if baseline.settings_visible else None
    if baseline.settings_visible and (reference or {}).get("rejection_sample_method") != "standard":
        raise ValueError(
            "baseline: gate tune compares lossy settings with standard speculative decoding, so the "
            "baseline engine arm needs a speculative_config with rejection_sample_method 'standard' (got "
            f"{json.dumps(reference)})"
        )
    if not isinstance(candidates, list) or not candidates:
        raise ValueError("candidates: give a non-empty JSON list of settings")
    settings = [_setting(i, entry, baseline, reference) for i, entry in enumerate(candidates)]
    seen: dict[str, str] = {}
    for s in settings:
        key = json.dumps(s.speculative_config, sort_keys=True)
        if key in seen and s.arm.settings_visible:
            raise ValueError(
                f"candidate {s.id[1:]}: the same setting as candidate {seen[key][1:]} ({s.label})"
            )
        seen[key] = s.id
    return settings


PROCEDURE = (
    "fixed-sequence testing (Maurer, Hothorn and Lehmacher 1995; Westfall and Krishen 2001): each setting "
    "against the margin at the full alpha, in the registered order; stop at the first that does not PASS"
)
TunePlan = Plan[TuneOptions]
SettingsById = dict[str, TuneSetting]


def tune(options: TuneOptions) -> RunResult:
    """Calibrate, register the order, then test the settings in it until the first that does not PASS."""
    planned, settings = _with_settings(options)
    name = options.name
    clock = Clock(options.max_minutes)
    with GateStore(options.store) as store, StoreLock(store.path, name):
        claim = population(store, name, options.population)
        names = [n for n in options.exclude_runs if n not in (name, options.calibration_run)]
        chosen = choose(
            planned, used_questions(store, names), names, calibration=options.calibration_questions
        )
        announce_sandbox({q.grader for q in chosen.questions}, "gate tune")
        if chosen.calibration:
            reason = _calibrate(store, planned, settings, chosen, clock)
            if reason != "complete":
                return RunResult(name, reason)
        order = _order(store, planned, settings)
        executors = make_executors(list(planned.arms.values()))
        registration = _registration(planned, settings, chosen, order, claim)
        register(store, name, registration, chosen.questions, executors, planned.arms)
        labels = {s.id: s.title for s in settings.values()}
        log(
            f"gate tune: run {name!r} in {store.path}; test order: "
            + ", ".join(labels[i] for i in order.settings)
        )
        run = store.get_run(name)
        assert run is not None
        for setting_id in order.settings:
            status = setting_status(store, run, setting_id)
            if not status.final:
                reason = _test(store, planned, chosen, run.registered.sequential, settings[setting_id], clock)
                if reason in PAUSES:
                    return RunResult(name, reason)
                status = setting_status(store, run, setting_id)
            log(f"gate tune: {labels[setting_id]}: {status.decision} after {status.n} questions")
            if status.decision != PASS:
                break
    return RunResult(name, "complete")


def _with_settings(options: TuneOptions) -> tuple[TunePlan, SettingsById]:
    """The run's plan with each setting's arm beside the baseline, and the settings by id (its candidates,
    its grid over policies, or the default FLy grid for the baseline's K); judged questions and too few
    questions refused before the store is touched."""
    planned = plan(options)
    baseline, candidates = planned.baseline, options.candidates
    if isinstance(candidates, str):
        candidates = load_json(candidates, "--candidates", inline="[", expected="a JSON list")
        if not isinstance(candidates, list):
            raise ValueError(
                f"--candidates: must be a JSON list of settings, got {type(candidates).__name__}"
            )
    if options.policies is not None:
        candidates = expand_grid(options.policies)
    if candidates is None:
        if baseline.speculative_config is None:
            raise ValueError(
                "candidates: the default grid needs an engine baseline with a speculative_config (it varies "
                "fly_window_size and fly_entropy_threshold for its K); with endpoint arms give --candidates"
            )
        k = baseline.speculative_config["num_speculative_tokens"]
        if k < 2:
            raise ValueError(f"num_speculative_tokens={k}: FLy needs K >= 2, so there is nothing to tune")
        windows = options.windows
        if windows is None:
            windows = tuple(range(min(MAX_DEFAULT_WINDOW, k - 1), 0, -1))
        thresholds = options.thresholds if options.thresholds is not None else DEFAULT_THRESHOLDS
        if not windows or not thresholds:
            raise ValueError("the grid needs at least one window and one entropy threshold")
        candidates = [{"fly_window_size": w, "fly_entropy_threshold": t} for w in windows for t in thresholds]
    settings = {s.id: s for s in parse_settings(baseline, candidates)}
    judged = planned.model_graded()
    if judged:
        raise ValueError(
            f"dataset {judged[0][0]!r}: gate tune cannot use judge questions: a judged baseline answer is "
            "right or wrong only against one candidate, so it cannot be shared by several settings"
        )
    planned = replace(planned, arms={**planned.arms, **{s.id: s.arm for s in settings.values()}})
    choose(planned, calibration=options.calibration_questions)
    return planned, settings


def _common(planned: TunePlan, settings: SettingsById, chosen: Chosen, kind: str) -> Registration:
    """What the calibration and tune runs both register: the run's keys, settings and left-out runs."""
    o = planned.options
    excluded = Excluded(o.exclude_runs, len(chosen.left_out)) if o.exclude_runs else None
    records = tuple(s.record for s in settings.values())
    return replace(planned.registration(kind), settings=records, excluded=excluded)


def _registration(
    planned: TunePlan, settings: SettingsById, chosen: Chosen, order: TestOrder, claim: str
) -> Registration:
    """What the tune run registers: its test ``order``, its design and its test questions' keys."""
    o = planned.options
    tune = TuneRecord(
        PROCEDURE,
        order,
        o.calibration_run if chosen.calibration else None,
        tuple((q.dataset, q.id) for q in chosen.calibration),
        len(chosen.questions),
    )
    return replace(
        _common(planned, settings, chosen, "tune"),
        tune=tune,
        order=QuestionOrder(o.question_order_seed, ORDER_RULE, chosen.pool + len(chosen.calibration)),
        max_questions=o.max_questions,
        design="sequential" if o.sequential else "fixed",
        sequential=sequential_plan(
            o.margin, o.alpha, len(chosen.questions), chosen.pool, o.question_order_seed, claim, None
        )
        if o.sequential
        else None,
    )


def _calibrate(
    store: GateStore, planned: TunePlan, settings: SettingsById, chosen: Chosen, clock: Clock
) -> str:
    """Each arm answers the calibration questions alone, one arm after another; answers not graded."""
    o = planned.options
    executors = make_executors(list(planned.arms.values()))
    calibration = replace(
        _common(planned, settings, chosen, "calibration"),
        calibration=CalibrationRecord(len(chosen.calibration), o.name),
    )
    register(store, o.calibration_run, calibration, chosen.calibration, executors, planned.arms)
    for name, arm in planned.arms.items():
        session = Session(
            store, o, o.calibration_run, [(name, 0)], list(chosen.calibration), {}, graded=False
        )
        who = f"gate tune: calibrating {name} (speed only, not graded)"
        reason = session.answer(make_executors([arm]), who, clock, {"lane": name})
        if reason != "complete":
            return reason
    return "complete"


def calibration_speeds(store: GateStore, run_id: str) -> dict[str, dict[str, float | None]]:
    """Per arm of a calibration run: tokens/s, mean acceptance length and forgiven share."""
    return lane_speeds(store, run_id, first_repeat_only=False)


def _order(store: GateStore, planned: TunePlan, settings: SettingsById) -> TestOrder:
    """The registered test order: by calibration speed, slowest first (ties as given), or as given."""
    o = planned.options
    given = list(settings)
    if o.order == "given":
        return TestOrder("given", tuple(given))
    speeds = calibration_speeds(store, o.calibration_run)
    by, fallback = o.order_by, None

    def missing(key: str) -> list[TuneSetting]:
        return [s for s in settings.values() if speeds.get(s.id, {}).get(key) is None]

    if by == "mean_acceptance_length" and missing(by) and not missing("tokens_per_s"):
        # A calibration answer too short to draft (or an endpoint without acceptance counters) has no
        # acceptance length; its speed still orders the settings, measured the same way for each.
        first = missing(by)[0]
        fallback = (
            f"{first.title}'s calibration answers report no acceptance length (they drafted nothing: too few "
            "calibration tokens, or an endpoint that reports no acceptance counters), so the settings are "
            "ordered by tokens_per_s"
        )
        log(f"gate tune: {fallback}")
        by = "tokens_per_s"
    if missing(by):
        first = missing(by)[0]
        k = (planned.baseline.speculative_config or {}).get("num_speculative_tokens", 4)
        raise ValueError(
            f"setting {first.title} ({first.id}): its calibration answers report no {by}, so the settings "
            f"cannot be ordered by speed: give more calibration tokens (--calibration-questions, or "
            f"--max-tokens of at least {4 * (k + 1)} so that each answer drafts a few times), or give the "
            "order with --order given"
        )
    values = {sid: float(speeds[sid][by]) for sid in settings}  # type: ignore[arg-type]
    ordered = sorted(given, key=lambda sid: (values[sid], given.index(sid)))
    direction = "ascending: slowest (least aggressive) first"
    return TestOrder("speed", tuple(ordered), by, direction, o.calibration_run, values, fallback)


def _test(
    store: GateStore,
    planned: TunePlan,
    chosen: Chosen,
    sequential: SequentialPlan | None,
    setting: TuneSetting,
    clock: Clock,
) -> str:
    """Test one setting (by the registered ``sequential`` plan) against the stored or new baseline answers."""
    o = planned.options
    lanes = (BASELINE, (setting.id, 0))
    monitors: dict[str, Monitor] = {}
    if sequential is not None:
        order = [(q.dataset, q.id) for q in chosen.questions]
        monitors["candidate"] = Monitor(order, sequential, lanes)
    session = Session(store, o, o.name, list(lanes), list(chosen.questions), monitors)
    log(f"gate tune: testing {setting.title} ({setting.id}) against the baseline")
    executors = make_executors([planned.baseline, setting.arm])
    return session.answer(executors, "gate tune: testing", clock, {"setting": setting.id})


def describe_pause(result: RunResult, store: str | Path) -> str:
    """The line printed when a tune pauses: what is kept and how to continue."""
    return (
        f"gate tune: paused ({result.reason}); every answer of run {result.run_id!r} is stored in {store}; "
        "rerun the same command to continue"
    )

"""The per-user alpha ledger (flyspec/gate/data/ledger.py, flyspec/gate/runs/register.py) with real stores
on disk and a real ledger file (each test its own, tests/conftest.py): which arms are one comparison, which
questions are the same, which looks count, and what survives moving a store.

The statistics of the routes (P(any false PASS) under the ledger and before it) are in
tests/test_gate_stats_spending.py; the command line's refusals in tests/test_gate_cli.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from flyspec.gate.data.ledger import UserLedger, comparison_key_of, ledger_path, output_identity
from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import GateStore, RegisteredQuestion
from flyspec.gate.report.build import build_report
from flyspec.gate.runs.register import check_alpha_left, record_looks

SPEC = {"method": "draft_model", "model": "draft", "num_speculative_tokens": 4}


def _engine(policy: str = "standard", window: int | None = None, **extra: object) -> dict:
    spec = {**SPEC, "rejection_sample_method": policy, **({"fly_window_size": window} if window else {})}
    return {"kind": "engine", "model": "target", "speculative_config": spec, "dtype": "auto", **extra}


def _endpoint(model: str, root: str, **extra: object) -> dict:
    return {
        "kind": "openai",
        "model": model,
        "extra_body": {},
        "served_model": {"id": model, "root": root},
        **extra,
    }


def test_arms_are_keyed_by_what_decides_their_outputs() -> None:
    """Lossless engine arms are their target model whatever drafts them; a lossy arm is its whole
    speculative config; device and batch limits never count. An endpoint is its served root: an alias or
    an inert extra_body field is the same arm, another root another arm, and a tune's declared config
    tells its settings apart."""
    lossless = output_identity(_engine())
    assert lossless == output_identity({"kind": "engine", "model": "target", "speculative_config": None})
    assert lossless == output_identity(_engine(verification="target_only", device="cpu", max_num_seqs=64))
    fly = output_identity(_engine("fly", 2))
    assert fly != lossless and fly != output_identity(_engine("fly", 3))
    assert fly == output_identity({**_engine("fly", 2), "max_num_seqs": 2, "seed": 9})
    draft_only = output_identity(_engine("fly", verification="draft_only"))
    assert draft_only == output_identity(_engine("typical", verification="draft_only"))
    plain = output_identity(_endpoint("b", "/m/b"))
    assert plain == output_identity(_endpoint("b-alias", "/m/b", extra_body={"user": "x"}))
    assert plain != output_identity(_endpoint("c", "/m/c"))
    assert output_identity(_endpoint("b", "/m/b"), {"fly_window_size": 2}) != plain


def _question(i: int, dataset: str = "gsm8k") -> RegisteredQuestion:
    return RegisteredQuestion(dataset, f"q{i}", i, hashlib.sha256(f"p{i}".encode()).hexdigest(), "7", "exact")


def _register(store: GateStore, run_id: str, questions: list[RegisteredQuestion], **extra: object) -> dict:
    registration = {
        "margin": 0.02,
        "alpha": 0.025,
        "seed": 0,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8},
        "arms": {"baseline": _endpoint("a", "/m/a"), "candidate": _endpoint("b", "/m/b")},
        "datasets": {questions[0].dataset: {"sha256": "ab" * 32, "questions": len(questions)}},
        "design": "fixed",
        **extra,
    }
    store.register(run_id, Registration.read("gate", registration), questions)
    return registration


def test_the_comparison_key_ignores_the_run_settings() -> None:
    """Margin, alpha, sampling and datasets are not part of a comparison's key."""
    a = {"arms": {"baseline": _endpoint("a", "/m/a"), "candidate": _endpoint("b", "/m/b")}, "margin": 0.02}
    b = {**a, "margin": 0.05, "alpha": 0.01, "sampling": {"temperature": 1.0}, "datasets": {"math": {}}}
    reg_a, reg_b = Registration.read("gate", {**a, "alpha": 0.025}), Registration.read("gate", b)
    assert comparison_key_of(reg_a, reg_a.comparisons[0]) == comparison_key_of(reg_b, reg_b.comparisons[0])


def test_a_moved_store_is_the_same_look_and_a_renamed_dataset_the_same_questions(tmp_path: Path) -> None:
    """A recorded look whose store file was moved resumes (it is identified by its run and registration
    time, not by the path); a finite-claim look on the same questions under another dataset name, in the
    moved store, counts it."""
    questions = [_question(i) for i in range(10)]
    with GateStore(tmp_path / "a.db") as store:
        registration = _register(store, "first", questions)
        record_looks(store, "first")
    moved = tmp_path / "moved.db"
    (tmp_path / "a.db").rename(moved)
    with GateStore(moved) as store:
        check_alpha_left(
            store, "first", Registration.read("gate", registration), questions
        )  # its own look: allowed
        renamed = [_question(i, "copy") for i in range(10)]
        finite = {
            **registration,
            "design": "sequential",
            "sequential": {
                "margin": 0.02, "alpha": 0.025, "max_questions": 10, "population_size": 10,
                "order_seed": 0, "population": "finite",
            },
        }  # fmt: skip
        with pytest.raises(ValueError, match="earlier look.* on these questions at this comparison"):
            check_alpha_left(store, "second", Registration.read("gate", finite), renamed)
        fresh = [_question(i, "copy") for i in range(10, 20)]
        assert (
            check_alpha_left(store, "second", Registration.read("gate", finite), fresh)
            .looks["candidate"]
            .allowed
        )


def test_a_store_written_before_the_ledger_counts_its_looks_and_is_adopted(tmp_path: Path) -> None:
    """A store's own looks count even when the ledger never recorded them (a store from before the ledger
    or from another machine), and the report of such a run says it was checked against its store only;
    once a run of that store is used again, its looks enter the user's ledger and count in other stores
    too."""
    questions = [_question(i) for i in range(10)]
    with GateStore(tmp_path / "old.db") as old:
        registration = _register(old, "legacy", questions)
        with pytest.raises(ValueError, match="fixed run 'legacy'"):
            check_alpha_left(old, "again", Registration.read("gate", registration), questions)
    with GateStore(tmp_path / "new.db") as new:
        assert (
            check_alpha_left(new, "gate", Registration.read("gate", registration), questions)
            .looks["candidate"]
            .allowed
        )
    report = build_report(tmp_path / "old.db", "legacy")
    assert report.ledger is not None and report.ledger.legacy and report.ledger.path is None
    assert "registered before the per-user ledger" in report.to_markdown()
    with GateStore(tmp_path / "old.db") as old:
        record_looks(old, "legacy")  # what a resume of it does
    with UserLedger() as user:
        (key,) = _keys(tmp_path / "old.db")
        assert user.path == ledger_path() and [e.look.run_id for e in user.entries(key)] == ["legacy"]
    with GateStore(tmp_path / "new.db") as new, pytest.raises(ValueError, match="fixed run 'legacy' of"):
        check_alpha_left(new, "gate", Registration.read("gate", registration), questions)


def _keys(path: Path) -> set[str]:
    with GateStore(path) as store:
        run = store.get_run("legacy")
        assert run is not None
        return {k for p in run.registered.comparisons if (k := comparison_key_of(run.registered, p))}

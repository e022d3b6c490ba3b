"""Settings and fixtures for the whole test run.

One torch thread: the tests' tiny models do tiny matmuls, where a second intra-op thread costs more than
it brings, and on a busy 2-core machine oversubscribed threads made tiny-model tests 10-50x slower. The
environment variable reaches the subprocesses that CLI tests start.

Every test gets its own alpha ledger (``gate_ledger``), so the gate runs of one test never count as
earlier looks of another's, and no test writes the user's real ledger.

`tiny_models` hands out tiny random-weight checkpoints (tests/tiny_llm.py), each written once per session
whichever test file asks first; tests/tiny_engine.py drives an engine over them.
"""

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The gate's alpha ledger is per user: tests never write the real one (~/.cache/flyspec). Module-scoped
# fixtures share this session's file; each test gets its own (``gate_ledger``).
os.environ["FLYSPEC_GATE_LEDGER"] = os.path.join(tempfile.mkdtemp(prefix="flyspec-ledger-"), "ledger.sqlite")

import pytest  # noqa: E402
import torch  # noqa: E402
import zoo  # noqa: E402
from tiny_llm import TinyModels  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Tiny checkpoints shared by every test file (TinyModels: `get`, `perturbed`, `pair`,
    `forgiving_pair`)."""
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(autouse=True)
def gate_ledger(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test its own alpha ledger file (the gate's per-user record of looks), inherited by the gate
    commands a test starts as subprocesses: one test's looks never count against another's."""
    path = str(tmp_path_factory.mktemp("ledger") / "ledger.sqlite")
    monkeypatch.setenv("FLYSPEC_GATE_LEDGER", path)
    return path


@pytest.fixture()
def own_ledger(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], AbstractContextManager[None]]:
    """``with own_ledger(): ...``: gate runs inside use a ledger of their own. For a reproduction a test
    compares with (the same run in another store), which is not a second look a user takes; in one
    ledger it would be counted as one and refused."""

    @contextmanager
    def use() -> Iterator[None]:
        with monkeypatch.context() as patch:
            patch.setenv("FLYSPEC_GATE_LEDGER", str(tmp_path_factory.mktemp("ledger") / "ledger.sqlite"))
            yield

    return use


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures are made: tell tests/zoo.py whether this test is in the slow tier."""
    zoo.running_slow_test = item.get_closest_marker("slow") is not None

"""The package's import rules: dependencies run one way (docs/architecture.md explains the layout).

Every `import` in every module of `flyspec` counts, wherever it sits (top level, inside a function, under
TYPE_CHECKING): a lazy import is still a dependency.

1. The leaves know nothing of who drives them: `flyspec.models` and `flyspec.spec_decode` import nothing
   of `flyspec.engine`, `flyspec.llm`, `flyspec.server`, `flyspec.gate`, `flyspec.demo`, `flyspec.bench`,
   `flyspec.cli`.
2. The verifier, its policies and the sampling kernels are pure: `flyspec.spec_decode.verify`,
   `flyspec.spec_decode.policies` and `flyspec.spec_decode.sampling` import only torch, the standard
   library, each other and `flyspec.checks` (the value checks, standard library only, held to the same rule).
3. The engine serves every face and depends on none: `flyspec.engine` imports nothing of `flyspec.llm`,
   `flyspec.server`, `flyspec.gate`, `flyspec.bench`, `flyspec.cli`.
4. Only the command line uses typer: no module outside `flyspec.cli` imports it.
5. Nobody imports the command line: no module outside `flyspec.cli` imports `flyspec.cli`; its one user is
   the `flyspec` entry point (`flyspec.cli:main` in pyproject.toml).
6. The gate, the demo, the benchmarks and the command line reach the engine only through `flyspec.llm`
   (`LLM`) and `flyspec.config`: they import nothing of `flyspec.engine` or `flyspec.spec_decode`, and of
   `flyspec.models` only `flyspec.models.loader` (to load weights once and hand them to
   `LLM.from_config`). The server is the exception: its engine thread drives `LLMEngine` step by step
   because it interleaves steps with requests that arrive and abort over HTTP, so `flyspec.server`, and
   `flyspec.cli.serve`, which builds the engine the server drives, may import `flyspec.engine.engine`.
7. The parts of the package (its subpackages and top-level modules) form no import cycle.
8. No module imports itself back through others: the modules of the package form no import cycle
   (``KNOWN_CYCLES`` would list a cycle tolerated for now, each to be removed when it goes; it is empty).
9. The gate is seven subpackages, each importing only the ones below it (``GATE_LAYERS``): ``stats`` and
   ``grading`` nothing else of the gate; ``data`` grading (a dataset checks its reference answers) and
   stats (a registration's sequential plans); ``arms`` data and grading; ``report`` stats, grading and
   data, never ``runs`` or ``arms``; ``logs`` stats, data and report; ``runs`` stats, grading, data and arms,
   never ``report`` (what a run needs to decide, a tune setting's test or a judged pair, is data: a run
   does not read its own report) nor ``logs``; ``shadow`` (live traffic) sits on top: stats, grading,
   data, arms, runs (a judged run fed by traffic) and report (its /decision is the report's), never logs.
   ``flyspec.gate`` itself only re-exports. Outside ``gate/arms``, no code tests an arm's class.
10. Only ``flyspec/llm.py`` touches the engine an ``LLM`` holds (``LLM._engine``): everything else, the
    package, its scripts and the tests, uses ``LLM``'s methods; ``LLM`` has no public ``engine``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flyspec"

LEAVES = ("flyspec.models", "flyspec.spec_decode")
FACES = ("flyspec.llm", "flyspec.server", "flyspec.gate", "flyspec.demo", "flyspec.bench", "flyspec.cli")
PURE = (
    "flyspec.spec_decode.verify",
    "flyspec.spec_decode.policies",
    "flyspec.spec_decode.sampling",
    "flyspec.checks",
)
ENGINE_USERS = ("flyspec.gate", "flyspec.demo", "flyspec.bench", "flyspec.cli")
SERVER_SIDE = ("flyspec.server", "flyspec.cli.serve")

# Imports allowed to break a rule (like import-linter's ignore_imports), each with its reason. None today.
IGNORED: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module name an `import` statement of this file names (for `from a import b`: a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the package uses absolute imports"
            assert node.module is not None
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


GRAPH = _graph()


def _within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _ignored(module: str, name: str) -> bool:
    return any(module == importer and _within(name, target) for importer, target in IGNORED)


def _face_may_import(module: str, name: str) -> bool:
    """Rule 6's exceptions: the model loader (weights and tokenizer) for everyone, the engine for the
    server side."""
    return _within(name, ("flyspec.models.loader", "flyspec.models.tokenizer")) or (
        _within(name, "flyspec.engine.engine") and _within(module, SERVER_SIDE)
    )


def _violations(
    graph: dict[str, set[str]],
    importers: tuple[str, ...],
    forbidden: tuple[str, ...],
    allowed: Callable[[str, str], bool] = lambda module, name: False,
    *,
    outside: bool = False,
) -> list[str]:
    """`module imports name` for every forbidden import of a module within `importers` (with `outside`:
    of a module not within them), minus IGNORED and what `allowed(module, name)` permits."""
    return sorted(
        f"{module} imports {name}"
        for module, names in graph.items()
        if _within(module, importers) != outside
        for name in names
        if _within(name, forbidden) and not _ignored(module, name) and not allowed(module, name)
    )


def leaves_violations(graph: dict[str, set[str]]) -> list[str]:
    return _violations(graph, LEAVES, ("flyspec.engine", *FACES))


def engine_violations(graph: dict[str, set[str]]) -> list[str]:
    return _violations(graph, ("flyspec.engine",), FACES)


def face_violations(graph: dict[str, set[str]]) -> list[str]:
    internals = ("flyspec.engine", "flyspec.spec_decode", "flyspec.models")
    return _violations(graph, ENGINE_USERS, internals, _face_may_import)


def test_the_walk_sees_the_package() -> None:
    """The rules below are only as good as the walk: it finds the modules and their lazy imports."""
    assert "flyspec.engine.engine" in GRAPH and "flyspec.cli" in GRAPH
    assert "flyspec.engine.engine" in GRAPH["flyspec.llm"]
    assert "torch" in GRAPH["flyspec.bench.peer_hf"]


def test_models_and_spec_decode_import_no_driver() -> None:
    """Rule 1: the model, the KV cache, the verifier and the metrics import nothing that drives them."""
    assert leaves_violations(GRAPH) == []


def test_verify_and_sampling_are_pure() -> None:
    """Rule 2: verify, the policies, sampling and the value checks import torch, the standard library and
    each other only."""
    allowed_roots = {"torch", "__future__"} | set(sys.stdlib_module_names)
    assert "flyspec.spec_decode.policies.typical" in GRAPH
    bad = sorted(
        f"{module} imports {name}"
        for module in GRAPH
        if _within(module, PURE)
        for name in GRAPH[module]
        if name.split(".")[0] not in allowed_roots and not _within(name, PURE)
    )
    assert bad == []


def test_engine_imports_no_face() -> None:
    """Rule 3: the engine imports nothing of the API, the server, the gate, the benchmarks or the CLI."""
    assert engine_violations(GRAPH) == []


def test_only_the_cli_imports_typer() -> None:
    """Rule 4: typer stays in flyspec.cli."""
    assert _violations(GRAPH, ("flyspec.cli",), ("typer",), outside=True) == []


def test_nobody_imports_the_cli_but_the_entry_point() -> None:
    """Rule 5: no module outside flyspec.cli imports it; pyproject's entry point is its one user."""
    assert _violations(GRAPH, ("flyspec.cli",), ("flyspec.cli",), outside=True) == []
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"flyspec": "flyspec.cli:main"}


def test_faces_reach_the_engine_only_through_llm_and_config() -> None:
    """Rule 6: the gate, the benchmarks and the CLI import no engine internals, no verifier and no model
    code but the loader; only the server side may import flyspec.engine.engine."""
    assert face_violations(GRAPH) == []


def _part(name: str) -> str | None:
    """The package part a module belongs to: flyspec.X for a subpackage or top-level module X."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "flyspec" and len(parts) >= 2 else None


def cycle_of(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph between package parts, as a list of parts (first == last), or None."""
    parts = {_part(m) for m in graph} - {None}
    edges: dict[str, set[str]] = defaultdict(set)
    for module, names in graph.items():
        src = _part(module)
        for name in names:
            dst = _part(name)
            if src and dst in parts and dst != src and not _ignored(module, name):
                edges[src].add(dst)
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_parts_form_no_cycle() -> None:
    """Rule 7: the import graph between subpackages and top-level modules is acyclic."""
    cycle = cycle_of(GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("check", "importer", "target"),
    [
        (leaves_violations, "flyspec.models.llama", "flyspec.engine.sequence"),
        (engine_violations, "flyspec.engine.engine", "flyspec.server.app"),
        (face_violations, "flyspec.bench.runner", "flyspec.engine.engine"),
        (face_violations, "flyspec.gate.runs.run", "flyspec.spec_decode.verify"),
        (cycle_of, "flyspec.sampling_params", "flyspec.llm"),
    ],
)
def test_one_forbidden_import_is_caught(check, importer: str, target: str) -> None:
    """Each check reports a graph with one forbidden import added, so none of them is vacuous."""
    graph = {**GRAPH, importer: GRAPH[importer] | {target}}
    assert check(graph)


# ------------------------------------------------------------------------------ modules: no cycle

MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}

# Module cycles tolerated for now, each entry removed when its cycle goes. None today: the engine's two
# (logits_processing <-> sequence, engine <-> warmup) went when the lower module named the higher one's
# type by a Protocol instead of importing it.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _resolve(name: str, modules: set[str] | dict[str, Path]) -> str | None:
    """The module a dotted name lives in (itself, or the longest module prefix of it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _module_edges(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules this file imports. ``from pkg import sub`` counts ``pkg.sub`` when it is a
    module (importing ``pkg`` on the way runs only its ``__init__``, counted when a name comes from it)."""
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            ]
        else:
            continue
        edges.update(m for n in names if n.startswith("flyspec") and (m := _resolve(n, modules)))
    edges.discard(_module_name(path))
    return edges


MODULE_GRAPH = {name: _module_edges(path, MODULES) for name, path in MODULES.items()}


def module_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_modules_form_no_cycle() -> None:
    """Rule 8: no module of the package reaches itself through its imports, lazy ones included; every
    known cycle is still there (when one goes, its KNOWN_CYCLES entry must go too)."""
    cycles = set(module_cycles(MODULE_GRAPH))
    assert cycles - KNOWN_CYCLES == set(), sorted(sorted(c) for c in cycles - KNOWN_CYCLES)
    assert cycles >= KNOWN_CYCLES, "a known cycle is gone: remove it from KNOWN_CYCLES"


def test_a_module_cycle_is_caught() -> None:
    """The cycle check is not vacuous: a lazy import of the report's builder from its renderer (the circle
    the report had) and one of the registry from an arm kind are each reported."""
    for importer, target in (
        ("flyspec.gate.report.markdown", "flyspec.gate.report.build"),
        ("flyspec.gate.arms.engine", "flyspec.gate.arms"),
    ):
        graph = {**MODULE_GRAPH, importer: MODULE_GRAPH[importer] | {target}}
        assert set(module_cycles(graph)) - KNOWN_CYCLES


# ------------------------------------------------------------------------------------ the gate

GATE = "flyspec.gate"
GATE_LAYERS: dict[str, tuple[str, ...]] = {
    "stats": (),
    "grading": (),
    "data": ("grading", "stats"),
    "arms": ("data", "grading"),
    "report": ("stats", "grading", "data"),
    "logs": ("stats", "data", "report"),
    "runs": ("stats", "grading", "data", "arms"),
    # Live traffic (docs/shadow.md) sits on top: a shadow run is a judged run fed by traffic, so it reuses
    # the runs' judged-pair machinery and the alpha ledger, and the report's build for /decision (the same
    # object as `gate report --json`); no gate part uses it.
    "shadow": ("stats", "grading", "data", "arms", "runs", "report"),
}


def gate_violations(graph: dict[str, set[str]]) -> list[str]:
    """``module imports name`` for every import of a gate subpackage's module that GATE_LAYERS does not
    allow, and every import of the ``flyspec.gate`` facade from inside the gate."""
    bad = []
    for module, names in graph.items():
        if not _within(module, GATE) or module == GATE:
            continue
        own = module.split(".")[2]
        allowed = (own, *GATE_LAYERS.get(own, ()))
        for name in names:
            if name == GATE or (_within(name, GATE) and name.split(".")[2] not in allowed):
                bad.append(f"{module} imports {name}")
    return sorted(bad)


def test_the_gate_is_eight_layered_subpackages() -> None:
    """Rule 9: flyspec/gate holds its facade and the eight subpackages of GATE_LAYERS, nothing else, and
    each subpackage imports only the ones GATE_LAYERS lets it (so no circle between them is possible)."""
    gate = PACKAGE / "gate"
    assert sorted(p.name for p in gate.glob("*.py")) == ["__init__.py"]
    assert {p.name for p in gate.iterdir() if (p / "__init__.py").is_file()} == set(GATE_LAYERS)
    assert gate_violations(MODULE_GRAPH) == []


@pytest.mark.parametrize(
    ("importer", "target"),
    [
        ("flyspec.gate.stats.monitor", "flyspec.gate.data.store"),
        ("flyspec.gate.report.tune_report", "flyspec.gate.runs.tune"),
        ("flyspec.gate.grading.graders", "flyspec.gate.arms.endpoint"),
        ("flyspec.gate.logs.compare", "flyspec.gate.runs.settings"),
        ("flyspec.gate.runs.run", "flyspec.gate"),
        ("flyspec.gate.runs.tune", "flyspec.gate.report.tune_report"),
        ("flyspec.gate.runs.judging", "flyspec.gate.report.build"),
        ("flyspec.gate.shadow.mirror", "flyspec.gate.logs.compare"),
        ("flyspec.gate.report.build", "flyspec.gate.shadow.proxy"),
        ("flyspec.gate.runs.run", "flyspec.gate.shadow.proxy"),
    ],
)
def test_one_layer_violation_is_caught(importer: str, target: str) -> None:
    """The layer check reports each import that once crossed the gate's layers the wrong way."""
    graph = {**MODULE_GRAPH, importer: MODULE_GRAPH[importer] | {target}}
    assert gate_violations(graph) == [f"{importer} imports {target}"]


def test_the_gate_facade_names_survive_its_subpackages() -> None:
    """``from flyspec.gate import run, ...`` gives the public objects even after every gate module is
    imported: a subpackage named like a public name (``run``) would replace it on the package. Run in a
    fresh interpreter, so the imports of other tests cannot hide it."""
    code = (
        "import importlib, inspect, flyspec.gate as g\n"
        f"for m in {sorted(m for m in MODULES if _within(m, GATE) and '._' not in m)!r}:\n"
        "    importlib.import_module(m)\n"
        "for name in g.__all__:\n"
        "    obj = getattr(g, name)\n"
        "    assert not inspect.ismodule(obj), name\n"
        "    assert obj is getattr(importlib.import_module(g._HOMES[name]), name), name\n"
        "print(len(g.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "13"


# ------------------------------------------------------------------------------ LLM's engine


def _engine_touches(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "_engine"
    ]


def test_only_llm_touches_the_engine_of_an_llm() -> None:
    """Rule 10: ``_engine`` appears in flyspec/llm.py and nowhere else in the package, its scripts or its
    tests, and LLM keeps no public ``engine`` (the step profile is ``LLM.profile_steps``)."""
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    touches = [t for f in files if f != PACKAGE / "llm.py" for t in _engine_touches(f)]
    assert touches == []
    assert _engine_touches(PACKAGE / "llm.py")
    llm = ast.parse((PACKAGE / "llm.py").read_text())
    public = [
        node.lineno
        for node in ast.walk(llm)
        if isinstance(node, ast.Attribute) and node.attr == "engine" and isinstance(node.value, ast.Name)
    ]
    assert public == []


def _arm_classes() -> set[str]:
    """The arm and executor classes flyspec/gate/arms defines (its data types, a Job or a Completion, are
    plain values anyone may check)."""
    names: set[str] = set()
    for path in (PACKAGE / "gate" / "arms").glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        names.update(node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef))
    return {n for n in names if n.endswith(("Arm", "Executor"))}


def arm_isinstance_violations(package: Path, arm_classes: set[str]) -> list[str]:
    """``module: isinstance(..., Class)`` for every isinstance check on a class of flyspec/gate/arms in a
    module outside that package: everyone else asks an arm through its protocol (``Arm``, ``Executor``)."""
    bad = []
    arms_dir = package / "gate" / "arms"
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(arms_dir):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id != "isinstance" or len(node.args) != 2:
                continue
            target = node.args[1]
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            for name in names:
                label = name.id if isinstance(name, ast.Name) else getattr(name, "attr", None)
                if label in arm_classes:
                    bad.append(f"{path.relative_to(package)}: isinstance(..., {label})")
    return bad


def test_no_isinstance_on_arm_classes_outside_the_arms_package() -> None:
    """Code outside flyspec/gate/arms asks an arm what it needs through the ``Arm`` protocol
    (``settings_visible``, ``speculative_config``, ``variant``), never by testing its class, so a new
    kind of arm is one module there plus its registration."""
    classes = _arm_classes()
    assert {"EngineArm", "OpenAIArm"} <= classes
    assert arm_isinstance_violations(PACKAGE, classes) == []


def test_the_arm_isinstance_check_can_fail(tmp_path: Path) -> None:
    """The check above finds such a test where one is written."""
    (tmp_path / "gate" / "arms").mkdir(parents=True)
    (tmp_path / "gate" / "runs.py").write_text("def f(a):\n    return isinstance(a, (int, EngineArm))\n")
    found = arm_isinstance_violations(tmp_path, {"EngineArm"})
    assert len(found) == 1 and "EngineArm" in found[0]

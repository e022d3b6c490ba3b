"""The package's import rules: dependencies run one way (docs/architecture.md explains the layout).

Every `import` in every module of `flyspec` counts, wherever it sits (top level, inside a function, under
TYPE_CHECKING): a lazy import is still a dependency.

1. The leaves know nothing of who drives them: `flyspec.models` and `flyspec.spec_decode` import nothing
   of `flyspec.engine`, `flyspec.llm`, `flyspec.server`, `flyspec.gate`, `flyspec.bench`, `flyspec.cli`.
2. The verifier, its policies and the sampling kernels are pure: `flyspec.spec_decode.verify`,
   `flyspec.spec_decode.policies` and `flyspec.spec_decode.sampling` import only torch, the standard
   library and each other.
3. The engine serves every face and depends on none: `flyspec.engine` imports nothing of `flyspec.llm`,
   `flyspec.server`, `flyspec.gate`, `flyspec.bench`, `flyspec.cli`.
4. Only the command line uses typer: no module outside `flyspec.cli` imports it.
5. Nobody imports the command line: no module outside `flyspec.cli` imports `flyspec.cli`; its one user is
   the `flyspec` entry point (`flyspec.cli:main` in pyproject.toml).
6. The gate, the benchmarks and the command line reach the engine only through `flyspec.llm` (`LLM`) and
   `flyspec.config`: they import nothing of `flyspec.engine` or `flyspec.spec_decode`, and of
   `flyspec.models` only `flyspec.models.loader` (to load weights once and hand them to
   `LLM.from_config`). The server is the exception: its engine thread drives `LLMEngine` step by step
   because it interleaves steps with requests that arrive and abort over HTTP, so `flyspec.server`, and
   `flyspec.cli.serve`, which builds the engine the server drives, may import `flyspec.engine.engine`.
7. The parts of the package (its subpackages and top-level modules) form no import cycle.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flyspec"

LEAVES = ("flyspec.models", "flyspec.spec_decode")
FACES = ("flyspec.llm", "flyspec.server", "flyspec.gate", "flyspec.bench", "flyspec.cli")
PURE = ("flyspec.spec_decode.verify", "flyspec.spec_decode.policies", "flyspec.spec_decode.sampling")
ENGINE_USERS = ("flyspec.gate", "flyspec.bench", "flyspec.cli")
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
    """Rule 6's exceptions: the model loader for everyone, the engine for the server side."""
    return _within(name, "flyspec.models.loader") or (
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
    """Rule 2: verify, the policies and sampling import torch, the standard library and each other only."""
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
        (face_violations, "flyspec.gate.run.runner", "flyspec.spec_decode.verify"),
        (cycle_of, "flyspec.sampling_params", "flyspec.llm"),
    ],
)
def test_one_forbidden_import_is_caught(check, importer: str, target: str) -> None:
    """Each check reports a graph with one forbidden import added, so none of them is vacuous."""
    graph = {**GRAPH, importer: GRAPH[importer] | {target}}
    assert check(graph)

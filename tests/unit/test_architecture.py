"""The library's structure, held against its imports: the "never" arrows of docs/development.md.

Read from the source (nothing is imported): an import inside a function
counts as much as one at the top; one under ``if TYPE_CHECKING:`` does not,
since it never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "postgres_mutex"

CORE = {
    "_acompat",
    "_admin_flows",
    "_clock",
    "_connections",
    "_core",
    "_acquisition",
    "_acquisition_async",
    "_engine",
    "_engine_async",
    "_heartbeat",
    "_heartbeat_async",
    "_heartbeat_flows",
    "_listener",
    "_listener_async",
    "_sources",
    "_sources_async",
    "_events",
    "_flows",
    "_host",
    "_metrics",
    "_rules",
    "_secrets",
    "_session",
    "_settings",
    "_shared",
    "_sql",
    "_state",
    "_steps",
    "_tracing",
    "_version",
    "_watchdog",
    "errors",
    "metric_names",
}
"""Below `client`: the machinery every primitive shares. None of it knows what is built on it."""

ENGINES = {
    f"_{part}{flavour}"
    for part in ("engine", "heartbeat", "listener", "sources", "acquisition")
    for flavour in ("", "_async")
}
"""The engine, in its parts: the hand-written async modules and the sync ones generated from them."""


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(id(sub) for sub in ast.walk(node))
    return found


def imports_of(module: str) -> set[str]:
    """The package's modules that ``module`` imports when it runs."""
    tree = ast.parse((SRC / f"{module}.py").read_text())
    skipped = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("postgres_mutex"):
            parts = (node.module or "").split(".")
            found.add(parts[1] if len(parts) > 1 else "__init__")
    return found - {module}


MODULES = sorted(path.stem for path in SRC.glob("*.py"))
GRAPH = {module: imports_of(module) for module in MODULES}


def test_the_reader_finds_every_module_and_what_it_imports() -> None:
    # The checks below mean something only if the graph is the real one.
    assert {"client", "_core", "_session", "_host", "_engine_async", "_mutex"} <= set(MODULES)
    assert {"_core", "_shared"} <= GRAPH["client"]
    assert {"_steps", "_sql", "_connections", "_heartbeat_async"} <= GRAPH["_engine_async"]


def test_no_import_cycle() -> None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for imported in sorted(GRAPH.get(module, ())):
            visit(imported, [*path, module])
        done.add(module)

    for module in MODULES:
        visit(module, [])


@pytest.mark.parametrize("module", sorted(CORE))
def test_the_core_never_imports_what_is_built_on_it(module: str) -> None:
    above = GRAPH[module] - CORE
    assert not above, f"{module} imports {sorted(above)}, which are built on the core"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_engine_knows_its_client_only_through_its_host(engine: str) -> None:
    forbidden = GRAPH[engine] & {"_core", "_session", "_shared", "client", "__init__"}
    assert not forbidden, f"{engine} imports {sorted(forbidden)}"
    source = (SRC / f"{engine}.py").read_text()
    # Not even for its types: what it may use of the client is `EngineHost`, declared.
    assert "MutexClient" not in source
    assert "ClientCore" not in source


def test_the_engine_and_its_listener_are_given_a_host() -> None:
    for module in ("_engine_async", "_engine", "_listener_async", "_listener"):
        assert "host: EngineHost" in (SRC / f"{module}.py").read_text(), module


def test_the_session_opens_no_connection_and_sends_nothing() -> None:
    forbidden = GRAPH["_session"] & {
        *ENGINES,
        "_connections",
        "_sql",
        "_steps",
        "_flows",
        "_heartbeat_flows",
        "_admin_flows",
        "_core",
    }
    assert not forbidden, f"_session imports {sorted(forbidden)}"


def test_only_the_client_module_makes_a_core() -> None:
    makers = sorted(module for module in MODULES if "_core" in GRAPH[module])
    assert makers == ["client"], makers

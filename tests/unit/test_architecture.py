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
    "_sql_history",
    "_sql_integrations",
    "_sql_lock",
    "_sql_names",
    "_sql_permits",
    "_sql_rows",
    "_sql_rwlocks",
    "_sql_schema",
    "_sql_sessions",
    "_sql_statement",
    "_sql_wake",
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

MUTEX_PARTS = {
    "_candidacy",
    "_closing",
    "_closing_async",
    "_own_watch",
    "_siblings",
    "_singleton",
    "_singleton_async",
}
"""What `_kinds.mutex` is made of besides the core: an election's side, closing, its own watcher, its decorators."""

ELECTION_PARTS = {"_campaign", "_leader", "_leader_reader", "_leader_reader_async", "_relay", "_term"}
"""What `election` is made of: its rounds (campaign, term, hand-over), who leads, its terms, its relay."""

SQL = {module for module in CORE if module == "_sql" or module.startswith("_sql_")}
"""Where the statements are: `_sql`, the door the rest of the library goes through, and its parts."""


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
        *SQL,
        "_connections",
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


def test_every_sql_module_is_known() -> None:
    assert {module for module in MODULES if module.startswith("_sql")} == SQL


def test_the_statements_are_reached_through_sql_only() -> None:
    # One door: what the library sends is read from `_sql`'s imports, whichever part builds it.
    for module in sorted(set(MODULES) - SQL):
        parts = GRAPH[module] & (SQL - {"_sql"})
        assert not parts, f"{module} imports {sorted(parts)}: import them from _sql"


@pytest.mark.parametrize("module", sorted(SQL))
def test_the_sql_modules_know_nothing_but_each_other(module: str) -> None:
    # Statements are text: composing one needs no state, no engine, no setting.
    assert GRAPH[module] <= SQL | {"errors"}, f"{module} imports {sorted(GRAPH[module] - SQL - {'errors'})}"


def test_an_elections_parts_are_its_own() -> None:
    # The package and the CLI reach an election through `election`, whose names are the public ones.
    for module in sorted(set(MODULES) - ELECTION_PARTS - {"election"}):
        used = GRAPH[module] & ELECTION_PARTS
        assert not used, f"{module} imports {sorted(used)}, which are the election's: import from election"


def test_a_mutexs_parts_are_its_own() -> None:
    # An election reaches its Mutex's side only through `_kinds.mutex.candidacy()`; `_kinds.holder` is what every
    # holder (Mutex, Semaphore, RWLock's) is made of, with its methods of each flavour.
    holder = {"_holder", "_holder_methods", "_holder_methods_async"}
    for module in sorted(set(MODULES) - MUTEX_PARTS - holder - {"_mutex"}):
        used = GRAPH[module] & MUTEX_PARTS
        assert not used, f"{module} imports {sorted(used)}, which are the Mutex's"


CLI = SRC / "_cli"


def test_the_command_line_is_built_on_the_public_api_only() -> None:
    import postgres_mutex

    reached: set[str] = set()
    for path in sorted(CLI.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level != 2:
                continue
            if node.module is None:
                names = {alias.name for alias in node.names}
                assert names <= set(postgres_mutex.__all__), f"{path.name} takes {sorted(names)} from the package"
                reached.add("__init__")
            else:
                assert not node.module.startswith("_"), f"{path.name} imports the private {node.module}"
                reached.add(node.module)
    # A guard on the reading itself: the command line does use the library.
    assert {"__init__", "errors"} <= reached


def test_nothing_below_the_command_line_imports_it() -> None:
    users = sorted(module for module in MODULES if "_cli" in GRAPH[module])
    assert users == ["__main__", "cli"], users


MOST_PRIVATE_REACHES = 25
"""Private names reached across objects that the hand-written modules may have, in all."""


def private_reaches(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self``, ``cls``, ``super()`` or a module: another object's private state."""
    tree = ast.parse(path.read_text())
    modules = {"os", "sys", "threading", "asyncio", "psycopg", "enum"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            modules.update(alias.asname or alias.name for alias in node.names if (SRC / f"{alias.name}.py").exists())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in {"self", "cls", *modules}:
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_objects_seldom_reach_into_each_others_private_state() -> None:
    # What two objects truly share is a declared interface (EngineHost, Session, Candidacy ...).
    hand_written = [path for path in sorted(SRC.rglob("*.py")) if "do not edit" not in path.read_text()[:600].lower()]
    reaches = [reach for path in hand_written for reach in private_reaches(path)]
    assert len(hand_written) > 40, "the reading found the package"
    assert len(reaches) <= MOST_PRIVATE_REACHES, "\n".join(reaches)


def test_no_hand_written_module_is_over_800_lines() -> None:
    # A module's size is set by its one concept, not by a cap met by splitting it; past this
    # many lines, it is likely doing several jobs.
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text().splitlines())
        for path in SRC.rglob("*.py")
        if "do not edit" not in path.read_text()[:600].lower()
    }
    assert {name: lines for name, lines in sizes.items() if lines > 800} == {}


def test_no_module_waits_on_a_socket_with_select() -> None:
    # select() refuses a descriptor numbered 1,024 or more, which a process with many sockets
    # open hands the library: it waits with poll() (`_base.acompat.ready_to_read`) or psycopg's waits.
    users = sorted(
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Import) and any(alias.name == "select" for alias in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "select")
    )
    assert users == []


INTEGRATIONS = SRC / "integrations"


def test_the_framework_integrations_are_built_on_the_public_api_only() -> None:
    import postgres_mutex

    reached: set[str] = set()
    for path in sorted(INTEGRATIONS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level > 0 and not module.startswith("postgres_mutex"):
                # Relative: within the integrations package only (not up into the library).
                depth = len(path.relative_to(INTEGRATIONS).parts) - 1
                assert node.level <= depth + 1, f"{path.name} reaches into the library by a relative import"
                continue
            if module == "postgres_mutex":
                names = {alias.name for alias in node.names}
                public_modules = {name for name in MODULES if not name.startswith("_")}
                allowed = set(postgres_mutex.__all__) | public_modules
                assert names <= allowed, f"{path.name} takes {sorted(names - allowed)} from the package"
                reached.add("__init__")
            elif module.startswith("postgres_mutex."):
                parts = module.split(".")[1:]
                if parts[0] == "integrations":
                    continue
                assert not any(part.startswith("_") for part in parts), f"{path.name} imports the private {module}"
                reached.add(parts[0])
    # A guard on the reading itself: the integrations do use the library.
    assert "__init__" in reached

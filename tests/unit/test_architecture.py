"""The library's structure, held against its imports: the layers of docs/development.md.

Read from the source (nothing is imported): an import inside a function
counts as much as one at the top; one under ``if TYPE_CHECKING:`` does not,
since it never runs. Modules are named by their dotted path inside the
package (``_io.engine_async``, ``client``; ``__init__`` is the package's own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "postgres_mutex"

LAYERS: list[set[str]] = [
    {"errors", "metric_names", "_version"},
    {"_base"},
    {"_sql", "_observe"},
    {"_state"},
    {"_io"},
    {"client"},
    {"_table"},
    {"table"},
    {"watcher"},
    {"_kinds"},
    {"_election"},
    {"election"},
    {"__init__", "mutex", "semaphore", "rwlock", "metrics", "exceptions", "shutdown", "prometheus", "otel"},
    {"_cli", "cli", "__main__", "integrations"},
]
"""Bottom to top: a module imports only from its own layer and those below it.

The vocabulary (errors, metric names, the version); building blocks that know nothing of locks
(`_base`); the statements (`_sql`) and what the library tells (`_observe`: the hooks' interface,
tracing, the exporters' shared part); the lock states and their rules, without I/O (`_state`);
connections and the engine (`_io`); the client; the table's methods (`_table`) and its public face; the
watcher; the lock kinds (`_kinds`); an election's parts and its public face; the rest of the
public modules; the command line and the framework integrations, on the public API only.
"""

LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


FILES = {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}
MODULES = sorted(FILES)


def layer_of(module: str) -> str:
    return module.split(".")[0]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(id(sub) for sub in ast.walk(node))
    return found


def _base_of(module: str, node: ast.ImportFrom) -> str:
    """The dotted module (inside the package; "" for the package itself) an import's ``from`` names."""
    if not node.level:
        name = node.module or ""
        return name.removeprefix("postgres_mutex").removeprefix(".") if name.split(".")[0] == "postgres_mutex" else "?"
    here = [] if module == "__init__" else module.split(".")
    if FILES[module].name != "__init__.py":
        here = here[:-1]
    here = here[: len(here) - (node.level - 1)]
    return ".".join([*here, *([node.module] if node.module else [])])


def _known(dotted: str) -> str | None:
    if dotted == "":
        return "__init__"
    return dotted if dotted in FILES else None


def imports_of(module: str) -> set[str]:
    """The package's modules that ``module`` imports when it runs."""
    tree = ast.parse(FILES[module].read_text())
    skipped = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = _base_of(module, node)
            if base == "?":
                continue
            for alias in node.names:
                sub = _known(f"{base}.{alias.name}" if base else alias.name)
                found.add(sub or _known(base) or base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "postgres_mutex":
                    found.add(_known(alias.name.removeprefix("postgres_mutex").removeprefix(".")) or alias.name)
    return found - {module}


GRAPH = {module: imports_of(module) for module in MODULES}

ENGINES = {
    f"_io.{part}{flavour}"
    for part in ("engine", "heartbeat", "listener", "sources", "interrupt", "acquisition")
    for flavour in ("", "_async")
}
"""The engine, in its parts: the hand-written async modules and the sync ones generated from them."""

MUTEX_PARTS = {
    f"_kinds.{part}"
    for part in (
        "closing",
        "closing_async",
        "siblings",
        "singleton",
        "singleton_async",
    )
}
"""What `_kinds.mutex` is made of: an election's side, closing, its decorators."""

HOLDER = {"_kinds.holder", "_kinds.holder_methods", "_kinds.holder_methods_async"}
"""What every holder (Mutex, Semaphore, an RWLock's modes) is made of."""

SQL = {module for module in MODULES if layer_of(module) == "_sql"}
"""Where the statements are: `_sql`, the door the rest of the library goes through, and its parts."""


def test_the_reader_finds_every_module_and_what_it_imports() -> None:
    # The checks below mean something only if the graph is the real one.
    assert {"client", "_state.session", "_io.host", "_io.engine_async", "_kinds.mutex"} <= set(MODULES)
    assert {"_io.engine_async", "_io.shared", "_io.heartbeat_async"} <= GRAPH["client"]
    assert {"_state.steps", "_sql", "_base.connections", "_io.listener_async"} <= GRAPH["_io.engine_async"]
    assert {"_sql.lock", "_sql.names"} <= GRAPH["_sql"]
    assert {"election", "mutex", "errors"} <= GRAPH["_cli._run"]


def test_every_module_has_a_layer() -> None:
    # A new subpackage or top-level module is placed in LAYERS (and in docs/development.md).
    unplaced = sorted({layer_of(module) for module in MODULES} - set(LEVEL))
    assert not unplaced, f"not in LAYERS: {unplaced}"


def test_private_modules_live_in_their_layers_package() -> None:
    # The top of the package is its public modules; what is private is in a layer's subpackage.
    loose = sorted(path.name for path in SRC.glob("_*.py") if path.stem not in {"__init__", "__main__", "_version"})
    assert loose == [], f"private modules at the top: put each in its layer's subpackage: {loose}"


@pytest.mark.parametrize("module", MODULES)
def test_a_module_imports_only_its_layer_and_those_below(module: str) -> None:
    above = sorted(
        imported
        for imported in GRAPH[module]
        if layer_of(imported) in LEVEL and LEVEL[layer_of(imported)] > LEVEL[layer_of(module)]
    )
    assert not above, f"{module} imports {above}, which are above its layer {layer_of(module)}"


@pytest.mark.parametrize("layer", ["_sql", "_observe"])
def test_the_statements_and_what_the_library_tells_know_nothing_of_each_other(layer: str) -> None:
    other = ({"_sql", "_observe"} - {layer}).pop()
    used = sorted(
        imported
        for module in MODULES
        if layer_of(module) == layer
        for imported in GRAPH[module]
        if layer_of(imported) == other
    )
    assert not used, f"{layer} imports {used}"


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


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_engine_knows_its_client_only_through_its_host(engine: str) -> None:
    forbidden = GRAPH[engine] & {"_state.session", "_io.shared", "client", "__init__"}
    assert not forbidden, f"{engine} imports {sorted(forbidden)}"
    source = FILES[engine].read_text()
    # Not even for its types: what it may use of the client is `EngineHost`, declared.
    assert "MutexClient" not in source
    assert "ClientCore" not in source


def test_the_engine_and_its_listener_are_given_a_host() -> None:
    for module in ("_io.engine_async", "_io.engine", "_io.listener_async", "_io.listener"):
        assert "host: EngineHost" in FILES[module].read_text(), module


def test_the_session_opens_no_connection_and_sends_nothing() -> None:
    forbidden = {
        module
        for module in GRAPH["_state.session"]
        if layer_of(module) in {"_io", "_sql"}
        or module in {"_state.steps", "_state.flows", "_state.heartbeat_flows", "_state.admin_flows"}
    }
    assert not forbidden, f"_state.session imports {sorted(forbidden)}"


def test_only_the_client_module_makes_a_core() -> None:
    makers = sorted(module for module in MODULES if "ClientCore(" in FILES[module].read_text())
    assert makers == ["client"], makers


def test_statements_are_composed_in_sql_only() -> None:
    # All SQL in one place: the library's other modules take statements from `_sql` (its package or
    # the part whose job it is), never compose one. The CLI's demo and the integrations' own tables
    # are theirs, outside the core.
    for module in sorted(set(MODULES) - SQL):
        if layer_of(module) in {"_cli", "integrations"}:
            continue
        source = FILES[module].read_text()
        assert "psycopg.sql" not in source, module
        assert "from psycopg import sql" not in source, module


@pytest.mark.parametrize("module", sorted(SQL))
def test_the_sql_modules_know_nothing_but_each_other(module: str) -> None:
    # Statements are text: composing one needs no state, no engine, no setting.
    assert GRAPH[module] <= SQL | {"errors"}, f"{module} imports {sorted(GRAPH[module] - SQL - {'errors'})}"


def test_an_elections_parts_are_its_own() -> None:
    # The package and the CLI reach an election through `election`, whose names are the public ones.
    for module in sorted(module for module in MODULES if layer_of(module) != "_election" and module != "election"):
        used = sorted(imported for imported in GRAPH[module] if layer_of(imported) == "_election")
        assert not used, f"{module} imports {used}, which are the election's: import from election"


def test_a_mutexs_parts_are_its_own() -> None:
    # An election campaigns with its Mutex's own `_campaign` (it is built on the Mutex); the holder is
    # what every holder (Mutex, Semaphore, RWLock's) is made of, with its methods of each flavour.
    for module in sorted(set(MODULES) - MUTEX_PARTS - HOLDER - {"_kinds.mutex"}):
        used = GRAPH[module] & MUTEX_PARTS
        assert not used, f"{module} imports {sorted(used)}, which are the Mutex's"


KIND_WORDS = {"permits", "_permits", "rw_mode", "_rw_mode"}
"""What a semaphore's or a read/write lock's holder used to be told apart by, in the general code."""

KINDS_OWN = {"_kinds.semaphore", "_kinds.rwlock"}
"""The modules of the kinds themselves, which say what a semaphore and a read/write lock are."""


def _names_in_code(module: str) -> set[str]:
    """The identifiers ``module``'s code uses: names, attributes, parameters and keywords (not its strings)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(FILES[module].read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.arg, ast.keyword)):
            found.add(node.arg or "")
    return found


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if layer_of(m) in {"_state", "_io", "_kinds"} and m not in KINDS_OWN)
)
def test_the_general_code_asks_a_locks_kind_what_differs(module: str) -> None:
    # What differs between a mutex, a permit and a mode (the statement, the row, the reply, the
    # words) is its `LockKind`'s to say (`_state.kind`): nothing else branches on which it is.
    told_apart = sorted(_names_in_code(module) & KIND_WORDS)
    assert not told_apart, f"{module} tells kinds apart by {told_apart}: ask the lock's kind"


CLI = SRC / "_cli"
PUBLIC_MODULES = {module for module in MODULES if "." not in module and not module.startswith("_")}


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
    assert {"election", "errors", "mutex"} <= reached


MOST_LAYERS_CROSSED = 12
"""The longest chain of modules each importing the next, from the command line to the clock.

What a reader crosses to follow a call down to the wire: each module on the chain is a layer they
must hold in mind. A new module that lengthens it is a layer the design did not have.
"""


def longest_chain() -> list[str]:
    chains: dict[str, list[str]] = {}

    def below(module: str) -> list[str]:
        if module not in chains:
            deepest = max((below(imported) for imported in GRAPH.get(module, ())), key=len, default=[])
            chains[module] = [module, *deepest]
        return chains[module]

    return max((below(module) for module in MODULES), key=len)


def test_a_call_crosses_few_layers() -> None:
    chain = longest_chain()
    assert len(chain) <= MOST_LAYERS_CROSSED, " -> ".join(chain)
    # A guard on the reading: the chain does run from the command line down to the clock's level.
    assert len(chain) >= 8, chain


def test_nothing_below_the_command_line_imports_it() -> None:
    users = sorted(
        module
        for module in MODULES
        if layer_of(module) != "_cli" and any(layer_of(imported) == "_cli" for imported in GRAPH[module])
    )
    assert users == ["cli"], users


MOST_PRIVATE_REACHES = 25
"""Private names reached across objects that the hand-written modules may have, in all."""


def private_reaches(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self``, ``cls``, ``super()`` or a module: another object's private state."""
    tree = ast.parse(path.read_text())
    modules = {"os", "sys", "threading", "asyncio", "psycopg", "enum"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            folder = path.parent
            for _ in range(node.level - 1):
                folder = folder.parent
            folder = folder.joinpath(*(node.module or "").split(".")) if node.module else folder
            modules.update(
                alias.asname or alias.name
                for alias in node.names
                if (folder / f"{alias.name}.py").exists() or (folder / alias.name / "__init__.py").exists()
            )
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
    # What two objects truly share is a declared interface (EngineHost, Session ...).
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
    # open hands the library: it waits with poll() (`_acompat.ready_to_read`) or psycopg's waits.
    users = sorted(
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id, node.attr) in (("select", "select"), ("selectors", "SelectSelector"))
        )
        or (
            isinstance(node, ast.ImportFrom) and node.module == "select" and any(a.name == "select" for a in node.names)
        )
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
                allowed = set(postgres_mutex.__all__) | PUBLIC_MODULES
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

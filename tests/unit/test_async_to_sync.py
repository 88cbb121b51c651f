"""The generator of the sync engine (tools/async_to_sync.py), on small sources: what it promises."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_to_sync", ROOT / "tools" / "async_to_sync.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("async_to_sync", module)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()


def sync_of(source: str) -> str:
    generated: str = GENERATOR.convert(source, "example_async.py")
    return generated.split("\n", 2)[2]  # past the two-line header


def test_code_loses_its_keywords_and_takes_the_sync_names() -> None:
    source = "async def fence_async(conn: AsyncConnection) -> None:\n    await conn.execute('SELECT 1')\n"
    assert sync_of(source) == "def fence(conn: Connection) -> None:\n    conn.execute('SELECT 1')\n"


def test_a_context_manager_type_takes_its_sync_name() -> None:
    source = "def fenced_async(conn: AsyncConnection) -> AbstractAsyncContextManager[int]: ...\n"
    assert sync_of(source) == "def fenced(conn: Connection) -> AbstractContextManager[int]: ...\n"


def test_docstrings_and_comments_take_the_sync_names_and_phrases() -> None:
    source = (
        "class AsyncAcquisition:\n"
        '    """What ``acquire_async()`` returns: the ``async with`` block.\n'
        "\n"
        '    See `fence_async`."""\n'
        "\n"
        "    # As `AsyncEngine` says.\n"
    )
    generated = sync_of(source)
    assert '"""What ``acquire()`` returns: the ``with`` block.' in generated
    assert "See `fence`." in generated
    assert "# As `Engine` says." in generated
    assert GENERATOR.async_words(GENERATOR.HEADER + generated) == []


def test_an_async_only_block_is_dropped_and_a_sync_only_one_uncommented() -> None:
    source = (
        "x = 1\n"
        "# async-only\n"
        "# one engine per event loop\n"
        "y = 2\n"
        "# end async-only\n"
        "# sync-only\n"
        '# """One engine, for threads."""\n'
        "#\n"
        "# z = 3\n"
        "# end sync-only\n"
    )
    assert sync_of(source) == 'x = 1\n"""One engine, for threads."""\n\nz = 3\n'


def test_the_sync_text_of_a_directive_or_a_sync_only_block_is_taken_as_written() -> None:
    # It is the sync module's own text already: a name in it that looks async is meant.
    source = (
        "release: Callable[[], Awaitable[None]]  # sync: release: Callable[[], None]  # see aclose_async\n"
        "# sync-only\n"
        '# log("only an async_pool is there: use aclose()")\n'
        "# end sync-only\n"
        'log("aclose() releases it")\n'
    )
    assert sync_of(source) == (
        "release: Callable[[], None]  # see aclose_async\n"
        'log("only an async_pool is there: use aclose()")\n'
        'log("close() releases it")\n'
    )


@pytest.mark.parametrize(
    "source",
    [
        "# async-only\nx = 1\n",  # never closed
        "# end sync-only\n",  # closes nothing
        "# sync-only\nx = 1\n# end sync-only\n",  # a sync-only line must be a comment
    ],
)
def test_a_malformed_block_is_refused(source: str) -> None:
    with pytest.raises(SyntaxError):
        sync_of(source)


def test_async_words_left_in_a_generated_module_are_found() -> None:
    generated = GENERATOR.HEADER + '"""Runs on one event loop."""\n# a cancelled task\nx = "no await here"\n'
    found = GENERATOR.async_words(generated)
    assert [line.split(":", 1)[0] for line in found] == ["3", "4", "5"]


def test_every_public_async_method_is_exercised_by_a_test() -> None:
    # Some public twins are still written by hand, and a generated one's async source runs only if a test
    # calls it: one without a test could drift from its sync side unseen.
    import inspect
    import re

    import postgres_mutex
    from postgres_mutex.watcher import StaleWatcher

    sources = "\n".join(path.read_text() for folder in ("tests", "chaos") for path in (ROOT / folder).rglob("*.py"))
    public = [getattr(postgres_mutex, name) for name in postgres_mutex.__all__]
    classes = [thing for thing in [*public, StaleWatcher] if inspect.isclass(thing)]
    twins = [
        f"{cls.__name__}.{name}"
        for cls in classes
        for name, _ in inspect.getmembers(cls)
        if name.endswith("_async") and not name.startswith("_")
    ]
    assert len(twins) >= 20, twins  # the walk found the public classes' twins
    untested = [twin for twin in twins if not re.search(rf"\.{re.escape(twin.split('.')[1])}\(", sources)]
    assert untested == [], f"no test calls {untested}"

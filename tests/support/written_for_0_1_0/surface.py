"""Print, as JSON, the public surface of whichever ``postgres_mutex`` this interpreter imports.

    python -I surface.py

What a program written against 0.1.0 can touch: the distribution's Python
and dependency requirements, the package's public names
(and the classes among them each one derives from), its public submodules,
every public member of a `Mutex` instance (method, coroutine, property or plain
attribute) with its signature, the hook methods, and ``mutex.config``'s fields.
Run with 0.1.0 and with this version, the two descriptions are compared.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import pkgutil
from typing import Any

import postgres_mutex as package
from postgres_mutex import MetricsHook, Mutex


def signature(obj: Any) -> list[list[str]] | None:
    """Each parameter as [name, kind, default]; the default is ``<required>`` when there is none."""
    try:
        found = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [
        [p.name, p.kind.name, "<required>" if p.default is inspect.Parameter.empty else repr(p.default)]
        for p in found.parameters.values()
    ]


def member(cls: type, instance: object, name: str) -> dict[str, Any]:
    raw = inspect.getattr_static(cls, name, None)
    if raw is None:
        value = getattr(instance, name)
        return {"kind": "attribute", "type": type(value).__name__}
    if isinstance(raw, property):
        return {"kind": "property", "settable": raw.fset is not None}
    if inspect.iscoroutinefunction(raw):
        return {"kind": "coroutine", "signature": signature(raw)}
    if callable(raw):
        return {"kind": "method", "signature": signature(raw)}
    return {"kind": "attribute", "type": type(raw).__name__}


def describe_name(name: str) -> dict[str, Any]:
    value = getattr(package, name)
    if not isinstance(value, type):
        return {"kind": type(value).__name__}
    exported_bases = sorted(
        other
        for other in package.__all__
        if other != name and isinstance(getattr(package, other), type) and issubclass(value, getattr(package, other))
    )
    builtin_bases = sorted(
        base.__name__ for base in value.__mro__ if base.__module__ == "builtins" and base is not object
    )
    return {
        "kind": "class",
        "exported_bases": exported_bases,
        "builtin_bases": builtin_bases,
        "signature": signature(value),
    }


def modules() -> dict[str, list[str] | str]:
    """Each public submodule: the package's public names it offers (or why it does not import)."""
    found: dict[str, list[str] | str] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
        except ImportError as exc:
            found[info.name] = f"ImportError: {exc}"
            continue
        found[info.name] = sorted(name for name in package.__all__ if getattr(module, name, None) is not None)
    return found


class SixMethodHook:
    """The metrics hook of 0.1.0's README: only its six methods."""

    def acquired(self, lock_name: str, *, instance_id: str) -> None: ...
    def released(self, lock_name: str, *, instance_id: str) -> None: ...
    def contended(self, lock_name: str, *, instance_id: str) -> None: ...
    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None: ...
    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None: ...
    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None: ...


def methods(cls: type) -> dict[str, list[list[str]] | None]:
    return {
        name: signature(value)
        for name, value in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }


def main() -> None:
    # Constructing a Mutex opens no connection, in either version: nothing listens on port 1.
    mutex = Mutex(
        "host=127.0.0.1 port=1 dbname=surface",
        "surface",
        instance_id="surface-1",
        heartbeat_interval=0.2,
        alert_threshold=1.0,
        stale_threshold=3.0,
        poll_interval=0.1,
    )
    config = mutex.config
    distribution = importlib.metadata.metadata("postgres-mutex")
    requires = importlib.metadata.requires("postgres-mutex") or []
    description = {
        "requires_python": distribution["Requires-Python"],
        "requires": sorted(requirement for requirement in requires if "extra ==" not in requirement),
        "version": package.__version__,
        "file": package.__file__,
        "all": sorted(package.__all__),
        "names": {name: describe_name(name) for name in package.__all__},
        "modules": modules(),
        "mutex": {name: member(Mutex, mutex, name) for name in dir(mutex) if not name.startswith("_")},
        "hook_methods": methods(MetricsHook),
        "null_metrics_methods": sorted(name for name in dir(package.NullMetrics) if not name.startswith("_")),
        "six_method_hook_is_a_metrics_hook": isinstance(SixMethodHook(), MetricsHook),
        "config": {field.name: getattr(config, field.name) for field in dataclasses.fields(config)},
    }
    print(json.dumps(description, sort_keys=True))


if __name__ == "__main__":
    main()

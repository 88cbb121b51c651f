# Generated from rwlock_methods_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""`RWLock`'s methods in one flavour: hold a mode, its decorators, fence, release, close.

`RWLock` is made of them and of what is its own (its two holders, its state);
each method hands the call to the holder of the mode asked for, or held.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

if TYPE_CHECKING:
    import psycopg

    from .._io.acquisition import Acquisition
    from .rwlock import ModeHolder

P = ParamSpec("P")
R = TypeVar("R")

Function = Callable[P, R]
"""What a decorator is given."""
Skippable = Callable[P, R | None]
"""What it returns: the same function, returning None when it did not run."""


class RWLockMethods:
    """What an RWLock does in one flavour (``read``, ``fence`` ...), through its holders."""

    # What `RWLock` sets up for them.
    _reader: ModeHolder
    _writer: ModeHolder
    _holding: Callable[[], ModeHolder]

    # -- acquire ---------------------------------------------------------------------

    def read(
        self,
        blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Acquisition:
        """Hold the lock for reading for the ``with`` block; yields whether it was acquired.

        With `Mutex.acquire`'s defaults, timeouts and errors.
        """
        return self._reader.acquire(blocking=blocking, timeout=timeout)

    def write(
        self,
        blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Acquisition:
        """Hold the lock alone, for writing, for the ``with`` block; yields whether it was acquired.

        With `Mutex.acquire`'s defaults, timeouts and errors.
        """
        return self._writer.acquire(blocking=blocking, timeout=timeout)

    # -- decorators ------------------------------------------------------------------

    @overload
    def read_singleton(self, func: Function[P, R], /) -> Skippable[P, R]: ...

    @overload
    def read_singleton(
        self,
        *,
        blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Callable[[Function[P, R]], Skippable[P, R]]: ...

    def read_singleton(
        self,
        func: Callable[..., Any] | None = None,
        *,
        blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Decorate a function to run only while holding the lock for reading (see `Mutex.singleton`).

        Each call holds it for reading for the call, with `read`'s
        ``blocking`` and ``timeout``: while a writer holds it or waits, the
        function does not run and the call returns None (blocking with a
        ``timeout``, it raises `LockAcquisitionTimeout` instead). Readers
        elsewhere run meanwhile; in this process, one RWLock holds once at a
        time, so a call made while it reads (another call, a block holding
        it) returns None too, and one made while it writes raises
        `InvalidArgument`, as `read` does: use an RWLock per concurrent
        caller. Also usable bare: ``@rw.read_singleton``.
        """
        return (
            self._reader.singleton(func)
            if func is not None
            else self._reader.singleton(blocking=blocking, timeout=timeout)
        )

    @overload
    def write_singleton(self, func: Function[P, R], /) -> Skippable[P, R]: ...

    @overload
    def write_singleton(
        self,
        *,
        blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Callable[[Function[P, R]], Skippable[P, R]]: ...

    def write_singleton(
        self,
        func: Callable[..., Any] | None = None,
        *,
        blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Decorate a function to run only while holding the lock alone, for writing (see `read_singleton`).

        While anyone else reads or writes, the function does not run and the
        call returns None, unless ``blocking``: a waiting writer keeps new
        readers out until it gets in. Also usable bare: ``@rw.write_singleton``.
        """
        return (
            self._writer.singleton(func)
            if func is not None
            else self._writer.singleton(blocking=blocking, timeout=timeout)
        )

    # -- fencing ---------------------------------------------------------------------

    def fence(self, conn: psycopg.Connection[Any]) -> int:
        """`Mutex.fence` for the mode held: `LockNotHeldError` if neither is, or the hold is no longer
        current."""
        return self._holding().fence(conn)

    def fenced(self, conn: psycopg.Connection[Any]) -> AbstractContextManager[int]:
        """`Mutex.fenced` for the mode held: a transaction on ``conn``, fenced first; yields the token."""
        return self._holding().fenced(conn)

    # -- release and shutdown ----------------------------------------------------------

    def release(self) -> None:
        """Release the mode held (see `Mutex.release`)."""
        self._holding().release()

    def close(self) -> None:
        """Release what is held and let go of the client (see `Mutex.close`)."""
        self._reader.close()
        self._writer.close()

"""`RWLock`'s methods in one flavour: hold a mode, its decorators, fence, release, close.

`RWLock` is made of them and of what is its own (its two holders, its state);
each method hands the call to the holder of the mode asked for, or held.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

if TYPE_CHECKING:
    import psycopg

    from .._io.acquisition_async import AsyncAcquisition
    from .rwlock import ModeHolder

P = ParamSpec("P")
R = TypeVar("R")

AsyncFunction = Callable[P, Awaitable[R]]  # sync: Function = Callable[P, R]
"""What a decorator is given."""
AsyncSkippable = Callable[P, Awaitable[R | None]]  # sync: Skippable = Callable[P, R | None]
"""What it returns: the same function, returning None when it did not run."""


class AsyncRWLockMethods:
    """What an RWLock does in one flavour (``read_async``, ``fence_async`` ...), through its holders."""

    # What `RWLock` sets up for them.
    _reader: ModeHolder
    _writer: ModeHolder
    _holding: Callable[[], ModeHolder]

    # -- acquire ---------------------------------------------------------------------

    def read_async(
        self,
        blocking: bool = True,  # sync: blocking: bool | None = None,
        timeout: float | None = None,
    ) -> AsyncAcquisition:
        """Hold the lock for reading for the ``async with`` block; yields whether it was acquired.

        With `Mutex.acquire_async`'s defaults, timeouts and errors.
        """
        return self._reader.acquire_async(blocking=blocking, timeout=timeout)

    def write_async(
        self,
        blocking: bool = True,  # sync: blocking: bool | None = None,
        timeout: float | None = None,
    ) -> AsyncAcquisition:
        """Hold the lock alone, for writing, for the ``async with`` block; yields whether it was acquired.

        With `Mutex.acquire_async`'s defaults, timeouts and errors.
        """
        return self._writer.acquire_async(blocking=blocking, timeout=timeout)

    # -- decorators ------------------------------------------------------------------

    @overload
    def read_singleton_async(self, func: AsyncFunction[P, R], /) -> AsyncSkippable[P, R]: ...

    @overload
    def read_singleton_async(
        self,
        *,
        blocking: bool = True,  # sync: blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Callable[[AsyncFunction[P, R]], AsyncSkippable[P, R]]: ...

    def read_singleton_async(
        self,
        func: Callable[..., Any] | None = None,
        *,
        blocking: bool = True,  # sync: blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Decorate a function to run only while holding the lock for reading (see `Mutex.singleton_async`).

        Each call holds it for reading for the call, with `read_async`'s
        ``blocking`` and ``timeout``: while a writer holds it or waits, the
        function does not run and the call returns None (blocking with a
        ``timeout``, it raises `LockAcquisitionTimeout` instead). Readers
        elsewhere run meanwhile; in this process, one RWLock holds once at a
        time, so a call made while it reads (another call, a block holding
        it) returns None too, and one made while it writes raises
        `InvalidArgument`, as `read_async` does: use an RWLock per concurrent
        caller. Also usable bare: ``@rw.read_singleton_async``.
        """
        return (
            self._reader.singleton_async(func)
            if func is not None
            else self._reader.singleton_async(blocking=blocking, timeout=timeout)
        )

    @overload
    def write_singleton_async(self, func: AsyncFunction[P, R], /) -> AsyncSkippable[P, R]: ...

    @overload
    def write_singleton_async(
        self,
        *,
        blocking: bool = True,  # sync: blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Callable[[AsyncFunction[P, R]], AsyncSkippable[P, R]]: ...

    def write_singleton_async(
        self,
        func: Callable[..., Any] | None = None,
        *,
        blocking: bool = True,  # sync: blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Decorate a function to run only while holding the lock alone, for writing (see `read_singleton_async`).

        While anyone else reads or writes, the function does not run and the
        call returns None, unless ``blocking``: a waiting writer keeps new
        readers out until it gets in. Also usable bare: ``@rw.write_singleton_async``.
        """
        return (
            self._writer.singleton_async(func)
            if func is not None
            else self._writer.singleton_async(blocking=blocking, timeout=timeout)
        )

    # -- fencing ---------------------------------------------------------------------

    async def fence_async(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """`Mutex.fence_async` for the mode held: `LockNotHeldError` if neither is, or the hold is no longer
        current."""
        return await self._holding().fence_async(conn)

    def fenced_async(self, conn: psycopg.AsyncConnection[Any]) -> AbstractAsyncContextManager[int]:
        """`Mutex.fenced_async` for the mode held: a transaction on ``conn``, fenced first; yields the token."""
        return self._holding().fenced_async(conn)

    # -- release and shutdown ----------------------------------------------------------

    async def release_async(self) -> None:
        """Release the mode held (see `Mutex.release_async`)."""
        await self._holding().release_async()

    async def aclose(self) -> None:
        """Release what is held and let go of the client (see `Mutex.aclose`)."""
        await self._reader.aclose()
        await self._writer.aclose()

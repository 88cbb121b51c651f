"""The paired primitives the engine is written with: one async, one sync, same shape.

`_io/engine_async.py` is written once, with the async names; `_io/engine.py` is
generated from it by ``tools/async_to_sync.py``, which drops ``async`` and
``await`` and renames each async primitive to its sync twin (``AEvent`` to
``Event``, ``AWorker`` to ``Worker``, ...). Everything that genuinely differs
between a thread and a task lives here, side by side, and nowhere else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import select
import selectors
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from .clock import MAX_SLICE, now
from .threads import start_thread

T = TypeVar("T")


def current_owner() -> object:
    """Who is running: the asyncio task, if there is one in this thread, else the thread."""
    # Asked of the running loop, if any, rather than by catching the error
    # asyncio.current_task raises without one: twice per sync lock cycle.
    loop = asyncio._get_running_loop()
    task = None if loop is None else asyncio.current_task(loop)
    if task is not None:
        return task
    # The thread, as the thread itself keeps it: read in C (`threading.current_thread` is Python).
    try:
        return _this_thread.owner
    except AttributeError:
        owner = _this_thread.owner = threading.current_thread()
        return owner


_this_thread = threading.local()


# -- events ----------------------------------------------------------------------------


class AEvent:
    """An event a task waits on; `set` may be called from any thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def set(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._event.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self._loop.call_soon_threadsafe(self._event.set)

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until set or ``timeout`` seconds passed (on the library's clock); returns whether it is set."""
        if timeout is None:
            await self._event.wait()
            return True
        deadline = now() + timeout
        while not self._event.is_set():
            left = deadline - now()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), min(left, MAX_SLICE))
        return True


class Event:
    """An event a thread waits on; `set` may be called from any thread.

    Built on a bare `threading.Lock`, held while the event is clear, rather than on
    `threading.Event`, whose `threading.Condition` is entered and left by Python code: a
    signal handler's exception landing there (a waiting acquire's job runner timing out) left
    its lock held, and every later `set`, the listener thread's included, waited for good.
    A lock's acquire and release are single C calls, and a waiter that got it while the event
    is still clear keeps it: holding it is what "clear" means, whoever holds it.
    """

    __slots__ = ("_clear", "_flag")

    def __init__(self) -> None:
        self._flag = False
        self._clear = threading.Lock()
        self._clear.acquire()

    def set(self) -> None:
        self._flag = True
        # Not contextlib.suppress: its Python frames are where an exception could land.
        try:  # noqa: SIM105
            self._clear.release()
        except RuntimeError:
            pass  # already released: set twice

    def clear(self) -> None:
        self._flag = False
        self._clear.acquire(blocking=False)

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else now() + timeout
        while not self._flag:
            left = MAX_SLICE if deadline is None else min(deadline - now(), MAX_SLICE)
            if left <= 0:
                return False
            if self._clear.acquire(timeout=left) and self.is_set():
                try:  # noqa: SIM105 (as in `set`)
                    self._clear.release()  # let the other waiters through
                except RuntimeError:
                    pass  # released by a `set` meanwhile
        return True


# -- the engine's statement connection: one user at a time, heartbeats first ----------


class AGate:
    """Lets one task at a time use a connection; urgent ones (heartbeats) go first.

    Everything runs on one event loop, so the bookkeeping needs no lock; a task
    cancelled just after being let in passes its turn on, so the gate never
    stays shut.
    """

    def __init__(self) -> None:
        self.busy = False
        self._waiting: dict[bool, collections.deque[asyncio.Future[None]]] = {
            True: collections.deque(),
            False: collections.deque(),
        }

    async def enter(self, urgent: bool, seconds: float) -> None:
        """Take the connection for one statement (of ``seconds`` at most); give it back with `leave`.

        Plain calls rather than a context manager's object: one turn is taken per statement.
        """
        if self.busy:
            await self.wait(urgent)
        else:
            self.busy = True  # one loop: nothing runs between the check and this

    def try_enter(self) -> bool:
        """Take the connection only if nobody has it or waits for it; give it back with `leave`."""
        taken, self.busy = not self.busy, True
        return taken

    async def wait(self, urgent: bool) -> None:
        """Wait for the busy connection to be handed over (`enter` found it busy)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting[urgent]
        queue.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # let in, then cancelled: pass the turn on
            else:
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
            raise

    def leave(self) -> None:
        for queue in (self._waiting[True], self._waiting[False]):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the gate stays busy: it is theirs now
                    return
        self.busy = False


class Gate:
    """Lets one thread at a time use a connection; urgent ones (heartbeats) go first, the others in turn.

    First come, first served: a thread that gives the connection back and asks
    again at once (an acquire polling) queues behind those already waiting
    (the release of the lock it polls for, say).

    A turn is its thread's: a thread runs one statement at a time, so the
    thread names the turn, and `leave` gives back the calling thread's turn
    only (none if it was taken back and passed on). No object is made per
    turn: the uncontended `enter` and `leave` are a few stores under a bare
    `threading.Lock`, whose acquire and release are single C calls.

    A turn whose holder never gave it back is taken back: an exception a
    signal handler raised just as the holder's statement ended can skip the
    giving back, and nothing else would. Its holder can no longer be using
    the connection when it asks for another turn (a thread runs one
    statement at a time), nor once its statement's bound has passed (the
    watchdog cuts a statement at its deadline, a connect and a cancel
    request are bounded): a waiter looks again every `_LOOK_AGAIN` seconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._holder_thread = 0
        self._holder_until = 0.0
        self._waiting: dict[bool, collections.deque[tuple[threading.Lock, int, float]]] = {
            True: collections.deque(),
            False: collections.deque(),
        }

    def enter(self, urgent: bool, seconds: float) -> None:
        """Take the connection for one statement (of ``seconds`` at most); give it back with `leave`."""
        me = threading.get_ident()
        turn: threading.Lock | None = None
        try:
            with self._lock:
                if not self._busy or self._left_behind(me):
                    # `_give`, inline: one statement at a time mostly finds the gate free.
                    self._busy = True
                    self._holder_thread = me
                    self._holder_until = now() + _TURN_BOUNDS * seconds + _HELD_BEYOND_STATEMENT
                    return
                turn = threading.Lock()
                turn.acquire()
                self._waiting[urgent].append((turn, me, seconds))
            # Released by _pass_on when it is this thread's turn.
            while not turn.acquire(timeout=_LOOK_AGAIN):
                with self._lock:
                    if self._left_behind(me):
                        self._pass_on()
        except BaseException:
            # Interrupted (a signal handler's exception) before the statement began: out of the
            # queue if it waits there, else the turn passes on if it was given.
            self._give_back(me, turn)
            raise

    def try_enter(self) -> bool:
        """Take the connection only if nobody has it or waits for it, for an instant; give it back with `leave`."""
        with self._lock:
            if self._busy and now() <= self._holder_until:
                return False
            self._give(threading.get_ident(), 0.0)
            return True

    def leave(self) -> None:
        """Give back the calling thread's turn (`enter`'s or `try_enter`'s); nothing if it was taken back."""
        me = threading.get_ident()
        with self._lock:
            if self._holder_thread == me:  # else it was taken back, and passed on already
                if self._waiting[True] or self._waiting[False]:
                    self._pass_on()
                else:
                    self._busy = False
                    self._holder_thread = 0

    def _left_behind(self, asking: int) -> bool:
        """Whether the turn's holder can no longer be using the connection, though it never gave the turn back."""
        return self._holder_thread == asking or now() > self._holder_until

    def _give(self, thread: int, seconds: float) -> None:
        self._busy = True
        self._holder_thread = thread
        self._holder_until = now() + _TURN_BOUNDS * seconds + _HELD_BEYOND_STATEMENT

    def _give_back(self, thread: int, turn: threading.Lock | None) -> None:
        """``thread`` was interrupted: out of the queue if it waits there, else its turn passes on if it had it."""
        with self._lock:
            for queue in self._waiting.values():
                for waiting in queue:
                    if waiting[0] is turn:
                        queue.remove(waiting)
                        return
            if self._holder_thread == thread:
                self._pass_on()

    def _pass_on(self) -> None:
        for queue in (self._waiting[True], self._waiting[False]):
            if queue:
                turn, thread, seconds = queue.popleft()
                self._give(thread, seconds)
                turn.release()  # the gate stays busy: it is theirs now
                return
        self._busy = False
        self._holder_thread = 0


# How often a thread waiting for the connection looks whether its holder left without giving it
# back, and how long a holder may keep it: a turn may open the connection, end the server
# processes of statements cut off before, and send its statement, each within the statement's
# bound; then a connect's floor of two seconds, a cancel request's second. Taken back sooner, a
# turn still in use would share the connection with the next one.
_LOOK_AGAIN = 0.05
_TURN_BOUNDS = 3
_HELD_BEYOND_STATEMENT = 3.0


# -- background workers ----------------------------------------------------------------


class AWorker:
    """A task running one of the engine's loops."""

    def __init__(self, target: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(target(), name=name)

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def join(self, timeout: float) -> None:
        if self._task is not asyncio.current_task():
            await asyncio.wait([self._task], timeout=timeout)


class Worker:
    """A daemon thread running one of the engine's loops (none once the interpreter is shutting down)."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._thread = start_thread(target, name)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


async def asleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


# -- cancellation ------------------------------------------------------------------------


ACancelled = asyncio.CancelledError


class Cancelled(BaseException):
    """Threads are never cancelled: nothing raises this."""


Outcome = tuple[T | None, Exception | None]
"""What a task of the library's returns instead of raising: asyncio.run's shutdown
reports every task it finds ended with an exception, even one its awaiter saw."""


async def _outcome(work: Coroutine[Any, Any, T], ended: asyncio.Future[None]) -> Outcome[T]:
    try:
        return await work, None
    except Exception as error:  # raised again in the awaiting task, by _unwrap
        return None, error
    finally:
        # Woken from here rather than by a done callback: one turn of the event
        # loop fewer per statement. The task is done before the awaiter runs.
        if not ended.done():
            ended.set_result(None)


def _unwrap(outcome: Outcome[T]) -> T:
    value, error = outcome
    if error is not None:
        raise error
    return cast(T, value)


# From Python 3.12 a task can run its first steps at once, in the awaiting
# task's turn, instead of waiting for a turn of the event loop of its own.
_EAGER: dict[str, Any] = {"eager_start": True} if sys.version_info >= (3, 12) else {}


class _Protected(asyncio.Task[Outcome[T]]):
    """A task the event loop's shutdown does not cancel: whoever awaits it decides how it ends.

    asyncio.run, ending, cancels every task left (with the loop stopped, the
    only time this is refused). Cancellations while the loop runs, asyncio's
    own timeouts inside the work among them, go through as usual. ``ended``
    is set once the work is over, however it ended.
    """

    def __init__(self, work: Coroutine[Any, Any, T], name: str) -> None:
        loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[None] = loop.create_future()
        super().__init__(_outcome(work, self.ended), loop=loop, name=name, **_EAGER)
        if not _EAGER:
            # Cancelled before its first step, the work never runs (nor sets ``ended``).
            self.add_done_callback(_set_ended)

    def cancel(self, msg: Any | None = None) -> bool:
        if not self.get_loop().is_running():
            return False
        return super().cancel(msg)


def _set_ended(task: asyncio.Task[Any]) -> None:
    ended = cast(_Protected[Any], task).ended
    if not ended.done():
        ended.set_result(None)


class _ToTheEnd(_Protected[T]):
    """The task of work that must run to its end (a release).

    Statements it awaits itself need no task of their own: nothing of the
    library's cancels it, and the loop's shutdown does not either.
    """


async def _until_done(task: _Protected[T]) -> T:
    """Wait for ``task`` to end; the awaiting task's cancellation cancels this wait, not the task.

    What asyncio.shield does, for one task and without a future of its own.
    """
    await task.ended
    return _unwrap(task.result())


async def auncancellable(work: Coroutine[Any, Any, T], on_cancel: Callable[[], Coroutine[Any, Any, object]]) -> T:
    """Await ``work``; if the caller is cancelled meanwhile, await ``on_cancel`` and let the work end first.

    psycopg would answer a cancellation with a server-side cancel bounded only
    by its own timeouts, over what may be a dead network; ``on_cancel`` stops
    the statement within the library's deadlines instead.
    """
    if isinstance(asyncio.current_task(), _ToTheEnd):
        return await work  # nothing of the library's cancels it
    task = _Protected(work, "postgres-mutex statement")
    try:
        return await _until_done(task)
    except asyncio.CancelledError:
        await on_cancel()
        await asyncio.wait([task])
        raise


def uncancellable(work: T, on_cancel: Callable[[], object]) -> T:
    """Threads are not cancelled: the work has already run."""
    return work


async def ato_the_end(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end even if the awaiting task is cancelled meanwhile (a release, say).

    The awaiting task, cancelled, returns at once; the work goes on in a task
    of its own, which the loop's shutdown waits for rather than cancels.
    """
    return await _until_done(_ToTheEnd(work, "postgres-mutex release"))


def to_the_end(work: T) -> T:
    return work


# -- the listener's wait: a socket, or a wake-up ----------------------------------------


def ready_to_read(fds: tuple[int, ...], timeout: float) -> set[int]:
    """Which of ``fds`` are readable (or closed by their peer) within ``timeout`` seconds.

    poll() where there is one, never select(): a process with many sockets open (a web server's)
    hands the library descriptors above 1,023, which select() refuses; epoll costs a descriptor.
    The poll object itself, not a `selectors.PollSelector`: a waiter woken by a release calls
    this on its way to the lock, where a selector's bookkeeping costs dozens of Python calls.
    """
    if _poll is None:
        selector = selectors.DefaultSelector()
        with selector:
            for fd in fds:
                selector.register(fd, selectors.EVENT_READ)
            return {key.fd for key, _ in selector.select(max(timeout, 0.0))}
    poller = _poll()
    for fd in fds:
        poller.register(fd, _READABLE)
    # In milliseconds, rounded up as selectors rounds: a wait never ends before its time. Any event
    # counts (a hang-up, an error): the caller's read then finds out what it was.
    return {fd for fd, _ in poller.poll(math.ceil(max(timeout, 0.0) * 1e3))}


_poll = getattr(select, "poll", None)
_READABLE = getattr(select, "POLLIN", 1)


class AWaker:
    """Wakes the listener task from any thread."""

    def __init__(self) -> None:
        self._event = AEvent()

    def wake(self) -> None:
        self._event.set()

    async def wait_readable(self, fd: int | None, timeout: float, drain: Callable[[], None]) -> None:
        """Wait until `wake` is called or ``timeout`` passes; whenever ``fd`` is readable meanwhile, ``drain`` it.

        ``drain`` runs in the event loop's own callback for the socket: what it
        wakes (a waiter's event) runs next, with no turn of this task between.
        What it raises ends the wait and is raised here.
        """
        failed: list[Exception] = []
        if fd is not None and not self._event.is_set():
            loop = asyncio.get_running_loop()

            def readable() -> None:
                try:
                    drain()
                except Exception as exc:
                    failed.append(exc)
                    loop.remove_reader(fd)
                    self._event.set()

            loop.add_reader(fd, readable)
            try:
                await self._event.wait(timeout)
            finally:
                loop.remove_reader(fd)
        elif not self._event.is_set():
            await self._event.wait(timeout)
        self._event.clear()
        if failed:
            raise failed[0]

    def close(self) -> None:
        pass


class Waker:
    """Wakes the listener thread from any thread: a pipe it waits on with its socket."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._write, b"\0")

    def wait_readable(self, fd: int | None, timeout: float, drain: Callable[[], None]) -> None:
        ready = ready_to_read((self._read,) if fd is None else (fd, self._read), timeout)
        if self._read in ready:
            with contextlib.suppress(OSError):
                os.read(self._read, 4096)
        if fd is not None and fd in ready:
            drain()

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


# -- a waiter's wait for its wake-up -------------------------------------------------------


class AReader:
    """How a waiting task waits for a release: on its event, which the loop's callback for the
    listener's socket sets (`AWaker.wait_readable`), with no turn of the listener task between."""

    def __init__(self, waker: AWaker) -> None:
        pass

    def busy_until(self) -> float:
        """Until when a waiter reads the listener's socket (0: nobody does): tasks never do."""
        return 0.0

    def using(self) -> contextlib.nullcontext[None]:
        """The listener's connection, for the listener's own use: a task's is never shared."""
        return contextlib.nullcontext()

    def drain_if_free(self, drain: Callable[[T], object], conn: T) -> None:
        """Read the socket now if nobody uses the connection: a task never does, the listener's task reads it
        whenever it is readable, before the task whose wait ends runs."""

    async def wait(self, released: AEvent, fd: int | None, drain: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``released`` is set or ``timeout`` passes; False: the listener read the socket, not this."""
        await released.wait(timeout)
        return False

    def poke(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Baton:
    """Who may use the listener's connection at this instant: its thread or a waiter reading its socket.

    A holder keeps it for a drain of the socket or one statement of the
    listener's; a holder that never gave it back (an exception a signal
    handler raised just after it was taken) is passed over after
    `_BATON_HELD_AT_MOST`, the longest any holder keeps it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def try_take(self) -> threading.Lock | None:
        lock = self._lock
        return lock if lock.acquire(blocking=False) else None

    def __enter__(self) -> None:
        lock = self._lock
        if not lock.acquire(timeout=_BATON_HELD_AT_MOST):
            self._lock = threading.Lock()  # left behind: a new one, the old one is nobody's
            self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(RuntimeError):
            self._lock.release()


_BATON_HELD_AT_MOST = 5.0


class Reader:
    """How a waiting thread waits for a release: reading the listener's socket itself, if no other waiter does.

    A notification then wakes the very thread that waits for it: no listener
    thread in between, which would wake first and then wake it. One waiter
    reads at a time (the others wait on their events, which whoever reads
    sets); the listener's thread leaves the socket to it meanwhile, and keeps
    the connection for its own statements (`using`). A reader's turn ends
    with its wait at the latest, whatever was raised into it.
    """

    def __init__(self, waker: Waker) -> None:
        self._waker = waker
        self._guard = threading.Lock()
        self._until = 0.0
        self._turn: object | None = None  # the reading waiter's turn, which only it ends
        self._draining: int | None = None  # the thread of the reading waiter, while it drains the socket
        self._baton = _Baton()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def busy_until(self) -> float:
        """Until when a waiter reads the listener's socket (past: nobody does)."""
        return self._until

    def using(self) -> _Baton:
        return self._baton

    def drain_if_free(self, drain: Callable[[T], object], conn: T) -> None:
        """Read ``conn``'s socket now with ``drain``, if nobody uses the connection (else whoever does reads it)."""
        baton = self._baton.try_take()
        if baton is not None:
            try:
                drain(conn)
            finally:
                with contextlib.suppress(RuntimeError):
                    baton.release()

    def wait(self, released: Event, fd: int | None, drain: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``released`` is set or ``timeout`` passes, reading the socket ``fd`` meanwhile if no other
        waiter does; ``drain`` reads it (False: the connection failed). True if this waiter read it."""
        deadline = now() + timeout
        turn = object()
        taken = False
        try:
            # Taken inside the try: an exception landing just after (a signal handler's) still gives
            # the socket back to the listener's thread, which would otherwise leave it until the deadline.
            with self._guard:
                taken = fd is not None and self._until < now()
                if taken:
                    self._until, self._turn = deadline, turn
            if not taken:
                released.wait(timeout)
                return False
            # The listener's thread may be waiting on the socket too: it leaves it to this waiter.
            self._waker.wake()
            while not released.is_set():
                left = deadline - now()
                if left <= 0:
                    break
                assert fd is not None
                ready = ready_to_read((fd, self._read), min(left, MAX_SLICE))
                if self._read in ready:
                    with contextlib.suppress(OSError):
                        os.read(self._read, 4096)
                if fd in ready:
                    baton = self._baton.try_take()
                    if baton is None:
                        # The listener's thread has the connection: it hands out what it reads.
                        released.wait(min(left, _BATON_BUSY))
                        continue
                    self._draining = threading.get_ident()
                    try:
                        ok = drain()
                    finally:
                        self._draining = None
                        with contextlib.suppress(RuntimeError):
                            baton.release()
                    if not ok:
                        break
        finally:
            if taken:
                with self._guard:
                    # Once its deadline passed, another waiter may have taken the socket before this one
                    # left: that one's turn stays, or a release's poke would no longer reach it.
                    if self._turn is turn:
                        self._until, self._turn = 0.0, None
        return True

    def poke(self) -> None:
        """End a reading waiter's wait on the socket, to look at its event again.

        Not from the reading waiter's thread as it drains the socket: it looks at its event right after (a
        write to the pipe would cost its hand-off a system call, and its next wait another round of the loop).
        """
        if self._until and self._draining != threading.get_ident():
            with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
                os.write(self._write, b"\0")

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


_BATON_BUSY = 0.002
"""How long a reading waiter waits on its event while the listener's thread has the connection."""

"""`LockKind`: what differs between the things a holder can hold, asked of one object.

A mutex, a semaphore's permit and a read/write lock's read or write hold share
everything the lock state, the flows, the engine and the events do: the lease,
the heartbeat, the doubt, the clean-ups, the history. What differs is here:
which statement acquires, what row an acquire writes, how its reply is read
and what a reply says to do next, which failures mean "busy", and the words
that messages, log lines, metrics and spans use. The general code asks its
lock's kind and never branches on what the kind is.

`LockKind` itself is the mutex's kind (`MUTEX`); every other kind is a
subclass in the module of its holder (`_kinds.semaphore`, `_kinds.rwlock`),
beside which its statements live in `_sql`. A new kind is that module, its
statements, and the holder that passes its kind to `Holder._setup`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from ..errors import SchemaError, phrase
from .outcome import PermitReply, interpret_acquire

if TYPE_CHECKING:
    from .._sql import Statement, Statements
    from .settings import Timing


class LockKind:
    """A mutex's: one holder at a time of a row named after the lock."""

    noun: ClassVar[str] = "lock"
    """What is held, as messages say it (``lock 'job'``); also what keeps its wake-up channel its own."""
    holder_type: ClassVar[str] = "Mutex"
    """What holds it, as a program makes it."""
    mode: str | None = None
    """The mode held, for a kind with modes: hooks get ``mode=`` and spans the mode only then."""
    takes_minimum_hold: ClassVar[bool] = True
    """Whether ``hold_at_least`` applies: a mutex's hold may outlast its release, nothing else's."""
    direct: ClassVar[bool] = True
    """Whether its acquire and release may go in plain calls, one statement each (`_io.acquisition`): its
    acquire's win a mutex's five columns, its release's reply a row count."""
    alerts_left_to_watcher: ClassVar[bool] = False
    """Whether its holders' alerts are its watcher's alone (many holders, each alerted on once per episode)."""
    follows_lease: ClassVar[bool] = True
    """Whether its row may follow its holder's lease (`_sql.leases`): only a row that every statement taking it
    over judges by the later of its own heartbeat and its lease's."""
    single_hold: bool = True
    """Whether a release frees the one hold there is (a mutex's, a one-permit semaphore's), so a waiter's next
    attempt stands for any number of releases before it; a semaphore's of more frees one permit of many."""
    queues: ClassVar[bool] = False
    """Whether its waiters wait in line (a fair Mutex's or Semaphore's, `_sql.fair`): a waiter's acquire queues
    it, a release may hand it the row, and a waiter that gives up leaves the line (its `stray_cleanup`)."""
    handed_whole: ClassVar[bool] = True
    """Whether a hand-off's notification (`_sql.handed`: the token and ``acquired_at``) says all its waiter needs
    to hold the row; if not (a permit's: which one is not said), the waiter takes the row with an attempt."""

    def __str__(self) -> str:
        return self.noun

    # -- the rows and the statements ------------------------------------------------

    def row_name(self, lock_name: str, instance_id: str) -> str:
        """The ``lock_name`` of the row an acquire writes, when known before it (else the lock's own)."""
        return lock_name

    def params(self, lock_name: str, row_name: str, timing: Timing) -> dict[str, object]:
        """What its statements take beyond every lock's parameters."""
        return {}

    def acquiring(self, params: dict[str, object], *, blocking: bool) -> None:
        """Set what only an acquire says in ``params`` (a blocking acquire, say)."""

    def migrated(self, statements: Statements) -> bool:
        """Whether the table has what this kind's statements need."""
        return True

    def acquire_statement(self, statements: Statements, name: str) -> Statement:
        """The statement that acquires it; `SchemaError` naming the migration when the table lacks it."""
        return statements.acquire

    def release_statement(self, statements: Statements) -> Statement:
        """The statement that releases a hold of it (and wakes whom its release wakes)."""
        return statements.release

    def stray_cleanup(self, statements: Statements) -> Statement | None:
        """The statement that removes a row an unanswered acquire may have left (None: the release's kind)."""
        return None

    def missing(self, name: str, statements: Statements, needs: str) -> SchemaError:
        """The `SchemaError` for a table that lacks this kind's ``needs``."""
        return SchemaError(
            phrase(
                self.noun + " {name!r} needs the " + needs + ", which the lock table {table} lacks: "
                "run {LockTable.migrate()} once; mutexes keep working meanwhile",
                name=name,
                table=statements.names.table_name,
            )
        )

    # -- what a reply says ------------------------------------------------------

    def read(self, row: Sequence[object] | None, instance_id: str) -> PermitReply:
        """Its acquire statement's reply."""
        return PermitReply(interpret_acquire(row, instance_id), None, None, 0)

    def refusal(self, reply: PermitReply, table: str, name: str) -> Exception | None:
        """An error that ends the acquire, the reply being what it is (None: none)."""
        return None

    def again_at_once(self, reply: PermitReply) -> bool:
        """Nothing won, yet an attempt sent again at once may win (a bounded number of times)."""
        return False

    def lost_race(self, sqlstate: str | None) -> bool:
        """A failure that says the lock is busy: the statement was refused whole, nothing was written."""
        return False

    def changed_meanwhile(self, sqlstate: str | None) -> bool:
        """A failure that says what the lock is changed while the attempt ran: the next one sees it (once)."""
        return False

    # -- its words ----------------------------------------------------------------

    def permit_of(self, row: str | None) -> int | None:
        """The number a row held carries, for a kind whose rows are numbered (else None)."""
        return None

    def still_busy(self, name: str, holder: str | None, held: int | None, waited: float) -> str:
        """Why a blocking acquire timed out; ``held``: how many rows were held at its last attempt."""
        return f"lock {name!r} still held by {holder or 'another instance'} after {waited:g}s"

    def not_held(self, name: str, instance_id: str) -> str:
        return f"lock {name!r} is not held by instance {instance_id!r}"

    def one_hold(self, name: str) -> str:
        """What one holder object holds of ``name`` at a time, as messages say it."""
        return f"{self.noun} {name!r}"

    def already_held(self, name: str, instance_id: str) -> str:
        return (
            f"this {self.holder_type} already holds or is acquiring {self.one_hold(name)} "
            f"(instance_id {instance_id!r}); use a separate {self.holder_type} per concurrent holder"
        )


MUTEX = LockKind()

"""Who a release wakes: one waiting process of the fleet, on a channel of its own, not every one.

A process's listener that LISTENs on a lock's channel also *registers* there:
on its own connection it takes the lowest free of `SLOTS` slots, a
session-level advisory lock ``(slot key, slot)`` held exclusively, and the
channel's ``(key, 0)`` shared (someone waits); and it LISTENs on the slot's
channel too (`slot_channel`). A release notifies one taken slot's channel
(`_taken_slot`): only that process hears it, and it wakes one of its waiters, so a
release costs one attempt and one delivery across the fleet, not one per
process (`after_release`). A release that finds nobody registered notifies
the lock's own channel with `WAKE_EACH_PROCESS`: every listener wakes one
waiter of its own, as when a listener could not register.

Finding the slot costs a release a probe of each of the `CHOSEN_AMONG` slots
on either side of its own, or of the first `CHOSEN_AMONG` (a try and an unlock
of a shared lock, each one entry of one lock-manager partition), more only if
none of those is taken, and the first
question, whether ``(key, 0)`` is free, spares even that when
nobody waits: no scan of ``pg_locks``, which takes every partition's lock.

Advisory locks need no privilege and no table, end with their session (a
process that exits or is killed leaves no registration behind), and are per
database. A listener registers only on a direct connection (``pg_backend_pid()``
is the process id the connection was given): behind a pooler a session-level
lock could outlive the client on a shared server session. A process that stops
waiting on a lock unregisters and stops LISTENing a while later (at once if a
release of another chose it meanwhile: `_io.listener_async`), so later
releases reach none of its connections; a release never chooses the releasing
process's own slot (`after_release`). In between it waits for the releases that may
have chosen its slot to commit (each holds ``(key, -1)`` shared while it
chooses, `unregister` takes it exclusively), so their notifications reach it
before it stops hearing them, and it passes them on.

A registered process woken when none of its waiters can use the wake-up (all
already woken, or the last one just left) passes it on (`pass_on`): the freed
hold may be free, and nobody else was told.
"""

from __future__ import annotations

import re

from psycopg import sql

from .statement import render

WAKE_ALL = "*"
"""The payload of a notification that wakes every waiter of the channel rather than one."""

WAKE_EACH_PROCESS = ""
"""The payload of a notification that wakes one waiter in each listening process (nobody registered)."""

UNREGISTERED = "unregistered"
"""The payload of the notification a process sends its own slot's channel as it gives the slot back
(`unregister`): never a wake-up."""

SLOTS = 128
"""The most processes registered on one lock's channel at once; the others LISTEN on the lock's own channel."""

CHOSEN_AMONG = 8
"""How far a release looks on either side of its own slot for one taken, and how many slots from the first it
chooses among when it has no slot of its own."""

_KEY = sql.SQL("(hashtext({channel}) & 2147483647)")
"""The channel's advisory-lock key (the first of two int4 keys): the same in every session of a server."""

_SLOT_KEY = sql.SQL("(hashtext({channel} || '#') & 2147483647)")
"""The key of the channel's slots, each the second int4 key under it."""


def slot_channel(channel: str, slot: int) -> str:
    """The channel a process registered in ``slot`` of ``channel`` LISTENs on: what wakes it alone."""
    return f"{channel}_{slot}"


def slot_or_lock_channel(channel: sql.Composable, slot: sql.Composable) -> sql.Composable:
    """`slot_channel` in SQL: the channel of ``slot`` (text; NULL: none) of the lock's ``channel``, else that
    channel itself."""
    return sql.SQL("coalesce({channel} || '_' || {slot}, {channel})").format(channel=channel, slot=slot)


def _taken_slot(channel: sql.Composable, skip: sql.Composable, near: sql.Composable) -> sql.Composable:
    """A slot another session holds, as text (NULL if none): one of the `CHOSEN_AMONG` slots on either side of
    ``near`` (the chooser's own slot; 0: none), at random; else one of the first `CHOSEN_AMONG`, at random;
    else the lowest beyond.

    A slot is free if a shared lock on it can be had; that lock is let go at
    once, so a release keeps no lock entry for the slots it looked at. The
    session's own slot (a listener passing a wake-up on) counts as free, and so does ``skip`` (0: none), the
    releasing process's own, when none of its waiters sleeps: its next attempt, if any, is sent already.
    Around the chooser's own slot: a process that holds the lock again and
    again keeps its slot (its registration lingers), so a choice among the
    lowest slots alone would never reach those above them. On both sides
    and at random: each process then wakes its neighbours alike, and is
    woken as often as they are (with up to `CHOSEN_AMONG` + 1 processes,
    every one by every other). Not the next one in turn: the one woken
    would be the same each time. Not lowest first either: a process back to
    wait takes the lowest free slot, and would be woken before those waiting longer.
    """
    key = _SLOT_KEY.format(channel=channel)
    taken = sql.SQL(
        "CASE WHEN pg_try_advisory_lock_shared({key}, slot) THEN NOT pg_advisory_unlock_shared({key}, slot) "
        "ELSE true END"
    ).format(key=key)
    return sql.SQL(
        """coalesce((SELECT slot FROM generate_series(greatest({near} - {among}, 1), least({near} + {among}, {slots}))
                      AS slot
               WHERE {near} > 0 AND slot <> {near} AND slot <> {skip} AND {taken} ORDER BY random() LIMIT 1),
              (SELECT slot FROM generate_series(1, {among}) AS slot WHERE slot <> {skip} AND {taken}
               ORDER BY random() LIMIT 1),
              (SELECT slot FROM generate_series({beyond}, {slots}) AS slot WHERE slot <> {skip} AND {taken}
               LIMIT 1))::text"""
    ).format(
        among=sql.Literal(CHOSEN_AMONG),
        beyond=sql.Literal(CHOSEN_AMONG + 1),
        slots=sql.Literal(SLOTS),
        taken=taken,
        skip=skip,
        near=near,
    )


def _wake_one(channel: sql.Composable, skip: sql.Composable, near: sql.Composable) -> sql.Composable:
    """The channel whose notification wakes one waiter of the fleet: a registered process's slot's, else the lock's;
    chosen around slot ``near`` (0: none), never ``skip`` (0: none) (`_taken_slot`).

    Asks first whether anyone registered: the exclusive try succeeds only if
    nobody holds ``(key, 0)``, and then holds it to the end of the statement's
    transaction, so a listener registering meanwhile waits for that end and
    its waiter's next attempt sees this release.
    """
    return sql.SQL(
        """CASE WHEN {nobody} THEN {channel}
            WHEN {choosing} IS NULL THEN {channel}
            ELSE {taken} END"""
    ).format(
        nobody=_nobody_registered(channel),
        channel=channel,
        choosing=_choosing(channel),
        taken=slot_or_lock_channel(channel, _taken_slot(channel, skip, near)),
    )


def _nobody_registered(channel: sql.Composable) -> sql.Composable:
    """True if nobody holds ``(key, 0)``: no process registered on ``channel``; held to the transaction's end then."""
    return sql.SQL("pg_try_advisory_xact_lock({key}, 0)").format(key=_KEY.format(channel=channel))


def nobody_waits(row: str) -> sql.Composable:
    """True when `after_release` of ``row`` would notify the lock's own channel with `WAKE_EACH_PROCESS` because
    nobody registered there (`_wake_one`'s first question, with the same lock kept); False for a read/write lock's
    row, and when someone registered. Lets a caller skip the choice of a slot (`_sql.functions`)."""
    return sql.SQL("NOT {rw} AND {nobody}").format(
        rw=_RW_ROW.format(row=sql.Identifier(row)),
        nobody=_nobody_registered(sql.SQL("{}::text").format(sql.Placeholder("channel"))),
    )


_RW_ROW = sql.SQL("{row}.lock_name ~ (chr(31) || '[rw]')")
"""A read/write lock's row (`_state.rows`), which wakes one waiter of each process (`after_release`)."""


def _choosing(channel: sql.Composable) -> sql.Composable:
    """Held while a slot is chosen, to the end of the transaction that notifies it (never NULL).

    Shared: releases never wait for each other. They wait for a process
    giving its slot back (`unregister`) only while that one waits for the
    choices already made to commit, a moment. Taken, not tried: a try fails
    while an unregister waits for the lock, and a choice made without it
    could pick the slot of a process that stops listening before the
    notification commits, a wake-up lost until the waiters' poll.
    """
    return sql.SQL("pg_advisory_xact_lock_shared({key}, -1)").format(key=_KEY.format(channel=channel))


def after_release(row: str, *, answered: bool = False) -> sql.Composable:
    """The notification of a release of ``row`` (a ``RETURNING`` of the deleted row), whose statement's
    parameter ``channel`` names the lock's channel, and ``own_slot`` the releasing process's slot there
    (NULL if none): a release does not wake its own process, which keeps its registration a while after
    its waiter got the lock (`_io.listener_async`), and whose next acquire, if any, is sent already. Its
    negative (``-slot``) when a waiter of that process sleeps: the release may wake it then, and still
    chooses among the slot's neighbours, or the processes registered above the first `CHOSEN_AMONG` slots
    would never be chosen by a process whose threads take turns on the lock.

    A mutex's or a permit's release frees one hold: it wakes one waiter of
    the fleet (`_wake_one`). A read/write lock's (its row's name says so,
    `_state.rows`) wakes one waiter of each process: its waiters wait in two
    modes, and one chosen without regard to mode could be a reader the
    waiting writer's gate keeps out while the writer is not told.

    ``answered``: the expression is the channel notified (text), not void: a
    slot's channel (`slot_channel`) says another process was chosen and woken,
    which the releaser's next acquire lets go first (`_state.flows`). The
    choice is made once, in a subquery the planner keeps apart (``OFFSET 0``):
    the channel answered is the one notified.
    """
    channel = sql.SQL("{}::text").format(sql.Placeholder("channel"))
    own = sql.SQL("coalesce({}::int, 0)").format(sql.Placeholder("own_slot"))
    skip, near = sql.SQL("greatest({}, 0)").format(own), sql.SQL("abs({})").format(own)
    choice = sql.SQL("CASE WHEN {rw} THEN {channel} ELSE {one} END").format(
        rw=_RW_ROW.format(row=sql.Identifier(row)), channel=channel, one=_wake_one(channel, skip, near)
    )
    each = sql.Literal(WAKE_EACH_PROCESS)
    if not answered:
        return sql.SQL("pg_notify({choice}, {each})").format(choice=choice, each=each)
    return sql.SQL(
        "(SELECT chosen.channel FROM (SELECT {choice} AS channel OFFSET 0) AS chosen, "
        "pg_notify(chosen.channel, {each}) AS notified)"
    ).format(choice=choice, each=each)


def register(channel: str, backend_pid: int) -> str:
    """LISTEN on ``channel`` and, if the connection is direct, take a slot there and LISTEN on its channel: one
    round trip, whose last row is the slot taken (NULL: not registered, all taken or behind a pooler).
    ``backend_pid``: the process id the connection was given.

    One transaction: a release that chooses the slot before it commits is not
    heard, and is made up for by the waiters' attempt once they listen
    (`_state.flows`).
    """
    if not _PLAIN.fullmatch(channel):
        raise ValueError(f"not a lock's channel: {channel!r}")  # it is written into the block's text
    return render(
        sql.SQL(
            """BEGIN; DO $register$DECLARE taken int; BEGIN
  EXECUTE format('LISTEN %I', {channel});
  IF pg_backend_pid() = {pid} THEN
    SELECT slot INTO taken FROM generate_series(1, {slots}) AS slot
     WHERE pg_try_advisory_lock({slot_key}, slot) LIMIT 1;
    IF taken IS NOT NULL THEN
      EXECUTE format('LISTEN %I', {channel} || '_' || taken);
      PERFORM pg_advisory_lock_shared({key}, 0);
    END IF;
  END IF;
  PERFORM set_config('postgres_mutex.slot', coalesce(taken::text, ''), true);
END$register$; SELECT nullif(current_setting('postgres_mutex.slot'), '')::int; COMMIT"""
        ).format(
            channel=sql.Literal(channel),
            key=_KEY.format(channel=sql.Literal(channel)),
            slot_key=_SLOT_KEY.format(channel=sql.Literal(channel)),
            slots=sql.Literal(SLOTS),
            pid=sql.Literal(backend_pid),
        )
    )


_PLAIN = re.compile(r"[a-z0-9_]{1,60}")
"""What a lock's channel is made of (`Names.channel`): safe to write into a DO block's text."""


def unregister(channel: str, slot: int) -> str:
    """Give the slot on ``channel`` back, once the releases that may have chosen it have committed, and hear
    their notifications before the statement's reply, so before `stop_listening`.

    A release's notification is queued before its locks are let go, but
    the server signals the listener only after: left to that signal, it
    could come after the UNLISTEN, and be dropped. So the statement also
    notifies the slot's channel itself (`UNREGISTERED`): a session reads the
    queue, up to its own notification, before it answers, and the
    releases' come before it there.
    """
    return render(
        sql.SQL(
            "SELECT pg_advisory_unlock({slot_key}, {slot}), pg_advisory_unlock_shared({key}, 0), "
            "pg_advisory_xact_lock({key}, -1), pg_notify({slot_channel}, {unregistered})"
        ).format(
            slot_key=_SLOT_KEY.format(channel=sql.Literal(channel)),
            slot=sql.Literal(slot),
            key=_KEY.format(channel=sql.Literal(channel)),
            slot_channel=sql.Literal(slot_channel(channel, slot)),
            unregistered=sql.Literal(UNREGISTERED),
        )
    )


def stop_listening(channel: str, slot: int | None) -> str:
    """Stop hearing ``channel`` (and the slot's channel, given back already): no release wakes this process."""
    unlisten = sql.SQL("UNLISTEN {}").format(sql.Identifier(channel))
    if slot is None:
        return render(unlisten)
    return render(sql.SQL("{}; UNLISTEN {}").format(unlisten, sql.Identifier(slot_channel(channel, slot))))


def pass_on(channel: str, slot: int | None) -> str:
    """Hand a wake-up this process cannot use to another registered process (else to every process): one
    near ``slot``, this process's own (None: not registered), as a release chooses (`_taken_slot`)."""
    literal = sql.SQL("{}::text").format(sql.Literal(channel))
    return render(
        sql.SQL("SELECT pg_notify(CASE WHEN {choosing} IS NULL THEN {channel} ELSE {taken} END, {each})").format(
            channel=literal,
            choosing=_choosing(literal),
            taken=slot_or_lock_channel(literal, _taken_slot(literal, sql.SQL("0"), sql.Literal(slot or 0))),
            each=sql.Literal(WAKE_EACH_PROCESS),
        )
    )

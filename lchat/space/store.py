"""The space's SQLite store: messages, scheduled messages and the sidecar's charter due time.

One connection, owned by one worker thread: every call is queued on a 1-thread pool, so the
reactor never blocks on disk and SQLite never sees two writers from this process.

Ids are never reused, not even after a crash that loses the last writes. AUTOINCREMENT alone does
not promise that here: a database restored from a replica that lags by a second has lost those
messages *and* the counter that issued their ids, while clients may already hold the ids and page
with ``after=<id>``. So every new id is at least the wall clock in microseconds
(:func:`next_id`): ids issued after a restore exceed every id issued before the crash, as long as
the clock of the box that restores is not behind the one that crashed by more than the time the
restore took (seconds; NTP keeps boxes within milliseconds). Ids stay increasing within a database
and fit a JavaScript number (2**53 microseconds is the year 2255); they are not dense.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from attrs import define, frozen
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

from lchat.sqlite import migrate, open_wal, write_transaction

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Additive migrations: entry N takes the schema from user_version N to N + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, room TEXT NOT NULL,"
        " body TEXT NOT NULL, sent_at INTEGER NOT NULL)",
        "CREATE INDEX messages_room_id ON messages (room, id)",
        # message_id stays NULL until the scheduler has delivered the row.
        "CREATE TABLE scheduled (id INTEGER PRIMARY KEY AUTOINCREMENT, room TEXT NOT NULL,"
        " body TEXT NOT NULL, deliver_at INTEGER NOT NULL, message_id INTEGER)",
        "CREATE INDEX scheduled_pending ON scheduled (deliver_at) WHERE message_id IS NULL",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    ),
    (
        # The wake-free stats contract (docs/hibernation.md, "Wake-free stats"): the router reads
        # this one row off a sleeping space's file, read-only, without waking it. This space has
        # no accounts and no setup step: it counts as set up once anything was posted or
        # scheduled in it, and reports no members. EXISTS, not COUNT: cheap on any size.
        "CREATE VIEW lchat_stats AS SELECT"
        " (EXISTS (SELECT 1 FROM messages) OR EXISTS (SELECT 1 FROM scheduled)) AS setup_complete,"
        " 0 AS members,"
        " (EXISTS (SELECT 1 FROM messages) OR EXISTS (SELECT 1 FROM scheduled)) AS has_content",
    ),
    (
        # The setup invite (docs/hibernation.md, "the contract for a space"): at most one row,
        # written by the one POST /api/setup that presented the invite; a claimed space is set
        # up whatever else it holds.
        "CREATE TABLE setup (id INTEGER PRIMARY KEY CHECK (id = 1), claimed_at INTEGER NOT NULL)",
        "DROP VIEW lchat_stats",
        "CREATE VIEW lchat_stats AS SELECT"
        " (EXISTS (SELECT 1 FROM setup) OR EXISTS (SELECT 1 FROM messages)"
        " OR EXISTS (SELECT 1 FROM scheduled)) AS setup_complete,"
        " 0 AS members,"
        " (EXISTS (SELECT 1 FROM messages) OR EXISTS (SELECT 1 FROM scheduled)) AS has_content",
    ),
)
BUSY_TIMEOUT_MS = 5000
DELIVER_BATCH = 500


class StoreClosed(Exception):
    """The store was used after close()."""


@frozen
class Message:
    id: int
    room: str
    body: str
    sent_at: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "room": self.room, "body": self.body, "sent_at": self.sent_at}


@define
class Store:
    """Async facade over the connection; every method returns a Deferred fired on the reactor."""

    _reactor: IReactorFromThreads
    _pool: ThreadPool
    _conn: sqlite3.Connection | None
    _clock: IReactorTime  # the floor of new ids (see the module docstring)

    @classmethod
    async def open(
        cls, reactor: IReactorFromThreads, path: str, clock: IReactorTime | None = None
    ) -> Store:
        """``clock`` defaults to ``reactor``."""
        pool = ThreadPool(minthreads=1, maxthreads=1, name="space-db")
        pool.start()
        try:
            conn = await deferToThreadPool(reactor, pool, _connect, path)
        except BaseException:
            pool.stop()
            raise
        return cls(reactor, pool, conn, clock if clock is not None else reactor)  # type: ignore[arg-type]

    def _id_floor(self) -> int:
        return int(self._clock.seconds() * 1_000_000)

    def _run(
        self,
        fn: Callable[Concatenate[sqlite3.Connection, _P], _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> Deferred[_T]:
        conn = self._conn
        if conn is None:
            return fail(StoreClosed("store is closed"))
        return deferToThreadPool(self._reactor, self._pool, fn, conn, *args, **kwargs)

    def post(self, room: str, body: str, now: int) -> Deferred[Message]:
        return self._run(_post, room, body, now, self._id_floor())

    def schedule(self, room: str, body: str, deliver_at: int) -> Deferred[int]:
        return self._run(_schedule, room, body, deliver_at, self._id_floor())

    def messages(self, room: str, after: int, limit: int) -> Deferred[list[Message]]:
        return self._run(_messages, room, after, limit)

    def deliver_due(self, now: int) -> Deferred[list[Message]]:
        return self._run(_deliver_due, now, self._id_floor())

    def next_due(self, now: int) -> Deferred[int]:
        return self._run(_next_due, now)

    def set_charter_due(self, due: int) -> Deferred[None]:
        return self._run(_set_meta, "charter_due", due)

    def claim_setup(self, now: int) -> Deferred[bool]:
        """Record the setup as claimed at ``now``: True for the one call that claims it, False
        for every later one (the row exists; it is never rewritten)."""
        return self._run(_claim_setup, now)

    async def close(self) -> None:
        """Checkpoint what it can of the WAL, close the connection, stop the thread."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await deferToThreadPool(self._reactor, self._pool, _close, conn)
        finally:
            self._pool.stop()

    def abandon(self) -> None:
        """Stop the thread without closing the connection (SQLite recovers from the WAL)."""
        if self._conn is not None:
            self._conn = None
            self._pool.stop()


def _connect(path: str) -> sqlite3.Connection:
    # The pool has exactly one thread, but it may be replaced; access is serialised either way.
    conn = open_wal(path, BUSY_TIMEOUT_MS)
    try:
        migrate(
            conn,
            MIGRATIONS,
            lambda found: sqlite3.DatabaseError(
                f"database schema version {found} is newer than this server knows"
            ),
        )
    except BaseException:
        conn.close()
        raise
    return conn


def _close(conn: sqlite3.Connection) -> None:
    try:
        # PASSIVE, not TRUNCATE: under the router's replicator (which holds a read transaction
        # so no checkpoint can reset the WAL past what it shipped) a TRUNCATE would wait out the
        # whole busy timeout. Alone, the last close checkpoints and removes the WAL anyway.
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    finally:
        conn.close()


def next_id(conn: sqlite3.Connection, table: str, floor: int) -> int:
    """The id for a new row of ``table`` (an AUTOINCREMENT table): above every id it ever issued
    that this database remembers, and at least ``floor`` (the clock in microseconds), which covers
    the ids it issued and forgot (a restore that lost the last writes). Call inside the write
    transaction that inserts the row."""
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)).fetchone()
    return max((row[0] if row else 0) + 1, floor)


def _insert_message(
    conn: sqlite3.Connection, room: str, body: str, now: int, floor: int
) -> Message:
    message_id = next_id(conn, "messages", floor)
    conn.execute(
        "INSERT INTO messages (id, room, body, sent_at) VALUES (?, ?, ?, ?)",
        (message_id, room, body, now),
    )
    return Message(message_id, room, body, now)


def _post(conn: sqlite3.Connection, room: str, body: str, now: int, floor: int) -> Message:
    with write_transaction(conn):
        return _insert_message(conn, room, body, now, floor)


def _schedule(conn: sqlite3.Connection, room: str, body: str, deliver_at: int, floor: int) -> int:
    with write_transaction(conn):
        scheduled_id = next_id(conn, "scheduled", floor)
        conn.execute(
            "INSERT INTO scheduled (id, room, body, deliver_at) VALUES (?, ?, ?, ?)",
            (scheduled_id, room, body, deliver_at),
        )
    return scheduled_id


def _messages(conn: sqlite3.Connection, room: str, after: int, limit: int) -> list[Message]:
    rows = conn.execute(
        "SELECT id, room, body, sent_at FROM messages WHERE room = ? AND id > ?"
        " ORDER BY id LIMIT ?",
        (room, after, limit),
    )
    return [Message(*row) for row in rows]


_PENDING = (
    "SELECT id, room, body FROM scheduled WHERE message_id IS NULL AND deliver_at <= ?"
    " ORDER BY deliver_at, id LIMIT ?"
)


def _deliver_due(conn: sqlite3.Connection, now: int, floor: int) -> list[Message]:
    # Cheap read first: this runs every second and usually finds nothing to write.
    if conn.execute(_PENDING, (now, 1)).fetchone() is None:
        return []
    delivered = []
    with write_transaction(conn):
        for scheduled_id, room, body in conn.execute(_PENDING, (now, DELIVER_BATCH)).fetchall():
            message = _insert_message(conn, room, body, now, floor)
            conn.execute(
                "UPDATE scheduled SET message_id = ? WHERE id = ?", (message.id, scheduled_id)
            )
            delivered.append(message)
    return delivered


def _next_due(conn: sqlite3.Connection, now: int) -> int:
    (scheduled,) = conn.execute(
        "SELECT MIN(deliver_at) FROM scheduled WHERE message_id IS NULL"
    ).fetchone()
    row = conn.execute("SELECT value FROM meta WHERE key = 'charter_due'").fetchone()
    candidates = [] if scheduled is None else [scheduled]
    # A charter time in the past has either run or been superseded; the sidecar reports anew.
    if row is not None and row[0] >= now:
        candidates.append(row[0])
    return min(candidates, default=0)


def _set_meta(conn: sqlite3.Connection, key: str, value: int) -> None:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )


def _claim_setup(conn: sqlite3.Connection, now: int) -> bool:
    with write_transaction(conn):
        cursor = conn.execute(
            "INSERT INTO setup (id, claimed_at) VALUES (1, ?) ON CONFLICT (id) DO NOTHING", (now,)
        )
        return cursor.rowcount == 1

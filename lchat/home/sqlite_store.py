"""The home store on SQLite: one file (``LCHAT_HOME_DB``), the zero-config default, forever.

:class:`SQLiteVaultStore` implements :class:`lchat.home.store.VaultStore` (read its contract).

- **Threads.** Every call runs in the ``run_in_thread`` it is given (the reactor's pool, in
  production), never on the reactor. Each worker thread checks a connection out of a small pool
  (``_Connections``), so reads run in parallel under WAL; writes take SQLite's write lock up front
  (``BEGIN IMMEDIATE``), so a compare-and-swap is one transaction and ``busy_timeout`` covers it.
- **Versions** are decimal strings from one store-wide counter: every write (a blob or a user
  document, any user) takes the next number, and that number is also at least the clock in
  microseconds. So a version is never issued twice, not across users, not after a user's rows
  are deleted, and not after the file is restored from a replica that lost the last writes (as
  long as the restoring box's clock is not behind the one that crashed by more than the restore
  took: NTP keeps boxes within milliseconds). That matters: a client holding
  a version must never see its compare-and-swap succeed against other content that happens to
  carry the same number. ``"0"`` is "nothing yet". A version is *ours* if it is a canonical
  decimal between the first and the last version issued; anything else (``"abc"``, an S3 ETag,
  ``"07"``, ``"12"``, a number not issued yet) is :class:`~lchat.home.store.BadVersion`.
- **Keep-last-5** is the table itself: each blob write deletes the user's rows older than the 5
  newest in the same transaction, so the file holds at most 5 versions per user.
- **Revocation markers** (the feed, :meth:`~SQLiteVaultStore.mark_revoked` and
  :meth:`~SQLiteVaultStore.revoked_since`) are rows numbered by an ``AUTOINCREMENT`` sequence
  (never reused, committed in order: SQLite has one writer), so the cursor is the last number
  seen and a poll is one ``SELECT`` of the rows above it. Rows past their 25 hours are deleted by
  the poll that finds them (the only time a poll takes the write lock).
- **Single-use records** (:meth:`~SQLiteVaultStore.use_once`: used WebAuthn challenges and
  ceremony proofs) are rows of ``used``; the insert that finds the name there already says "used";
  each insert first deletes the rows past their expiry (an index range, usually empty).
- User documents are decoded and encoded in the worker thread, never on the reactor.
- Failures of SQLite itself (locked past ``busy_timeout``, I/O errors, a corrupt or foreign file)
  raise :class:`~lchat.home.store.StoreError`, logged once with the file's path.

Migrations are additive and keyed on ``PRAGMA user_version``, as for the registry.
"""

from __future__ import annotations

import random
import re
import sqlite3
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from attrs import define, field
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.backoff import Uniform
from lchat.home.store import (
    CAS_CONFLICTS,
    KEEP_VERSIONS,
    MARKER_LIFETIME,
    NO_VERSION,
    BadVersion,
    Blob,
    BlobVersion,
    Conflict,
    PointerKind,
    PointerTaken,
    Revocation,
    Revocations,
    StoreError,
    UserDoc,
    UserUpdate,
    check_digest,
    check_pointer,
    check_uid,
    decode_user,
    encode_user,
    measured,
    update_user_cas,
)
from lchat.sqlite import migrate, open_wal, write_transaction
from lchat.threads import RunInThread

log = Logger()

BACKEND = "sqlite"
BUSY_TIMEOUT_MS = 5000
_CANONICAL_VERSION = re.compile(r"0|[1-9][0-9]{0,17}")  # fits in SQLite's INTEGER

_T = TypeVar("_T")

# Each step moves the schema from version N to N+1. Never edit a step that has shipped; append.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        # The kept versions of each user's vault blob; the current one is the highest.
        """CREATE TABLE blobs (
            uid         TEXT NOT NULL,
            version     INTEGER NOT NULL CHECK (version > 0),
            data        BLOB NOT NULL,
            modified_ms INTEGER NOT NULL,
            PRIMARY KEY (uid, version)
        ) WITHOUT ROWID""",
        """CREATE TABLE users (
            uid     TEXT PRIMARY KEY,
            version INTEGER NOT NULL CHECK (version > 0),
            doc     TEXT NOT NULL
        ) WITHOUT ROWID""",
        """CREATE TABLE pointers (
            kind TEXT NOT NULL CHECK (kind IN ('creds', 'tokens')),
            name TEXT NOT NULL,
            uid  TEXT NOT NULL,
            PRIMARY KEY (kind, name)
        ) WITHOUT ROWID""",
    ),
    (
        # The store-wide version counter (see the module docstring): the first and the last
        # version issued (0 and 0 before any), so "never issued" can be told apart. Schema 1
        # counted per user from 1: the counter starts above every version it issued.
        """CREATE TABLE version_counter (
            id    INTEGER PRIMARY KEY CHECK (id = 1),
            first INTEGER NOT NULL,
            last  INTEGER NOT NULL
        )""",
        """INSERT INTO version_counter (id, first, last)
           SELECT 1, min(issued, 1), issued FROM (SELECT max(
               (SELECT coalesce(max(version), 0) FROM blobs),
               (SELECT coalesce(max(version), 0) FROM users)
           ) AS issued)""",
    ),
    (
        # The revocation feed: one row per revoked link token, numbered in commit order.
        """CREATE TABLE revocations (
            seq       INTEGER PRIMARY KEY AUTOINCREMENT,
            digest    TEXT NOT NULL UNIQUE,
            uid       TEXT NOT NULL,
            device    TEXT NOT NULL,
            marked_ms INTEGER NOT NULL
        )""",
    ),
    (
        # Single-use records (challenges, proofs): a name is accepted once; rows past their
        # expiry are deleted by later writes (the index keeps that cheap).
        """CREATE TABLE used (
            name       TEXT PRIMARY KEY,
            expires_ms INTEGER NOT NULL
        ) WITHOUT ROWID""",
        "CREATE INDEX used_expiry ON used (expires_ms)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


class _Closed(Exception):
    pass


class _Connections:
    """SQLite connections for worker threads: one checked out per call, returned after it.

    A connection is used by one thread at a time (``check_same_thread=False`` only lets the next
    call run on another pool thread). There are never more connections than calls in flight at
    once, which the thread pool bounds. Thread-safe; ``close`` closes idle connections at once and
    busy ones as they come back.
    """

    def __init__(self, path: str, busy_timeout_ms: int) -> None:
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._lock = threading.Lock()
        self._idle: list[sqlite3.Connection] = []
        self._closed = False

    def open_first(self) -> None:
        """Connect, enable WAL and migrate (once, at open); keep the connection for reuse."""
        conn = self._connect()
        try:
            _migrate(conn)
        except BaseException:
            conn.close()
            raise
        self._checkin(conn)

    def _connect(self) -> sqlite3.Connection:
        return open_wal(self.path, self._busy_timeout_ms)

    def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """In a worker thread: ``fn(conn, *args)`` on a checked-out connection."""
        with self._lock:
            if self._closed:
                raise _Closed()
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            return fn(conn, *args)
        finally:
            self._checkin(conn)

    def _checkin(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:  # a failure mid-transaction that could not roll back
            conn.close()
            return
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for i, conn in enumerate(idle):
            try:
                if i == len(idle) - 1:
                    # PASSIVE, not TRUNCATE: a replicator's read transaction (Litestream) would
                    # make TRUNCATE wait out the busy timeout. The last close cleans up anyway.
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:
                pass
            finally:
                conn.close()


@define
class SQLiteVaultStore:
    """:class:`lchat.home.store.VaultStore` on one SQLite file. Build it with :meth:`open`."""

    _connections: _Connections
    _run_in_thread: RunInThread
    # Wall clock: blob versions' times and the versions' floor; update_user's backoff; latency.
    _clock: IReactorTime
    _rng: Uniform = field(factory=random.SystemRandom)

    @classmethod
    async def open(
        cls,
        path: str,
        run_in_thread: RunInThread,
        clock: IReactorTime,
        *,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
        rng: Uniform | None = None,
    ) -> SQLiteVaultStore:
        """Open (creating and migrating) the database at ``path``. :class:`StoreError` if it
        cannot be used: a directory that does not exist, a file that is not a database, a
        schema newer than this code."""
        connections = _Connections(path, busy_timeout_ms)
        try:
            await run_in_thread(connections.open_first)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the home database {path}: {e}") from e
        return cls(connections, run_in_thread, clock, rng or random.SystemRandom())

    def describe(self) -> str:
        return f"sqlite:{self._connections.path}"

    async def _run(self, operation: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(conn, *args)`` in a worker thread, measured as ``operation``."""
        with measured(BACKEND, operation, self._clock):
            try:
                result: _T = await self._run_in_thread(self._connections.run, fn, *args)
            except _Closed:
                raise StoreError(f"{self.describe()}: the store is closed") from None
            except sqlite3.Error as e:
                log.error(
                    "home store: SQLite {operation} on {path} failed: {error} (a locked database "
                    "means another process holds its write lock; 'disk I/O error', 'malformed' or "
                    "'not a database' need the file checked)",
                    operation=operation,
                    path=self._connections.path,
                    error=f"{type(e).__name__}: {e}",
                )
                raise StoreError(f"{self.describe()}: {operation} failed: {e}") from e
        return result

    async def _cas(self, kind: str, fn: Callable[..., int], uid: str, *args: Any) -> str:
        """A compare-and-swap write of ``kind`` (blob, user): the new version."""
        try:
            version = await self._run(f"put_{kind}", fn, uid, *args, self._clock.seconds())
        except Conflict:
            CAS_CONFLICTS.labels(BACKEND, kind).inc()
            raise
        return str(version)

    async def check(self) -> None:
        await self._run("check", _check)

    async def get_blob(self, uid: str) -> Blob | None:
        return await self._run("get_blob", _get_blob, check_uid(uid))

    async def put_blob(self, uid: str, data: bytes, expected_version: str) -> str:
        check_uid(uid)
        if not isinstance(data, bytes):
            raise ValueError("a vault blob is bytes")
        return await self._cas("blob", _put_blob, uid, data, expected_version)

    async def list_blob_versions(self, uid: str) -> list[BlobVersion]:
        return await self._run("list_blob_versions", _list_blob_versions, check_uid(uid))

    async def get_blob_version(self, uid: str, version: str) -> bytes | None:
        check_uid(uid)
        if not _CANONICAL_VERSION.fullmatch(version) or version == NO_VERSION:
            return None
        return await self._run("get_blob_version", _get_blob_version, uid, int(version))

    async def get_user(self, uid: str) -> UserDoc | None:
        # Decoded in the worker thread: the reactor never parses a document.
        where = f"{self.describe()} user {check_uid(uid)}"
        return await self._run("get_user", _get_user, uid, where)

    async def put_user(self, uid: str, doc: Mapping[str, Any], expected_version: str) -> str:
        check_uid(uid)
        if not isinstance(doc, Mapping):
            raise ValueError(f"a user document is a JSON object, not {type(doc).__name__}")
        # Encoded in the worker thread (ValueError/DocumentTooLarge come back from it).
        return await self._cas("user", _put_user, uid, doc, expected_version)

    async def update_user(self, uid: str, fn: UserUpdate) -> UserDoc | None:
        return await update_user_cas(self, BACKEND, uid, fn, clock=self._clock, rng=self._rng)

    async def put_pointer(self, kind: PointerKind, name: str, uid: str) -> None:
        check_pointer(kind, name)
        owner: str = await self._run("put_pointer", _put_pointer, kind, name, check_uid(uid))
        if owner != uid:
            raise PointerTaken(f"the {kind} pointer {name!r} already names another user")

    async def resolve_pointer(self, kind: PointerKind, name: str) -> str | None:
        check_pointer(kind, name)
        return await self._run("resolve_pointer", _resolve_pointer, kind, name)

    async def use_once(self, name: str, expires_at: float) -> bool:
        now = self._clock.seconds()
        name = check_digest(name, "single-use record name")
        return await self._run("use_once", _use_once, name, expires_at, now)

    async def mark_revoked(self, digest: str, uid: str, device: str) -> None:
        check_digest(digest)
        check_uid(uid)
        now = self._clock.seconds()
        await self._run("mark_revoked", _mark_revoked, digest, uid, device, now)

    async def revoked_since(self, cursor: str) -> Revocations:
        if cursor and not _CANONICAL_VERSION.fullmatch(cursor):
            raise ValueError(f"not a revocation cursor of this store: {cursor!r}")
        now = self._clock.seconds()
        return await self._run("revoked_since", _revoked_since, int(cursor or 0), now)

    async def close(self) -> None:
        await self._run_in_thread(self._connections.close)


# -- in the worker thread ------------------------------------------------------------------------


def _migrate(conn: sqlite3.Connection) -> None:
    migrate(
        conn,
        MIGRATIONS,
        lambda found: sqlite3.DatabaseError(
            f"database schema version {found} is newer than this server knows "
            f"({SCHEMA_VERSION}): run the newer lchat-home, or restore a backup"
        ),
    )


def _check(conn: sqlite3.Connection) -> None:
    conn.execute("SELECT 1 FROM blobs LIMIT 1").fetchall()
    conn.execute("SELECT 1 FROM users LIMIT 1").fetchall()
    conn.execute("SELECT 1 FROM pointers LIMIT 1").fetchall()
    conn.execute("SELECT 1 FROM revocations LIMIT 1").fetchall()
    conn.execute("SELECT 1 FROM used LIMIT 1").fetchall()


def _issued(conn: sqlite3.Connection) -> tuple[int, int]:
    """The first and the last version this store issued ((0, 0) before any)."""
    first, last = conn.execute("SELECT first, last FROM version_counter WHERE id = 1").fetchone()
    return int(first), int(last)


def _check_expected(conn: sqlite3.Connection, expected: str, current: int, what: str) -> None:
    """Pass if ``expected`` is the current version (``current``, 0 for none); else Conflict if
    this store ever issued it, BadVersion if not."""
    if not isinstance(expected, str) or not _CANONICAL_VERSION.fullmatch(expected):
        raise BadVersion(f"{expected!r} is not a version this store issues")
    number = int(expected)
    if number == current:
        return
    first, last = _issued(conn)
    if number != 0 and not first <= number <= last:  # "0" is everyone's
        raise BadVersion(f"version {expected!r} was never issued by this store")
    raise Conflict(str(current), what)


def _next_version(conn: sqlite3.Connection, now: float) -> int:
    """Take the next version: above every one issued, and at least the clock in microseconds
    (which covers versions issued and forgotten by a restore). In the write transaction."""
    first, last = _issued(conn)
    version = max(last + 1, int(now * 1_000_000))
    conn.execute(
        "UPDATE version_counter SET first = ?, last = ? WHERE id = 1", (first or version, version)
    )
    return version


def _get_blob(conn: sqlite3.Connection, uid: str) -> Blob | None:
    row = conn.execute(
        "SELECT data, version FROM blobs WHERE uid = ? ORDER BY version DESC LIMIT 1", (uid,)
    ).fetchone()
    return None if row is None else Blob(bytes(row[0]), str(row[1]))


def _put_blob(
    conn: sqlite3.Connection, uid: str, data: bytes, expected_version: str, now: float
) -> int:
    with write_transaction(conn):
        (current,) = conn.execute(
            "SELECT coalesce(max(version), 0) FROM blobs WHERE uid = ?", (uid,)
        ).fetchone()
        _check_expected(conn, expected_version, current, "vault blob")
        new = _next_version(conn, now)
        conn.execute(
            "INSERT INTO blobs (uid, version, data, modified_ms) VALUES (?, ?, ?, ?)",
            (uid, new, data, int(now * 1000)),
        )
        conn.execute(
            "DELETE FROM blobs WHERE uid = ? AND version NOT IN"
            " (SELECT version FROM blobs WHERE uid = ? ORDER BY version DESC LIMIT ?)",
            (uid, uid, KEEP_VERSIONS),
        )
    return new


def _list_blob_versions(conn: sqlite3.Connection, uid: str) -> list[BlobVersion]:
    return [
        BlobVersion(str(v), _utc(ms), int(size))
        for v, ms, size in conn.execute(
            "SELECT version, modified_ms, length(data) FROM blobs WHERE uid = ?"
            " ORDER BY version DESC LIMIT ?",
            (uid, KEEP_VERSIONS),
        )
    ]


def _get_blob_version(conn: sqlite3.Connection, uid: str, version: int) -> bytes | None:
    # Only the KEEP_VERSIONS newest are readable, whatever the table holds.
    row = conn.execute(
        "SELECT data FROM (SELECT version, data FROM blobs WHERE uid = ?"
        " ORDER BY version DESC LIMIT ?) WHERE version = ?",
        (uid, KEEP_VERSIONS, version),
    ).fetchone()
    return None if row is None else bytes(row[0])


def _get_user(conn: sqlite3.Connection, uid: str, where: str) -> UserDoc | None:
    row = conn.execute("SELECT doc, version FROM users WHERE uid = ?", (uid,)).fetchone()
    if row is None:
        return None
    return UserDoc(decode_user(str(row[0]).encode(), where), str(row[1]))


def _put_user(
    conn: sqlite3.Connection,
    uid: str,
    doc: Mapping[str, Any],
    expected_version: str,
    now: float,
) -> int:
    text = encode_user(doc).decode()
    with write_transaction(conn):
        row = conn.execute("SELECT version FROM users WHERE uid = ?", (uid,)).fetchone()
        current = 0 if row is None else int(row[0])
        _check_expected(conn, expected_version, current, "user document")
        new = _next_version(conn, now)
        conn.execute(
            "INSERT INTO users (uid, version, doc) VALUES (?, ?, ?)"
            " ON CONFLICT (uid) DO UPDATE SET version = excluded.version, doc = excluded.doc",
            (uid, new, text),
        )
    return new


def _put_pointer(conn: sqlite3.Connection, kind: str, name: str, uid: str) -> str:
    """Create the pointer if it is absent; return the uid it names afterwards."""
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO pointers (kind, name, uid) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            (kind, name, uid),
        )
        (owner,) = conn.execute(
            "SELECT uid FROM pointers WHERE kind = ? AND name = ?", (kind, name)
        ).fetchone()
    return str(owner)


def _resolve_pointer(conn: sqlite3.Connection, kind: str, name: str) -> str | None:
    row = conn.execute(
        "SELECT uid FROM pointers WHERE kind = ? AND name = ?", (kind, name)
    ).fetchone()
    return None if row is None else str(row[0])


def _use_once(conn: sqlite3.Connection, name: str, expires_at: float, now: float) -> bool:
    with write_transaction(conn):
        conn.execute("DELETE FROM used WHERE expires_ms < ?", (int(now * 1000),))
        inserted = conn.execute(
            "INSERT INTO used (name, expires_ms) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (name, int(expires_at * 1000)),
        ).rowcount
    return bool(inserted == 1)


def _mark_revoked(conn: sqlite3.Connection, digest: str, uid: str, device: str, now: float) -> None:
    with write_transaction(conn):
        # Marked again (a retried revoke): a new number and date, so every cursor sees it again.
        conn.execute("DELETE FROM revocations WHERE digest = ?", (digest,))
        conn.execute(
            "INSERT INTO revocations (digest, uid, device, marked_ms) VALUES (?, ?, ?, ?)",
            (digest, uid, device, int(now * 1000)),
        )


def _revoked_since(conn: sqlite3.Connection, after: int, now: float) -> Revocations:
    oldest = int((now - MARKER_LIFETIME) * 1000)
    # Expired markers are deleted by whoever lists them: a write only when there are some (the
    # oldest row is the lowest-numbered one), so a poll is one read otherwise.
    if conn.execute("SELECT 1 FROM revocations WHERE marked_ms < ? LIMIT 1", (oldest,)).fetchone():
        with write_transaction(conn):
            conn.execute("DELETE FROM revocations WHERE marked_ms < ?", (oldest,))
    rows = conn.execute(
        "SELECT seq, digest, marked_ms FROM revocations WHERE seq > ? ORDER BY seq", (after,)
    ).fetchall()
    markers = [Revocation(str(digest), _utc(ms)) for _, digest, ms in rows]
    return Revocations(markers, str(max([after, *(int(seq) for seq, _, _ in rows)])))


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


__all__ = ["BUSY_TIMEOUT_MS", "SCHEMA_VERSION", "SQLiteVaultStore"]

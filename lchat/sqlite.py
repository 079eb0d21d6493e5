"""SQLite as lchat's own stores use it (the registry, home's SQLite store, the reference space):
connections in autocommit mode whose write transactions are explicit, in WAL mode, with schemas
migrated additively by ``PRAGMA user_version``."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, committed when the block ends, rolled back when it raises.
    ``BEGIN IMMEDIATE`` takes the write lock up front: writers queue for it instead of upgrading
    a read, a compare-and-swap's read and write are one atomic step, and ``busy_timeout`` covers
    the whole transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def open_wal(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode with ``synchronous = NORMAL``, usable from any one
    thread at a time (the caller serialises access). Raises ``sqlite3.OperationalError`` when the
    database cannot be put in WAL mode."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
        (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        if mode != "wal":
            raise sqlite3.OperationalError(f"cannot enable WAL on {path} (journal_mode={mode})")
        conn.execute("PRAGMA synchronous = NORMAL")
    except BaseException:
        conn.close()
        raise
    return conn


def migrate(
    conn: sqlite3.Connection,
    migrations: Sequence[Sequence[str]],
    newer: Callable[[int], Exception],
) -> int:
    """Bring the schema to version ``len(migrations)`` (each entry the statements from one
    version to the next) in one write transaction; returns the version found. A database newer
    than that raises ``newer(found)`` and is left as it was."""
    with write_transaction(conn):
        (found,) = conn.execute("PRAGMA user_version").fetchone()
        if found > len(migrations):
            raise newer(found)
        for statements in migrations[found:]:
            for statement in statements:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {len(migrations)}")
    return int(found)

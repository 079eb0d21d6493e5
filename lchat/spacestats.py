"""Wake-free stats: what a space holds, read off its local database without waking it.

``GET /stats/<host>`` on the admin socket and ``lchat stats <host>`` answer three things about a
space (docs/hibernation.md, "Wake-free stats: the contract for a space's database"):
``setup_complete`` (someone claimed it), ``members`` (how many can sign in) and ``has_content``
(anything was written in it). A space defines them for its own schema as one view,
``lchat_stats`` (one row: ``setup_complete``, ``members``, ``has_content``); the router only
ever runs :data:`QUERY` against it. Where the answer comes from:

- a hibernating space with a local database: that file (the warm cache is the newest copy on a
  box that served it last), whether it sleeps or runs right now;
- a hibernating space that never woke on this box (no database, no clean-sleep marker, no copy
  moved aside): its registry row says it all: never set up, no members, no content;
- an always-on space: its database, which must exist (a missing one is a create that failed);
- a "lives elsewhere" row (a mesh peer runs the space always-on, ``lives_at``): no answer here,
  whatever file this box may still hold from when the space hibernated on it (that copy is stale
  by definition): the error names the box to ask (``reason`` ``elsewhere``, ``lives_at``).

Invariants of the read (:func:`read_database`):

- **Nothing is created or modified.** Every connection is ``mode=ro`` with ``PRAGMA query_only``.
  A database with a ``-wal`` and a ``-shm`` is read through SQLite's WAL protocol with the
  ``-shm`` opened read-only (``readonly_shm=1``): a concurrent writer is safe, and neither the
  database nor its WAL changes. (The ``-shm`` is SQLite's shared lock table, not data: when
  another connection of this process already mapped it writable, SQLite shares that mapping
  and this reader records its read mark there, as every WAL reader must.) Without a ``-wal`` (a cleanly closed database: every commit is in the main
  file) the read is ``immutable=1``: SQLite would otherwise *create* a ``-wal`` and ``-shm``
  for a WAL-mode file even on a read-only open. A writer that starts meanwhile is caught by
  comparing the files before and after (a WAL-mode writer creates the ``-wal`` before it can
  change the main file), and the read is retried through the WAL protocol.
- **Only SQLite connections touch the files; never ``open()``/``os.open()``** of the database or
  of its ``-wal``/``-shm``/``-journal`` (a ``stat`` is fine). The router process may hold the
  same database in SQLite right now (a replicator's read transaction on an awake space, the
  fleet backup's on an always-on one), and POSIX drops *every* lock a process holds on a file
  when *any* descriptor of it closes: a raw open-and-close would silently release that read
  transaction, and the space's last close could then checkpoint and delete the WAL under the
  replicator (see :func:`lchat.backup.selection.scan` and :mod:`lchat.replica.db`). SQLite's own
  connections in one process share one lock table per inode and defer closing a descriptor while
  another connection holds locks on it, so a read-only SQLite connection is safe.
- **Bounded**: a short busy timeout, and a progress handler interrupts a view that takes longer
  than :data:`QUERY_BUDGET` (the view is the space's code; the router's thread is not).

Blocking throughout except :class:`SpaceStats` (the admin API's side, which runs the blocking part
in a thread).
"""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Literal

from attrs import asdict, frozen

from lchat.hibernation.localdb import MARKER_SUFFIX, moved_aside
from lchat.registry import Route, RouteSource

VIEW = "lchat_stats"
QUERY = "SELECT setup_complete, members, has_content FROM lchat_stats"  # the contract: VIEW
BUSY_TIMEOUT = 1.0  # seconds SQLite waits on a lock (a WAL reader rarely waits at all)
QUERY_BUDGET = 2.0  # seconds the query may run before it is interrupted
ATTEMPTS = 3  # immutable reads raced by a writer, before answering "busy"
_PROGRESS_EVERY = 1000  # SQLite VM instructions between deadline checks

Source = Literal["database", "registry"]


class StatsError(Exception):
    """Why there are no stats; ``code`` is the admin API's HTTP status, ``reason`` a stable word
    (``unknown_host``, ``service``, ``elsewhere``, ``no_database``, ``not_local``, ``waking``,
    ``no_contract``, ``bad_contract``, ``wal_without_shm``, ``busy``, ``unreadable``).
    ``lives_at``: with ``elsewhere``, the URL of the box that runs the space."""

    def __init__(self, code: int, reason: str, message: str, *, lives_at: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.lives_at = lives_at

    def to_json(self, host: str) -> dict[str, Any]:
        out = {"host": host, "error": self.message, "reason": self.reason}
        if self.lives_at:
            out["lives_at"] = self.lives_at
        return out


@frozen
class Counts:
    """The one row of a space's ``lchat_stats`` view."""

    setup_complete: bool
    members: int
    has_content: bool


NEVER_WOKEN = Counts(setup_complete=False, members=0, has_content=False)


@frozen
class Stats:
    host: str
    counts: Counts
    source: Source  # "registry": a hibernating space that never woke on this box
    db: str
    hibernate: bool
    state: str | None = None  # the activator's state of a hibernating space, when known

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "host": self.host,
            **asdict(self.counts),
            "source": self.source,
            "db": self.db,
            "hibernate": self.hibernate,
        }
        if self.state is not None:
            out["state"] = self.state
        return out


def stats_of(route: Route | None, host: str, data_dir: str, state: str | None = None) -> Stats:
    """Blocking. The stats of ``host`` whose registry row is ``route`` (None: not registered);
    ``state`` is the activator's state of a hibernating space (None: unknown or no activator).
    Raises :class:`StatsError`."""
    if route is None:
        raise StatsError(404, "unknown_host", f"{host} is not registered on this box")
    if route.kind != "instance":
        raise StatsError(
            409,
            "service",
            f"{host} is a service route (a server lchat does not run): it has no space database",
        )
    if route.elsewhere:
        # Checked before any file: a database left here from when the space hibernated on this
        # box is older than what the box at lives_at serves, and its numbers would mislead.
        raise StatsError(
            409,
            "elsewhere",
            f"{host} runs always-on on {route.lives_at} (a lives-elsewhere row from that box), "
            f"not here: ask there (`lchat stats {host}` on that box)",
            lives_at=route.lives_at,
        )
    db = route.database(data_dir)
    if not os.path.exists(db):  # a stat, never an open (see the module docstring)
        return Stats(host, _without_database(route, db, state), "registry", db, True, state)
    return Stats(host, read_database(db), "database", db, route.hibernate, state)


def _without_database(route: Route, db: str, state: str | None) -> Counts:
    host = route.host
    if not route.hibernate:
        raise StatsError(
            404,
            "no_database",
            f"{host} is an always-on space but its database {db} does not exist: a create that "
            "failed, or a data directory that moved (check lchat instances and its unit's log)",
        )
    if state not in (None, "asleep"):
        raise StatsError(
            409,
            "waking",
            f"{host} is {state} and its database {db} is not there yet (a restore from the "
            "bucket is under way): ask again in a moment",
        )
    traces = [a.path for a in moved_aside(db)]
    if os.path.exists(db + MARKER_SUFFIX):
        traces.insert(0, db + MARKER_SUFFIX)
    if traces:
        raise StatsError(
            409,
            "not_local",
            f"{host} has no database at {db} but has run on this box before "
            f"({', '.join(os.path.basename(t) for t in traces)}): the bucket holds it, and its "
            "stats are unknown until it wakes",
        )
    # Never woken here: no file was ever written, so nothing was set up, joined or posted.
    return NEVER_WOKEN


# -- the read-only read --------------------------------------------------------------------------

_FileId = tuple[int, int, int, int, int] | None  # dev, ino, size, mtime_ns, ctime_ns


def _file_id(path: str) -> _FileId:
    try:
        st = os.stat(path)  # a stat opens no descriptor: no lock of this process can be lost
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _files(db: str) -> tuple[_FileId, ...]:
    """The database, its -wal, its -shm and its -journal."""
    return tuple(_file_id(db + suffix) for suffix in ("", "-wal", "-shm", "-journal"))


def read_database(
    db: str, *, clock: Callable[[], float] = time.monotonic, budget: float = QUERY_BUDGET
) -> Counts:
    """Blocking. The ``lchat_stats`` row of the database ``db``, read without creating or
    changing any file (see the module docstring for how). Raises :class:`StatsError`."""
    for _ in range(ATTEMPTS):
        before = _files(db)
        main, wal, shm, journal = before
        if main is None:
            raise StatsError(404, "no_database", f"{db} does not exist")
        if journal is not None:
            # A rollback journal: a writer outside WAL mode is mid-transaction (or crashed there,
            # and only a read-write open may roll it back). Nothing read now is trustworthy.
            time.sleep(0.05)  # blocking on purpose: this runs in a worker thread or the CLI
            continue
        if wal is not None and shm is not None:
            # With nobody else holding the -shm, SQLite rebuilds the WAL index in its own memory.
            return _query(db, "mode=ro&readonly_shm=1", clock, budget)
        if wal is not None and wal[2] > 0:
            raise StatsError(
                409,
                "wal_without_shm",
                f"{db}-wal holds commits but {db}-shm is missing: reading them would create it. "
                "Wake the space once (its own open folds the WAL in), then ask again",
            )
        # No -wal, or an empty one and no -shm (the module docstring): immutable=1, then checked.
        counts = _query(db, "mode=ro&immutable=1", clock, budget)
        if _files(db) == before:
            return counts
    raise StatsError(
        503,
        "busy",
        f"{db} was being written through {ATTEMPTS} attempts (a writer starting, or a rollback "
        f"journal {db}-journal): ask again in a moment",
    )


def _query(db: str, params: str, clock: Callable[[], float], budget: float) -> Counts:
    uri = f"file:{urllib.parse.quote(db)}?{params}"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT, isolation_level=None)
    except sqlite3.Error as e:
        raise StatsError(500, "unreadable", f"{db}: cannot open it read-only: {e}") from e
    deadline = clock() + budget
    try:
        conn.execute("PRAGMA query_only = ON")
        # The view is the space's schema: it may not call functions that have side effects.
        conn.execute("PRAGMA trusted_schema = OFF")
        # Returning non-zero interrupts the statement (sqlite3.OperationalError "interrupted").
        conn.set_progress_handler(lambda: int(clock() > deadline), _PROGRESS_EVERY)
        rows = conn.execute(QUERY).fetchall()
    except sqlite3.OperationalError as e:
        text = str(e)
        if text.startswith("no such table") or text.startswith("no such column"):
            raise StatsError(
                409,
                "no_contract",
                f"{db} has no usable {VIEW} view ({text}): the space does not implement the "
                "wake-free stats contract (docs/hibernation.md), or it has not woken since an "
                "upgrade that added it",
            ) from e
        if text == "interrupted":
            raise StatsError(
                500, "unreadable", f"{db}: the {VIEW} view took over {budget:g}s: make it cheaper"
            ) from e
        if "locked" in text or "busy" in text:
            raise StatsError(503, "busy", f"{db}: {text}; ask again in a moment") from e
        raise StatsError(500, "unreadable", f"{db}: {text}") from e
    except sqlite3.Error as e:
        raise StatsError(500, "unreadable", f"{db}: {e}") from e
    finally:
        conn.close()
    return _counts(db, rows)


def _counts(db: str, rows: list[Any]) -> Counts:
    if len(rows) != 1:
        raise StatsError(
            500, "bad_contract", f"{db}: {VIEW} has {len(rows)} rows; the contract is one row"
        )
    setup, members, content = rows[0]
    if not (_flag(setup) and _flag(content)):
        raise StatsError(
            500,
            "bad_contract",
            f"{db}: {VIEW} must give setup_complete and has_content as 0 or 1, "
            f"not {setup!r} and {content!r}",
        )
    if type(members) is not int or members < 0:
        raise StatsError(
            500, "bad_contract", f"{db}: {VIEW}.members must be a count, not {members!r}"
        )
    return Counts(setup_complete=bool(setup), members=members, has_content=bool(content))


def _flag(value: object) -> bool:
    return type(value) is int and value in (0, 1)


# -- the router's side ---------------------------------------------------------------------------


@frozen
class SpaceStats:
    """``GET /stats/<host>`` of the admin API: the row from the router's current table, the
    activator's state, the read in a worker thread. Never wakes anything."""

    routes: RouteSource
    data_dir: str
    state: Callable[[str], str] | None = None  # the activator's ``state(host)``, when it exists

    async def answer(self, host: str) -> tuple[int, dict[str, Any]]:
        """The HTTP status and JSON body for ``host`` (normalised)."""
        route = self.routes.table.get(host)
        state = None
        if route is not None and route.hibernate and self.state is not None:
            state = self.state(host)
        try:
            stats: Stats = await self.routes.run_in_thread(
                stats_of, route, host, self.data_dir, state
            )
        except StatsError as e:
            return e.code, e.to_json(host)
        return 200, stats.to_json()

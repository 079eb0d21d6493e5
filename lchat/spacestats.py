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

On a mesh box (:class:`MeshStats`), a hibernating space under ``LCHAT_MESH_DOMAINS`` may have been
woken and written on any box since this one last saw it, so its local file and its row are not
the truth ("the warm cache is the newest truth *on one box*"). :meth:`SpaceStats.answer` then:

1. awake (or waking, or stopping) here: the local read above;
2. otherwise held awake by a live peer (its word, else ``lock.json``), else owned by a peer by the
   hash: that box's own answer (``GET /api/mesh/stats/<host>``, :data:`OWNER_TIMEOUT`), with
   ``source`` ``owner`` and ``box`` its URL; no answer is 503 ``owner_unreachable``, a peer
   without the endpoint 503 ``peer_too_old`` — errors, never "never woken";
3. this box answers and the space sleeps: one LIST of the space's prefix in the bucket decides
   (:func:`judge`): the local file when it is the copy a wake here would use (its clean-sleep
   marker equals the bucket's newest txid, or the bucket has nothing newer), "never woken"
   (``source`` ``bucket``) when the prefix is empty and nothing of it is on this box, and 409
   ``not_local`` otherwise; a bucket out of reach is 503 ``bucket_unreachable``.

**Invariant (skip-never-reap):** for a mesh space, :data:`NEVER_WOKEN` is answered only from an
empty bucket prefix read just now (by the box that answers for it); whatever cannot be known is an
error, never a guess.

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
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal

from attrs import asdict, frozen
from prometheus_client import Counter
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.hibernation.localdb import MARKER_SUFFIX, BucketView, local_state, moved_aside
from lchat.lease.lock import LOCK_NAME
from lchat.mesh.witness import PeerCallError
from lchat.objstore import ObjectInfo, ObjectStore, ObjectStoreError
from lchat.registry import Route
from lchat.routesource import RouteSource

VIEW = "lchat_stats"
QUERY = "SELECT setup_complete, members, has_content FROM lchat_stats"  # the contract: VIEW
BUSY_TIMEOUT = 1.0  # seconds SQLite waits on a lock (a WAL reader rarely waits at all)
QUERY_BUDGET = 2.0  # seconds the query may run before it is interrupted
ATTEMPTS = 3  # immutable reads raced by a writer, before answering "busy"
_PROGRESS_EVERY = 1000  # SQLite VM instructions between deadline checks

# Where an answer came from: the local file, the registry row (never woken on a box alone), the
# bucket's empty prefix (never woken anywhere, on a mesh), the box that holds or owns the space.
Source = Literal["database", "registry", "bucket", "owner"]
OWNER_TIMEOUT = 5.0  # seconds the owner has to answer GET /api/mesh/stats/<host>
LIST_TIMEOUT = 5.0  # seconds the LIST of a space's prefix may take
WARN_EVERY = 60.0  # seconds between warnings about one peer (or the bucket)

# Errors decided by the registry row and the files beside the database, before any read of it.
_ROW_REASONS = frozenset(
    {"unknown_host", "service", "elsewhere", "no_database", "not_local", "waking"}
)
_log = Logger(namespace="lchat.stats")
_answers = Counter(
    "lchat_stats_answers_total",
    "Wake-free stats answers, by where they came from and how they ended",
    # source: database, registry, bucket, owner; outcome: ok or the error's reason
    ["source", "outcome"],
)


class StatsError(Exception):
    """Why there are no stats; ``code`` is the admin API's HTTP status, ``reason`` a stable word
    (``unknown_host``, ``service``, ``elsewhere``, ``no_database``, ``not_local``, ``waking``,
    ``no_contract``, ``bad_contract``, ``wal_without_shm``, ``busy``, ``unreadable``; on a mesh
    ``owner_unreachable``, ``peer_too_old``, ``bucket_unreachable``; the CLI's
    ``no_router_mesh``).
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
    source: Source  # "registry": never woke on this box; "bucket": never woke anywhere
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


# -- on a mesh: which copy is the truth -----------------------------------------------------------

Verdict = Literal["database", "never_woken", "not_local"]


@frozen
class LocalView:
    """What this box holds of a space, for :func:`judge` (:func:`local_view` reads it)."""

    present: bool  # the database file exists
    marker_txid: int | None  # its clean-sleep marker, still valid (lchat.hibernation.localdb)
    traces: tuple[str, ...] = ()  # with no database: a marker or copies moved aside


def local_view(db: str) -> LocalView:
    """Blocking: ``stat`` calls and a read of the clean-sleep marker, never an open of the
    database or its ``-wal``/``-shm`` (the module docstring)."""
    state = local_state(db)
    if state.present:
        return LocalView(True, state.marker_txid)
    traces = [a.path for a in moved_aside(db)]
    if os.path.exists(db + MARKER_SUFFIX):
        traces.insert(0, db + MARKER_SUFFIX)
    return LocalView(False, None, tuple(traces))


def judge(local: LocalView, listing: Sequence[ObjectInfo]) -> tuple[Verdict, str]:
    """Pure. Which answer a mesh box that answers for a sleeping space may give, from what it
    holds and one LIST of the space's prefix (``<prefix>/<host>/``): ``database`` exactly when a
    wake here would use the local file as it is (the rule of
    :meth:`lchat.hibernation.localdb.Restorer.prepare`), ``never_woken`` only for an empty prefix
    and nothing of the space on this box, ``not_local`` otherwise; with why, for the error."""
    bucket = BucketView.of(listing)
    locked = any(o.key.rsplit("/", 1)[-1] == LOCK_NAME for o in listing)
    mine = local.marker_txid
    if local.present:
        if mine is not None and (mine == bucket.newest or bucket.lost_everything_up_to(mine)):
            return "database", ""
        if mine is None and not listing:
            return "database", ""  # nothing in the bucket at all: the local file is all there is
        ours = f"txid {mine}" if mine is not None else "a txid it cannot vouch for"
        return "not_local", (
            f"this box's copy holds {ours}, the bucket has {bucket.describe()}"
            + (" and a lease" if locked else "")
            + ": another box wrote it since"
        )
    if local.traces:
        names = ", ".join(os.path.basename(t) for t in local.traces)
        return "not_local", f"it ran on this box before ({names}) and its database is not here"
    if not listing:
        return "never_woken", ""
    held = " and a lease (a wake under way)" if locked else ""
    return "not_local", f"the bucket has {bucket.describe()}{held} and this box has no copy"


Ask = Callable[[str, str], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]


@frozen
class MeshStats:
    """What :class:`SpaceStats` needs on a mesh box (built in lchat.tap)."""

    self_url: str  # this box's LCHAT_MESH_SELF, normalised
    in_scope: Callable[[str], bool]  # under LCHAT_MESH_DOMAINS (MeshRouter.in_scope)
    # the box that answers for a row: its holder, else its owner (MeshRouter.answering_box)
    answering_box: Callable[[Route], Coroutine[Any, Any, str]]
    # GET /api/mesh/stats/<host> on a peer: (status, body) whatever the status; raises
    # PeerCallError when no answer came (lchat.mesh.client.ask_stats)
    ask: Ask
    store: ObjectStore  # the hibernation bucket
    replica: Callable[[str], str]  # a host's replica prefix (HibernateConfig.key)
    clock: IReactorTime  # the timeouts, the warnings' pacing
    # Did this box's last beat to that peer go unanswered (Membership.peer_unreachable)? Then
    # the answer is owner_unreachable at once, not after OWNER_TIMEOUT: a reaper walking the
    # spaces of a frozen box must not wait 5 s on each.
    unreachable: Callable[[str], bool] = lambda url: False

    def meshed(self, route: Route | None) -> bool:
        """Is ``route`` a space any box of the mesh may run (so no box alone knows it)?"""
        return (
            route is not None
            and route.kind == "instance"
            and route.hibernate
            and not route.elsewhere
            and self.in_scope(route.host)
        )


# -- the router's side ---------------------------------------------------------------------------


class SpaceStats:
    """``GET /stats/<host>`` of the admin API (:meth:`answer`) and ``GET /api/mesh/stats/<host>``
    of the mesh API (:meth:`answer_here`): the row from the router's current table, the
    activator's state, the read in a worker thread; on a mesh, the owner's answer or the
    bucket's (the module docstring). Never wakes anything."""

    def __init__(
        self,
        routes: RouteSource,
        data_dir: str,
        state: Callable[[str], str] | None = None,  # the activator's ``state(host)``, if any
        mesh: MeshStats | None = None,
    ) -> None:
        self.routes = routes
        self.data_dir = data_dir
        self.state = state
        self.mesh = mesh
        self._warned: dict[str, float] = {}  # peer url (or "bucket") -> last warning

    async def answer(self, host: str) -> tuple[int, dict[str, Any]]:
        """The HTTP status and JSON body for ``host`` (normalised), from whichever box has it."""
        return await self._answer(host, forward=True)

    async def answer_here(self, host: str) -> tuple[int, dict[str, Any]]:
        """This box's own answer, never another box's (what a peer asks of it)."""
        return await self._answer(host, forward=False)

    async def _answer(self, host: str, *, forward: bool) -> tuple[int, dict[str, Any]]:
        route = self.routes.table.get(host)
        state = None
        if route is not None and route.hibernate and self.state is not None:
            state = self.state(host)
        mesh = self.mesh
        if mesh is None or route is None or not mesh.meshed(route) or state != "asleep":
            # Off the mesh, or running (waking, stopping) here: this box's file is the truth.
            return await self._local(route, host, state)
        if forward:
            box = await mesh.answering_box(route)
            if box != mesh.self_url:
                return await self._ask(mesh, box, host)
        return await self._sleeping_here(mesh, route, host, state)

    async def _local(
        self, route: Route | None, host: str, state: str | None
    ) -> tuple[int, dict[str, Any]]:
        try:
            stats: Stats = await self.routes.run_in_thread(
                stats_of, route, host, self.data_dir, state
            )
        except StatsError as e:
            _answers.labels("registry" if e.reason in _ROW_REASONS else "database", e.reason).inc()
            return e.code, e.to_json(host)
        _answers.labels(stats.source, "ok").inc()
        return 200, stats.to_json()

    async def _sleeping_here(
        self, mesh: MeshStats, route: Route, host: str, state: str | None
    ) -> tuple[int, dict[str, Any]]:
        """This box answers for ``route``, asleep here: one LIST decides (:func:`judge`)."""
        db = route.database(self.data_dir)
        local = await self.routes.run_in_thread(local_view, db)
        prefix = mesh.replica(host) + "/"
        listing_d = Deferred.fromCoroutine(mesh.store.list(prefix))
        listing_d.addTimeout(LIST_TIMEOUT, mesh.clock)
        try:
            listing = await listing_d
        except (ObjectStoreError, TimeoutError, CancelledError) as e:
            why = str(e) or f"no answer within {LIST_TIMEOUT:g}s"
            self._warn("bucket", "stats: {host}: the bucket could not be listed ({why})", host, why)
            _answers.labels("bucket", "bucket_unreachable").inc()
            return 503, StatsError(
                503,
                "bucket_unreachable",
                f"{host} sleeps here and only the bucket can tell whether another box wrote it "
                f"since, but listing {prefix} failed ({why}): ask again once the bucket answers",
            ).to_json(host)
        verdict, why = judge(local, listing)
        if verdict == "never_woken":
            _answers.labels("bucket", "ok").inc()
            return 200, Stats(host, NEVER_WOKEN, "bucket", db, True, state).to_json()
        if verdict == "not_local":
            _answers.labels("bucket", "not_local").inc()
            return 409, StatsError(
                409,
                "not_local",
                f"{host} sleeps and this box answers for it, but {why}: its stats are unknown "
                "until it next wakes (a request, or the admin socket's POST /wake?host=), then "
                "ask again",
            ).to_json(host)
        try:
            counts = await self.routes.run_in_thread(read_database, db)
        except StatsError as e:
            _answers.labels("database", e.reason).inc()
            return e.code, e.to_json(host)
        _answers.labels("database", "ok").inc()
        return 200, Stats(host, counts, "database", db, True, state).to_json()

    async def _ask(self, mesh: MeshStats, box: str, host: str) -> tuple[int, dict[str, Any]]:
        """The answer of ``box``, which holds or owns ``host``: passed on with ``box`` (and
        ``source`` ``owner`` on a 200, the owner's own in ``owner_source``); no answer is an
        error (skip-never-reap), never "never woken"."""
        if mesh.unreachable(box):
            return self._owner_error(
                box, host, "owner_unreachable", "its beats go unanswered (it is out of reach)"
            )
        asking = Deferred.fromCoroutine(mesh.ask(box, host))
        asking.addTimeout(OWNER_TIMEOUT, mesh.clock)
        try:
            code, body = await asking
        except (PeerCallError, TimeoutError, CancelledError) as e:
            why = str(e) or f"no answer within {OWNER_TIMEOUT:g}s"
            return self._owner_error(box, host, "owner_unreachable", f"it did not answer: {why}")
        if code == 404 and "reason" not in body:
            return self._owner_error(
                box,
                host,
                "peer_too_old",
                "it has no stats endpoint (GET /api/mesh/stats): it runs an older lchat; "
                "upgrade it, or ask `lchat stats` on that box",
            )
        if not isinstance(body.get("host"), str):
            error = body.get("error") if isinstance(body.get("error"), str) else "no stats"
            return self._owner_error(
                box, host, "owner_unreachable", f"it answered {code} without stats ({error})"
            )
        answer = {**body, "box": box}
        if code == 200:
            answer["owner_source"], answer["source"] = body.get("source"), "owner"
        outcome = "ok" if code == 200 else str(body.get("reason") or "error")
        _answers.labels("owner", outcome).inc()
        _log.debug(
            "stats: {host} asked of its owner {box}: {outcome}",
            host=host,
            box=box,
            outcome=outcome,
        )
        return code, answer

    def _owner_error(
        self, box: str, host: str, reason: str, why: str
    ) -> tuple[int, dict[str, Any]]:
        _answers.labels("owner", reason).inc()
        self._warn(box, "stats: {host} asked of its owner {box}: " + reason + ": {why}", host, why)
        error = StatsError(
            503,
            reason,
            f"{host} is held or owned by {box}, which must answer for it, but {why}: no answer "
            "(not 'never woken': a reaper must skip it)",
        )
        return 503, {**error.to_json(host), "box": box}

    def _warn(self, about: str, text: str, host: str, why: str) -> None:
        """A warning, at most once per :data:`WARN_EVERY` per peer (or the bucket); debug else."""
        now = self.mesh.clock.seconds() if self.mesh is not None else 0.0
        last = self._warned.get(about)
        if last is not None and now - last < WARN_EVERY:
            _log.debug(text, host=host, box=about, why=why)
            return
        self._warned[about] = now
        _log.warn(text, host=host, box=about, why=why)

"""The registry: the box's SQLite routing table, its migrations, and the immutable
:class:`RouteTable` a load gives (the router's live copy is :mod:`lchat.routesource`).

WAL mode plus a busy timeout lets the CLI write while the router reads. Migrations are additive only
(docs/design.md §10, invariant 5) and keyed on ``PRAGMA user_version``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, Literal

from attrs import evolve, frozen

from lchat import hosts
from lchat.sqlite import migrate, write_transaction

Kind = Literal["instance", "service"]
Status = Literal["creating", "ready", "failed"]
Replication = Literal["stream", "batched", "daily"]

KINDS: tuple[Kind, ...] = ("instance", "service")
STATUSES: tuple[Status, ...] = ("creating", "ready", "failed")
REPLICATIONS: tuple[Replication, ...] = ("stream", "batched", "daily")

BUSY_TIMEOUT_MS = 5000

# Each step moves the schema from version N to N+1. Never edit a step that has shipped; only append.
# v1 is the original router's table; v2 added hibernation; v3 added placement fields.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE routes (
            host         TEXT PRIMARY KEY,
            kind         TEXT NOT NULL DEFAULT 'instance' CHECK (kind IN ('instance', 'service')),
            socket       TEXT NOT NULL,
            status       TEXT NOT NULL DEFAULT 'creating'
                         CHECK (status IN ('creating', 'ready', 'failed')),
            last_error   TEXT NOT NULL DEFAULT '',
            version      TEXT NOT NULL DEFAULT '',
            prev_version TEXT NOT NULL DEFAULT '',
            created_at   INTEGER NOT NULL DEFAULT 0,
            updated_at   INTEGER NOT NULL DEFAULT 0
        )""",
    ),
    (
        "ALTER TABLE routes ADD COLUMN hibernate INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE routes ADD COLUMN next_due INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE routes ADD COLUMN replication TEXT NOT NULL DEFAULT 'stream'",
    ),
    (
        "ALTER TABLE routes ADD COLUMN db_path TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE routes ADD COLUMN home_region TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE routes ADD COLUMN provider TEXT NOT NULL DEFAULT ''",
    ),
    (
        # A counter every write bumps, so the router's poll notices a change even when the file's
        # size and mtime do not move (coarse timestamps, same-size rewrites).
        """CREATE TABLE registry_changes (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            n  INTEGER NOT NULL
        )""",
        "INSERT INTO registry_changes (id, n) VALUES (1, 0)",
        """CREATE TRIGGER routes_changed_insert AFTER INSERT ON routes
           BEGIN UPDATE registry_changes SET n = n + 1 WHERE id = 1; END""",
        """CREATE TRIGGER routes_changed_update AFTER UPDATE ON routes
           BEGIN UPDATE registry_changes SET n = n + 1 WHERE id = 1; END""",
        """CREATE TRIGGER routes_changed_delete AFTER DELETE ON routes
           BEGIN UPDATE registry_changes SET n = n + 1 WHERE id = 1; END""",
    ),
    (
        # A "lives elsewhere" row (docs/mesh.md, Hibernate flips): the normalised LCHAT_MESH_SELF
        # of the box that runs the space always-on; '' for every other row.
        "ALTER TABLE routes ADD COLUMN lives_at TEXT NOT NULL DEFAULT ''",
    ),
    (
        # A replicated space's settings version (lchat.mesh.settings, docs/mesh.md, "What
        # travels"): a Lamport-style generation (0: never versioned, a row from before them) and
        # the digest of the settings it versions ('' with generation 0).
        "ALTER TABLE routes ADD COLUMN settings_gen INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE routes ADD COLUMN settings_hash TEXT NOT NULL DEFAULT ''",
    ),
    (
        # A removed replicated row's tombstone (lchat.mesh.sync, docs/mesh.md "What travels"):
        # its generation (above the row's last one) beats every older copy a peer may still
        # hold, so anti-entropy never brings the row back; purged once that generation is older
        # than TOMBSTONE_RETENTION_MS. No trigger: a tombstone does not route anything.
        """CREATE TABLE tombstones (
            host        TEXT PRIMARY KEY,
            gen         INTEGER NOT NULL,
            home_region TEXT NOT NULL DEFAULT '',
            deleted_at  INTEGER NOT NULL DEFAULT 0
        )""",
    ),
    (
        # The settings generation at which the row's home_region last changed (lchat.mesh.settings
        # .region_newer): a relocate's region is never rolled back by a later, unrelated change
        # made on a box that missed it. 0: unchanged since generations (a row from before this).
        "ALTER TABLE routes ADD COLUMN region_gen INTEGER NOT NULL DEFAULT 0",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


# How long a tombstone is kept, by its generation (unix ms of the delete, Lamport-raised): a row
# whose generation is older than this is never created by anti-entropy (lchat.mesh.sync), so a
# purged tombstone can never be undone by a copy it would have beaten.
TOMBSTONE_RETENTION_MS = 30 * 24 * 3600 * 1000


@frozen
class Tombstone:
    """A replicated row removed here: ``gen`` above every generation the row had (so a peer's
    older copy loses to it), ``home_region`` the row's (the mesh scope of the host), ``deleted_at``
    unix seconds of this box's record."""

    host: str
    gen: int
    home_region: str = ""
    deleted_at: int = 0


class RegistryError(Exception):
    """The registry cannot be opened or used; the message says which file and why."""


class UnknownHost(RegistryError):
    pass


class DuplicateHost(RegistryError):
    pass


class Stale(RegistryError):
    """A replicated write older than the row it would replace (lchat.mesh.settings): nothing was
    written. ``existing`` is the row kept."""

    def __init__(self, existing: Route) -> None:
        super().__init__(
            f"{existing.host}: this box holds settings generation "
            f"{existing.settings_gen}, newer than the write"
        )
        self.existing = existing


class Tombstoned(RegistryError):
    """A replicated write of a host removed here with a newer generation than the write's: the
    delete wins (nothing was written). ``tombstone`` is the one kept."""

    def __init__(self, tombstone: Tombstone) -> None:
        super().__init__(
            f"{tombstone.host}: removed on this box at settings generation {tombstone.gen}, "
            f"newer than the write"
        )
        self.tombstone = tombstone


class Conflict(RegistryError):
    """A row exists that a replicated write may not touch (a service, or a space that does not
    hibernate: it lives on this box alone)."""


@frozen
class Route:
    host: str
    kind: Kind
    socket: str
    status: Status = "creating"
    last_error: str = ""
    version: str = ""
    prev_version: str = ""
    hibernate: bool = False
    next_due: int = 0
    replication: Replication = "stream"
    db_path: str = ""
    home_region: str = ""
    provider: str = ""
    created_at: int = 0
    updated_at: int = 0
    # Non-empty only on a mesh peer's "lives elsewhere" row: the space runs always-on on the box
    # at this URL (a normalised LCHAT_MESH_SELF), which this box forwards every request to. Such
    # a row never hibernates, never runs here and has no database here (:attr:`elsewhere`).
    lives_at: str = ""
    # The version of the space's mesh-wide settings (lchat.mesh.settings): the generation, a
    # Lamport-style counter of unix milliseconds that every change raises (0: never versioned),
    # and the digest of the settings as this box holds them (the row's replicated fields and the
    # env file's replicable values). The highest generation wins across the mesh.
    settings_gen: int = 0
    settings_hash: str = ""
    # The generation of the last change of ``home_region`` (0: none since generations), never
    # above ``settings_gen`` once bumped: the home region merges on its own generation, so an
    # unrelated newer change from a box that missed a relocate never rolls the region back.
    region_gen: int = 0

    @property
    def serveable(self) -> bool:
        return self.status == "ready"

    @property
    def hibernating(self) -> bool:
        """A space this box's activator wakes and sleeps (lchat.hibernation)."""
        return self.kind == "instance" and self.hibernate

    @property
    def elsewhere(self) -> bool:
        """A replicated "lives elsewhere" row: not this box's space in any way (no process, no
        wake, no sweep, no backup); its requests go to :attr:`lives_at`."""
        return bool(self.lives_at)

    @property
    def always_on_here(self) -> bool:
        """An instance this box runs always-on (not hibernating, not a lives-elsewhere row)."""
        return self.kind == "instance" and not self.hibernate and not self.elsewhere

    def database(self, data_dir: str) -> str:
        """The space's SQLite file: its row's ``db_path``, else where ``data_dir``'s layout puts
        it (:func:`lchat.hosts.db_path`). Every reader of a space's database finds it here."""
        return self.db_path or hosts.db_path(data_dir, self.host)

    @property
    def replicated(self) -> bool:
        """A row a mesh peer may write or delete: a hibernating instance, or a lives-elsewhere
        row. Services and spaces running here always-on are this box's alone."""
        return self.kind == "instance" and (self.hibernate or self.elsewhere)


_COLUMNS = tuple(Route.__attrs_attrs__[i].name for i in range(len(Route.__attrs_attrs__)))
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM routes"


@frozen
class RouteTable:
    """An immutable snapshot of every row; the router swaps whole tables, never edits one."""

    routes: Mapping[str, Route]
    fingerprint: tuple[Any, ...] = ()

    def get(self, host: str) -> Route | None:
        return self.routes.get(host)

    def __len__(self) -> int:
        return len(self.routes)

    def __iter__(self) -> Iterator[Route]:
        return iter(self.routes.values())

    def count_by_status(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        for route in self.routes.values():
            counts[route.status] += 1
        return counts


EMPTY = RouteTable(routes=MappingProxyType({}))


def validate(route: Route) -> Route:
    """Check a row before it is written; hostile values never reach the table."""
    try:
        canonical = hosts.normalise(route.host)
    except hosts.InvalidHost as e:
        raise RegistryError(str(e)) from e
    if canonical != route.host:
        route = evolve(route, host=canonical)
    if route.kind not in KINDS:
        raise RegistryError(f"kind must be one of {', '.join(KINDS)}, not {route.kind!r}")
    if route.status not in STATUSES:
        raise RegistryError(f"status must be one of {', '.join(STATUSES)}, not {route.status!r}")
    if route.replication not in REPLICATIONS:
        raise RegistryError(
            f"replication must be one of {', '.join(REPLICATIONS)}, not {route.replication!r}"
        )
    if not route.socket or not os.path.isabs(route.socket) or "\x00" in route.socket:
        raise RegistryError(f"socket must be an absolute path, not {route.socket!r}")
    if route.db_path and (not os.path.isabs(route.db_path) or "\x00" in route.db_path):
        raise RegistryError(f"db_path must be empty or an absolute path, not {route.db_path!r}")
    if route.kind == "service" and route.hibernate:
        raise RegistryError("a service row cannot hibernate: only instances can")
    if route.lives_at and (
        route.kind != "instance"
        or route.hibernate
        or not route.lives_at.startswith(("https://", "http://"))
        or any(c.isspace() or ord(c) < 0x20 for c in route.lives_at)
    ):
        raise RegistryError(
            "lives_at must be empty, or a peer's http(s) URL on an instance row that does not "
            f"hibernate, not {route.lives_at[:200]!r}"
        )
    if (
        not 0 <= route.settings_gen < 2**63
        or not 0 <= route.region_gen < 2**63
        or len(route.settings_hash) > 128
    ):
        raise RegistryError("settings_gen, region_gen and settings_hash are not acceptable")
    for name in ("version", "prev_version", "home_region", "provider", "last_error", "lives_at"):
        value = getattr(route, name)
        if "\x00" in value or len(value) > 4096:
            raise RegistryError(f"{name} is not acceptable text")
    return route


class Registry:
    """Short-lived connections to the registry file: safe from any thread, one per call.

    Every method opens, uses and closes its own connection, so the router can call them from a
    thread pool and the CLI from its main thread without sharing a sqlite3 object across threads.
    """

    def __init__(self, path: str, clock: Callable[[], float]) -> None:
        """``clock``: unix seconds, for the rows' ``updated_at`` (the router passes its
        reactor's clock, the CLI ``time.time``)."""
        if "\x00" in path:
            raise RegistryError(f"registry {path!r}: the path contains a NUL byte")
        self.path = path
        self._clock = clock

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        directory = os.path.dirname(self.path) or "."
        if not os.path.isdir(directory):
            raise RegistryError(f"registry {self.path}: directory {directory} does not exist")
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as e:
            raise RegistryError(f"registry {self.path}: {e}") from e
        try:
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            yield conn
        except sqlite3.DatabaseError as e:
            raise RegistryError(f"registry {self.path}: {e}") from e
        finally:
            conn.close()

    def migrate(self) -> int:
        """Bring the schema to :data:`SCHEMA_VERSION`; returns the version found before."""
        with self.connect() as conn:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RegistryError(f"registry {self.path}: cannot enable WAL (got {mode})")
            return migrate(
                conn,
                MIGRATIONS,
                lambda found: RegistryError(
                    f"registry {self.path} has schema version {found}, newer than this lchat "
                    f"understands ({SCHEMA_VERSION}): upgrade lchat"
                ),
            )

    def load(self) -> RouteTable:
        """Read every row into a fresh immutable table."""
        fingerprint = self.fingerprint()
        with self.connect() as conn:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version != SCHEMA_VERSION:
                raise RegistryError(
                    f"registry {self.path} is at schema version {version}, expected "
                    f"{SCHEMA_VERSION}: run the router or `lchat instances` once to migrate"
                )
            rows = conn.execute(f"{_SELECT} ORDER BY host").fetchall()
        routes = {route.host: route for route in map(_route_from_row, rows)}
        return RouteTable(routes=MappingProxyType(routes), fingerprint=fingerprint)

    def get(self, host: str) -> Route | None:
        with self.connect() as conn:
            return _select(conn, host)

    def insert(self, route: Route) -> Route:
        route = validate(route)
        now = int(self._clock())
        route = evolve(route, created_at=route.created_at or now, updated_at=now)
        with self.connect() as conn:
            try:
                _insert(conn, route)
            except sqlite3.IntegrityError as e:
                if "UNIQUE" in str(e) or "PRIMARY KEY" in str(e):
                    raise DuplicateHost(f"{route.host} is already registered") from e
                raise RegistryError(f"{route.host}: {e}") from e
        return route

    def update(self, host: str, **changes: Any) -> Route:
        """Change some columns of one row; validation applies to the result."""
        with self.connect() as conn, write_transaction(conn):
            return self._update_row(conn, host, changes)

    def _update_row(self, conn: sqlite3.Connection, host: str, changes: dict[str, Any]) -> Route:
        unknown = set(changes) - set(_COLUMNS) - {"host"}
        if unknown or "host" in changes:
            raise RegistryError(
                f"cannot update columns {sorted(unknown | {'host'} & set(changes))}"
            )
        existing = _select(conn, host)
        if existing is None:
            raise UnknownHost(f"{host} is not registered")
        moved = changes.get("home_region", existing.home_region) != existing.home_region
        if moved and "region_gen" not in changes:
            # A region changed outside a bump (lchat relocate's flip): its generation now, above
            # every one the row has seen; the bump that follows raises settings_gen to it.
            changes["region_gen"] = max(
                int(self._clock() * 1000), existing.settings_gen + 1, existing.region_gen + 1
            )
        route = validate(evolve(existing, **changes, updated_at=int(self._clock())))
        _update(conn, route, [*changes, "updated_at"])
        return route

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """One write transaction (``BEGIN IMMEDIATE``: the registry's write lock, which every
        process writing this file queues for) over the block, committed when it ends, rolled
        back when it raises. A replicated row and its env files change inside one
        (:class:`lchat.mesh.route_store.RouteStore`'s writes, ``lchat env``), so that no other
        writer, in this process or another, lands between a file and its row. Inside the block,
        write only through the :class:`Transaction` (another connection's write would wait for
        this one: ``busy_timeout``, then fail)."""
        with self.connect() as conn, write_transaction(conn):
            yield Transaction(self, conn)

    def set_status(self, host: str, status: Status, last_error: str = "") -> Route | None:
        """Record a health change; a row removed meanwhile is not an error (returns None)."""
        try:
            return self.update(host, status=status, last_error=last_error[:4096])
        except UnknownHost:
            return None

    def delete(self, host: str) -> bool:
        with self.connect() as conn:
            cursor = conn.execute("DELETE FROM routes WHERE host = ?", (host,))
            return cursor.rowcount > 0

    def delete_with_tombstone(self, host: str, now_ms: int) -> tuple[Route, Tombstone] | None:
        """``lchat remove-instance`` of a row that replicates on a mesh: delete it and keep its
        tombstone, in one transaction, at generation ``max(now_ms, row's gen + 1, an older
        tombstone's + 1)``, so that no peer's copy brings it back. None when there was no row."""
        with self.connect() as conn, write_transaction(conn):
            existing = _select(conn, host)
            if existing is None:
                return None
            conn.execute("DELETE FROM routes WHERE host = ?", (host,))
            tomb = self._bury(conn, existing, now_ms)
        return existing, tomb

    # --- tombstones (lchat.mesh.sync) ---------------------------------------------------------

    def tombstones(self) -> dict[str, Tombstone]:
        """Every tombstone kept here, by host."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT host, gen, home_region, deleted_at FROM tombstones ORDER BY host"
            ).fetchall()
        return {row["host"]: Tombstone(*row) for row in rows}

    def tombstone(self, host: str) -> Tombstone | None:
        with self.connect() as conn:
            return _tombstone(conn, host)

    def record_tombstone(self, host: str, gen: int, home_region: str) -> Tombstone:
        """A peer's tombstone of a host this box holds no row of: kept (the higher generation
        wins), so that no third box's older copy creates it here either."""
        with self.connect() as conn, write_transaction(conn):
            found = _tombstone(conn, host)
            if found is not None and found.gen >= gen:
                return found
            tomb = Tombstone(host, gen, home_region, int(self._clock()))
            _write_tombstone(conn, tomb)
        return tomb

    def purge_tombstones(self, older_than_ms: int) -> list[str]:
        """Forget the tombstones whose generation is below ``older_than_ms``; their hosts."""
        with self.connect() as conn, write_transaction(conn):
            hosts_ = [
                row[0]
                for row in conn.execute(
                    "SELECT host FROM tombstones WHERE gen < ? ORDER BY host", (older_than_ms,)
                )
            ]
            conn.execute("DELETE FROM tombstones WHERE gen < ?", (older_than_ms,))
        return hosts_

    def _bury(self, conn: sqlite3.Connection, route: Route, now_ms: int) -> Tombstone:
        older = _tombstone(conn, route.host)
        gen = max(int(now_ms), route.settings_gen + 1, (older.gen + 1) if older else 0)
        tomb = Tombstone(route.host, gen, route.home_region, int(self._clock()))
        _write_tombstone(conn, tomb)
        return tomb

    # --- route replication (lchat.mesh.api) ---------------------------------------------------

    def bump_settings(
        self,
        host: str,
        settings_hash: str,
        now_ms: int,
        *,
        expect: tuple[int, str] | None = None,
        keep_gen: bool = False,
        changed: Route | None = None,
    ) -> Route | None:
        """Give ``host``'s row a new settings generation, ``max(now_ms, gen + 1)`` (so that a
        clock behind the last writer's never rolls a change back), and ``settings_hash``, in one
        transaction: a local change of the space's settings, to be pushed to the peers. A
        tombstone of the host (it was removed, and is added again) is forgotten, the generation
        raised above it. Raises :class:`UnknownHost`.

        ``expect``: only while the row still holds this (generation, hash); otherwise nothing is
        written and None is returned (a compare-and-swap: lchat.mesh.sync's sweep). ``keep_gen``:
        record the hash only (a row from before generations gets its first one, at 0).
        ``changed``: the local change itself (its replication class, home region and version),
        written in the same transaction, so that a peer's older copy landing between the
        change and its generation can never end under the change's generation and hash."""
        with self.connect() as conn, write_transaction(conn):
            return self._bump_settings(
                conn, host, settings_hash, now_ms, expect=expect, keep_gen=keep_gen, changed=changed
            )

    def _bump_settings(
        self,
        conn: sqlite3.Connection,
        host: str,
        settings_hash: str,
        now_ms: int,
        *,
        expect: tuple[int, str] | None,
        keep_gen: bool,
        changed: Route | None,
    ) -> Route | None:
        existing = _select(conn, host)
        if existing is None:
            raise UnknownHost(f"{host} is not registered")
        if expect is not None and (existing.settings_gen, existing.settings_hash) != expect:
            return None
        gen = (
            existing.settings_gen
            if keep_gen
            else max(int(now_ms), existing.settings_gen + 1, existing.region_gen)
        )
        buried = _tombstone(conn, host)
        if buried is not None and not keep_gen:
            # The same host re-added after a remove: above its tombstone, which goes.
            gen = max(gen, buried.gen + 1)
            conn.execute("DELETE FROM tombstones WHERE host = ?", (host,))
        names: tuple[str, ...] = ("settings_gen", "settings_hash", "updated_at")
        if changed is not None:
            if changed.home_region != existing.home_region:
                existing = evolve(existing, region_gen=gen)  # the region's own generation
                names += ("region_gen",)
            existing = evolve(
                existing,
                replication=changed.replication,
                home_region=changed.home_region,
                version=changed.version,
            )
            names += ("replication", "home_region", "version")
        route = evolve(
            existing,
            settings_gen=gen,
            settings_hash=settings_hash,
            updated_at=int(self._clock()),
        )
        _update(conn, validate(route), names)
        return route

    def upsert_replicated(
        self,
        route: Route,
        *,
        next_due: bool = False,
        accept: Callable[[Route], bool] | None = None,
    ) -> tuple[Route, bool]:
        """Write a row replicated from a mesh peer, in one transaction: a hibernating instance,
        or a "lives elsewhere" row (``hibernate`` false, ``lives_at`` the URL of the box that
        runs the space always-on).

        Inserts ``route`` when the host has no row; otherwise updates only the replicated fields
        (``version``, ``replication``, ``home_region``, ``hibernate``, ``lives_at``, and
        ``next_due`` when ``next_due`` is true) of the replicated row already there
        (:attr:`Route.replicated`), keeping its local socket, database path and status (a flip
        back to hibernating makes it ``ready``). ``next_due``: the payload carried one, and it
        replaces this box's value, 0 included (the sender slept the space or honoured its due
        time: it knows best); without it the local value stays. A lives-elsewhere row never keeps
        a due time (it never wakes here). Returns ``(row, created)``. Raises :class:`Conflict`
        when the existing row is a service or a space this box runs always-on.

        ``accept``: asked, inside the transaction, whether ``route`` may replace the existing row
        (the settings generations' order: lchat.mesh.settings.newer); when it says no, nothing is
        written and :class:`Stale` is raised. The settings generation and hash are written with
        the replicated fields. Over no row but a tombstone, ``route`` is inserted only when its
        generation is above the tombstone's (which goes); otherwise :class:`Tombstoned`.
        """
        with self.connect() as conn, write_transaction(conn):
            return self._upsert_replicated(conn, route, next_due=next_due, accept=accept)

    def _upsert_replicated(
        self,
        conn: sqlite3.Connection,
        route: Route,
        *,
        next_due: bool,
        accept: Callable[[Route], bool] | None,
    ) -> tuple[Route, bool]:
        route = validate(route)
        if not route.replicated:
            raise RegistryError(
                f"{route.host}: only hibernating instances and lives-elsewhere rows replicate"
            )
        now = int(self._clock())
        existing = _select(conn, route.host)
        if existing is None:
            buried = _tombstone(conn, route.host)
            if buried is not None:
                if buried.gen >= route.settings_gen:  # (a write without a gen: 0)
                    raise Tombstoned(buried)
                conn.execute("DELETE FROM tombstones WHERE host = ?", (route.host,))
            result = evolve(route, created_at=route.created_at or now, updated_at=now)
            _insert(conn, result)
            return result, True
        _refuse_replicated(existing)
        if accept is not None and not accept(existing):
            raise Stale(existing)
        due = route.next_due if next_due else existing.next_due
        result = validate(
            evolve(
                existing,
                version=route.version,
                replication=route.replication,
                home_region=route.home_region,
                hibernate=route.hibernate,
                lives_at=route.lives_at,
                settings_gen=route.settings_gen,
                settings_hash=route.settings_hash,
                region_gen=route.region_gen,
                next_due=0 if route.elsewhere else due,
                status="ready" if existing.elsewhere != route.elsewhere else existing.status,
                updated_at=now,
            )
        )
        if result == evolve(existing, updated_at=now):
            return existing, False  # nothing changed: no write, no reload churn
        _update(conn, result, _REPLICATED_COLUMNS)
        return result, False

    def delete_replicated(
        self, host: str, gen: int | None = None, now_ms: int | None = None
    ) -> Route | None:
        """Delete ``host``'s row when it is replicated (a hibernating instance or a lives-elsewhere
        row: :attr:`Route.replicated`) (a peer's tombstone), in one transaction, keeping this
        box's tombstone of it at generation ``max(gen or now_ms, row's gen + 1)`` (``now_ms``:
        the registry's clock by default). ``gen``: the peer's tombstone's; a row newer than it
        (added again since) is kept (:class:`Stale`). Returns the row deleted, or None when
        there was none. Raises :class:`Conflict` for a service or a space that does not
        hibernate."""
        if now_ms is None:
            now_ms = int(self._clock() * 1000)
        with self.connect() as conn, write_transaction(conn):
            existing = _select(conn, host)
            if existing is not None:
                _refuse_replicated(existing)
                if gen is not None and gen <= existing.settings_gen:
                    raise Stale(existing)
                conn.execute("DELETE FROM routes WHERE host = ?", (host,))
                self._bury(conn, existing, gen if gen is not None else now_ms)
        return existing

    def fingerprint(self) -> tuple[Any, ...]:
        """What changes whenever a committed write lands: the file and its WAL (inode, size, mtime)
        and the write counter kept by triggers on ``routes``."""
        parts: list[Any] = []
        for suffix in ("", "-wal"):
            try:
                st = os.stat(self.path + suffix)
            except FileNotFoundError:
                parts.append(None)
            else:
                parts.append((st.st_ino, st.st_size, st.st_mtime_ns))
        if parts[0] is None:
            return (*parts, None)  # connecting would create the file
        try:
            with self.connect() as conn:
                row = conn.execute("SELECT n FROM registry_changes WHERE id = 1").fetchone()
            parts.append(row[0] if row else None)
        except RegistryError:
            parts.append(None)  # unreadable: the stats above still change when it is fixed
        return tuple(parts)


class Transaction:
    """One write transaction on the registry (:meth:`Registry.transaction`): the writes a
    replicated row takes with its env files, on the transaction's connection. Each method is its
    :class:`Registry` namesake's, inside the transaction (nothing commits before the block
    ends)."""

    def __init__(self, registry: Registry, conn: sqlite3.Connection) -> None:
        self._registry = registry
        self._conn = conn

    def get(self, host: str) -> Route | None:
        return _select(self._conn, host)

    def update(self, host: str, **changes: Any) -> Route:
        return self._registry._update_row(self._conn, host, changes)

    def bump_settings(
        self,
        host: str,
        settings_hash: str,
        now_ms: int,
        *,
        expect: tuple[int, str] | None = None,
        keep_gen: bool = False,
        changed: Route | None = None,
    ) -> Route | None:
        return self._registry._bump_settings(
            self._conn,
            host,
            settings_hash,
            now_ms,
            expect=expect,
            keep_gen=keep_gen,
            changed=changed,
        )

    def upsert_replicated(
        self,
        route: Route,
        *,
        next_due: bool = False,
        accept: Callable[[Route], bool] | None = None,
    ) -> tuple[Route, bool]:
        return self._registry._upsert_replicated(
            self._conn, route, next_due=next_due, accept=accept
        )


def _refuse_replicated(existing: Route) -> None:
    if existing.kind != "instance":
        raise Conflict(f"{existing.host} is a service on this box: services do not replicate")
    if not existing.replicated:
        raise Conflict(
            f"{existing.host} runs on this box without hibernating: a peer may not change it"
        )


def _route_from_row(row: sqlite3.Row) -> Route:
    values = {c: row[c] for c in _COLUMNS}
    values["hibernate"] = bool(values["hibernate"])
    return Route(**values)


def _to_sql(value: object) -> object:
    return int(value) if isinstance(value, bool) else value


# What a peer's copy of a replicated row may change in ours (Registry.upsert_replicated).
_REPLICATED_COLUMNS = (
    "version",
    "replication",
    "home_region",
    "hibernate",
    "lives_at",
    "settings_gen",
    "settings_hash",
    "region_gen",
    "next_due",
    "status",
    "updated_at",
)


def _select(conn: sqlite3.Connection, host: str) -> Route | None:
    found = conn.execute(f"{_SELECT} WHERE host = ?", (host,)).fetchone()
    return _route_from_row(found) if found is not None else None


def _tombstone(conn: sqlite3.Connection, host: str) -> Tombstone | None:
    found = conn.execute(
        "SELECT host, gen, home_region, deleted_at FROM tombstones WHERE host = ?", (host,)
    ).fetchone()
    return Tombstone(*found) if found is not None else None


def _write_tombstone(conn: sqlite3.Connection, tomb: Tombstone) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO tombstones (host, gen, home_region, deleted_at) "
        "VALUES (?, ?, ?, ?)",
        (tomb.host, tomb.gen, tomb.home_region, tomb.deleted_at),
    )


def _update(conn: sqlite3.Connection, route: Route, names: Iterable[str]) -> None:
    """Write ``route``'s ``names`` columns into its row."""
    names = list(names)
    conn.execute(
        f"UPDATE routes SET {', '.join(f'{n} = ?' for n in names)} WHERE host = ?",
        [*(_to_sql(getattr(route, n)) for n in names), route.host],
    )


def _insert(conn: sqlite3.Connection, route: Route) -> None:
    conn.execute(
        f"INSERT INTO routes ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})",
        [_to_sql(getattr(route, c)) for c in _COLUMNS],
    )


def changed_hosts(old: RouteTable, new: RouteTable) -> Iterable[str]:
    """Hosts added, removed or altered between two tables (for the reload log line)."""
    for host in sorted(set(old.routes) | set(new.routes)):
        if old.routes.get(host) != new.routes.get(host):
            yield host

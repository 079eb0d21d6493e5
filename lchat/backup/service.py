"""The backup service: one replicator per database the activator does not replicate.

Which databases: :mod:`lchat.backup.selection`. Where: :mod:`lchat.backup.layout`. Each chosen
database gets a :class:`~lchat.replica.replicator.Replicator` on the backup bucket with the
``batched`` cadence of ``LCHAT_BACKUP_INTERVAL`` (a commit is in the backup within it; a quiet
database costs one ``stat`` per interval and no request). The choice is re-made when the route
table changes, when the activator lets go of a host, and every ``rescan`` seconds (new files,
``LCHAT_BACKUP_EXTRA`` globs).

Invariants:

- **One replicator per database.** A database's replicator here starts only while its row is not
  hibernating and the activator does not hold its host (:class:`~lchat.units.Claims`); the
  activator's wake awaits the claims' hand-over, :meth:`Backup.release` of the database here,
  before it touches it (a final
  sync, then the replicator is stopped). Going back, the activator's stand-down ends before it
  releases the claim that lets a replicator here start. Operations on one database are
  serialised (a per-database lock), so a release waits for a start in progress and stops it.
- **Bounded hand-over.** The final sync of a release may take ``release_budget`` seconds; a
  backup bucket that is down then costs the hand-over that long, never the wake's correctness
  (the activator snapshots the database to its own bucket at its first wake).
- **Exclusive, enforced.** A replicator here runs only while this process holds its database's
  :class:`~lchat.backup.lock.ReplicaLock` (``<data>/.backup/<name>.lock``), taken before the
  replicator opens the database and let go after it closed it. Held elsewhere (``lchat backup
  replicate``: a unit that kept shipping while the router was down), the database is ``held
  elsewhere``: said once, counted in the gauge, tried again at every rescan, never a failure.
- **A start that fails is retried** (backoff 1 s doubling to 5 min); a bucket that fails while
  running is the replicator's to ride out (uploads stay queued, nothing is lost locally).
- Every state change is a log line and a metric (``lchat_backup_databases{state}``,
  ``lchat_backup_lag_seconds{db}``, ``lchat_backup_handovers_total``, and the per-database
  request, byte and error counters of :mod:`lchat.backup.metered`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from attrs import define, field
from prometheus_client import Counter, Gauge
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, DeferredLock, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from lchat import hosts
from lchat.backoff import Backoff
from lchat.backup import envfiles, litestream_yml, selection
from lchat.backup.layout import Layout
from lchat.backup.lock import ReplicaLock, lock_path
from lchat.backup.metered import MeteredStore
from lchat.config import BackupConfig
from lchat.deferutil import settled
from lchat.objstore import NotFound, ObjectStore
from lchat.registry import RouteTable
from lchat.replica.db import PageFds
from lchat.replica.replicator import Replicator
from lchat.routesource import RouteSource
from lchat.threads import RunInThread
from lchat.units import Claims

_log = Logger(namespace="lchat.backup")

HELD_ELSEWHERE = "held elsewhere"  # another process replicates it (lchat backup replicate)
STATES = ("starting", "running", "failed", "stopping", HELD_ELSEWHERE)
_databases = Gauge("lchat_backup_databases", "Databases in the backup by state", ["state"])
_lag = Gauge(
    "lchat_backup_lag_seconds",
    "Seconds since the oldest commit not yet in the backup was noticed (at scrape time)",
    ["db"],
)
HANDOVERS = Counter(
    "lchat_backup_handovers_total",
    "Databases handed from the backup to the activator (a wake after hibernate --on)",
)
UNPROTECTED = Gauge(
    "lchat_backup_unprotected_env_files",
    "Spaces' env files (secrets) not in the backup: LCHAT_BACKUP_KEY is unset",
)
ENV_UPLOADS = Counter(
    "lchat_backup_env_uploads_total",
    "Env files uploaded to the backup (sealed), by outcome",
    ["outcome"],
)
START_BACKOFF = Backoff(1.0, 300.0)
RESCAN = 30.0  # seconds between scans for new databases (and retries of failed starts)
RELEASE_BUDGET = 30.0  # the longest a hand-over's final sync may take
UNPROTECTED_REMINDER = 86400.0  # without the key, the unprotected env files are said this often

ReplicatorFactory = Callable[[ObjectStore, str, str], Replicator]  # (store, db path, replica path)


@define(eq=False)
class _Database:
    chosen: selection.Chosen
    store: MeteredStore
    flock: ReplicaLock  # held from before the replicator opens the database to after it closed
    lock: DeferredLock = field(factory=DeferredLock)
    holder: str = ""  # while held elsewhere: what the lock file says of its holder
    replicator: Replicator | None = None
    state: str = "starting"
    since: float = 0.0
    failures: int = 0
    retry_at: float = 0.0
    gone: bool = False  # stopped for good: a newer entry may take the name
    # The stop under way (at most one): every waiter watches it through settled(), so a waiter
    # that gives up (a cancelled wake) never cancels the stop itself.
    stop: Deferred[None] | None = None


class Backup(Service):
    """Keeps one backup replicator per chosen database (see the module docstring)."""

    name = "backup"

    def __init__(
        self,
        reactor: IReactorTime,
        store: ObjectStore,
        cfg: BackupConfig,
        routes: RouteSource,
        claims: Claims,
        *,
        registry: str,
        data_dir: str,
        run_in_thread: RunInThread,
        replicator: ReplicatorFactory | None = None,
        rescan: float = RESCAN,
        release_budget: float = RELEASE_BUDGET,
    ) -> None:
        self._reactor = reactor
        self._store = store
        self._cfg = cfg
        self.layout = Layout(cfg.prefix, cfg.box)
        self._routes = routes
        self._claims = claims
        self._registry = registry
        self._data_dir = data_dir
        self._external: frozenset[str] = frozenset()  # what LCHAT_BACKUP_CONFIG lists
        self._external_error = ""  # why it could not be read last time ("": it could)
        self._run = run_in_thread
        self._make = replicator or self._replicator
        self._rescan = rescan
        self._release_budget = release_budget
        self._dbs: dict[str, _Database] = {}  # by name
        self._problems: tuple[str, ...] = ()
        self._skipped: dict[str, str] = {}  # path -> why: stale databases a glob matched
        self._scanning: Deferred[None] | None = None
        self._again = False  # a change arrived during a scan: scan once more after it
        self._tick: IDelayedCall | None = None
        self._stopping = False
        self._page_fds = PageFds()  # descriptors our replicators never close (replica/db.py)
        # host -> database path the activator took (release() until the claim's release): never
        # ours, and never opened here, whatever the table says by then.
        self._handed: dict[str, str] = {}
        self._env_sent: dict[str, str] = {}  # env file path -> sha256 of what is in the bucket
        # The box's env manifest (envfiles): None until read from the bucket once; then each env
        # file's newest sealed generation, carried forward across starts.
        self._env_manifest: envfiles.Manifest | None = None
        self._env_manifest_due = False  # an upload since the manifest was last written
        self._env_unreadable: set[str] = set()  # logged once each
        # Without the key: the env files not in the backup (None until the first scan), and
        # when they were last said.
        self._unprotected: list[str] | None = None
        self._unprotected_said = 0.0
        routes.subscribe(self._table_changed)
        claims.on_release(self._released)
        claims.on_hand_over(self.release)

    def _replicator(self, store: ObjectStore, db: str, replica: str) -> Replicator:
        # One stat of the WAL per interval; what it finds ships at once.
        return Replicator(
            self._reactor, store, db, replica, interval=self._cfg.interval, page_fds=self._page_fds
        )

    # -- what is backed up -----------------------------------------------------------------------

    def rescan(self) -> Deferred[None]:
        """Re-make the choice now; fires once it is applied (starts and stops under way)."""
        if self._stopping:
            return succeed(None)
        if self._scanning is not None:
            self._again = True
            return self._scanning
        self._scanning = Deferred.fromCoroutine(self._scan())
        return self._scanning

    async def _scan(self) -> None:
        try:
            while True:
                self._again = False
                table = self._routes.table
                paths = selection.candidates(table, self._registry, self._data_dir)
                # Every database a replicator here may have open right now (they are only
                # added by _apply, after this scan): their headers must not be read.
                open_here = {db.chosen.path for db in self._dbs.values()}
                open_here |= set(self._handed.values())
                try:
                    present, extra = await self._run(
                        selection.scan, self._data_dir, self._cfg.extra, paths, open_here
                    )
                except Exception:
                    _log.failure("backup: could not scan the data dir")
                    return
                await self._read_external()
                self._apply(present, extra)
                if self._cfg.env_key:
                    await self._sync_env_files()
                else:
                    await self._count_unprotected()
                if not self._again or self._stopping:
                    return
        finally:
            self._scanning = None

    async def _read_external(self) -> None:
        """What an external Litestream's config (``LCHAT_BACKUP_CONFIG``) lists now: left out of
        this backup. Unreadable, the last list read stays (said once per distinct error)."""
        config_file = self._cfg.external_config
        try:
            self._external = await self._run(litestream_yml.listed, config_file)
        except litestream_yml.BackupConfigError as e:
            if str(e) != self._external_error:
                _log.error(
                    "backup: {error}: the databases it listed when last read stay out of the "
                    "backup ({count}); make it readable by the router's user",
                    error=e,
                    count=len(self._external),
                )
            self._external_error = str(e)
            return
        if self._external_error:
            _log.info("backup: {file} read again", file=config_file)
        self._external_error = ""

    def _apply(self, present: set[str], extra: list[str]) -> None:
        """On the reactor thread, with the table and the claims as they are *now*."""
        if self._stopping:
            return
        choice = selection.choose(
            self._routes.table,
            registry=self._registry,
            data_dir=self._data_dir,
            present=present,
            extra=extra,
            claimed=self._claims,
            excluded=set(self._handed.values()),
            external=self._external,
        )
        chosen, problems = choice.chosen, choice.problems
        if tuple(problems) != self._problems:
            for problem in problems:
                _log.error("backup: {problem}", problem=problem)
            self._problems = tuple(problems)
        for path, why in sorted(choice.skipped.items()):
            if self._skipped.get(path) != why:
                _log.info("backup: {path} is not backed up: {why}", path=path, why=why)
        self._skipped = choice.skipped
        now = self._reactor.seconds()
        for name, db in list(self._dbs.items()):
            wanted = chosen.get(name)
            if db.state != "stopping" and (wanted is None or wanted.path != db.chosen.path):
                self._stop(db, self._why_not(db.chosen, wanted))
        for name, wanted in chosen.items():
            known = self._dbs.get(name)
            if known is None:
                self._start(wanted)
            elif known.state == "failed" and now >= known.retry_at:
                known.state = "starting"
                Deferred.fromCoroutine(self._run_start(known))
            elif known.state == HELD_ELSEWHERE:
                # Its holder may have let go (the unit stopped): take it if so, quietly if not.
                Deferred.fromCoroutine(self._run_start(known))
        self._update_gauge()

    async def _sync_env_files(self) -> None:
        """Upload, sealed, every backed-up instance's env files that changed, then the box's
        manifest naming each one's newest generation (envfiles: a restore refuses an older
        copy). Nothing is uploaded until the manifest there has been read (a lost entry would
        unpin a file), and a manifest that failed to go up is retried at the next scan."""
        key = self._cfg.env_key
        if not key:
            return
        if self._env_manifest is None and not await self._load_env_manifest(key):
            return
        assert self._env_manifest is not None
        # Every instance's, hibernating ones too: a box rebuilt from the backup wakes those
        # from the hibernation bucket, and cannot start them without their env files either.
        paths = []
        for route in self._routes.table:
            if route.kind == "instance":
                paths += [hosts.env_path(self._data_dir, route.host)]
                paths += [hosts.bot_env_path(self._data_dir, route.host)]
        for path in paths:
            if self._stopping:
                return
            try:
                found = await self._run(envfiles.read, path)
            except OSError as e:
                if path not in self._env_unreadable:
                    self._env_unreadable.add(path)
                    _log.error(
                        "backup: cannot read {path} ({error}): it is not in the backup, and a "
                        "box rebuilt from the backup cannot start that space without it",
                        path=path,
                        error=e.strerror or e,
                    )
                continue
            self._env_unreadable.discard(path)
            if found is None or self._env_sent.get(path) == found[1]:
                continue
            content, digest = found
            name = os.path.basename(path)
            last = self._env_manifest.files.get(name, 0)
            generation = envfiles.next_generation(self._now_ns(), last)
            try:
                await self._store.put(
                    envfiles.key_for(self.layout.box_path(), name),
                    envfiles.seal(self.layout, name, content, key, generation),
                )
            except Exception as e:
                ENV_UPLOADS.labels("failed").inc()
                _log.warn("backup: could not upload {name}: {error}", name=name, error=e)
                continue
            ENV_UPLOADS.labels("ok").inc()
            self._env_sent[path] = digest
            self._env_manifest = envfiles.Manifest(
                self._env_manifest.generation, {**self._env_manifest.files, name: generation}
            )
            self._env_manifest_due = True
            _log.info("backup: {name} (sealed) is in the backup", name=name)
        if self._env_manifest_due:
            await self._put_env_manifest(key)

    async def _count_unprotected(self) -> None:
        """Without the key: count the env files the backup does not hold (the gauge), and say
        so at the first scan (every start), whenever the count changes, and daily."""
        try:
            files = await self._run(envfiles.on_disk, self._data_dir)
        except OSError as e:
            _log.warn("backup: cannot list the env files: {error}", error=e)
            return
        UNPROTECTED.set(len(files))
        now = self._reactor.seconds()
        due = now - self._unprotected_said >= UNPROTECTED_REMINDER
        if files == self._unprotected and not due:
            return
        self._unprotected, self._unprotected_said = files, now
        if not files:
            _log.info("backup: no env files to protect (LCHAT_BACKUP_KEY is not set)")
            return
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        _log.warn(
            "backup: {count} env file{s} (space secrets) {are} NOT backed up: LCHAT_BACKUP_KEY "
            "is not set (LCHAT_BACKUP_ENV=unprotected). A box rebuilt from the backup cannot "
            "start those spaces without them: {files}",
            count=len(files),
            s="s" if len(files) != 1 else "",
            are="are" if len(files) != 1 else "is",
            files=shown,
        )

    def _now_ns(self) -> int:
        return int(self._reactor.seconds() * 1e9)

    async def _load_env_manifest(self, key: bytes) -> bool:
        """Read the box's env manifest once (what earlier starts sealed); False: not now."""
        try:
            blob = (await self._store.get(envfiles.manifest_key(self.layout.box_path()))).body
        except NotFound:
            self._env_manifest = envfiles.Manifest(0, {})
            return True
        except Exception as e:
            ENV_UPLOADS.labels("manifest_unreadable").inc()
            _log.warn(
                "backup: cannot read the env manifest ({error}): env files wait for the next scan",
                error=e,
            )
            return False
        try:
            self._env_manifest = envfiles.unseal_manifest(self.layout, blob, key)
        except envfiles.SealError as e:
            # Not ours to trust (another key, moved, altered): started afresh. Every file this
            # router can read is re-sealed and named anew; what it cannot read stays unpinned.
            ENV_UPLOADS.labels("manifest_refused").inc()
            _log.error("backup: {error}: writing a new one", error=e)
            self._env_manifest = envfiles.Manifest(0, {})
            self._env_manifest_due = True
        return True

    async def _put_env_manifest(self, key: bytes) -> None:
        assert self._env_manifest is not None
        manifest = envfiles.Manifest(
            envfiles.next_generation(self._now_ns(), self._env_manifest.generation),
            self._env_manifest.files,
        )
        try:
            await self._store.put(
                envfiles.manifest_key(self.layout.box_path()),
                envfiles.seal_manifest(self.layout, manifest, key),
            )
        except Exception as e:
            ENV_UPLOADS.labels("manifest_failed").inc()
            _log.warn("backup: could not upload the env manifest: {error}", error=e)
            return
        ENV_UPLOADS.labels("manifest_ok").inc()
        self._env_manifest = manifest
        self._env_manifest_due = False

    def _why_not(self, was: selection.Chosen, now: selection.Chosen | None) -> str:
        """Why a database we replicate is no longer ours, for the log."""
        if now is not None:
            return f"the name {was.name} is now {now.path}"
        if was.host:
            route = self._routes.table.get(was.host)
            if route is None:
                return f"{was.host} was removed"
            if route.hibernate or was.host in self._claims:
                return f"{was.host} hibernates: the activator replicates it"
        return "no longer chosen (gone, or no longer matched)"

    def _table_changed(self, old: RouteTable, new: RouteTable) -> None:
        self.rescan()

    def _released(self, host: str) -> None:
        self._handed.pop(host, None)
        self.rescan()  # the activator let go of it: ours again, if it is not hibernating

    # -- one database ----------------------------------------------------------------------------

    def _start(self, chosen: selection.Chosen) -> None:
        store = MeteredStore(self._store, chosen.name, self._reactor)
        flock = ReplicaLock(lock_path(self._data_dir, chosen.name), "router")
        db = _Database(chosen, store, flock, since=self._reactor.seconds())
        self._dbs[chosen.name] = db
        Deferred.fromCoroutine(self._run_start(db))

    async def _run_start(self, db: _Database) -> None:
        async with db.lock:
            if db.state not in ("starting", HELD_ELSEWHERE):
                return  # stopped before it could start, or started by an earlier call
            name, path = db.chosen.name, db.chosen.path
            replica = self.layout.replica_path(name)
            error: OSError | None = None
            try:
                mine: bool = await self._run(db.flock.acquire)
            except OSError as e:
                mine, error = False, e
            if db.state not in ("starting", HELD_ELSEWHERE):
                await self._run(db.flock.release)
                return  # stopped meanwhile: the stop waits on our lock
            if error is None and not mine:
                await self._held_elsewhere(db)
                return
            if mine and db.holder:
                _log.info(
                    "backup: {name}: its other replicator ({holder}) let go; the router takes it",
                    name=name,
                    holder=db.holder,
                )
                db.holder = ""
            db.state = "starting"
            replicator: Replicator | None = None
            try:
                if error is not None:
                    raise error
                replicator = self._make(db.store, path, replica)
                await replicator.start()
            except Exception as e:
                if replicator is not None:
                    await replicator.stop()
                await self._run(db.flock.release)
                if db.state != "starting":
                    return
                db.failures += 1
                delay = START_BACKOFF.delay(db.failures)
                db.state = "failed"
                db.retry_at = self._reactor.seconds() + delay
                db.store.last_error = db.store.last_error or str(e)
                _log.error(
                    "backup: {name} cannot start replicating to {replica}: {error} (retry in "
                    "{delay:.0f}s)",
                    name=name,
                    replica=replica,
                    error=e,
                    delay=delay,
                )
                self._schedule(delay)
                self._update_gauge()
                return
            db.replicator = replicator
            if db.state != "starting":
                return  # stopped while it started (a hand-over): the stop waits on our lock
            db.state = "running"
            db.failures = 0
            db.since = self._reactor.seconds()
            _lag.labels(name).set_function(replicator.lag)
            _log.info(
                "backup: {name} ({path}) replicating to {replica} every {interval:g}s, txid "
                "{txid:016x}",
                name=name,
                path=path,
                replica=replica,
                interval=self._cfg.interval,
                txid=replicator.txid,
            )
            self._update_gauge()

    async def _held_elsewhere(self, db: _Database) -> None:
        """Another process holds ``db``'s lock: not ours until it lets go (a rescan retries)."""
        holder = await self._run(db.flock.holder) or "another process"
        if db.state not in ("starting", HELD_ELSEWHERE):
            return  # stopped meanwhile
        if db.state == HELD_ELSEWHERE and db.holder == holder:
            return
        db.state, db.holder = HELD_ELSEWHERE, holder
        db.since = self._reactor.seconds()
        _log.info(
            "backup: {name} is replicated by another process ({holder}: lock {lock}): not "
            "started here; the router takes it over once that one stops",
            name=db.chosen.name,
            holder=holder,
            lock=db.flock.path,
        )
        self._update_gauge()

    def _stop(self, db: _Database, why: str) -> Deferred[None]:
        """Stop ``db`` (once; a second call watches the first): fires when no replicator here
        runs on it. The returned Deferred may be cancelled without cancelling the stop."""
        if db.stop is None:
            db.state = "stopping"
            self._update_gauge()
            db.stop = Deferred.fromCoroutine(self._run_stop(db, why))
            db.stop.addErrback(
                lambda f: _log.failure("backup: stopping {name} failed", f, name=db.chosen.name)
            )
            # A name chosen again meanwhile (a path change, a flip back) starts at once.
            db.stop.addCallback(lambda _: self.rescan())
        return settled(db.stop)

    async def _run_stop(self, db: _Database, why: str) -> None:
        async with db.lock:
            name = db.chosen.name
            replicator, db.replicator = db.replicator, None
            if replicator is not None:
                synced = await self._final_sync(db, replicator)
                await replicator.stop()
                _log.info(
                    "backup: {name} stopped ({why}); {synced}",
                    name=name,
                    why=why,
                    synced=f"in the backup up to txid {replicator.txid:016x}"
                    if synced
                    else "its last commits may not be in the backup",
                )
            # After the replicator closed the database: only then may another one open it.
            await self._run(db.flock.release)
            db.gone = True
            if self._dbs.get(name) is db:
                del self._dbs[name]
                with contextlib.suppress(KeyError):
                    _lag.remove(name)
                db.store.forget()
            self._update_gauge()

    async def _final_sync(self, db: _Database, replicator: Replicator) -> bool:
        flush = Deferred.fromCoroutine(replicator.flush())
        flush.addTimeout(self._release_budget, self._reactor)
        try:
            await flush
        except Exception as e:
            _log.warn(
                "backup: the final sync of {name} failed: {error}",
                name=db.chosen.name,
                error=e,
            )
            return False
        return True

    def release(self, host: str, db_path: str) -> Deferred[None]:
        """Hand ``db_path`` over to the activator, which has claimed ``host`` and is about to
        replicate it: fires once no replicator here runs on it, after a final sync bounded by
        ``release_budget``. From now until the claim is released the path is never chosen (nor
        opened) here, whatever the table says (a row removed or re-pointed meanwhile)."""
        path = os.path.abspath(db_path)
        self._handed[host] = path
        for db in list(self._dbs.values()):
            if db.chosen.path == path:
                HANDOVERS.inc()
                return self._stop(db, "handed to the activator")
        return succeed(None)

    # -- service ---------------------------------------------------------------------------------

    def _schedule(self, delay: float) -> None:
        if self._stopping:
            return
        when = self._reactor.seconds() + delay
        if self._tick is not None and self._tick.active():
            if self._tick.getTime() <= when:
                return
            self._tick.cancel()
        self._tick = self._reactor.callLater(delay, self._ticked)

    def _ticked(self) -> None:
        self._tick = None
        self.rescan()
        self._schedule(self._rescan)

    def startService(self) -> None:
        super().startService()
        _log.info(
            "backup: every database not hibernating goes to {bucket} under {root} (every "
            "{interval:g}s)",
            bucket=self._store.describe(),
            root=self.layout.box_path(),
            interval=self._cfg.interval,
        )
        # (Without LCHAT_BACKUP_KEY, the first scan says how many env files are unprotected.)
        UNPROTECTED.set(0)
        self.rescan()
        self._schedule(self._rescan)

    def stopService(self) -> Deferred[None]:
        """A final sync of every database, in parallel, each bounded; then the bucket closes."""
        super().stopService()
        self._stopping = True
        if self._tick is not None and self._tick.active():
            self._tick.cancel()
        stops = [self._stop(db, "shutdown") for db in list(self._dbs.values())]
        d: Deferred[Any] = DeferredList(stops, consumeErrors=True)
        d.addCallback(lambda _: Deferred.fromCoroutine(self._store.close()))
        return d.addCallback(lambda _: None)

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``GET /status``'s ``backup``: the bucket, the layout and every database's state."""
        now = self._reactor.seconds()
        databases: dict[str, Any] = {}
        for name, db in sorted(self._dbs.items()):
            r = db.replicator
            entry: dict[str, Any] = {
                "path": db.chosen.path,
                "why": db.chosen.why,
                "replica": self.layout.replica_path(name),
                "state": db.state,
                "since": round(now - db.since, 1),
                "txid": f"{r.txid:016x}" if r is not None else None,
                "lag": round(r.lag(), 3) if r is not None else None,
                "requests": db.store.requests,
                "bytes_up": db.store.bytes_up,
            }
            if db.chosen.host:
                entry["host"] = db.chosen.host
            if db.store.last_error:
                entry["last_error"] = db.store.last_error
                entry["last_error_ago"] = round(now - db.store.last_error_at, 1)
            if db.state == "failed":
                entry["retry_in"] = round(max(0.0, db.retry_at - now), 1)
            if db.state == HELD_ELSEWHERE:
                entry["held_by"] = db.holder
                entry["lock"] = db.flock.path
            databases[name] = entry
        return {
            "bucket": self._store.describe(),
            "box": self.layout.box,
            "prefix": self.layout.prefix,
            "interval": self._cfg.interval,
            "databases": databases,
            **({"problems": list(self._problems)} if self._problems else {}),
            **({"skipped": dict(sorted(self._skipped.items()))} if self._skipped else {}),
            "env_files": {
                "sealed": bool(self._cfg.env_key),
                "unprotected": len(self._unprotected or ()),
            },
        }

    def _update_gauge(self) -> None:
        for state in STATES:
            _databases.labels(state).set(sum(1 for d in self._dbs.values() if d.state == state))

"""Stream a live space's database to the bucket as Litestream-0.5 LTX files (docs/design.md §6).

One :class:`Replicator` per space. A *sync* reads the WAL's newly committed frames after what we
shipped (``ReplicaDB.read_committed``), encodes them as one level-0 LTX file and uploads it. When
to sync: every ``watch_interval`` (100 ms on ``stream``) one ``stat`` of the WAL says whether
anything was written; if so, a sync starts at once unless one started less than ``gap`` ago, so a
commit is durable within ``interval`` and a busy space costs one upload per ``gap``. A quiet space
costs no request at all. At start, and whenever the
log is not where we left it (``WALReset``/``WALRewritten``), a level-9 snapshot is shipped instead.
After an upload we run our own checkpoint when ``ReplicaDB.wanted_checkpoint`` asks for one.

Files are prepared (read, LZ4, CRC) in a worker thread into temp files and queued; the queue is
uploaded in order and a file leaves it only once the store accepted it, so a store outage just
leaves it queued for the next sync (nothing newer is read meanwhile, and no checkpoint runs, so the
WAL — held by our read transaction — keeps everything). Before every upload the lease is checked;
once it is lost we stop for good and never write again.

Txids count uploaded files, as Litestream's do. At start we LIST ``<path>/`` once to continue
after the highest txid there, then snapshot: we cannot know whether our WAL continues whatever
wrote those files (a caller that vouches for the database resumes instead, if the files there
restore to exactly its txid).

A bucket that forgets (the store restarted empty, the prefix deleted, a lifecycle rule) must never
be left with incrementals that have no snapshot under them, yet steady state must not pay a LIST
per upload. So the replica is checked (one LIST, compared with the files we know we wrote) only
when something says the bucket may have changed under us: after any failed write (a store that
restarts fails first), when the lease finds its lock vanished (:meth:`recheck`, from the keeper's
``verify_retake``), and before the final flush at sleep (``flush(check=True)``). If files we wrote
are missing, the queue is dropped (a snapshot covers it) and the next upload is a level-9 snapshot
of the local database at a txid above everything seen, then retention deletes the leftovers: the
bucket is *re-seeded* (``lchat_replica_reseeds_total``). Until such a check runs, incrementals may
land in a forgotten prefix; the lease renewal bounds that to a third of the lease TTL.

Maintenance (Litestream 0.5's levels, see :mod:`lchat.replica.compact`) runs on the ticks, under the
same lock, from the in-memory list of files we know are in the bucket (the start LIST plus what we
uploaded): every ``compaction[level]`` seconds each contiguous run of level ``level - 1`` files is
downloaded, merged in the worker thread, uploaded as one level-``level`` file, and only then are
its inputs deleted; every ``snapshot_interval`` seconds, if anything was shipped since the last
snapshot, a new level-9 snapshot is shipped and, once durable, every file wholly older than it is
deleted. With nothing new to act on, none of this issues a request. The lease is checked before
every upload and every delete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Gauge
from twisted.internet.defer import CancelledError, Deferred, DeferredLock
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from lchat.deferutil import observe
from lchat.lease import LeaseKeeper, LeaseLost, LeaseSuspended
from lchat.objstore import ObjectInfo, ObjectStore, ObjectStoreError
from lchat.replica import compact as _compact
from lchat.replica import ltx
from lchat.replica.db import PageFds, ReplicaDB
from lchat.replica.encode import Encoder, Prepared, make_tmp, rfc3339_nano, unlink_quietly
from lchat.replica.restore import (
    SNAPSHOT_LEVEL,
    TIMESTAMP_METADATA,
    parse_timestamp,
    replica_files,
    restores_to,
)
from lchat.replica.wal import WALPosition, WALReset, WALRewritten
from lchat.threads import DaemonThreadPool, RunInThread

_log = Logger()

# The txids a replicator skips after a lease takeover (Replicator.start): the old holder can
# have at most one upload in flight, naming at most the next txid; the rest is margin.
TAKEOVER_TXID_GAP = 8

_uploads = Counter(
    "lchat_replica_uploads_total", "LTX uploads by level and outcome", ["level", "outcome"]
)
_bytes = Counter("lchat_replica_bytes_total", "LTX bytes uploaded")
RESEEDS = Counter(
    "lchat_replica_reseeds_total",
    "Snapshots shipped because the bucket lost replica files (the bucket lost data), by what "
    "noticed it",
    ["trigger"],
)
# lease: the lease's lock vanished and was re-taken; write_error: a check after a failed write;
# flush: the check before the final flush at sleep; start: a replicator told to resume found the
# files no longer restore to its txid; wake: the activator found the bucket behind a local copy.
for _trigger in ("lease", "write_error", "flush", "start", "wake"):
    RESEEDS.labels(_trigger)
_lag = Gauge(
    "lchat_replica_lag_seconds",
    "Seconds since the oldest commit not yet in the bucket was noticed (computed at scrape time)",
    ["path"],
)

# Replication classes (docs/design.md §6): the longest a commit may wait before it is durable.
INTERVALS = {"stream": 1.0, "batched": 300.0, "daily": 86400.0}

# How often a ``stream`` replicator looks at the WAL (one stat, no read) for new commits.
STREAM_WATCH = 0.1
# Headroom for reading, encoding and uploading a sync within the class's interval.
_UPLOAD_MARGIN = 0.05


class ReplicatorStopped(Exception):
    """The replicator is stopped (or lost its lease) and will not write again."""


class ReplicaPaused(ObjectStoreError):
    """The lease's lock vanished and is being re-taken: nothing is written until it is. Handled
    like a store outage (what is queued stays queued and is retried)."""


class Replicator:
    def __init__(
        self,
        reactor: IReactorTime,  # and IReactorFromThreads without a run_in_thread
        store: ObjectStore,
        db_path: str,
        replica_path: str,  # "<prefix>/<host>"
        *,
        interval: float = INTERVALS["stream"],
        watch_interval: float | None = None,  # default: STREAM_WATCH when interval <= 1 s
        keeper: LeaseKeeper | None = None,
        run_in_thread: RunInThread | None = None,
        db_options: Mapping[str, int] | None = None,  # ReplicaDB's tuning (tests: tiny thresholds)
        tmp_dir: str | None = None,
        compaction: Mapping[int, float] | None = None,  # level -> seconds (Litestream's defaults)
        snapshot_interval: float = _compact.DEFAULT_SNAPSHOT_INTERVAL,
        compacted_retention: float = 300.0,
        page_fds: PageFds | None = None,  # for databases other code here also opens (db.py)
    ) -> None:
        self._reactor = reactor
        self._store = store
        self.db_path = db_path
        self.path = replica_path.rstrip("/")
        self.interval = interval
        if watch_interval is None:
            watch_interval = STREAM_WATCH if interval <= 1.0 else interval
        self.watch_interval = min(watch_interval, interval)
        # Syncs start at least ``gap`` apart: a commit right after a sync waits at most that
        # long, and a busy space costs one upload per gap (no more than Litestream's per-second
        # sync). A quiet space's lone commit is noticed by the next watch and shipped at once.
        if self.watch_interval < interval:
            self.gap = max(interval - self.watch_interval - _UPLOAD_MARGIN, self.watch_interval)
        else:
            self.gap = interval
        self._seen: tuple[int, int, int] | None = None  # the WAL's stat at the last sync
        self._last_sync = float("-inf")
        self._keeper = keeper
        self._pool: ThreadPool | None = None
        if run_in_thread is None:
            # One thread: ReplicaDB takes one call at a time, and a slow disk here must not
            # starve the reactor's shared pool.
            self._pool = DaemonThreadPool(minthreads=0, maxthreads=1, name=f"replica {self.path}")
            pool, back = self._pool, IReactorFromThreads(reactor)
            run_in_thread = lambda f, *a: deferToThreadPool(back, pool, f, *a)  # noqa: E731
        self._run = run_in_thread
        self._db = ReplicaDB(db_path, **dict(db_options or {}), page_fds=page_fds)
        self._tmp_root = tmp_dir
        self._tmp: str | None = None
        self._lock = DeferredLock()
        self._call: IDelayedCall | None = None
        self._queue: list[Prepared] = []
        self._pos: WALPosition | None = None  # end of what is prepared (shipped once queue empty)
        self.txid = 0  # the last txid prepared (uploaded too, when nothing is queued)
        self._need_snapshot = True
        # When the oldest commit not yet in the bucket was noticed (None: everything is there).
        # The gauge is computed from it at scrape time: an upload hanging on a frozen store
        # produces no event at all, and the lag must still be seen to grow.
        self._pending_since: float | None = None
        self._started = False
        self.stopped = False  # no more writes (for good)
        # A write (upload or delete) was sent: one whose answer was an error or never came may
        # still land, at any time (docs/lease.md, "Late writes").
        self.wrote = False
        self._stopping: Deferred[None] | None = None  # stop()'s work, which every caller awaits
        self.lost: str | None = None  # why the lease was lost, if it was
        self.snapshots = 0
        self.checkpoints = 0
        self.compactions = 0
        self.deleted = 0
        levels = dict(_compact.DEFAULT_LEVELS if compaction is None else compaction)
        if any(not 1 <= lvl < SNAPSHOT_LEVEL for lvl in levels):
            raise ValueError(f"compaction levels must be 1..{SNAPSHOT_LEVEL - 1}: {levels}")
        self._levels = dict(sorted(levels.items()))
        self.snapshot_interval = snapshot_interval
        self._known = _compact.Inventory()  # what we know is in the bucket
        self._last_compaction: dict[int, float] = {}
        self._last_snapshot = 0.0
        self._writing: Deferred[Any] | None = None  # the store write in flight
        # Compacted inputs are deleted this long after their replacement is durable (as
        # Litestream keeps level 0 a while): readers mid-restore still find them, and the
        # deletes of a busy minute go out together instead of after every compaction.
        self.compacted_retention = compacted_retention
        self._listed = False  # the start LIST is in _known: a check can compare with it
        # Why the replica must be checked (one LIST) before anything more is written; None: no
        # reason to doubt the bucket. See the module docstring.
        self._check: str | None = None
        self._retain_after_snapshot = False  # a re-seed: once its snapshot is durable, tidy up

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(
        self,
        listing: Sequence[ObjectInfo] | None = None,
        *,
        resume_txid: int | None = None,
        txid_floor: int = 0,
        after_takeover: bool = False,
    ) -> None:
        """Begin replicating. ``listing``: a LIST of ``<path>/`` the caller just made under the
        same lease (saves ours).

        ``resume_txid``: the caller vouches that the database is exactly the state at that txid
        (restored just now, or slept here cleanly after shipping it) and that nothing else writes
        it before we are started. If it is the bucket's newest txid *and* the files there restore
        to it (a snapshot, then no gap), we continue without the first snapshot: everything in the WAL (including our own open) goes out as
        the next level-0 file — pages already shipped are harmless. Files that no longer restore
        to it mean the bucket lost some: that start is a re-seed (snapshot, counted, logged).

        ``txid_floor``: txids continue above it even if the bucket's files end lower — the
        caller re-seeds an emptied bucket from a copy that once matched that txid, and a txid
        must never name two different states of one space.

        ``after_takeover``: the lease was taken over from another holder (expired, dead or
        restarted box). That holder may still have one write in flight (its operations are
        sequential, and it checked its lease before sending it), which can land at any time
        with the next txid after what we list. So we never resume, and our first snapshot
        skips :data:`TAKEOVER_TXID_GAP` txids: a late file of the old holder lies below our
        snapshot, where no restore reads it, and it can never replace a file of ours
        (docs/lease.md, "Late writes").
        """
        if self._started:
            raise RuntimeError("Replicator.start() called twice")
        self._started = True
        if self._pool is not None:
            self._pool.start()
        self._tmp = await self._run(make_tmp, self._tmp_root)
        self._encoder = Encoder(self._db, self.path, self._tmp, self._reactor.seconds)
        await self._run(self._db.open)
        # Under the lock from the LIST on: a recheck() meanwhile compares with this LIST.
        async with self._lock:
            # Continue after whatever txid is already there.
            if listing is None:
                listing = await self._store.list(self.path + "/")
            files = replica_files(list(listing))
            self.txid = max(max((f.max_txid for f in files), default=0), txid_floor)
            if after_takeover:
                resume_txid = None
                self.txid += TAKEOVER_TXID_GAP
            for f in files:
                self._known.remember(
                    _compact.Entry(
                        f.level, f.min_txid, f.max_txid, f.info.key, rfc3339_nano(f.created_at)
                    )
                )
            self._listed = True
            resumed = resume_txid is not None and 0 < resume_txid == self.txid
            if resumed and restores_to(files) != resume_txid:
                resumed = False
                RESEEDS.labels("start").inc()
                _log.error(
                    "replica {path}: THE BUCKET LOST DATA: the local database matches txid "
                    "{txid}, but the files there no longer restore to it (no snapshot, or a gap): "
                    "re-seeding the replica with a snapshot of the local database",
                    path=self.path,
                    txid=f"{resume_txid:016x}",
                )
            if resumed:
                self._need_snapshot = False
                self._pos = None  # the whole current WAL: every page written since resume_txid
                _log.info(
                    "replica {path}: resuming after txid {txid} (the local database matches it)",
                    path=self.path,
                    txid=f"{self.txid:016x}",
                )
            now = self._reactor.seconds()
            self._last_compaction = dict.fromkeys(self._levels, now)
            self._last_snapshot = now
            _lag.labels(self.path).set_function(self.lag)
            await self._sync_locked()
            if self._queue:
                raise ObjectStoreError(f"replica {self.path}: initial upload not done")
            if not resumed:
                # A new snapshot is durable: what came before it is history we do not keep.
                await self._retain_locked()
        self._schedule()

    async def stop(self) -> None:
        """Stop syncing and close the database; nothing is written after this returns, for
        every caller: a second call while the first is under way waits for it (a cleanup that
        finds the replicator stopping itself, after a lost lease, must not go on while its
        database is still open)."""
        if self._stopping is None:
            self._stopping = Deferred.fromCoroutine(self._stop())
        await observe(self._stopping)

    async def _stop(self) -> None:
        self.stopped = True
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        if self._writing is not None:
            self._writing.cancel()  # after a flush nothing is in flight; after a loss, cut it
        async with self._lock:  # let a sync in flight finish (it checks _stopped before writes)
            pass
        try:
            _lag.remove(self.path)
        except KeyError:
            pass  # never started
        if self._started:
            await self._run(self._db.close)
            if self._tmp is not None:
                await self._run(shutil.rmtree, self._tmp, True)
        if self._pool is not None and self._pool.started:
            self._pool.stop()

    async def flush(self, *, check: bool = False) -> None:
        """Sync now; return once everything committed so far is in the bucket, else raise.

        ``check``: first compare the replica with what we wrote (one LIST) and re-seed it if the
        bucket lost any of it — for the last flush before a space sleeps, after which the
        bucket's copy is all that exists off this box."""
        self._ensure_running()
        async with self._lock:
            # Stopped while we waited for the lock (a tick that held it found the lease lost):
            # nothing more goes up, and what was written is not in the bucket.
            self._ensure_running()
            if check and self._check is None:
                self._check = "flush"
            await self._sync_locked()
            self._ensure_running()
            if self._queue:
                raise ObjectStoreError(
                    f"replica {self.path}: {len(self._queue)} files not uploaded"
                )

    async def recheck(self, trigger: str = "lease") -> bool:
        """Compare the replica in the bucket with what this replicator wrote (one LIST), now.

        Files of ours missing: re-seed (the queue is dropped, the next upload is a snapshot, see
        the module docstring); True. Files someone else wrote (a snapshot we did not write, or
        anything above our newest txid): False and nothing changes — for the lease keeper whose
        lock vanished, this means another writer held the space meanwhile. True otherwise.
        Raises :class:`ObjectStoreError` when the LIST fails.
        """
        self._ensure_running()
        async with self._lock:
            if not self._listed or self.stopped:
                return True  # start() has not listed yet: its own LIST will see the truth
            return await self._check_locked(trigger, foreign_is_takeover=True)

    async def _check_locked(self, trigger: str, *, foreign_is_takeover: bool = False) -> bool:
        listing = await self._store.list(self.path + "/")
        files = replica_files(list(listing))
        present = {f.info.key for f in files}
        ours = self._known.entries()
        known = self._known.known() | {p.key for p in self._queue}
        ours_max = max((e.max_txid for e in ours), default=0)
        # Another writer continues after the highest txid it saw, and its first file is a
        # snapshot. A key of ours we lost track of (a write whose answer was lost) is neither.
        foreign = [
            f
            for f in files
            if f.info.key not in known and (f.level == SNAPSHOT_LEVEL or f.max_txid > ours_max)
        ]
        # (A key whose delete is pending is no loss if it is gone.)
        missing = [e for e in ours if e.key not in present and e.key not in self._known.garbage]
        self._check = None
        if foreign and foreign_is_takeover:
            _log.error(
                "replica {path}: the bucket holds files this box did not write ({keys}): "
                "another writer had the space while the lock was missing",
                path=self.path,
                keys=", ".join(f.info.key for f in foreign[:5]),
            )
            return False
        if missing or foreign:
            await self._reseed(trigger, missing, [f.max_txid for f in foreign], len(files))
        else:
            _log.debug(
                "replica {path}: checked ({trigger}): intact", path=self.path, trigger=trigger
            )
        return True

    async def _reseed(
        self, trigger: str, missing: list[_compact.Entry], foreign: list[int], there: int
    ) -> None:
        """Forget what the bucket lost, drop the queue (the snapshot covers it) and make the next
        upload a snapshot above every txid seen; retention tidies up once it is durable."""
        for e in missing:
            await self._forget(e.key)
        dropped, self._queue = self._queue, []
        for p in dropped:
            await self._run(unlink_quietly, p.tmp_path)
        self.txid = max([self.txid, *foreign])
        self._known.snap_txid = max((e.max_txid for e in self.files(SNAPSHOT_LEVEL)), default=0)
        self._need_snapshot = True
        self._retain_after_snapshot = True
        RESEEDS.labels(trigger).inc()
        if missing:
            what = (
                f"THE BUCKET LOST DATA: {len(missing)} of the files this replica had written "
                f"are gone ({there} replica files left there)"
            )
        else:
            what = (
                f"files this box did not write appeared although it held the lease (txids up to "
                f"{max(foreign):016x}): is another replicator writing here?"
            )
        _log.error(
            "replica {path}: {what}; re-seeding it from the local database: a snapshot at txid "
            "{txid}, then incrementals as usual (noticed: {trigger})",
            path=self.path,
            what=what,
            txid=f"{self.txid + 1:016x}",
            trigger=trigger,
        )

    # -- the loop ----------------------------------------------------------------------------

    def _schedule(self, delay: float | None = None) -> None:
        if not self.stopped:
            wait = self.watch_interval if delay is None else max(delay, 0.0)
            self._call = self._reactor.callLater(wait, self._tick)

    def _tick(self) -> None:
        self._call = None
        if self.stopped:
            return
        now = self._reactor.seconds()
        changed = self._wal_stat() != self._seen
        if changed and self._pending_since is None:
            self._pending_since = now  # a commit since the last read: unshipped from now on
        want_sync = bool(self._queue) or self._need_snapshot or changed or bool(self._check)
        due = self._last_sync + self.gap
        if want_sync and now < due:
            # (Compared with the sum itself: "now - last < gap" can hold where "now < due" does
            # not, and a zero delay at the same instant would loop on a fake clock.)
            self._schedule(due - now)
            return
        if not want_sync and not self._maintenance_due(now):
            self._schedule()
            return
        d = Deferred.fromCoroutine(self._tick_async(want_sync))
        d.addBoth(lambda _: self._schedule())

    def _wal_stat(self) -> tuple[int, int, int] | None:
        # On the reactor thread on purpose: one metadata syscall (microseconds, no data read) is
        # far cheaper than a hop to the worker thread ten times a second.
        try:
            st = os.stat(self._db.wal_path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    async def _tick_async(self, want_sync: bool) -> None:
        try:
            async with self._lock:
                if want_sync:
                    await self._sync_locked()
                if not self._queue:
                    await self._maintain_locked(self._reactor.seconds())
        except Exception as e:
            if isinstance(e, ObjectStoreError) and not isinstance(e, ReplicaPaused):
                self._check = self._check or "write_error"  # the store may be back empty
            if not self.stopped:
                _log.warn("replica {path}: sync failed, retrying: {e!r}", path=self.path, e=e)

    async def _sync_locked(self) -> None:
        if self.stopped:
            return
        self._last_sync = self._reactor.seconds()
        seen = self._wal_stat()  # before the read: a commit after it shows as a change
        if self._check is not None:
            # Before anything more goes up: the bucket may have forgotten what it builds on.
            await self._check_locked(self._check)
        if not await self._drain():
            return
        if self._need_snapshot:
            await self._prepare_snapshot()
        else:
            got = await self._run(self._encoder.read_and_encode, self._pos, self.txid + 1)
            if isinstance(got, WALReset | WALRewritten):
                _log.warn(
                    "replica {path}: WAL reset ({why}); snapshotting",
                    path=self.path,
                    why=got.reason,
                )
                await self._prepare_snapshot()
            elif got is not None:
                self._enqueue(*got)
        self._seen = seen  # read (and queued): only a later change needs another sync
        shipped = bool(self._queue)
        if not await self._drain():
            return
        if shipped:  # only after an upload: an idle space gets no checkpoint dance every tick
            await self._maybe_checkpoint()
        if self._retain_after_snapshot and not self._need_snapshot and not self._queue:
            # A re-seed's snapshot is durable: what the forgetful bucket kept is history now.
            self._retain_after_snapshot = False
            await self._retain_locked()
        self._synced()

    def _update_lag(self) -> None:
        """Anything queued is unshipped: the lag runs from now at the latest."""
        if self._queue and self._pending_since is None:
            self._pending_since = self._reactor.seconds()

    def _synced(self) -> None:
        """After a whole sync (read, then every upload done): nothing is pending unless the WAL
        changed since the stat taken before the read; such commits came after that stat, so
        they count from when the read began."""
        if self._queue:
            self._update_lag()
        elif self._wal_stat() == self._seen:
            self._pending_since = None
        else:
            self._pending_since = self._last_sync

    def lag(self) -> float:
        """Seconds since the oldest commit not yet in the bucket was noticed (0: none); the
        gauge's value at scrape time."""
        if self._pending_since is None or self.stopped:
            return 0.0
        return max(0.0, self._reactor.seconds() - self._pending_since)

    def _enqueue(self, prepared: Prepared, end: WALPosition | None) -> None:
        self._queue.append(prepared)
        self._pos = end
        self.txid = prepared.txid

    async def _prepare_snapshot(self) -> None:
        prepared, end = await self._run(self._encoder.snapshot, self.txid + 1)
        self.snapshots += 1
        self._need_snapshot = False
        self._enqueue(prepared, end)

    async def _maybe_checkpoint(self) -> None:
        if self.stopped or self._queue:
            return
        captured: list[Prepared] = []
        result = await self._run(self._encoder.checkpoint, self._pos, self.txid, captured)
        if result is None:
            return
        self.checkpoints += 1
        for p in captured:
            self._queue.append(p)
            self.txid = p.txid
        if result.reset is not None:
            self._need_snapshot = True
        elif result.done:
            self._pos = result.position
        await self._drain()

    # -- uploads (reactor) -------------------------------------------------------------------

    async def _drain(self) -> bool:
        """Upload the queue in order; False if something is left (already logged)."""
        self._update_lag()
        while self._queue:
            p = self._queue[0]
            if self.stopped:
                return False
            try:
                await self._put(p.level, p.key, p.tmp_path, p.timestamp, p.size)
            except ReplicaPaused:
                return False  # the lock is being re-taken: stays queued, like an outage
            except ObjectStoreError as e:
                self._check = self._check or "write_error"  # the store may come back empty
                _uploads.labels(str(p.level), "error").inc()
                _log.warn(
                    "replica {path}: upload of txid {txid} failed, will retry: {e}",
                    path=self.path,
                    txid=f"{p.txid:016x}",
                    e=e,
                )
                self._update_lag()
                return False
            self._queue.pop(0)
            self._known.remember(_compact.Entry(p.level, p.min_txid, p.txid, p.key, p.timestamp))
            if p.level == 0 and 1 in self._levels:
                # Kept until compacted: compaction then reads it here instead of a GET.
                self._known.local[p.key] = p.tmp_path
            else:
                await self._run(os.unlink, p.tmp_path)
            what = "snapshot" if p.level == SNAPSHOT_LEVEL else "shipped"
            _log.info(
                "replica {path}: " + what + " txid {txid} ({pages} pages)",
                path=self.path,
                txid=f"{p.txid:016x}",
                pages=p.pages,
            )
        self._update_lag()
        return True

    async def _put(self, level: int, key: str, path: str, stamp: str, size: int) -> None:
        """Upload one LTX file, the lease checked first."""
        self._ensure_held(level)
        await self._write(self._store.put_file(key, path, metadata={TIMESTAMP_METADATA: stamp}))
        _uploads.labels(str(level), "ok").inc()
        _bytes.inc(size)

    async def _write(self, request: Any) -> Any:
        """Run one store write so that :meth:`stop` can abandon it (a lost lease must not wait
        for a hung upload, and should not let it land later if the connection can still be cut)."""
        self.wrote = True
        d = Deferred.fromCoroutine(request)
        self._writing = d
        try:
            return await d
        except CancelledError:
            raise ReplicatorStopped(self.lost or f"replica {self.path}: stopped") from None
        finally:
            self._writing = None

    def _ensure_held(self, level: int | None = None) -> None:
        """Before every write or delete: raise :class:`ReplicatorStopped` (for good) unless we
        still hold the lease."""
        self._ensure_running()
        try:
            if self._keeper is not None:
                self._keeper.ensure_held()
        except LeaseSuspended as e:
            raise ReplicaPaused(str(e)) from None
        except LeaseLost as e:
            self.lost = str(e) or "lease lost"
            _log.error("replica {path}: lease lost ({why}); stopping", path=self.path, why=e)
            _uploads.labels("delete" if level is None else str(level), "lease_lost").inc()
            # Mark stopped now (synchronously) so nothing else can write; tidy up later.
            self._reactor.callLater(0, lambda: Deferred.fromCoroutine(self.stop()))
            self.stopped = True
            raise ReplicatorStopped(self.lost) from e

    def _ensure_running(self) -> None:
        if self.stopped:
            raise ReplicatorStopped(self.lost or f"replica {self.path}: stopped")

    def files(self, level: int) -> list[_compact.Entry]:
        """The files this replicator believes are at ``level`` (no request)."""
        return self._known.files(level)

    # -- compaction, periodic snapshots, retention -------------------------------------------

    def _maintenance_due(self, now: float) -> bool:
        return (
            bool(self._known.garbage)
            or bool(self._known.retired and self._known.retired[0][0] <= now)
            or any(
                now - self._last_compaction.get(lvl, now) >= t for lvl, t in self._levels.items()
            )
            or now - self._last_snapshot >= self.snapshot_interval
        )

    async def _maintain_locked(self, now: float) -> None:
        """The timed work of a tick. Each step acts only on files uploaded since it last ran, so
        an idle space issues no request here (not even a LIST)."""
        if self.stopped:
            return
        if self._known.garbage:
            await self._delete_keys(list(self._known.garbage))
        if self._known.retired and self._known.retired[0][0] <= now:
            await self._delete_keys(self._known.due(now))
        for level, every in self._levels.items():
            if now - self._last_compaction.get(level, now) >= every:
                self._last_compaction[level] = now
                await self._compact_locked(level)
        if now - self._last_snapshot >= self.snapshot_interval:
            self._last_snapshot = now
            await self._snapshot_locked()

    async def _compact_locked(self, level: int) -> int:
        if not 1 <= level < SNAPSHOT_LEVEL:
            raise ValueError(f"cannot compact into level {level}")
        below = self.files(level - 1)
        if not below or self.stopped or self._need_snapshot:
            return 0  # (a snapshot is due first: nothing incremental goes up before it)
        written = 0
        for run in _compact.contiguous_runs(below):
            if self.stopped:
                break
            await self._compact_run(level, run)
            written += 1
        return written

    async def _compact_run(self, level: int, run: list[_compact.Entry]) -> None:
        assert self._tmp is not None
        work = await self._run(lambda: tempfile.mkdtemp(prefix="compact-", dir=self._tmp))
        try:
            inputs = []
            for i, e in enumerate(run):
                local = self._known.local.get(e.key)
                if local is not None:
                    inputs.append(local)  # we uploaded it: no need to download it back
                    continue
                path = os.path.join(work, f"{i:06d}.ltx")
                await self._store.get_to_file(e.key, path)
                inputs.append(path)
            out = os.path.join(work, "out.ltx")
            merged: _compact.Merged = await self._run(_compact.merge, inputs, out)
            h = merged.header
            key = ltx.object_key(self.path, level, h.min_txid, h.max_txid)
            # Litestream keeps the oldest source's time, so point-in-time restore still sees it.
            stamp = min(run, key=lambda e: parse_timestamp(e.timestamp)).timestamp
            await self._put(level, key, out, stamp, merged.size)
        finally:
            await self._run(shutil.rmtree, work, True)
        # Durable: only now may the files it replaces go.
        self._known.remember(_compact.Entry(level, h.min_txid, h.max_txid, key, stamp))
        self.compactions += 1
        _log.info(
            "replica {path}: compacted {n} files into level {lvl} {lo}-{hi} ({pages} pages)",
            path=self.path,
            n=len(run),
            lvl=level,
            lo=f"{h.min_txid:016x}",
            hi=f"{h.max_txid:016x}",
            pages=merged.pages,
        )
        now = self._reactor.seconds()
        for e in run:
            if e.key == key:
                continue
            await self._forget(e.key)  # replaced: no longer an input to anything
            self._known.retired.append((now + self.compacted_retention, e.key))

    async def _snapshot_locked(self) -> None:
        if self.stopped or self.txid <= self._known.snap_txid:
            return  # nothing new since the last snapshot: no request
        self._need_snapshot = True
        await self._sync_locked()
        if self._queue or self._need_snapshot:
            return
        await self._retain_locked()

    async def _retain_locked(self) -> None:
        """Delete every file wholly older than the newest durable snapshot."""
        await self._delete_keys(self._known.older_than(self._known.snap_txid))

    async def _forget(self, key: str) -> None:
        """``key`` is gone (or going): drop it, and our local copy of it."""
        local = self._known.forget(key)
        if local is not None:
            await self._run(unlink_quietly, local)

    async def _delete_keys(self, keys: list[str]) -> None:
        for i, key in enumerate(keys):
            try:
                self._ensure_held()
            except ReplicaPaused:
                # The lock is being re-taken: these deletes wait for the next pass.
                garbage = self._known.garbage
                garbage.extend(k for k in keys[i:] if k not in garbage)
                raise
            await self._forget(key)
            try:
                await self._write(self._store.delete(key))
            except ObjectStoreError as e:
                self._check = self._check or "write_error"
                _log.warn("replica {path}: delete {key} failed: {e}", path=self.path, key=key, e=e)
                if key not in self._known.garbage:
                    self._known.garbage.append(key)
                continue
            if key in self._known.garbage:
                self._known.garbage.remove(key)
            self.deleted += 1

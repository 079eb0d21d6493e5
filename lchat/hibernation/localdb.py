"""A hibernating space's local database, its clean-sleep marker, the copies moved aside, and the
wake's database step (docs/hibernation.md, "Waking" and "When the bucket forgets").

Files, for a database ``<db>`` (``<data>/<host>.db``):

- ``<db>-lchat.json``, the *marker*: the txid of the bucket's replica the local database is exactly
  (written at a clean sleep), valid only while the database and its WAL are untouched (their
  inode, size and mtime are recorded with it);
- ``<db>-lease.json``, the *lease record*: the lease generation under which the local database
  last became the space's copy (written by each wake once its space is ready). A lease
  taken back from this box's own earlier holding vouches for the local copy only when that holding
  is the one the record names: a holding whose wake never got that far (its lock PUT landed after
  the wake gave up) left the copy of an older tenure, which another box's writes may have passed;
- ``<db>.stale-<stamp>`` and ``<db>.lease-lost-<stamp>`` (with their ``-wal``, ``-shm``): copies
  moved aside, each dated by a record in the marker's format (``<copy>-lchat.json``) when the txid
  it holds at least is known.

:class:`Restorer` decides, at a wake, whether the local file is used as it is, restored from the
bucket, used to re-seed a bucket that forgot it, or refused (503 ``diverged``) — never silently
older or empty when a copy it can date holds more.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence

from attrs import define, frozen
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat import hosts
from lchat.files import write_atomic
from lchat.hibernation.space import WakeFailed
from lchat.lease import HeldLease
from lchat.objstore import ObjectInfo, ObjectStore, ObjectStoreError
from lchat.replica.encode import unlink_quietly
from lchat.replica.replicator import RESEEDS
from lchat.replica.restore import RestoreError, plan_files, replica_files, restore
from lchat.threads import RunInThread

_log = Logger(namespace="lchat.activator")

MARKER_SUFFIX = "-lchat.json"  # <db>-lchat.json: the txid a cleanly slept local DB matches
LEASE_SUFFIX = "-lease.json"  # <db>-lease.json: the lease generation it was last the copy under
_ASIDE_NAME = re.compile(r"\.(?:stale|lease-lost)-\d{8}T\d{6}")
_ASIDE_AT_END = re.compile(_ASIDE_NAME.pattern + r"\Z")


@frozen
class LocalState:
    present: bool
    marker_txid: int | None  # None: no marker, or the files changed since it was written
    # The lease generation the copy was last the space's copy under (None: no record, as a copy
    # from before the record existed, or one moved back: of unknown lineage).
    lease_generation: int | None = None


@frozen
class DBPlan:
    """What the wake's database step decided."""

    listing: Sequence[ObjectInfo] | None  # the replica's LIST, when one was made (reused)
    resume: int | None = None  # the local database is exactly this txid of the bucket's
    floor: int = 0  # replication's txids continue above this (a re-seed from a dated copy)


@frozen
class BucketView:
    """The replica as one LIST shows it."""

    newest: int  # the highest txid of any file (0: none)
    restorable: bool  # a restore reaches ``newest`` (a snapshot, no gap)
    error: str = ""  # why not

    @classmethod
    def of(cls, listing: Sequence[ObjectInfo]) -> BucketView:
        files = replica_files(list(listing))
        newest = max((f.max_txid for f in files), default=0)
        if newest == 0:
            return cls(0, True)
        try:
            reached = plan_files(files)[-1].max_txid
        except RestoreError as e:
            return cls(newest, False, str(e))
        return cls(newest, reached == newest, "" if reached == newest else "files beyond a gap")

    def lost_everything_up_to(self, txid: int) -> bool:
        """Nothing here that a copy at ``txid`` lacks: no files, or files that restore to
        nothing and reach no further (a forgetful bucket's stray incrementals)."""
        return self.newest == 0 or (not self.restorable and self.newest <= txid)

    def describe(self) -> str:
        if self.newest == 0:
            return "no replica files"
        if not self.restorable:
            return f"files up to txid {self.newest} that cannot be restored ({self.error})"
        return f"txid {self.newest}"


@frozen
class MovedAside:
    path: str  # <db>.stale-<stamp> or <db>.lease-lost-<stamp>
    txid: int | None  # what it holds at least, from its record (None: unrecorded or changed)


# -- files (blocking: call them in a worker thread) ------------------------------------------------


def fingerprint(db: str) -> list[list[int] | None]:
    """What the database and its WAL look like on disk: a later write changes it."""
    out: list[list[int] | None] = []
    for path in (db, db + "-wal"):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            out.append(None)
        else:
            out.append([st.st_ino, st.st_size, st.st_mtime_ns])
    return out


def local_state(db: str) -> LocalState:
    present = os.path.exists(db)
    marker: int | None = None
    if present:
        try:
            with open(db + MARKER_SUFFIX, "rb") as f:
                record = json.load(f)
            value = record.get("txid")
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and record.get("files") == fingerprint(db)
            ):
                marker = value
        except (OSError, ValueError, AttributeError):
            marker = None
    return LocalState(present, marker, read_lease_generation(db) if present else None)


def read_lease_generation(db: str) -> int | None:
    """The generation ``<db>-lease.json`` records (None: none, or unreadable)."""
    try:
        with open(db + LEASE_SUFFIX, "rb") as f:
            value = json.load(f).get("generation")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_lease_generation(db: str, generation: int) -> None:
    """Record that the local database is now the space's copy under lease ``generation`` (the
    wake writes it once the space is ready: its database step done, before any request of this
    tenure is let through; on an isolating box the space's directory exists only by then)."""
    write_atomic(db + LEASE_SUFFIX, json.dumps({"generation": generation}).encode(), 0o600)


def write_marker(db: str, txid: int, now: float) -> None:
    """Record that the local database is exactly the bucket's state at ``txid`` — valid only
    while the files are untouched (anything else writing them voids it)."""
    record = {"txid": txid, "slept_at": int(now), "files": fingerprint(db)}
    # Only the router reads it (mode 0600). No directory fsync: a marker lost to a crash only
    # costs the next wake a download from the bucket.
    write_atomic(db + MARKER_SUFFIX, json.dumps(record).encode(), 0o600, fsync_dir=False)


def forget_marker(db: str) -> None:
    """The database is about to move on past its marker (replication started): void it."""
    unlink_quietly(db + MARKER_SUFFIX)


def move_aside(db: str, why: str, now: float, txid: int | None = None) -> str | None:
    """Rename the database and its -wal/-shm/marker out of the way; returns the new name.

    ``txid``: the copy holds at least that state (its replicator had read that far), recorded
    beside it in the marker's format (``<new name>-lchat.json``), so a later wake can tell
    whether the bucket is behind it. Without it, a moved marker still dates the copy."""
    if not os.path.exists(db):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    target = f"{db}.{why}-{stamp}"
    for suffix in ("", "-wal", "-shm", MARKER_SUFFIX):
        if os.path.exists(db + suffix):
            os.replace(db + suffix, target + suffix)
    unlink_quietly(db + LEASE_SUFFIX)  # (it vouched for the copy now aside: for nothing now)
    if txid is not None:
        write_marker(target, txid, now)
    return target


def is_moved_aside(name: str) -> bool:
    """Is the file name ``name`` a copy :func:`move_aside` made (``<db>.stale-<stamp>``,
    ``<db>.lease-lost-<stamp>``), or one of its ``-wal``/``-shm``/record? Such a copy is stale by
    definition: the space's database is the file at ``<db>``."""
    for suffix in ("-wal", "-shm", MARKER_SUFFIX):
        name = name.removesuffix(suffix)
    found = _ASIDE_AT_END.search(name)
    return found is not None and found.start() > 0


def moved_aside(db: str) -> list[MovedAside]:
    """The copies of ``db`` moved aside by :func:`move_aside`, newest name first."""
    directory, base = os.path.split(db)
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return []
    found = []
    for name in names:
        if name.startswith(base) and _ASIDE_NAME.fullmatch(name[len(base) :]):
            path = os.path.join(directory, name)
            found.append(MovedAside(path, local_state(path).marker_txid))
    return sorted(found, key=lambda a: a.path, reverse=True)


def move_back(aside: str, db: str) -> None:
    """Put a moved-aside copy back as ``db`` (with its WAL), without its record: the wake then
    trusts it as a local file of unknown lineage and ships a snapshot of it."""
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(aside + suffix):
            os.replace(aside + suffix, db + suffix)
    unlink_quietly(aside + MARKER_SUFFIX)
    unlink_quietly(db + MARKER_SUFFIX)
    unlink_quietly(db + LEASE_SUFFIX)


# -- the wake's database step ----------------------------------------------------------------------


@define
class Restorer:
    """Decides and performs the database step of a wake, for one box."""

    _store: ObjectStore
    _run: RunInThread
    _box_id: str
    _mesh: bool  # in a mesh, an unmarked local copy is trusted only when the lease was ours
    _data_dir: str
    _clock: IReactorTime  # wall time: the stamps of moved-aside copies

    async def prepare(self, host: str, db: str, replica: str, lease: HeldLease | None) -> DBPlan:
        """Restore ``db`` from the replica at ``replica`` unless a local copy must be used.
        Raises :class:`WakeFailed` (``bucket``, ``restore`` or ``diverged``). (The wake records
        the lease generation, :func:`write_lease_generation`, once its space is ready.)"""
        local = await self._run(lambda: local_state(db))
        # A lease taken back from this box's own holding vouches for the local copy only when
        # that holding is the one the copy was last the space's copy under: a holding whose wake
        # gave up before its database step (the lock PUT landed late) left an older tenure's
        # copy, which another box's writes may have passed (the fence model found it: a restore
        # that lost shipped writes). No record: a copy from before records (trusted, as then).
        reclaimed = (
            lease is not None
            and lease.took_over_from == self._box_id
            and local.lease_generation in (None, lease.generation - 1)
        )
        if lease is not None and lease.took_over_from == self._box_id and not reclaimed:
            _log.warn(
                "activator: {host}: the lease taken back was this box's (generation {taken}), "
                "but the local copy was last the space's copy under generation {mine}: another "
                "box may have written since, so the bucket decides",
                host=host,
                taken=lease.generation - 1,
                mine=local.lease_generation,
            )
        if local.present and local.marker_txid is None and (not self._mesh or reclaimed):
            # Not cleanly slept here (a crash, or created before hibernation): it is the newest
            # copy — on one box nobody else can have written since, and in a mesh the lease we
            # just took back was still our own (nobody held it in between).
            return _local(host, DBPlan(None))
        try:
            listing = await self._store.list(replica + "/")
        except ObjectStoreError as e:
            if local.present:
                raise WakeFailed(host, "bucket", f"the bucket is unavailable: {e}") from e
            raise WakeFailed(host, "bucket", f"cold wake needs the bucket: {e}") from e
        bucket = BucketView.of(listing)
        newest = bucket.newest
        if local.present and local.marker_txid is None and newest == 0:
            # A mesh box's unvouched copy, but the bucket has nothing: it is all there is.
            return _local(host, DBPlan(listing))
        if local.present and local.marker_txid is not None:
            mine = local.marker_txid
            if mine == newest:
                return _local(host, DBPlan(listing, resume=newest or None))
            if bucket.lost_everything_up_to(mine):
                # Slept here cleanly at txid `mine`, and the bucket has none of it (or only files
                # that restore to nothing): the bucket forgot. The local file is the space.
                _bucket_forgot(host, db, mine, bucket, moved_back=False)
                return DBPlan(listing, floor=mine)
            if newest < mine or not bucket.restorable:
                raise self._diverged(host, db, mine, bucket, live=True)
            # The bucket moved on past the local copy (another box served it): restore below.
        if local.present:
            if not bucket.restorable:
                _log.error(
                    "activator: {host} restore failed: {error}; the local db {db} (txid "
                    "unknown) is kept where it is",
                    host=host,
                    error=bucket.error,
                    db=db,
                )
                raise WakeFailed(host, "restore", f"restore failed: {bucket.error}")
            now = self._clock.seconds()
            aside = await self._run(lambda: move_aside(db, "stale", now))
            _log.warn(
                "activator: {host}: local db matches txid {mine}, the bucket has {newest}: "
                "moved it to {aside} and restoring",
                host=host,
                mine=local.marker_txid if local.marker_txid is not None else "unknown",
                newest=newest,
                aside=aside,
            )
        else:
            # No local file. A copy this box moved aside must not lose to an emptier bucket.
            asides = await self._run(lambda: moved_aside(db))
            dated = [a for a in asides if a.txid is not None]
            best = max(dated, key=lambda a: (a.txid or 0, a.path)) if dated else None
            if best is not None and best.txid:
                if bucket.lost_everything_up_to(best.txid):
                    await self._run(lambda: move_back(best.path, db))
                    _bucket_forgot(host, best.path, best.txid, bucket, moved_back=True)
                    return DBPlan(listing, floor=best.txid)
                if bucket.restorable and newest < best.txid:
                    raise self._diverged(host, best.path, best.txid, bucket, live=False)
            if newest == 0 and asides:
                # Copies whose txid nobody recorded (an older router, or lost before
                # replicating): whether they hold the space cannot be told, and an empty start
                # would hide them. An operator decides.
                raise self._diverged(host, asides[0].path, None, bucket, live=False)
        if newest == 0:
            _log.info("activator: {host} restored: no replica yet, starting empty", host=host)
            return DBPlan(listing)
        try:
            result = await restore(self._store, replica, db, run_in_thread=self._run)
        except (RestoreError, ObjectStoreError) as e:
            _log.error("activator: {host} restore failed: {error}", host=host, error=e)
            raise WakeFailed(host, "restore", f"restore failed: {e}") from e
        _log.info(
            "activator: {host} restored: {result}",
            host=host,
            result=f"txid={result.txid}, files={result.files}, pages={result.pages}, "
            f"bytes_downloaded={result.bytes_downloaded}",
        )
        return DBPlan(listing, resume=result.txid)

    def _diverged(
        self, host: str, copy: str, txid: int | None, bucket: BucketView, *, live: bool
    ) -> WakeFailed:
        """A local copy and the bucket that cannot both be right: refuse, keep both, and say in
        the log how to choose (nothing here can tell which one holds the writes that matter)."""
        db = hosts.db_path(self._data_dir, host) if not live else copy
        if live:
            keep_copy = f"rm {db}{MARKER_SUFFIX}"
            keep_bucket = f"mv {db} {db}.kept (with its -wal, and rm {db}{MARKER_SUFFIX})"
        else:
            keep_copy = f"mv {copy} {db} (with its -wal), then rm {copy}{MARKER_SUFFIX}"
            keep_bucket = f"mv {copy} {copy}.kept (and its -wal and {MARKER_SUFFIX} files)"
        dated = f"txid {txid}" if txid is not None else "a txid nobody recorded"
        _log.error(
            "activator: {host} not woken: the bucket has {what}, but {copy} holds {dated}: the "
            "bucket lost files, or the space was started afresh elsewhere. Refusing to wake so "
            "that neither copy is lost. To serve that copy (and re-seed the bucket from it): "
            "{keep_copy}. To serve the bucket's copy instead: {keep_bucket}. Then wake it "
            "again (POST /wake?host={host}).",
            host=host,
            what=bucket.describe(),
            copy=copy,
            dated=dated,
            keep_copy=keep_copy,
            keep_bucket=keep_bucket,
        )
        return WakeFailed(
            host, "diverged", f"{copy} ({dated}) and the bucket ({bucket.describe()})"
        )


def _local(host: str, plan: DBPlan) -> DBPlan:
    """The wake uses the local database as it is."""
    _log.info("activator: {host} restored: local db present, skipping restore", host=host)
    return plan


def _bucket_forgot(
    host: str, copy: str, txid: int, bucket: BucketView, *, moved_back: bool
) -> None:
    RESEEDS.labels("wake").inc()
    _log.error(
        "activator: {host}: THE BUCKET LOST DATA: it has {what}, but {copy} holds txid "
        "{txid}{moved}: waking from that copy and re-seeding the bucket from it (a snapshot "
        "at txid {next}). Find out why the bucket forgot.",
        host=host,
        what=bucket.describe(),
        copy=copy,
        txid=txid,
        moved=" (moved back into place)" if moved_back else "",
        next=txid + 1,
    )

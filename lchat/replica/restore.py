"""Rebuild a database from its replica in the bucket (DESIGN.md §6 "Restore").

The plan is Litestream 0.5's (``CalcRestorePlan``): the latest level-9 snapshot at or before the
target, then, again and again, the file from levels 8…0 that extends the contiguous txid range the
furthest. Each file is downloaded, verified (its file checksum, and the database checksums when it
carries them) and applied page by page into a temp file beside ``out_path``, which is truncated to
the file's ``commit`` pages after each file. The result is fsynced, must pass
``PRAGMA integrity_check``, and only then is renamed to ``out_path``: on any failure ``out_path`` is
untouched. Pages are written as they were stored, so the database keeps its header's journal mode
(bytes 18/19 are 2 for a WAL database), as ``litestream restore`` leaves it.

All disk and CPU work runs through ``run_in_thread`` (the reactor's pool by default).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import sqlite3
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO
from urllib.parse import quote

from attrs import frozen
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from lchat.objstore import UTC, ObjectInfo, ObjectStore
from lchat.replica import ltx

_log = Logger()

SNAPSHOT_LEVEL = 9
TIMESTAMP_METADATA = "litestream-timestamp"
_KEY = re.compile(r"(?:^|/)([0-9a-f]{4})/([0-9a-f]{16})-([0-9a-f]{16})\.ltx$")

RunInThread = Callable[..., Any]  # (f, *args) -> Awaitable[result]


class RestoreError(Exception):
    """The replica cannot be restored as asked: nothing to restore, a gap, a corrupt file."""


@frozen
class ReplicaFile:
    """One LTX object, as its key and listing describe it (no download)."""

    info: ObjectInfo
    level: int
    min_txid: int
    max_txid: int
    created_at: datetime.datetime  # Litestream's metadata timestamp when known, else Last-Modified


def parse_key(info: ObjectInfo) -> ReplicaFile | None:
    """The LTX file ``info`` names, or None for any other object (``lock.json``, strays)."""
    m = _KEY.search(info.key)
    if m is None:
        return None
    level, lo, hi = int(m[1], 16), int(m[2], 16), int(m[3], 16)
    if level > SNAPSHOT_LEVEL or lo == 0 or lo > hi:
        return None
    created = info.last_modified
    stamp = info.metadata.get(TIMESTAMP_METADATA)
    if stamp:
        with contextlib.suppress(ValueError):
            created = parse_timestamp(stamp)
    return ReplicaFile(info, level, lo, hi, created)


def parse_timestamp(text: str) -> datetime.datetime:
    """RFC 3339 with any fraction (Go's RFC3339Nano trims zeros; Python wants at most 6 digits)."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text.strip())
    if m is None:
        raise ValueError(f"not an RFC 3339 timestamp: {text!r}")
    frac = (m[2] or "")[:6].ljust(6, "0")
    zone = "+00:00" if m[3] == "Z" else m[3]
    return datetime.datetime.fromisoformat(f"{m[1]}.{frac}{zone}").astimezone(UTC)


def replica_files(infos: list[ObjectInfo]) -> list[ReplicaFile]:
    files = [f for f in map(parse_key, infos) if f is not None]
    files.sort(key=lambda f: (f.level, f.min_txid, f.max_txid))
    return files


def plan(
    infos: list[ObjectInfo],
    *,
    txid: int | None = None,
    timestamp: datetime.datetime | None = None,
) -> list[ObjectInfo]:
    """The files to apply, in order, to reach ``txid``, the last state before ``timestamp``, or
    the newest state. Raises :class:`RestoreError` when there is nothing to restore or a gap."""
    return [f.info for f in plan_files(replica_files(infos), txid=txid, timestamp=timestamp)]


def plan_files(
    files: list[ReplicaFile],
    *,
    txid: int | None = None,
    timestamp: datetime.datetime | None = None,
) -> list[ReplicaFile]:
    if txid is not None and timestamp is not None:
        raise RestoreError("give a txid or a timestamp, not both")
    if txid is not None and txid < 1:
        raise RestoreError(f"txid {txid} is not positive")

    def eligible(f: ReplicaFile) -> bool:
        if txid is not None and f.max_txid > txid:
            return False
        return timestamp is None or f.created_at < timestamp

    chosen: list[ReplicaFile] = []
    snapshots = [f for f in files if f.level == SNAPSHOT_LEVEL and f.min_txid == 1 and eligible(f)]
    if snapshots:
        chosen.append(max(snapshots, key=lambda f: (f.max_txid, f.created_at)))
    current = chosen[-1].max_txid if chosen else 0
    deltas = [f for f in files if f.level < SNAPSHOT_LEVEL]
    while txid is None or current < txid:
        best: ReplicaFile | None = None
        for f in deltas:
            if f.min_txid > current + 1 or f.max_txid <= current or not eligible(f):
                continue
            if best is None or _better(best, f):
                best = f
        if best is None:
            break
        chosen.append(best)
        current = best.max_txid
    if not chosen:
        raise RestoreError("no snapshot to restore from" + _target(txid, timestamp))
    beyond = [f for f in deltas if f.min_txid > current + 1 and eligible(f)]
    if beyond:
        first = min(beyond, key=lambda f: f.min_txid)
        raise RestoreError(
            f"gap in the replica: files reach txid {current:016x} but the next starts at "
            f"{first.min_txid:016x} ({first.info.key})"
        )
    if txid is not None and current < txid:
        raise RestoreError(f"txid {txid:016x} is not in the replica (it reaches {current:016x})")
    return chosen


def _better(current: ReplicaFile, candidate: ReplicaFile) -> bool:
    # Litestream's restoreCandidateBetter: reach further, then start earlier, then the higher
    # (compacted) level, then the older file.
    if candidate.max_txid != current.max_txid:
        return candidate.max_txid > current.max_txid
    if candidate.min_txid != current.min_txid:
        return candidate.min_txid < current.min_txid
    if candidate.level != current.level:
        return candidate.level > current.level
    return candidate.created_at < current.created_at


def _target(txid: int | None, timestamp: datetime.datetime | None) -> str:
    if txid is not None:
        return f" at or before txid {txid:016x}"
    if timestamp is not None:
        return f" before {timestamp.isoformat()}"
    return ""


@frozen
class RestoreResult:
    path: str
    txid: int  # the state restored: max txid of the last file applied
    timestamp: datetime.datetime  # that file's LTX header timestamp
    page_size: int
    pages: int
    files: int
    bytes_downloaded: int


def _default_run_in_thread() -> RunInThread:
    from twisted.internet import reactor

    r: Any = reactor
    return lambda f, *args: deferToThreadPool(r, r.getThreadPool(), f, *args)


async def restore(
    store: ObjectStore,
    path: str,
    out_path: str,
    *,
    txid: int | None = None,
    timestamp: datetime.datetime | None = None,
    overwrite: bool = False,
    run_in_thread: RunInThread | None = None,
) -> RestoreResult:
    """Restore the replica under ``<path>/`` (e.g. ``<prefix>/<host>``) into ``out_path``."""
    run = run_in_thread or _default_run_in_thread()
    if timestamp is not None and timestamp.tzinfo is None:
        raise RestoreError("the target timestamp needs a time zone")
    if not overwrite and await run(os.path.lexists, out_path):
        raise RestoreError(f"{out_path} already exists")
    files = replica_files(await store.list(path.rstrip("/") + "/"))
    if timestamp is not None:
        # A LIST carries no metadata; Litestream judges time by its timestamp metadata.
        files = [await _with_metadata(store, f) for f in files]
    chosen = plan_files(files, txid=txid, timestamp=timestamp)
    _log.info(
        "restoring {path} to {out}: {n} files up to txid {txid}",
        path=path,
        out=out_path,
        n=len(chosen),
        txid=f"{chosen[-1].max_txid:016x}",
    )
    # Beside out_path, so the final rename stays on one filesystem.
    work = await run(
        lambda: tempfile.mkdtemp(prefix=".restore-", dir=os.path.dirname(os.path.abspath(out_path)))
    )
    state = _ApplyState(os.path.join(work, "db"))
    try:
        await run(state.open)
        downloaded = 0
        for i, f in enumerate(chosen):
            ltx_path = os.path.join(work, f"{i:06d}.ltx")
            got = await store.get_to_file(f.info.key, ltx_path)
            downloaded += got.size
            await run(state.apply, ltx_path, f)
        await run(state.finish)
        await run(_publish, state.db_path, out_path, overwrite)
    except BaseException:
        await run(state.close)
        raise
    finally:
        await run(shutil.rmtree, work, True)
    assert state.header is not None
    return RestoreResult(
        path=out_path,
        txid=state.header.max_txid,
        timestamp=datetime.datetime.fromtimestamp(state.header.timestamp / 1000, UTC),
        page_size=state.header.page_size,
        pages=state.header.commit,
        files=len(chosen),
        bytes_downloaded=downloaded,
    )


async def _with_metadata(store: ObjectStore, f: ReplicaFile) -> ReplicaFile:
    head = await store.head(f.info.key)
    return parse_key(head) or f


class _ApplyState:
    """The temp database being built; every method runs in a worker thread."""

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self.header: ltx.LTXHeader | None = None
        self._db: BinaryIO | None = None

    def open(self) -> None:
        self._db = open(self.db_path, "w+b")  # closed in finish/close

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def apply(self, ltx_path: str, f: ReplicaFile) -> None:
        assert self._db is not None
        db = self._db
        with open(ltx_path, "rb") as src:
            try:
                reader = ltx.LTXReader(src)
                h = reader.header
                self._check_header(h, f)
                if not h.no_checksum and not h.is_snapshot:
                    have = ltx.database_checksum(db, h.page_size)
                    if have != h.pre_apply_checksum:
                        raise RestoreError(
                            f"{f.info.key}: database checksum {have:016x} before it is applied, "
                            f"the file expects {h.pre_apply_checksum:016x}"
                        )
                if h.is_snapshot:
                    db.truncate(0)
                for pgno, data in reader:
                    db.seek((pgno - 1) * h.page_size)
                    db.write(data)
                db.truncate(h.commit * h.page_size)
                assert reader.trailer is not None
                if not h.no_checksum:
                    have = ltx.database_checksum(db, h.page_size)
                    if have != reader.trailer.post_apply_checksum:
                        raise RestoreError(
                            f"{f.info.key}: database checksum {have:016x} after it is applied, "
                            f"the file promises {reader.trailer.post_apply_checksum:016x}"
                        )
            except ltx.LTXError as e:
                raise RestoreError(f"{f.info.key}: {e}") from None
        os.unlink(ltx_path)  # bounds the disk a long chain of files needs
        self.header = h

    def _check_header(self, h: ltx.LTXHeader, f: ReplicaFile) -> None:
        if (h.min_txid, h.max_txid) != (f.min_txid, f.max_txid):
            raise RestoreError(
                f"{f.info.key}: its header says txids {h.min_txid:016x}-{h.max_txid:016x}"
            )
        prev = self.header
        if prev is None:
            if not h.is_snapshot:
                raise RestoreError(f"{f.info.key}: the first file is not a snapshot")
        elif h.page_size != prev.page_size:
            raise RestoreError(f"{f.info.key}: page size {h.page_size}, was {prev.page_size}")
        elif not (h.min_txid <= prev.max_txid + 1 and h.max_txid > prev.max_txid):
            raise RestoreError(f"{f.info.key}: does not continue txid {prev.max_txid:016x}")

    def finish(self) -> None:
        assert self._db is not None and self.header is not None
        self._db.flush()
        os.fsync(self._db.fileno())
        self.close()
        with open(self.db_path, "rb") as f:
            head = f.read(100)
        if head[:16] != b"SQLite format 3\x00":
            raise RestoreError("the restored file is not a SQLite database")
        size = int.from_bytes(head[16:18], "big")
        if (65536 if size == 1 else size) != self.header.page_size:
            raise RestoreError("the restored database's page size disagrees with the replica")
        # immutable=1: no locks, no -wal/-shm beside it, nothing written to the file.
        conn = sqlite3.connect(f"file:{quote(self.db_path)}?immutable=1", uri=True)
        try:
            rows = conn.execute("PRAGMA integrity_check").fetchall()
        except sqlite3.DatabaseError as e:
            raise RestoreError(f"integrity check failed: {e}") from None
        finally:
            conn.close()
        if rows != [("ok",)]:
            problems = "; ".join(str(r[0]) for r in rows[:5])
            raise RestoreError(f"integrity check failed: {problems}")


def _publish(db_path: str, out_path: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(db_path, out_path)
    else:
        try:
            os.link(db_path, out_path)  # never clobbers a file created meanwhile
        except FileExistsError:
            raise RestoreError(f"{out_path} already exists") from None
    directory = os.open(os.path.dirname(os.path.abspath(out_path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)

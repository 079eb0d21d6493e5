"""Rebuild a database from its replica in the bucket (docs/design.md §6 "Restore").

The plan is Litestream 0.5's (``CalcRestorePlan``): the latest level-9 snapshot at or before the
target, then, again and again, the file from levels 8…0 that extends the contiguous txid range the
furthest. Each file is verified (its file checksum, its page index, and the database checksums
when it carries them) and applied page by page into a temp file beside ``out_path``, which is
truncated to the file's ``commit`` pages after each file. The result is fsynced, must pass
``PRAGMA integrity_check``, and only then is renamed to ``out_path``: on any failure ``out_path`` is
untouched. Pages are written as they were stored, so the database keeps its header's journal mode
(bytes 18/19 are 2 for a WAL database), as ``litestream restore`` leaves it.

Restore time is download time plus whatever is not overlapped with it, so everything is:

- Each body is decoded while it arrives (``_stream_all``, through the store's ``get_into``): no
  LTX file is written or read back. Decoding, writing and flushing overlap, each in a thread of
  the restore's own (:class:`_ApplyState`), so the final fsync has little left to do.
- That fsync and ``integrity_check`` (memory-mapped) run side by side; both must pass.

Nothing runs on the reactor thread: the rest goes through ``run_in_thread`` (the caller's thread
runner).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import shutil
import sqlite3
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, BinaryIO, cast
from urllib.parse import quote

from attrs import frozen
from twisted.internet.defer import ensureDeferred
from twisted.logger import Logger

from lchat.files import fsync_directory
from lchat.objstore import UTC, ObjectInfo, ObjectStore
from lchat.replica import ltx
from lchat.threads import RunInThread

_log = Logger()

SNAPSHOT_LEVEL = 9
TIMESTAMP_METADATA = "litestream-timestamp"
_KEY = re.compile(r"(?:^|/)([0-9a-f]{4})/([0-9a-f]{16})-([0-9a-f]{16})\.ltx$")


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


def plan_files(
    files: list[ReplicaFile],
    *,
    txid: int | None = None,
    timestamp: datetime.datetime | None = None,
) -> list[ReplicaFile]:
    """The files to apply, in order, to reach ``txid``, the last state before ``timestamp``, or
    the newest state. Raises :class:`RestoreError` when there is nothing to restore or a gap."""
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


def restores_to(files: list[ReplicaFile]) -> int:
    """The txid a restore of ``files`` reaches; 0 if it cannot (no snapshot, a gap)."""
    try:
        chosen = plan_files(files)
    except RestoreError:
        return 0
    return chosen[-1].max_txid


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


async def restore(
    store: ObjectStore,
    path: str,
    out_path: str,
    *,
    txid: int | None = None,
    timestamp: datetime.datetime | None = None,
    overwrite: bool = False,
    run_in_thread: RunInThread,
) -> RestoreResult:
    """Restore the replica under ``<path>/`` (e.g. ``<prefix>/<host>``) into ``out_path``;
    ``run_in_thread`` runs every file and CPU step."""
    run = run_in_thread
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
        downloaded = await _stream_all(store, chosen, state, run)
        # Durable and sound, in parallel: the fsync waits on the disk while integrity_check reads
        # the same pages from the page cache. Both must succeed before out_path is touched.
        synced = ensureDeferred(run(state.sync))
        try:
            await run(state.check)
        except BaseException:
            with contextlib.suppress(Exception):
                await synced
            raise
        await synced
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


async def _stream_all(
    store: ObjectStore, chosen: list[ReplicaFile], state: _ApplyState, run: RunInThread
) -> int:
    """Each body is decoded and applied as it arrives and never stored.

    This leans on ``ObjectStore.get_into``: the body goes to the sink's ``write`` about a megabyte
    at a time, in a worker thread, one piece at a time (S3's socket paused while a piece waits);
    the sink is rewound (``seek(0)``, ``truncate()``) before every attempt; an exception from
    ``write`` fails the GET without a retry. A :class:`_FileApply` is such a sink.
    """
    downloaded = 0
    for f in chosen:
        key = f.info.key
        sink = _FileApply(state, f)
        streamed = await store.get_into(key, cast(IO[bytes], sink))
        # The decoder finishes this file (after its last piece) while the next one downloads.
        await run(state.queue, sink.finish_queued, 0)
        downloaded += streamed
    await run(state.decoded)
    return downloaded


_IOV_MAX = 512  # pages per pwritev (Linux allows 1024 buffers)
_DECODE_AHEAD = 8 << 20  # bytes of body queued for the decoder, at most
_WRITES_AHEAD = 4  # batches of pages (a piece of a body each: 1-4 MiB) queued for the writer
_SYNC_EVERY = 32 << 20  # the flusher fdatasyncs this often, so the final fsync finds little to do


class _ApplyState:
    """The temp database being built; every method runs in a worker thread.

    Three threads of its own, each fed in order: a decoder (so a piece of a body is handed over
    at once, and the next one can be on its way while this one is decoded), a writer
    (``pwritev`` releases the GIL, so decoding the next pages overlaps writing these), and a
    flusher that starts an ``fdatasync`` every ``_SYNC_EVERY`` bytes (so the disk works during the
    download rather than after it). ``drain`` waits for every queued write: anything that reads or
    truncates the file drains first.
    """

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self.header: ltx.LTXHeader | None = None
        self.db: BinaryIO | None = None
        self._decoder: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._flusher: ThreadPoolExecutor | None = None
        self._decoding: deque[tuple[Future[None], int]] = deque()
        self._decoding_bytes = 0
        self._pending: deque[Future[None]] = deque()
        self._unsynced = 0  # the writer's own
        self._flushing: Future[None] | None = None  # the writer's own

    def open(self) -> None:
        self.db = open(self.db_path, "w+b", buffering=0)  # closed in sync/close
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="lchat-restore-decode")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lchat-restore-write")
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="lchat-restore-flush")

    def close(self) -> None:
        # Nothing may touch the file once it is closed: let queued work and a flush end first.
        # (On failure, what has not started yet is dropped.)
        if self._decoder is not None:
            self._decoder.shutdown(wait=True, cancel_futures=True)
            self._decoder = None
        self._decoding.clear()
        if self._writer is not None:
            self._writer.shutdown(wait=True, cancel_futures=True)
            self._writer = None
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)
            self._flusher = None
        self._pending.clear()
        if self.db is not None:
            self.db.close()
            self.db = None

    def queue(self, f: Callable[[], None], size: int) -> None:
        """Queue ``f()`` for the decoder thread (``size``: the bytes it holds); wait while it is
        too far behind. Raises the error of an earlier job if one has failed (a piece of a body
        never fails its job: :class:`_Attempt` keeps its error)."""
        assert self._decoder is not None
        queue = self._decoding
        while queue and (queue[0][0].done() or self._decoding_bytes > _DECODE_AHEAD):
            done, n = queue.popleft()
            self._decoding_bytes -= n
            done.result()
        queue.append((self._decoder.submit(f), size))
        self._decoding_bytes += size

    def decoded(self) -> None:
        """Wait until every queued job has run; raise the first error among them."""
        while self._decoding:
            done, n = self._decoding.popleft()
            self._decoding_bytes -= n
            done.result()

    def write(self, runs: list[tuple[int, list[bytes]]]) -> None:
        """Queue ``(offset, pages)`` runs for the writer (waits while it is too far behind)."""
        assert self._writer is not None
        while len(self._pending) >= _WRITES_AHEAD:
            self._pending.popleft().result()
        self._pending.append(self._writer.submit(self._write, runs))

    def _write(self, runs: list[tuple[int, list[bytes]]]) -> None:
        assert self.db is not None and self._flusher is not None
        fd = self.db.fileno()
        for offset, pages in runs:
            self._unsynced += _pwrite(fd, pages, offset)
        if self._unsynced >= _SYNC_EVERY and (self._flushing is None or self._flushing.done()):
            self._flushing = self._flusher.submit(os.fdatasync, fd)
            self._unsynced = 0

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def sync(self) -> None:
        assert self.db is not None
        self.drain()
        if self._flushing is not None:
            self._flushing.result()
        os.fsync(self.db.fileno())
        self.close()

    def check_header(self, h: ltx.LTXHeader, f: ReplicaFile) -> None:
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

    def check(self) -> None:
        assert self.header is not None
        with open(self.db_path, "rb") as f:
            head = f.read(100)
            size = os.fstat(f.fileno()).st_size
        if head[:16] != b"SQLite format 3\x00":
            raise RestoreError("the restored file is not a SQLite database")
        page_size = int.from_bytes(head[16:18], "big")
        if (65536 if page_size == 1 else page_size) != self.header.page_size:
            raise RestoreError("the restored database's page size disagrees with the replica")
        # immutable=1: no locks, no -wal/-shm beside it, nothing written to the file. Memory-mapped
        # reads spare integrity_check a copy of every page into its cache (about twice as fast).
        conn = sqlite3.connect(f"file:{quote(self.db_path)}?immutable=1", uri=True)
        try:
            conn.execute(f"PRAGMA mmap_size={max(size, 1)}").fetchall()
            rows = conn.execute("PRAGMA integrity_check").fetchall()
        except sqlite3.DatabaseError as e:
            raise RestoreError(f"integrity check failed: {e}") from None
        finally:
            conn.close()
        if rows != [("ok",)]:
            problems = "; ".join(str(r[0]) for r in rows[:5])
            raise RestoreError(f"integrity check failed: {problems}")


class _Attempt:
    """One download of one file, and the first error its pieces met (see :class:`_FileApply`)."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: Exception | None = None


class _FileApply:
    """Applies one LTX file to the database while its bytes arrive, then verifies the whole.

    ``write`` takes the file in pieces (worker thread, one call at a time) and queues each for
    the state's decoder thread; ``finish_queued``, queued after the last, completes the file.
    ``seek(0)`` + ``truncate()`` — what a store does before retrying a download — start the file
    over: the pages an abandoned attempt wrote must all be rewritten by the attempt that
    completes (or lie past its commit), else the object changed under us and the restore fails.

    An attempt's error (a corrupt or junk piece, an unexpected header) is never raised from
    ``write``: the store would take it as final and not retry, and whether the decoder had got
    to that piece before the connection broke would decide whether a cut download is retried.
    The attempt's later pieces are skipped; a retry (``seek(0)``) drops the attempt and its error
    with it, and an attempt that the store completes raises it from ``finish_queued``. (So a body
    that is corrupt in the bucket is downloaded whole before the restore fails.)
    """

    def __init__(self, state: _ApplyState, f: ReplicaFile) -> None:
        self._state = state
        self._file = f
        self._decoder = ltx.LTXDecoder()
        self._header: ltx.LTXHeader | None = None  # the first attempt's
        self._started = False
        self._attempt = _Attempt()
        self._fed = False  # this attempt has queued pieces
        self._runs: list[tuple[int, int]] = []  # (first pgno, count) written by this attempt
        self._abandoned: list[tuple[int, int]] = []  # by earlier attempts

    # -- the sink interface ---------------------------------------------------------------------

    def write(self, data: bytes) -> int:
        self._fed = True
        self._state.queue(functools.partial(self._feed, self._attempt, data), len(data))
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if (offset, whence) != (0, os.SEEK_SET):
            raise OSError("an LTX file can only be started over")
        if not self._fed:
            return 0  # the first attempt: nothing to start over (and no need to wait)
        self._fed = False
        # Every piece of the abandoned attempt has been through the decoder once this returns
        # (their errors stay on the attempt; an error raised here is an earlier file's).
        self._state.decoded()
        self._attempt = _Attempt()
        self._abandoned += self._runs
        self._runs = []
        self._decoder = ltx.LTXDecoder()
        self._started = False
        return 0

    def truncate(self, size: int | None = None) -> int:
        return 0

    # -- applying (in the decoder thread, then finish) -------------------------------------------

    def _feed(self, attempt: _Attempt, data: bytes) -> None:
        if attempt.error is not None:
            return  # this attempt has failed: its bytes are waiting for a retry or the end
        try:
            self._apply(data)
        except Exception as e:
            attempt.error = e

    def _apply(self, data: bytes) -> None:
        try:
            pages = self._decoder.feed(data)
        except ltx.LTXError as e:
            raise RestoreError(f"{self._file.info.key}: {e}") from None
        if not self._started and self._decoder.header is not None:
            self._begin(self._decoder.header)
        if pages:
            self._write(pages)

    def _begin(self, h: ltx.LTXHeader) -> None:
        db = self._state.db
        assert db is not None
        key = self._file.info.key
        if self._header is None:
            self._state.check_header(h, self._file)
            if not h.no_checksum and not h.is_snapshot:
                self._verify(h, h.pre_apply_checksum, "before it is applied, the file expects")
            self._header = h
        elif h != self._header:
            raise RestoreError(f"{key}: changed while it was being downloaded")
        if h.is_snapshot:
            self._state.drain()
            db.truncate(0)
        self._started = True

    def _write(self, pages: list[tuple[int, bytes]]) -> None:
        # Runs of consecutive pages go down in one pwritev each.
        assert self._header is not None
        page_size = self._header.page_size
        runs: list[tuple[int, list[bytes]]] = []  # (first pgno, its pages)
        first = 0  # (no page 0: the first page starts a run)
        batch: list[bytes] = []
        for pgno, data in pages:
            if pgno != first + len(batch) or len(batch) == _IOV_MAX:
                first, batch = pgno, []
                runs.append((first, batch))
            batch.append(data)
        self._runs += [(first, len(batch)) for first, batch in runs]
        self._state.write([((first - 1) * page_size, batch) for first, batch in runs])

    def finish_queued(self) -> None:
        """Verify the whole file and cut the database to its size (as a decoder job, after the
        file's pieces; or once they are done)."""
        if self._attempt.error is not None:
            raise self._attempt.error
        db = self._state.db
        assert db is not None
        key = self._file.info.key
        try:
            trailer = self._decoder.close()
        except ltx.LTXError as e:
            raise RestoreError(f"{key}: {e}") from None
        h = self._decoder.header
        assert h is not None and self._started
        self._state.drain()
        db.truncate(h.commit * h.page_size)
        if self._abandoned:
            rewritten = {p for first, n in self._runs for p in range(first, first + n)}
            for first, n in self._abandoned:
                if any(p not in rewritten for p in range(first, min(first + n, h.commit + 1))):
                    raise RestoreError(f"{key}: changed between two attempts to download it")
        if not h.no_checksum:
            want = trailer.post_apply_checksum
            self._verify(h, want, "after it is applied, the file promises")
        self._state.header = h

    def _verify(self, h: ltx.LTXHeader, want: int, when: str) -> None:
        """The database's checksum must be ``want`` (``when``: at which step, and who says so)."""
        assert self._state.db is not None
        key = self._file.info.key
        try:
            have = ltx.database_checksum(self._state.db, h.page_size)
        except ltx.LTXError as e:
            raise RestoreError(f"{key}: {e}") from None
        if have != want:
            raise RestoreError(f"{key}: database checksum {have:016x} {when} {want:016x}")


def _pwrite(fd: int, pages: list[bytes], offset: int) -> int:
    done = os.pwritev(fd, pages, offset)
    want = sum(map(len, pages))
    if done != want:  # a short write: finish it the slow way
        rest = memoryview(b"".join(pages))[done:]
        while rest:
            n = os.pwrite(fd, rest, offset + done)
            done += n
            rest = rest[n:]
    return done


def _publish(db_path: str, out_path: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(db_path, out_path)
    else:
        try:
            os.link(db_path, out_path)  # never clobbers a file created meanwhile
        except FileExistsError:
            raise RestoreError(f"{out_path} already exists") from None
    fsync_directory(os.path.dirname(os.path.abspath(out_path)))

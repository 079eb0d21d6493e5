"""Preparing a replica's LTX files, in its worker thread (see :mod:`lchat.replica.replicator`): a
snapshot of the database or the WAL's newly committed frames, each encoded into a temp file in the
replicator's scratch directory (:func:`make_tmp`) and described by a :class:`Prepared`."""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from attrs import define, frozen
from twisted.logger import Logger

from lchat.objstore import UTC
from lchat.replica import ltx, wal
from lchat.replica.db import ReplicaDB
from lchat.replica.restore import SNAPSHOT_LEVEL
from lchat.replica.wal import Segment, WALPosition, WALReset, WALRewritten

# The replicator's namespace: these are its events, logged from its worker thread.
_log = Logger(namespace="lchat.replica.replicator")


@define
class Prepared:
    """One encoded LTX file waiting to be uploaded."""

    key: str
    tmp_path: str
    level: int
    min_txid: int
    txid: int
    pages: int
    size: int
    timestamp: str  # the litestream-timestamp metadata


def rfc3339_nano(when: datetime.datetime) -> str:
    """Go's ``time.RFC3339Nano`` in UTC: fraction with trailing zeros trimmed, none if zero."""
    when = when.astimezone(UTC)
    base = when.strftime("%Y-%m-%dT%H:%M:%S")
    frac = f"{when.microsecond:06d}".rstrip("0")
    return f"{base}.{frac}Z" if frac else f"{base}Z"


@frozen
class Encoder:
    """Encodes LTX files of the replica at ``path`` from ``db`` into ``tmp``; every method runs
    in the replicator's worker thread (``ReplicaDB`` takes one call at a time). ``seconds`` is
    the reactor's clock (the LTX header's timestamp): a plain read, safe from a thread."""

    _db: ReplicaDB
    _path: str
    _tmp: str
    _seconds: Callable[[], float]

    def _file(self, level: int, pages: Any, **fields: int) -> Prepared:
        """The LTX file of ``pages``, its header ``fields`` stamped now."""
        stamp = datetime.datetime.fromtimestamp(self._seconds(), UTC)
        header = ltx.LTXHeader(timestamp=int(stamp.timestamp() * 1000), **fields)
        fd, tmp_path = tempfile.mkstemp(suffix=".ltx", dir=self._tmp)
        n = 0
        try:
            with os.fdopen(fd, "wb") as f:
                writer = ltx.LTXWriter(f, header)
                for pgno, data in pages:
                    writer.write_page(pgno, data)
                    n += 1
                writer.finish()
                size = f.tell()
        except BaseException:
            os.unlink(tmp_path)
            raise
        key = ltx.object_key(self._path, level, header.min_txid, header.max_txid)
        return Prepared(
            key, tmp_path, level, header.min_txid, header.max_txid, n, size, rfc3339_nano(stamp)
        )

    def snapshot(self, txid: int) -> tuple[Prepared, WALPosition | None]:
        snap, pages = self._db.snapshot()
        pos = snap.position
        prepared = self._file(
            SNAPSHOT_LEVEL,
            pages,
            page_size=snap.page_size,
            commit=snap.page_count,
            min_txid=1,
            max_txid=txid,
            wal_offset=pos.offset if pos is not None else 0,
            wal_salt1=pos.salt1 if pos is not None else 0,
            wal_salt2=pos.salt2 if pos is not None else 0,
        )
        return prepared, pos

    def segment(self, seg: Segment, txid: int) -> Prepared:
        return self._file(
            0,
            wal.iter_segment_pages(self._db.wal_path, seg),
            page_size=seg.header.page_size,
            commit=seg.commit,
            min_txid=txid,
            max_txid=txid,
            wal_offset=seg.start.offset,
            wal_size=seg.size,
            wal_salt1=seg.header.salt1,
            wal_salt2=seg.header.salt2,
        )

    def read_and_encode(
        self, pos: WALPosition | None, txid: int
    ) -> tuple[Prepared, WALPosition] | WALReset | WALRewritten | None:
        got = self._db.read_committed(pos)
        if got is None or isinstance(got, WALReset | WALRewritten):
            return got
        if got.empty:
            return None
        return self.segment(got, txid), got.end

    def checkpoint(self, shipped: WALPosition | None, txid: int, captured: list[Prepared]) -> Any:
        mode = self._db.wanted_checkpoint(shipped)
        if mode is None:
            return None

        def capture(seg: Segment) -> None:
            # Called with the space's writers held off: copy the tail's pages now, ship after.
            captured.append(self.segment(seg, txid + 1 + len(captured)))

        result = self._db.checkpoint(mode, shipped, capture)
        _log.debug(
            "replica {path}: checkpoint {mode}: {result}", path=self._path, mode=mode, result=result
        )
        return result


_TMP_PREFIX = ".lchat-replica-"


def make_tmp(root: str | None) -> str:
    """Our scratch directory, named after this process; first sweep away those of dead ones (a
    SIGKILLed replicator cannot clean up after itself)."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        pid_text = name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if not name.startswith(_TMP_PREFIX) or not pid_text.isdigit():
            continue
        if int(pid_text) != os.getpid() and not _alive(int(pid_text)):
            _log.info("replica: removing {dir} left by a dead process", dir=name)
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=root)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True

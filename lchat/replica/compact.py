"""Compaction of LTX files: merge a contiguous run of files into one (Litestream 0.5's levels).

Litestream 0.5 keeps level 0 (one file per sync), compacts level 0 into level 1 every 30 s, level 1
into level 2 every 5 min, level 2 into level 3 hourly, and writes a level-9 snapshot daily; files
older than the newest snapshot are then removed by retention. :func:`merge` is the pure part (runs
in a worker thread): it applies the inputs in order to a page map (later pages win, pages beyond a
file's ``commit`` are dropped as applying that file would) and writes one LTX whose header spans
``[first.min_txid, last.max_txid]`` with the last file's ``commit``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

from attrs import frozen

from lchat.replica import ltx
from lchat.replica.restore import SNAPSHOT_LEVEL

# Litestream 0.5's defaults: level -> seconds between compactions into it.
DEFAULT_LEVELS: dict[int, float] = {1: 30.0, 2: 300.0, 3: 3600.0}
DEFAULT_SNAPSHOT_INTERVAL = 86400.0


@frozen
class Entry:
    """One LTX object we know is in the bucket (we wrote it, or the start LIST showed it)."""

    level: int
    min_txid: int
    max_txid: int
    key: str
    timestamp: str  # the litestream-timestamp metadata (RFC 3339)


class Inventory:
    """What a replicator knows is in the bucket, per level: the start LIST plus what it wrote
    since (``levels``); its local copies of the level-0 files it uploaded, kept until compacted
    (``local``: key -> path); compacted inputs waiting out their retention (``retired``: (delete
    after, key)); keys whose delete failed, retried at the next pass (``garbage``); and the
    newest snapshot's txid (``snap_txid``)."""

    def __init__(self) -> None:
        self.levels: dict[int, dict[str, Entry]] = {}
        self.local: dict[str, str] = {}
        self.retired: list[tuple[float, str]] = []
        self.garbage: list[str] = []
        self.snap_txid = 0

    def remember(self, entry: Entry) -> None:
        self.levels.setdefault(entry.level, {})[entry.key] = entry
        if entry.level == SNAPSHOT_LEVEL:
            self.snap_txid = max(self.snap_txid, entry.max_txid)

    def forget(self, key: str) -> str | None:
        """``key`` is gone (or going): drop it; returns its local copy, for the caller to delete."""
        for entries in self.levels.values():
            entries.pop(key, None)
        return self.local.pop(key, None)

    def files(self, level: int) -> list[Entry]:
        return sorted(self.levels.get(level, {}).values(), key=lambda e: (e.min_txid, e.max_txid))

    def entries(self) -> list[Entry]:
        return [e for entries in self.levels.values() for e in entries.values()]

    def known(self) -> set[str]:
        """Every key we wrote and have not deleted yet, in the bucket or on its way out."""
        return {e.key for e in self.entries()} | {key for _, key in self.retired} | {*self.garbage}

    def due(self, now: float) -> list[str]:
        """The retired keys whose retention has run out by ``now``, taken off the list."""
        due = [key for when, key in self.retired if when <= now]
        self.retired = [(when, key) for when, key in self.retired if when > now]
        return due

    def older_than(self, txid: int) -> list[str]:
        """Every key wholly below ``txid``, and every retired one (older than any new snapshot
        too), taken off the retired list."""
        old = [e.key for e in self.entries() if e.max_txid < txid]
        old += [key for _, key in self.retired]
        self.retired = []
        return old


def contiguous_runs(entries: Iterable[Entry]) -> list[list[Entry]]:
    """Split ``entries`` (one level) into runs where each file starts right after the previous:
    a gap (a snapshot's txid, or a file we do not have) is never merged across."""
    runs: list[list[Entry]] = []
    for e in sorted(entries, key=lambda e: (e.min_txid, e.max_txid)):
        if runs and e.min_txid == runs[-1][-1].max_txid + 1:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


@frozen
class Merged:
    header: ltx.LTXHeader
    pages: int
    size: int


def merge(inputs: list[str], out_path: str) -> Merged:
    """Merge the LTX files ``inputs`` (ascending, contiguous txids, none a snapshot) into
    ``out_path``. Every input is fully verified before anything is written; page data is staged in
    a scratch file beside ``out_path`` so memory stays at a few bytes per page."""
    if not inputs:
        raise ValueError("nothing to merge")
    headers: list[ltx.LTXHeader] = []
    index: dict[int, int] = {}  # pgno -> offset in scratch
    post_apply = 0  # the last input's post-apply checksum
    with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(out_path))) as scratch:
        for path in inputs:
            with open(path, "rb") as f:
                reader = ltx.LTXReader(f)
                h = reader.header
                if h.is_snapshot:
                    raise ltx.LTXError(f"{path}: a snapshot cannot be compacted")
                if headers:
                    first, last = headers[0], headers[-1]
                    if h.page_size != first.page_size:
                        raise ltx.LTXError(f"{path}: page size {h.page_size} != {first.page_size}")
                    if h.flags != first.flags:
                        raise ltx.LTXError(f"{path}: flags differ from the first input's")
                    if h.min_txid != last.max_txid + 1:
                        raise ltx.LTXError(
                            f"{path}: txid {h.min_txid:016x} does not follow {last.max_txid:016x}"
                        )
                for pgno, data in reader:
                    scratch.seek(0, os.SEEK_END)
                    index[pgno] = scratch.tell()
                    scratch.write(data)
                assert reader.trailer is not None
                headers.append(h)
                post_apply = reader.trailer.post_apply_checksum
                for pgno in [p for p in index if p > h.commit]:
                    del index[pgno]
        first, last = headers[0], headers[-1]
        low = min(h.commit for h in headers)  # pages above it not rewritten since are zeros
        header = ltx.LTXHeader(
            page_size=first.page_size,
            commit=last.commit,
            min_txid=first.min_txid,
            max_txid=last.max_txid,
            timestamp=last.timestamp,
            flags=first.flags,
            pre_apply_checksum=first.pre_apply_checksum,
        )
        lock = ltx.lock_pgno(header.page_size)
        zero = bytes(header.page_size)
        # Applying the inputs one by one truncates to each commit: a page above the smallest
        # commit that no later file wrote reads back as zeros. Say so explicitly.
        for pgno in range(low + 1, header.commit + 1):
            if pgno not in index and pgno != lock:
                index[pgno] = -1
        with open(out_path, "wb") as out:
            writer = ltx.LTXWriter(out, header)
            for pgno in sorted(index):
                off = index[pgno]
                if off < 0:
                    data = zero
                else:
                    scratch.seek(off)
                    data = scratch.read(header.page_size)
                writer.write_page(pgno, data)
            writer.finish(post_apply)
            size = out.tell()
            out.flush()
            os.fsync(out.fileno())
    return Merged(header, len(index), size)

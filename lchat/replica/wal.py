"""Reading the WAL of a SQLite database that another process (the space) is writing.

Format (https://www.sqlite.org/fileformat2.html#wal_file_format): a 32-byte header, then frames of a
24-byte frame header plus one page. All integers are big-endian; only the *checksum words* are read
in the byte order the magic names (``0x377f0682`` little-endian, ``0x377f0683`` big-endian).

    header  magic, format version (3007000), page size, checkpoint sequence, salt-1, salt-2,
            checksum-1, checksum-2 (over the first 24 bytes)
    frame   pgno, commit (database size in pages after a commit frame, else 0), salt-1, salt-2,
            checksum-1, checksum-2 (cumulative: over the header, then each frame's first 8 bytes
            and page, in order)

A frame is valid only if its salts equal the header's and its cumulative checksum matches; the first
invalid frame ends the log, exactly as SQLite's recovery reads it. Only frames up to the last
*commit* frame are committed: later ones belong to a transaction still being written (or abandoned)
and are never reported.

Restarts: when the log has been fully checkpointed, the next writer (or a RESTART/TRUNCATE
checkpoint) starts the log over with new salts (salt-1 + 1 and a random salt-2 when the restarting
connection writes the header itself; both random otherwise), overwriting frames from the start. A
reader therefore keeps a :class:`WALPosition` (offset, salts, cumulative checksum at that offset)
and on each read proves the log still continues from it; if it cannot, it reports
:class:`WALReset` (the salts changed, the file shrank or vanished) or :class:`WALRewritten`, and
the caller takes a fresh snapshot instead of shipping garbage (or follows the restart, when it
knows that is safe: :func:`read_committed`).

Pure and synchronous: runs in a worker thread, never on the reactor. Page bytes are read per frame,
never the whole log.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

from attrs import astuple, evolve, frozen

WAL_HEADER_SIZE = 32
FRAME_HEADER_SIZE = 24
MAGIC_LE = 0x377F0682
MAGIC_BE = 0x377F0683
WAL_VERSION = 3007000

_HEADER = struct.Struct(">IIIIIIII")
_FRAME_HEADER = struct.Struct(">IIIIII")
_MASK = 0xFFFFFFFF


class WALError(Exception):
    """The WAL cannot be read as asked (bad header, misaligned offset, wrong page size)."""


def wal_checksum(
    data: bytes | memoryview, s0: int = 0, s1: int = 0, *, big_endian: bool = False
) -> tuple[int, int]:
    """SQLite's WAL checksum, continued from ``(s0, s1)`` over ``data`` (a multiple of 8 bytes)."""
    if len(data) % 8:
        raise WALError(f"checksum over {len(data)} bytes, not a multiple of 8")
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    it = iter(words)
    for a, b in zip(it, it, strict=True):
        s0 = (s0 + a + s1) & _MASK
        s1 = (s1 + b + s0) & _MASK
    return s0, s1


def _frame_checksum(frame: bytes, prev: tuple[int, int], big_endian: bool) -> tuple[int, int]:
    """The cumulative checksum after ``frame``, continued from ``prev``: over its first 8 bytes,
    then its page."""
    view = memoryview(frame)
    s0, s1 = wal_checksum(view[:8], *prev, big_endian=big_endian)
    return wal_checksum(view[FRAME_HEADER_SIZE:], s0, s1, big_endian=big_endian)


@frozen
class WALHeader:
    magic: int
    version: int
    page_size: int
    checkpoint_seq: int
    salt1: int
    salt2: int
    checksum1: int
    checksum2: int

    @property
    def big_endian(self) -> bool:
        """The byte order of the checksum words (the magic's low bit)."""
        return self.magic == MAGIC_BE

    @property
    def salts(self) -> tuple[int, int]:
        return (self.salt1, self.salt2)

    @property
    def checksum(self) -> tuple[int, int]:
        return (self.checksum1, self.checksum2)

    @property
    def frame_size(self) -> int:
        return FRAME_HEADER_SIZE + self.page_size

    @classmethod
    def parse(cls, data: bytes) -> WALHeader:
        """Parse and verify 32 header bytes; :class:`WALError` if they are not a valid header."""
        if len(data) < WAL_HEADER_SIZE:
            raise WALError(f"WAL header is {len(data)} bytes, want {WAL_HEADER_SIZE}")
        hdr = cls(*_HEADER.unpack_from(data))
        if hdr.magic not in (MAGIC_LE, MAGIC_BE):
            raise WALError(f"bad WAL magic {hdr.magic:#x}")
        if hdr.version != WAL_VERSION:
            raise WALError(f"unsupported WAL format version {hdr.version}")
        ps = hdr.page_size
        if ps < 512 or ps > 65536 or ps & (ps - 1):
            raise WALError(f"bad WAL page size {ps}")
        # A torn header (a crash mid-restart) fails this; SQLite then ignores the whole log.
        if wal_checksum(data[:24], big_endian=hdr.big_endian) != hdr.checksum:
            raise WALError("WAL header checksum mismatch")
        return hdr

    def pack(self) -> bytes:
        return _HEADER.pack(*astuple(self))


@frozen
class WALPosition:
    """A point in one WAL generation: everything before ``offset`` has been read (and shipped).

    ``checksum`` is the cumulative checksum at ``offset`` (the header's at offset 32). It may be
    ``None`` when resuming from a record that lacks it (an LTX header carries offset and salts
    only); the frame before ``offset`` is then checked only for internal consistency.
    """

    offset: int
    page_size: int
    salt1: int
    salt2: int
    checksum: tuple[int, int] | None

    @property
    def salts(self) -> tuple[int, int]:
        return (self.salt1, self.salt2)

    @classmethod
    def start_of(cls, header: WALHeader) -> WALPosition:
        return cls(WAL_HEADER_SIZE, header.page_size, header.salt1, header.salt2, header.checksum)


@frozen
class PageRef:
    """Where a version of a page is, and how to re-verify it when read."""

    pgno: int
    offset: int  # of the frame header
    prev_checksum: tuple[int, int]  # cumulative checksum before this frame (to re-verify it)
    checksum: tuple[int, int]  # cumulative checksum after it


@frozen
class Segment:
    """Committed frames ``[start.offset, end.offset)`` of one WAL generation.

    ``pages`` maps each page written to its latest committed version (pages past the final
    ``commit`` size are dropped: the database shrank). ``commit`` is the database size in pages
    after the segment, 0 if it holds no commit. ``restarted``: the log restarted since ``start``'s
    generation and this segment begins at the new generation's first frame.
    """

    header: WALHeader
    start: WALPosition
    end: WALPosition
    commit: int
    pages: dict[int, PageRef]
    frame_count: int
    restarted: bool = False

    @property
    def empty(self) -> bool:
        return self.frame_count == 0

    @property
    def size(self) -> int:
        return self.end.offset - self.start.offset


@frozen
class WALReset:
    """The log is not the generation we were reading: salts changed, it shrank, or it is gone."""

    reason: str
    header: WALHeader | None


@frozen
class WALRewritten:
    """Same salts, but the frames at our position are no longer the ones we read."""

    reason: str


class WALReader:
    """Random access to one WAL file; use as a context manager (holds one file descriptor)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # Never through a link: a space owns its directory and could point its -wal at another
        # space's (the router reads with CAP_DAC_OVERRIDE; docs/secrets.md, "Who can read what").
        self._f: BinaryIO = os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW), "rb")

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> WALReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def size(self) -> int:
        return os.fstat(self._f.fileno()).st_size

    def _pread(self, offset: int, n: int) -> bytes:
        return os.pread(self._f.fileno(), n, offset)

    def header(self) -> WALHeader | None:
        """The verified header, or ``None`` if the file is empty or its header is invalid."""
        try:
            return WALHeader.parse(self._pread(0, WAL_HEADER_SIZE))
        except WALError:
            return None

    def frames(self, header: WALHeader, start: WALPosition) -> Iterator[tuple[PageRef, int]]:
        """Valid frames from ``start`` on (committed or not), verifying salts and the checksum chain:
        each as its page and its commit field (the database size in pages after a commit frame,
        0 for any other).

        ``start.checksum`` must be the cumulative checksum at ``start.offset``. Stops at the first
        short, foreign-salted or checksum-failing frame: that is where the valid log ends.
        """
        if start.checksum is None:
            raise WALError("frames() needs the cumulative checksum at the start position")
        fs = header.frame_size
        if (start.offset - WAL_HEADER_SIZE) % fs or start.offset < WAL_HEADER_SIZE:
            raise WALError(f"offset {start.offset} is not a frame boundary for page size {fs - 24}")
        offset, cksum, be = start.offset, start.checksum, header.big_endian
        while True:
            buf = self._pread(offset, fs)
            if len(buf) < fs:
                return
            pgno, commit, salt1, salt2, c1, c2 = _FRAME_HEADER.unpack_from(buf)
            if (salt1, salt2) != header.salts:
                return
            new = _frame_checksum(buf, cksum, be)
            if new != (c1, c2):
                return
            yield PageRef(pgno, offset, cksum, new), commit
            offset += fs
            cksum = new

    def read_page(self, header: WALHeader, ref: PageRef) -> bytes:
        """A page a :class:`Segment` points at, re-verified; :class:`WALError` if it changed since."""
        buf = self._pread(ref.offset, header.frame_size)
        if len(buf) < header.frame_size:
            raise WALError(f"frame at {ref.offset} is gone (WAL truncated)")
        pgno, _, salt1, salt2, c1, c2 = _FRAME_HEADER.unpack_from(buf)
        cksum = _frame_checksum(buf, ref.prev_checksum, header.big_endian)
        if (
            pgno != ref.pgno
            or (salt1, salt2) != header.salts
            or cksum != ref.checksum
            or (c1, c2) != ref.checksum
        ):
            raise WALError(f"frame at {ref.offset} was overwritten since it was read")
        return buf[FRAME_HEADER_SIZE:]

    def _stored_checksum(self, header: WALHeader, offset: int) -> tuple[int, int]:
        """The cumulative checksum stored for ``offset``: the header's, or the frame's before it."""
        if offset == WAL_HEADER_SIZE:
            return header.checksum
        fields = _FRAME_HEADER.unpack(self._pread(offset - header.frame_size, FRAME_HEADER_SIZE))
        return (fields[4], fields[5])

    def _check_continues(self, header: WALHeader, pos: WALPosition) -> str | None:
        """Why the log does not continue from ``pos`` (same generation assumed), else ``None``."""
        fs = header.frame_size
        if (pos.offset - WAL_HEADER_SIZE) % fs:
            return f"offset {pos.offset} is not a frame boundary"
        if pos.offset == WAL_HEADER_SIZE:
            if pos.checksum is not None and pos.checksum != header.checksum:
                return "header checksum differs"
            return None
        if self.size() < pos.offset:
            return f"WAL shrank below offset {pos.offset}"
        # Re-verify the last frame we read: its checksum recomputed from its predecessor's stored
        # one must equal both its own stored checksum and the one we recorded.
        last = pos.offset - fs
        buf = self._pread(last, fs)
        _, _, s1, s2, c1, c2 = _FRAME_HEADER.unpack_from(buf)
        if (s1, s2) != pos.salts:
            return "the frame before our position has other salts"
        ck = _frame_checksum(buf, self._stored_checksum(header, last), header.big_endian)
        if ck != (c1, c2):
            return "the frame before our position fails its checksum"
        if pos.checksum is not None and ck != pos.checksum:
            return "the checksum chain does not continue from our position"
        return None


def _collect(
    reader: WALReader,
    header: WALHeader,
    start: WALPosition,
    max_bytes: int | None,
    restarted: bool,
) -> Segment:
    pages: dict[int, PageRef] = {}
    pending: dict[int, PageRef] = {}
    end, commit, count, pending_count = start, 0, 0, 0
    generation = WALPosition.start_of(header)  # its positions differ in offset and checksum
    for ref, size in reader.frames(header, start):
        pending[ref.pgno] = ref
        pending_count += 1
        if size:
            # Only a commit frame makes the transaction's pages real.
            pages.update(pending)
            pending.clear()
            count += pending_count
            pending_count = 0
            commit = size
            end = evolve(generation, offset=ref.offset + header.frame_size, checksum=ref.checksum)
            if max_bytes is not None and end.offset - start.offset >= max_bytes:
                break
    if commit:
        for pgno in [p for p in pages if p > commit]:
            del pages[pgno]
    return Segment(header, start, end, commit, pages, count, restarted)


def read_committed(
    path: str | os.PathLike[str],
    start: WALPosition | None,
    *,
    follow_restart: bool = False,
    max_bytes: int | None = None,
) -> Segment | WALReset | WALRewritten | None:
    """The committed frames after ``start`` (from the log's beginning if ``None``).

    Returns ``None`` when there is no valid log at all and ``start`` is ``None`` or
    ``follow_restart`` is set (nothing to read: the database file alone is the state).
    ``max_bytes`` stops at the first commit boundary past that many bytes, so a huge backlog can
    be shipped in pieces.

    With ``follow_restart``, a log that restarted since ``start`` (new salts) is followed from its
    new beginning, and one truncated and not yet rewritten reads as ``None``, instead of either
    being reported as a reset. Only the caller can know this is safe (see ``db.py``).
    """
    try:
        reader = WALReader(path)
    except FileNotFoundError:
        if start is None or follow_restart:
            return None
        return WALReset("WAL file is missing", None)
    with reader:
        header = reader.header()
        if header is None:
            # A TRUNCATE checkpoint leaves an empty file until the next write.
            if start is None or follow_restart:
                return None
            return WALReset("WAL has no valid header (truncated or reset)", None)
        if start is None:
            return _collect(reader, header, WALPosition.start_of(header), max_bytes, False)
        if header.page_size != start.page_size:
            return WALReset(f"page size changed {start.page_size} -> {header.page_size}", header)
        if header.salts != start.salts:
            # SQLite bumps salt-1 on restart only when the restarting connection wrote the last
            # header itself (else the salts are random): so no guard beyond the caller's word.
            if follow_restart:
                return _collect(reader, header, WALPosition.start_of(header), max_bytes, True)
            return WALReset("WAL salts changed (restarted since our position)", header)
        why = reader._check_continues(header, start)
        if why is not None:
            if why.startswith("WAL shrank"):
                return WALReset(why, header)
            return WALRewritten(why)
        if start.checksum is None:
            # A missing checksum, from the frame before ``start`` (verified just now).
            start = evolve(start, checksum=reader._stored_checksum(header, start.offset))
        return _collect(reader, header, start, max_bytes, False)


def iter_segment_pages(
    path: str | os.PathLike[str], segment: Segment
) -> Iterator[tuple[int, bytes]]:
    """``(pgno, page)`` in ascending page order, one page in memory at a time."""
    with WALReader(path) as r:
        for pgno in sorted(segment.pages):
            yield pgno, r.read_page(segment.header, segment.pages[pgno])

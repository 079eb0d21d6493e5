"""The LTX file format (superfly/ltx v0.5, as Litestream 0.5 writes and reads it).

A file is::

    header    100 bytes, big-endian: "LTX1", flags u32, page size u32, commit u32 (database size in
              pages after this file), min/max txid u64, timestamp u64 (ms since the epoch),
              pre-apply checksum u64, WAL offset/size u64, WAL salt-1/salt-2 u32, node id u64,
              20 reserved zero bytes
    pages     per page, in ascending page order (the lock page never appears):
              pgno u32, flags u16 (0x0001: a size follows), size u32, one LZ4 *block* of the page
    end       six zero bytes (an empty page header)
    index     per page: uvarint pgno, offset (of its page header), size (header+size+block);
              a uvarint 0; then the index's byte length as u64
    trailer   post-apply checksum u64, file checksum u64

The file checksum is CRC-64/ISO (Go's ``crc64.ISO`` table) over everything before it, except that
each page contributes its *decompressed* bytes rather than the LZ4 block; bit 63 is then set.
Database checksums (pre/post-apply) are the XOR of each page's CRC-64/ISO over ``pgno u32 || page``,
with bit 63 set. Litestream 0.5 writes ``flags = 2`` (no database checksums, both zero).

The CRC is ``fastcrc`` (Rust, releases the GIL); LZ4 is ``lz4.block`` (C). Both run in the caller's
thread: callers on the reactor hand whole files to a thread pool.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import lz4.block  # type: ignore[import-untyped]
from attrs import frozen
from fastcrc import crc64

MAGIC = b"LTX1"
HEADER_SIZE = 100
PAGE_HEADER_SIZE = 6
TRAILER_SIZE = 16
FLAG_NO_CHECKSUM = 1 << 1
HEADER_FLAG_MASK = FLAG_NO_CHECKSUM
PAGE_FLAG_SIZE = 1 << 0
CHECKSUM_FLAG = 1 << 63
PENDING_BYTE = 0x40000000
MAX_PAGE_SIZE = 65536

_HEADER = struct.Struct(">4sIIIQQQQQQIIQ20s")  # magic, the _WIRE fields, 20 reserved bytes
_WIRE = (
    "flags page_size commit min_txid max_txid timestamp pre_apply_checksum wal_offset wal_size "
    "wal_salt1 wal_salt2 node_id"
).split()
_PAGE_HEADER = struct.Struct(">IH")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_TRAILER = struct.Struct(">QQ")
_END = b"\x00" * PAGE_HEADER_SIZE
_MAX_INDEX = 64 << 20  # a 64 KiB-page, 4 G-page database needs far less; guards memory


class LTXError(Exception):
    """An LTX file is malformed, corrupt, or not what its caller asked for."""


def crc64_iso(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Go's ``crc64.Update(crc, crc64.MakeTable(crc64.ISO), data)``: chain by passing ``crc``."""
    return crc64.go_iso(data, crc) if crc else crc64.go_iso(data)


def lock_pgno(page_size: int) -> int:
    """The page holding SQLite's pending byte: never written to a file, never in an LTX."""
    return PENDING_BYTE // page_size + 1


def valid_page_size(page_size: int) -> bool:
    return 512 <= page_size <= MAX_PAGE_SIZE and page_size & (page_size - 1) == 0


def page_checksum(pgno: int, data: bytes) -> int:
    return CHECKSUM_FLAG | crc64_iso(data, crc64_iso(_U32.pack(pgno)))


def database_checksum(fileobj: BinaryIO, page_size: int) -> int:
    """The rolling checksum of a whole database file (ltx's ``ChecksumReader``)."""
    fileobj.seek(0)
    lock = lock_pgno(page_size)
    checksum = 0
    pgno = 0
    while True:
        data = fileobj.read(page_size)
        if not data:
            return checksum
        pgno += 1
        if len(data) != page_size:
            raise LTXError(f"database ends inside page {pgno}")
        if pgno != lock:
            checksum = CHECKSUM_FLAG | (checksum ^ page_checksum(pgno, data))


@frozen
class LTXHeader:
    page_size: int
    commit: int  # database size in pages after this file is applied
    min_txid: int
    max_txid: int
    timestamp: int  # milliseconds since the Unix epoch
    flags: int = FLAG_NO_CHECKSUM
    pre_apply_checksum: int = 0
    wal_offset: int = 0
    wal_size: int = 0
    wal_salt1: int = 0
    wal_salt2: int = 0
    node_id: int = 0

    @property
    def is_snapshot(self) -> bool:
        return self.min_txid == 1

    @property
    def no_checksum(self) -> bool:
        return bool(self.flags & FLAG_NO_CHECKSUM)

    def pack(self) -> bytes:
        self.validate()
        return _HEADER.pack(MAGIC, *(getattr(self, name) for name in _WIRE), b"\x00" * 20)

    @classmethod
    def unpack(cls, data: bytes) -> LTXHeader:
        if len(data) < HEADER_SIZE:
            raise LTXError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
        fields = _HEADER.unpack_from(data)
        if fields[0] != MAGIC:
            raise LTXError(f"not an LTX file: magic {fields[0]!r}")
        header = cls(**dict(zip(_WIRE, fields[1:-1], strict=True)))
        header.validate()
        return header

    def validate(self) -> None:
        """The checks ltx's ``Header.Validate`` makes, so we neither write nor accept what it refuses."""
        if self.flags & ~HEADER_FLAG_MASK:
            raise LTXError(f"invalid header flags 0x{self.flags:08x}")
        if not valid_page_size(self.page_size):
            raise LTXError(f"invalid page size {self.page_size}")
        if not 0 <= self.commit < 1 << 32:
            raise LTXError(f"invalid commit {self.commit}")
        if not 1 <= self.min_txid <= self.max_txid < 1 << 64:
            raise LTXError(f"invalid txid range {self.min_txid}-{self.max_txid}")
        if not (0 <= self.wal_offset < 1 << 63 and 0 <= self.wal_size < 1 << 63):
            raise LTXError("invalid WAL offset or size")
        if (self.wal_salt1 or self.wal_salt2) and not self.wal_offset:
            raise LTXError("WAL salt without a WAL offset")
        if self.wal_size and not self.wal_offset:
            raise LTXError("WAL size without a WAL offset")
        if self.is_snapshot or self.no_checksum:
            if self.pre_apply_checksum:
                raise LTXError("pre-apply checksum not allowed on a snapshot or without checksums")
        elif not self.pre_apply_checksum & CHECKSUM_FLAG:
            raise LTXError("pre-apply checksum missing or malformed")


@frozen
class LTXTrailer:
    post_apply_checksum: int
    file_checksum: int


_UVARINT1 = [bytes((i,)) for i in range(0x80)]


def _uvarint(value: int) -> bytes:
    """Go's ``binary.AppendUvarint``; the common short forms without a loop (it runs per page)."""
    if value < 0x80:
        return _UVARINT1[value]
    if value < 0x4000:
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    if value < 0x200000:
        return bytes(((value & 0x7F) | 0x80, ((value >> 7) & 0x7F) | 0x80, value >> 14))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.cache
def _uvarint_tables() -> tuple[list[bytes], list[bytes]]:
    """For the decoder's page index, built once (about 1 MiB): ``whole[v]`` is the uvarint of
    ``v`` < 2**14; ``low[v]`` is the first two bytes of the uvarint of any value whose low 14 bits
    are ``v`` and that does not fit in 14 bits (the rest is the uvarint of ``value >> 14``)."""
    whole = [_uvarint(v) for v in range(1 << 14)]
    low = [bytes(((v & 0x7F) | 0x80, (v >> 7) | 0x80)) for v in range(1 << 14)]
    return whole, low


class LTXWriter:
    """Streams one LTX file to ``fileobj``: ``write_page`` each page in ascending order, then
    ``finish``. Only the page index (a few bytes per page) is kept in memory."""

    def __init__(self, fileobj: BinaryIO, header: LTXHeader) -> None:
        self._f = fileobj
        self.header = header
        self._lock = lock_pgno(header.page_size)
        self._prev = 0
        self._index = bytearray()
        self._finished = False
        self._n = 0
        self._crc = 0
        self._write(header.pack())

    def _write(self, data: bytes, hashed: bytes | None = None) -> None:
        self._f.write(data)
        self._n += len(data)
        self._crc = crc64_iso(data if hashed is None else hashed, self._crc)

    def write_page(self, pgno: int, data: bytes) -> None:
        h = self.header
        if self._finished:
            raise LTXError("writer already finished")
        if len(data) != h.page_size:
            raise LTXError(f"page {pgno} is {len(data)} bytes, not {h.page_size}")
        _check_pgno(h, pgno, self._prev, self._lock)
        block = lz4.block.compress(data, store_size=False)
        offset = self._n
        self._write(_PAGE_HEADER.pack(pgno, PAGE_FLAG_SIZE) + _U32.pack(len(block)))
        # The checksum covers the page as stored in the database, not its compressed form.
        self._write(block, hashed=data)
        self._index += _uvarint(pgno) + _uvarint(offset) + _uvarint(self._n - offset)
        self._prev = pgno

    def finish(self, post_apply_checksum: int = 0) -> LTXTrailer:
        """Write the terminator, index and trailer; returns the trailer. Does not close the file."""
        h = self.header
        if self._finished:
            raise LTXError("writer already finished")
        if h.is_snapshot and self._prev != _last_pgno(h.commit, self._lock):
            raise LTXError(f"snapshot ends at page {self._prev}, commit is {h.commit}")
        if h.no_checksum and post_apply_checksum:
            raise LTXError("post-apply checksum given to a file without checksums")
        if not h.no_checksum and not post_apply_checksum & CHECKSUM_FLAG:
            raise LTXError("post-apply checksum required")
        self._write(_END)
        index = bytes(self._index) + _uvarint(0)
        self._write(index + _U64.pack(len(index)))
        self._write(_U64.pack(post_apply_checksum))
        file_checksum = CHECKSUM_FLAG | self._crc
        self._f.write(_U64.pack(file_checksum))
        self._finished = True
        return LTXTrailer(post_apply_checksum, file_checksum)


def _check_pgno(h: LTXHeader, pgno: int, prev: int, lock: int) -> None:
    """Raise unless page ``pgno`` may follow page ``prev`` in a file with header ``h``."""
    if not 1 <= pgno <= h.commit:
        raise LTXError(f"page {pgno} outside the database's {h.commit} pages")
    if pgno <= prev:
        raise LTXError(f"page {pgno} after page {prev}: pages must ascend")
    if pgno == lock:
        raise LTXError(f"page {pgno} is the lock page")
    if h.is_snapshot and pgno != _next_snapshot_pgno(prev, lock):
        raise LTXError(f"snapshot skips from page {prev} to {pgno}")


def _next_snapshot_pgno(prev: int, lock: int) -> int:
    return prev + 2 if prev + 1 == lock else prev + 1


def _last_pgno(commit: int, lock: int) -> int:
    # A database that ends exactly on the lock page has no page to write there.
    return commit - 1 if commit == lock else commit


def encode(
    header: LTXHeader, pages: Iterable[tuple[int, bytes]], post_apply_checksum: int = 0
) -> bytes:
    """A whole LTX file in memory (small files and tests; stream big ones with :class:`LTXWriter`)."""
    import io

    buf = io.BytesIO()
    writer = LTXWriter(buf, header)
    for pgno, data in pages:
        writer.write_page(pgno, data)
    writer.finish(post_apply_checksum)
    return buf.getvalue()


_FRAME = struct.Struct(">IHI")  # a page header and its block size
_FRAME_SIZE = _FRAME.size
_READ_CHUNK = 1 << 20
# LTXDecoder states
_AT_HEADER, _AT_PAGES, _AT_TAIL, _DONE, _FAILED = range(5)


class LTXDecoder:
    """Decodes and verifies one LTX file pushed in pieces of any size (a body as it arrives).

    ``feed`` returns the pages that piece completed, ``(pgno, page)`` in file order; ``header`` is
    set as soon as its 100 bytes are in. After the last piece, ``close`` checks that the file ended
    exactly at its trailer — by then the page index, the file checksum and a snapshot's post-apply
    checksum have been verified — and returns the trailer. An :class:`LTXError` is final: the decoder
    refuses anything after it. Pages are handed out before the file checksum is known: write them
    somewhere disposable until ``close`` returns.

    A piece is read where it lies (no copy); only a frame split between two pieces is joined.
    """

    def __init__(self) -> None:
        self.header: LTXHeader | None = None
        self.trailer: LTXTrailer | None = None
        self._state = _AT_HEADER
        self._rest = b""  # received, not yet consumed: the start of a frame, the header or the tail
        self._offset = 0  # the file offset of _rest[0]
        self._frame_max = 0  # the largest page frame the header allows
        self._crc = 0
        self._prev = 0
        self._index = bytearray()  # the page index the pages seen so far call for
        self._snapshot_sum = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, bytes]]:
        if self._state == _FAILED:
            raise LTXError("the file was already found corrupt")
        try:
            return self._feed(data)
        except BaseException:
            self._state = _FAILED
            raise

    def close(self) -> LTXTrailer:
        if self._state == _DONE and self.trailer is not None:
            return self.trailer
        if self._state == _FAILED:
            raise LTXError("the file was already found corrupt")
        state, self._state = self._state, _FAILED
        have = len(self._rest)
        if state == _AT_HEADER:
            raise LTXError(f"truncated file: header ends after {have} of {HEADER_SIZE} bytes")
        if state == _AT_PAGES:
            received = self._offset + have
            raise LTXError(f"truncated file: it ends inside its pages, after {received} bytes")
        raise LTXError(
            f"truncated file: page index and trailer end after {have} of {self._tail_size()} bytes"
        )

    def _feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, bytes]]:
        pages: list[tuple[int, bytes]] = []
        rest = self._rest
        start = 0
        if rest:
            # Complete what the last piece left unfinished with as little of this one as will
            # do: while in the pages, at most one frame's worth.
            take = len(data)
            if self._state == _AT_PAGES:
                take = min(take, self._frame_max - len(rest))
            joined = rest + bytes(data[:take])
            used = self._consume(joined, 0, pages)
            if take == len(data) or used < len(rest):
                rest = joined[used:] + bytes(data[take:])
                self._rest = rest[self._consume(rest, 0, pages) :]
                self._check_trailing()
                return pages
            start = used - len(rest)
        used = self._consume(data, start, pages)
        self._rest = bytes(data[used:])
        self._check_trailing()
        return pages

    def _check_trailing(self) -> None:
        if self._state == _DONE and self._rest:
            raise LTXError("trailing bytes after the trailer")

    def _consume(
        self, src: bytes | bytearray | memoryview, pos: int, pages: list[tuple[int, bytes]]
    ) -> int:
        """Consume every whole part of ``src`` from ``pos`` on (``src[pos]`` is at file offset
        ``_offset``); return where the first incomplete one starts."""
        if self._state == _AT_HEADER:
            if len(src) - pos < HEADER_SIZE:
                return pos
            raw = bytes(src[pos : pos + HEADER_SIZE])
            self.header = h = LTXHeader.unpack(raw)
            self._frame_max = _FRAME_SIZE + h.page_size + h.page_size // 255 + 16
            self._crc = crc64_iso(raw)
            pos += HEADER_SIZE
            self._offset += HEADER_SIZE
            self._state = _AT_PAGES
        if self._state == _AT_PAGES:
            pos = self._pages(src, pos, pages)
        if self._state == _AT_TAIL:
            pos = self._tail(src, pos)
        return pos

    def _pages(
        self, src: bytes | bytearray | memoryview, pos: int, pages: list[tuple[int, bytes]]
    ) -> int:
        # The hot loop of every restore: one pass, no copies but the decompressed page itself.
        h = self.header
        assert h is not None
        end = len(src)
        base = self._offset - pos  # the file offset of src[0]
        page_size = h.page_size
        commit = h.commit
        lock = lock_pgno(page_size)
        snapshot = h.is_snapshot
        sums = snapshot and not h.no_checksum
        max_block = self._frame_max - _FRAME_SIZE
        crc = self._crc
        prev = self._prev
        index = self._index
        ssum = self._snapshot_sum
        unpack = _FRAME.unpack_from
        decompress = lz4.block.decompress
        go_iso = crc64.go_iso
        uvarint = _uvarint
        whole, low = _uvarint_tables()
        append = pages.append
        at_end = False
        view = memoryview(src)
        try:
            while True:
                if end - pos < _FRAME_SIZE:
                    # Only the end marker (6 bytes) can be shorter than a frame header.
                    at_end = end - pos >= PAGE_HEADER_SIZE and view[pos : pos + 6] == _END
                    break
                pgno, flags, size = unpack(src, pos)
                if not pgno and not flags:
                    at_end = True
                    break
                if (
                    not (prev < pgno <= commit and pgno != lock)
                    or flags != PAGE_FLAG_SIZE
                    or not 0 < size <= max_block
                    # a snapshot has every page but the lock page: _next_snapshot_pgno, inlined
                    or (snapshot and pgno != prev + 1 and (pgno != prev + 2 or prev + 1 != lock))
                ):
                    _bad_page(h, pgno, flags, size, prev)
                stop = pos + _FRAME_SIZE + size
                if stop > end:
                    break
                try:
                    data = decompress(view[pos + _FRAME_SIZE : stop], uncompressed_size=page_size)
                except lz4.block.LZ4BlockError as e:
                    raise LTXError(f"page {pgno}: corrupt LZ4 block ({e})") from None
                if len(data) != page_size:
                    raise LTXError(
                        f"page {pgno}: decompresses to {len(data)} bytes, not {page_size}"
                    )
                # The checksum covers the frame header and the page, not its LZ4 form.
                crc = go_iso(data, go_iso(view[pos : pos + _FRAME_SIZE], crc))
                if sums:
                    ssum = CHECKSUM_FLAG | (ssum ^ page_checksum(pgno, data))
                # index += uvarint(pgno) + uvarint(offset) + uvarint(length), from the tables
                # below 2**28 (two lookups at most; the offset reaches 2**28 only past 256 MiB).
                n = base + pos
                index += (
                    (whole[pgno] if pgno < 0x4000 else low[pgno & 0x3FFF] + whole[pgno >> 14])
                    if pgno < 0x10000000
                    else uvarint(pgno)
                )
                index += (
                    (whole[n] if n < 0x4000 else low[n & 0x3FFF] + whole[n >> 14])
                    if n < 0x10000000
                    else uvarint(n)
                )
                n = stop - pos
                index += whole[n] if n < 0x4000 else low[n & 0x3FFF] + whole[n >> 14]
                append((pgno, data))
                prev = pgno
                pos = stop
            if at_end:
                crc = go_iso(view[pos : pos + PAGE_HEADER_SIZE], crc)
                pos += PAGE_HEADER_SIZE
                if snapshot and prev != _last_pgno(commit, lock):
                    raise LTXError(f"snapshot ends at page {prev}, commit is {commit}")
                index += _uvarint(0)
                if len(index) > _MAX_INDEX:
                    raise LTXError("page index too large")
                self._state = _AT_TAIL
        finally:
            view.release()
            self._offset = base + pos
            self._crc = crc
            self._prev = prev
            self._snapshot_sum = ssum
        return pos

    def _tail_size(self) -> int:
        return len(self._index) + 8 + TRAILER_SIZE

    def _tail(self, src: bytes | bytearray | memoryview, pos: int) -> int:
        h = self.header
        assert h is not None
        expected_index = self._index
        n = len(expected_index)
        need = self._tail_size()
        if len(src) - pos < need:
            return pos
        tail = bytes(src[pos : pos + need])
        if tail[:n] != expected_index:
            raise LTXError("page index does not match the pages")
        (index_size,) = _U64.unpack_from(tail, n)
        if index_size != n:
            raise LTXError(f"page index size {index_size}, expected {n}")
        post, file_checksum = _TRAILER.unpack_from(tail, n + 8)
        crc = CHECKSUM_FLAG | crc64_iso(tail[: n + 8 + 8], self._crc)
        if file_checksum != crc:
            raise LTXError(
                f"file checksum mismatch: stored {file_checksum:016x}, computed {crc:016x}"
            )
        if h.no_checksum:
            if post:
                raise LTXError("post-apply checksum present in a file without checksums")
        else:
            if not post & CHECKSUM_FLAG:
                raise LTXError("post-apply checksum missing or malformed")
            if h.is_snapshot and post != self._snapshot_sum:
                raise LTXError(
                    f"snapshot post-apply checksum {post:016x} != its pages' "
                    f"{self._snapshot_sum:016x}"
                )
        self.trailer = LTXTrailer(post, file_checksum)
        self._index = bytearray()
        self._offset += need
        self._state = _DONE
        return pos + need


def _bad_page(h: LTXHeader, pgno: int, flags: int, size: int, prev: int) -> None:
    """Raise the error for a page header the decoder's fast check refused."""
    if pgno == 0:
        raise LTXError(f"page header with page 0 and flags 0x{flags:04x}")
    if flags != PAGE_FLAG_SIZE:
        # 0 would be ltx's pre-0.5 LZ4-frame pages, which Litestream 0.5 never writes.
        raise LTXError(f"page {pgno}: unsupported page flags 0x{flags:04x}")
    _check_pgno(h, pgno, prev, lock_pgno(h.page_size))
    raise LTXError(f"page {pgno}: implausible compressed size {size}")


class LTXReader:
    """Reads and verifies one LTX file from ``fileobj`` (an :class:`LTXDecoder` fed from it).

    ``header`` is read at construction. Iterating yields ``(pgno, page)`` in file order; the
    iteration ends only after the index and the file checksum have been verified, so a caller that
    consumed every page without an :class:`LTXError` has an intact file (``trailer`` is then set).
    Pages are yielded before that check: write them somewhere disposable.
    """

    def __init__(self, fileobj: BinaryIO) -> None:
        self._f = fileobj
        self._decoder = LTXDecoder()
        raw = fileobj.read(HEADER_SIZE)
        if len(raw) != HEADER_SIZE:
            raise LTXError(f"truncated file: header ends after {len(raw)} of {HEADER_SIZE} bytes")
        self._decoder.feed(raw)
        assert self._decoder.header is not None
        self.header = self._decoder.header
        self._started = False

    @property
    def trailer(self) -> LTXTrailer | None:
        return self._decoder.trailer

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        if self._started:
            raise LTXError("an LTX file can be read only once")
        self._started = True
        return self._pages()

    def _pages(self) -> Iterator[tuple[int, bytes]]:
        while chunk := self._f.read(_READ_CHUNK):
            yield from self._decoder.feed(chunk)
        self._decoder.close()


@frozen
class DecodedLTX:
    header: LTXHeader
    pages: list[tuple[int, bytes]]
    trailer: LTXTrailer


def decode(fileobj: BinaryIO) -> DecodedLTX:
    """Read and verify a whole file into memory (small files and tests)."""
    reader = LTXReader(fileobj)
    pages = list(reader)
    assert reader.trailer is not None
    return DecodedLTX(reader.header, pages, reader.trailer)


def filename(min_txid: int, max_txid: int) -> str:
    return f"{min_txid:016x}-{max_txid:016x}.ltx"


def object_key(path: str, level: int, min_txid: int, max_txid: int) -> str:
    """``<path>/<level %04x>/<min %016x>-<max %016x>.ltx``, Litestream's S3 layout."""
    return f"{path}/{level:04x}/{filename(min_txid, max_txid)}"

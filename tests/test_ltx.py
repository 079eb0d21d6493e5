"""The LTX codec: CRC vectors, round trips, corruption detection (files from the real binary are
decoded in ``test_restore``'s interop tests)."""

from __future__ import annotations

import io
import os
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from lchat.replica import ltx
from lchat.replica.ltx import LTXError, LTXHeader

PAGE_SIZES = [512, 1024, 4096, 65536]


def _header(page_size: int, commit: int, lo: int = 2, hi: int = 2, **kw: int) -> LTXHeader:
    return LTXHeader(
        page_size=page_size,
        commit=commit,
        min_txid=lo,
        max_txid=hi,
        timestamp=1_700_000_000_000,
        **kw,
    )


def _page(n: int, size: int) -> bytes:
    # Compressible but distinct pages, with a random tail so LZ4 has work of both kinds.
    return (bytes([n % 251]) * (size // 2) + os.urandom(size // 2))[:size]


class CRCTests(SynchronousTestCase):
    def test_go_iso_check_value(self) -> None:
        # CRC-64/GO-ISO's catalogue check value, and Go's crc64.Checksum(.., MakeTable(ISO)).
        self.assertEqual(ltx.crc64_iso(b"123456789"), 0xB90956C775A41001)
        self.assertEqual(ltx.crc64_iso(b""), 0)

    def test_incremental(self) -> None:
        data = os.urandom(10000)
        for cut in (0, 1, 4999, 10000):
            self.assertEqual(
                ltx.crc64_iso(data[cut:], ltx.crc64_iso(data[:cut])), ltx.crc64_iso(data)
            )

    def test_backend_is_compiled(self) -> None:
        # A pure-Python fallback would be far too slow for restores; fastcrc is a Rust extension.
        import importlib

        native = importlib.import_module("fastcrc.fastcrc")
        self.assertTrue(str(native.__file__).endswith(".so"), native.__file__)


class RoundTripTests(SynchronousTestCase):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        page_size=st.sampled_from(PAGE_SIZES),
        commit=st.integers(1, 40),
        data=st.data(),
        snapshot=st.booleans(),
        checksums=st.booleans(),
    )
    def test_round_trip(
        self, page_size: int, commit: int, data: st.DataObject, snapshot: bool, checksums: bool
    ) -> None:
        if snapshot:
            pgnos = list(range(1, commit + 1))
        else:
            pgnos = sorted(data.draw(st.sets(st.integers(1, commit), max_size=commit)))
        pages = [(p, _page(p, page_size)) for p in pgnos]
        lo = 1 if snapshot else 5
        post = 0
        pre = 0
        flags = ltx.FLAG_NO_CHECKSUM
        if checksums:
            flags = 0
            pre = 0 if snapshot else ltx.CHECKSUM_FLAG | 1234
            post = ltx.CHECKSUM_FLAG
            for p, d in pages:
                post = ltx.CHECKSUM_FLAG | (post ^ ltx.page_checksum(p, d))
        header = _header(page_size, commit, lo, lo + 3, flags=flags, pre_apply_checksum=pre)
        blob = ltx.encode(header, pages, post)
        decoded = ltx.decode(io.BytesIO(blob))
        self.assertEqual(decoded.header, header)
        self.assertEqual(decoded.pages, pages)
        self.assertEqual(decoded.trailer.post_apply_checksum, post)
        self.assertTrue(decoded.trailer.file_checksum & ltx.CHECKSUM_FLAG)

    def test_layout(self) -> None:
        pages = [(1, _page(1, 4096)), (3, b"\x00" * 4096)]
        blob = ltx.encode(_header(4096, 3), pages)
        self.assertEqual(blob[:4], b"LTX1")
        self.assertEqual(struct.unpack(">I", blob[4:8])[0], ltx.FLAG_NO_CHECKSUM)
        pgno, flags, size = struct.unpack(">IHI", blob[100:110])
        self.assertEqual((pgno, flags), (1, 1))
        self.assertEqual(blob[110 + size : 110 + size + 6], struct.pack(">IH", 3, 1))
        # Trailer: post-apply 0 (no checksums), file checksum with bit 63 set.
        post, file_checksum = struct.unpack(">QQ", blob[-16:])
        self.assertEqual(post, 0)
        self.assertEqual(file_checksum, ltx.CHECKSUM_FLAG | ltx.crc64_iso(_logical(blob, 4096)))

    def test_lock_page_is_never_written(self) -> None:
        # The lock page holds byte 1 GiB: a snapshot large enough to reach it is too slow for a
        # unit test, so a delta straddles it and the snapshot rule is checked on its own.
        self.assertEqual(ltx.lock_pgno(4096), 262145)
        self.assertEqual(ltx.lock_pgno(65536), 16385)
        lock = ltx.lock_pgno(512)
        header = _header(512, lock + 1)
        pages = [(lock - 1, b"\x01" * 512), (lock + 1, b"\x02" * 512)]
        self.assertEqual(ltx.decode(io.BytesIO(ltx.encode(header, pages))).pages, pages)
        with self.assertRaisesRegex(LTXError, "lock page"):
            ltx.encode(header, [(lock, b"\x01" * 512)])
        self.assertEqual(ltx._next_snapshot_pgno(lock - 1, lock), lock + 1)
        self.assertEqual(ltx._last_pgno(lock, lock), lock - 1)

    def test_writer_refusals(self) -> None:
        for header, pages in [
            (_header(4096, 3), [(2, b"x" * 4096), (1, b"x" * 4096)]),  # descending
            (_header(4096, 3), [(4, b"x" * 4096)]),  # beyond commit
            (_header(4096, 3), [(1, b"x" * 100)]),  # short page
            (_header(4096, 3, 1, 1), [(1, b"x" * 4096), (3, b"x" * 4096)]),  # snapshot gap
            (_header(4096, 3, 1, 1), [(1, b"x" * 4096)]),  # snapshot short
        ]:
            with self.assertRaises(LTXError):
                ltx.encode(header, pages)
        with self.assertRaises(LTXError):
            _header(1000, 3).pack()
        with self.assertRaises(LTXError):
            _header(4096, 3, 3, 2).pack()


def _logical(blob: bytes, page_size: int) -> bytes:
    """The bytes the file checksum covers: the file with each LZ4 block replaced by its page."""
    out = bytearray(blob[:100])
    i = 100
    while blob[i : i + 6] != b"\x00" * 6:
        size = struct.unpack(">I", blob[i + 6 : i + 10])[0]
        out += blob[i : i + 10]
        out += ltx.lz4.block.decompress(blob[i + 10 : i + 10 + size], uncompressed_size=page_size)
        i += 10 + size
    out += blob[i:-8]
    return bytes(out)


class CorruptionTests(SynchronousTestCase):
    def setUp(self) -> None:
        pages = [(p, _page(p, 1024)) for p in (1, 2, 5, 9)]
        self.blob = ltx.encode(_header(1024, 9), pages)

    def test_every_byte_flip_is_caught(self) -> None:
        # Every position, one bit each: header, page headers, LZ4 blocks, index, trailer. The
        # checksum covers the pages, not their LZ4 form, so a flip inside a block that still
        # decompresses to the same page (a match offset into a run of equal bytes) is harmless.
        good = ltx.decode(io.BytesIO(self.blob)).pages
        for i in range(len(self.blob)):
            bad = bytearray(self.blob)
            bad[i] ^= 1 << (i % 8)
            try:
                pages = ltx.decode(io.BytesIO(bytes(bad))).pages
            except LTXError:
                continue
            self.assertEqual(pages, good, f"flip at byte {i} changed a page unnoticed")

    def test_truncation_and_trailing_bytes(self) -> None:
        for n in (0, 50, 100, 105, len(self.blob) // 2, len(self.blob) - 1):
            with self.assertRaises(LTXError):
                ltx.decode(io.BytesIO(self.blob[:n]))
        with self.assertRaises(LTXError):
            ltx.decode(io.BytesIO(self.blob + b"\x00"))

    def test_messages_say_what(self) -> None:
        bad = bytearray(self.blob)
        bad[0] = ord("X")
        with self.assertRaisesRegex(LTXError, "magic"):
            ltx.decode(io.BytesIO(bytes(bad)))
        bad = bytearray(self.blob)
        bad[-1] ^= 1
        with self.assertRaisesRegex(LTXError, "file checksum mismatch"):
            ltx.decode(io.BytesIO(bytes(bad)))

    def test_checksums_refused_without_flag(self) -> None:
        # A no-checksum file carrying a post-apply checksum is what Litestream rejects (#1427).
        header = _header(1024, 1, 2, 2)
        with self.assertRaises(LTXError):
            ltx.encode(header, [(1, _page(1, 1024))], ltx.CHECKSUM_FLAG | 5)
        with self.assertRaises(LTXError):
            _header(1024, 1, 2, 2, pre_apply_checksum=ltx.CHECKSUM_FLAG | 5).pack()

    def test_snapshot_post_apply_checksum_is_checked(self) -> None:
        pages = [(1, _page(1, 1024)), (2, _page(2, 1024))]
        header = _header(1024, 2, 1, 1, flags=0)
        blob = ltx.encode(header, pages, ltx.CHECKSUM_FLAG | 99)
        with self.assertRaisesRegex(LTXError, "post-apply"):
            ltx.decode(io.BytesIO(blob))


class KeyTests(SynchronousTestCase):
    def test_object_key(self) -> None:
        self.assertEqual(
            ltx.object_key("p/h.example", 9, 1, 0x2A),
            "p/h.example/0009/0000000000000001-000000000000002a.ltx",
        )

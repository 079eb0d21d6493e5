"""The WAL reader (``lchat/replica/wal.py``) and the consistency machinery (``lchat/replica/db.py``).

Real SQLite files throughout, and a real writer in a separate process (``_WRITER``: it executes
SQL sent on stdin, one JSON command a line, and answers each with one JSON line), so locks, the
shared-memory index and checkpoints behave exactly as they do against a live space.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from lchat.replica import wal
from lchat.replica.db import ReplicaDB, Snapshot, lock_pgno
from lchat.replica.wal import (
    FRAME_HEADER_SIZE,
    MAGIC_BE,
    MAGIC_LE,
    WAL_HEADER_SIZE,
    Segment,
    WALHeader,
    WALPosition,
    WALReset,
    WALRewritten,
    wal_checksum,
)

_WRITER = r"""
import json, sqlite3, sys, time
path, autockpt = sys.argv[1], int(sys.argv[2])
db = sqlite3.connect(path, isolation_level=None, timeout=10)
db.execute("PRAGMA journal_mode=wal")
db.execute("PRAGMA busy_timeout=10000")
if autockpt >= 0:
    db.execute(f"PRAGMA wal_autocheckpoint={autockpt}")
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "sql":
            rows = db.execute(cmd["sql"], cmd.get("args", [])).fetchall()
            out = {"ok": True, "rows": rows}
        elif cmd["op"] == "script":
            db.executescript(cmd["sql"])
            out = {"ok": True}
        elif cmd["op"] == "loop":
            # Write for a while; count errors (a busy beyond the timeout surfaces here).
            n = errors = 0
            end = time.monotonic() + cmd["seconds"]
            while time.monotonic() < end:
                try:
                    db.execute("INSERT INTO t (v) VALUES (randomblob(200 + abs(random()) % 3000))")
                    if n % 7 == 0:
                        db.execute("DELETE FROM t WHERE id IN (SELECT id FROM t ORDER BY random() LIMIT 2)")
                    n += 1
                except sqlite3.OperationalError as e:
                    errors += 1
                    print("ERR", e, file=sys.stderr)
            out = {"ok": True, "n": n, "errors": errors}
        else:
            out = {"ok": False, "error": "bad op"}
    except Exception as e:
        out = {"ok": False, "error": repr(e)}
    print(json.dumps(out), flush=True)
"""


class Writer:
    """The space stand-in: one SQLite connection in another process."""

    def __init__(self, path: str, autocheckpoint: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, path, str(autocheckpoint)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        if not out["ok"]:
            raise AssertionError(out)
        return out

    def sql(self, sql: str, *args: Any) -> list[Any]:
        return list(self.send(op="sql", sql=sql, args=list(args))["rows"])

    def script(self, sql: str) -> None:
        self.send(op="script", sql=sql)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def dump(path: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


class Replica:
    """A database rebuilt only from what a replicator would ship: a snapshot, then segments."""

    def __init__(self, path: str, snap: Snapshot, pages: Any) -> None:
        self.path, self.page_size = path, snap.page_size
        with open(path, "wb") as f:
            for pgno, data in pages:
                f.seek((pgno - 1) * snap.page_size)
                f.write(data)
            f.truncate(snap.page_count * snap.page_size)

    def apply(self, wal_path: str, seg: Segment) -> None:
        if seg.empty:
            return
        with open(self.path, "r+b") as f:
            for pgno, data in wal.iter_segment_pages(wal_path, seg):
                f.seek((pgno - 1) * self.page_size)
                f.write(data)
            f.truncate(seg.commit * self.page_size)

    def dump(self) -> list[str]:
        # Read a copy so SQLite never writes a -wal/-shm beside our image.
        tmp = self.path + ".check"
        shutil.copyfile(self.path, tmp)
        try:
            conn = sqlite3.connect(tmp)
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            conn.close()
            return dump(tmp)
        finally:
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(tmp + suffix):
                    os.unlink(tmp + suffix)


def to_big_endian(data: bytes, page_size: int) -> bytes:
    """The same log as a big-endian machine writes it: new magic, every checksum recomputed."""
    hdr = bytearray(data[:WAL_HEADER_SIZE])
    struct.pack_into(">I", hdr, 0, MAGIC_BE)
    c = wal_checksum(bytes(hdr[:24]), big_endian=True)
    struct.pack_into(">II", hdr, 24, *c)
    out = bytearray(hdr)
    fs = page_size + FRAME_HEADER_SIZE
    for off in range(WAL_HEADER_SIZE, len(data) - fs + 1, fs):
        frame = bytearray(data[off : off + fs])
        c = wal_checksum(bytes(frame[:8]), *c, big_endian=True)
        c = wal_checksum(bytes(frame[FRAME_HEADER_SIZE:]), *c, big_endian=True)
        struct.pack_into(">II", frame, 16, *c)
        out += frame
    return bytes(out)


class Base(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(dir=os.getcwd())
        self.path = os.path.join(self.dir, "space.db")
        self.wal_path = self.path + "-wal"
        self.writers: list[Writer] = []

    def tearDown(self) -> None:
        for w in self.writers:
            if w.proc.poll() is None:
                w.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def writer(self, autocheckpoint: int = 0) -> Writer:
        w = Writer(self.path, autocheckpoint)
        self.writers.append(w)
        return w


class HeaderAndFrames(Base):
    def test_header_little_endian(self) -> None:
        w = self.writer()
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        with wal.WALReader(self.wal_path) as r:
            hdr = r.header()
        assert hdr is not None
        self.assertEqual(hdr.magic, MAGIC_LE if sys.byteorder == "little" else MAGIC_BE)
        self.assertEqual(hdr.version, 3007000)
        self.assertEqual(hdr.page_size, 4096)
        with open(self.wal_path, "rb") as f:
            raw = f.read(32)
        self.assertEqual(WALHeader.parse(raw), hdr)
        self.assertEqual(hdr.pack(), raw)
        bad = raw[:20] + bytes([raw[20] ^ 1]) + raw[21:]
        self.assertRaises(wal.WALError, WALHeader.parse, bad)

    def test_checksum_matches_sqlite(self) -> None:
        """Every frame SQLite wrote verifies: the reader's chain reaches the last commit."""
        w = self.writer()
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        for i in range(20):
            w.sql("INSERT INTO t (v) VALUES (randomblob(?))", 100 * i)
        seg = wal.read_committed(self.wal_path, None)
        assert isinstance(seg, Segment)
        fs = seg.header.frame_size
        self.assertEqual(seg.end.offset, os.path.getsize(self.wal_path))
        self.assertEqual(seg.frame_count, (seg.end.offset - WAL_HEADER_SIZE) // fs)

    def test_big_endian(self) -> None:
        w = self.writer()
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        for _ in range(5):
            w.sql("INSERT INTO t (v) VALUES (randomblob(3000))")
        le = wal.read_committed(self.wal_path, None)
        assert isinstance(le, Segment)
        with open(self.wal_path, "rb") as f:
            data = f.read()
        be_path = os.path.join(self.dir, "be.db-wal")
        with open(be_path, "wb") as f:
            f.write(to_big_endian(data, le.header.page_size))
        be = wal.read_committed(be_path, None)
        assert isinstance(be, Segment)
        self.assertTrue(be.header.big_endian)
        self.assertEqual(
            (be.commit, be.frame_count, be.end.offset), (le.commit, le.frame_count, le.end.offset)
        )
        self.assertEqual(sorted(be.pages), sorted(le.pages))
        self.assertEqual(
            dict(wal.iter_segment_pages(be_path, be)),
            dict(wal.iter_segment_pages(self.wal_path, le)),
        )
        # The little-endian checksums do not verify as big-endian ones: byte order matters.
        swapped = bytearray(data)
        struct.pack_into(">I", swapped, 0, MAGIC_BE)
        self.assertRaises(wal.WALError, WALHeader.parse, bytes(swapped[:32]))

    def test_committed_only(self) -> None:
        """A transaction still open in the writer (spilled into the log) is not reported."""
        w = self.writer()
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        w.sql("INSERT INTO t (v) VALUES (x'01')")
        before = wal.read_committed(self.wal_path, None)
        assert isinstance(before, Segment)
        w.sql("PRAGMA cache_size = 2")  # forces the open transaction's pages out to the log
        w.sql("BEGIN")
        for _ in range(50):
            w.sql("INSERT INTO t (v) VALUES (randomblob(4000))")
        self.assertGreater(os.path.getsize(self.wal_path), before.end.offset)
        during = wal.read_committed(self.wal_path, None)
        assert isinstance(during, Segment)
        self.assertEqual(during.end, before.end)
        again = wal.read_committed(self.wal_path, before.end)
        assert isinstance(again, Segment)
        self.assertTrue(again.empty)
        w.sql("COMMIT")
        after = wal.read_committed(self.wal_path, before.end)
        assert isinstance(after, Segment)
        self.assertGreater(after.end.offset, before.end.offset)
        self.assertEqual(after.end.offset, os.path.getsize(self.wal_path))


class ResetAndRewrite(Base):
    def _populated(self, w: Writer) -> Segment:
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        for _ in range(5):
            w.sql("INSERT INTO t (v) VALUES (randomblob(1000))")
        seg = wal.read_committed(self.wal_path, None)
        assert isinstance(seg, Segment)
        return seg

    def test_reset_by_truncate(self) -> None:
        w = self.writer()
        seg = self._populated(w)
        self.assertEqual(w.sql("PRAGMA wal_checkpoint(TRUNCATE)")[0][0], 0)
        out = wal.read_committed(self.wal_path, seg.end)
        self.assertIsInstance(out, WALReset)
        w.sql("INSERT INTO t (v) VALUES (x'02')")
        out = wal.read_committed(self.wal_path, seg.end)
        assert isinstance(out, WALReset)
        assert out.header is not None
        # The restarting connection wrote the header: salt-1 + 1, checkpoint sequence + 1.
        self.assertEqual(out.header.salt1, seg.header.salt1 + 1)
        self.assertEqual(out.header.checkpoint_seq, seg.header.checkpoint_seq + 1)

    def test_reset_by_restart(self) -> None:
        w = self.writer()
        seg = self._populated(w)
        self.assertEqual(w.sql("PRAGMA wal_checkpoint(RESTART)")[0][0], 0)
        w.sql("INSERT INTO t (v) VALUES (x'02')")
        self.assertLessEqual(os.path.getsize(self.wal_path), seg.end.offset)  # reused, not grown
        self.assertIsInstance(wal.read_committed(self.wal_path, seg.end), WALReset)
        # Following a single restart is allowed when the caller says it is safe.
        out = wal.read_committed(self.wal_path, seg.end, follow_restart=True)
        assert isinstance(out, Segment)
        self.assertTrue(out.restarted)
        self.assertEqual(out.start.offset, WAL_HEADER_SIZE)

    def test_rewritten_frame(self) -> None:
        w = self.writer()
        seg = self._populated(w)
        fs = seg.header.frame_size
        with open(self.wal_path, "r+b") as f:
            f.seek(seg.end.offset - fs + FRAME_HEADER_SIZE + 100)
            f.write(b"garbage!")
        out = wal.read_committed(self.wal_path, seg.end)
        self.assertIsInstance(out, WALRewritten)
        # A frame rewritten with a *valid* chain is caught too: our recorded checksum differs.
        with open(self.wal_path, "rb") as f:
            data = f.read()
        fixed = bytearray(data[:32])
        c = seg.header.checksum
        for off in range(32, len(data) - fs + 1, fs):
            frame = bytearray(data[off : off + fs])
            c = wal_checksum(bytes(frame[:8]), *c)
            c = wal_checksum(bytes(frame[24:]), *c)
            struct.pack_into(">II", frame, 16, *c)
            fixed += frame
        with open(self.wal_path, "wb") as f:
            f.write(fixed)
        out = wal.read_committed(self.wal_path, seg.end)
        assert isinstance(out, WALRewritten)
        self.assertIn("chain", out.reason)
        # Without a recorded checksum (resuming from an LTX header) the frame is self-consistent.
        loose = WALPosition(seg.end.offset, seg.end.page_size, seg.end.salt1, seg.end.salt2, None)
        self.assertIsInstance(wal.read_committed(self.wal_path, loose), Segment)

    def test_stale_page_ref(self) -> None:
        w = self.writer()
        seg = self._populated(w)
        w.sql("PRAGMA wal_checkpoint(RESTART)")
        for _ in range(10):
            w.sql("INSERT INTO t (v) VALUES (randomblob(1000))")
        ref = next(iter(seg.pages.values()))
        with wal.WALReader(self.wal_path) as reader:
            self.assertRaises(wal.WALError, reader.read_page, seg.header, ref)


class Consistency(Base):
    def _open(self, **kw: Any) -> ReplicaDB:
        rdb = ReplicaDB(self.path, **kw)
        rdb.open()
        self.addCleanup(rdb.close)
        return rdb

    def test_tables_and_read_txn_blocks_truncate(self) -> None:
        w = self.writer()
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        rdb = self._open()
        names = {r[0] for r in w.sql("SELECT name FROM sqlite_master")}
        self.assertTrue({"_lchat_replica_seq", "_lchat_replica_lock"} <= names)
        anchor = rdb._anchor
        assert anchor is not None
        for _ in range(10):
            w.sql("INSERT INTO t (v) VALUES (randomblob(2000))")
        busy = w.sql("PRAGMA wal_checkpoint(TRUNCATE)")[0][0]
        self.assertEqual(busy, 1)  # our reader pins the log
        seg = rdb.read_committed(anchor)
        assert isinstance(seg, Segment)
        self.assertEqual(seg.start, anchor)
        self.assertGreaterEqual(seg.frame_count, 10)
        for pgno, data in wal.iter_segment_pages(self.wal_path, seg):  # still readable
            self.assertEqual(len(data), 4096, pgno)

    def test_snapshot_plus_segments_equals_live(self) -> None:
        w = self.writer(autocheckpoint=1000)
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        for _ in range(30):
            w.sql("INSERT INTO t (v) VALUES (randomblob(3000))")
        rdb = self._open()
        snap, pages = rdb.snapshot()
        rep = Replica(os.path.join(self.dir, "replica.db"), snap, pages)
        self.assertEqual(rep.dump(), dump(self.path))
        pos = snap.position
        w.sql("UPDATE t SET v = randomblob(100) WHERE id % 3 = 0")
        w.sql("DELETE FROM t WHERE id % 5 = 0")
        w.sql("INSERT INTO t (v) VALUES (randomblob(70000))")  # overflow pages
        seg = rdb.read_committed(pos)
        assert isinstance(seg, Segment)
        rep.apply(self.wal_path, seg)
        self.assertEqual(rep.dump(), dump(self.path))
        self.assertNotIn(lock_pgno(4096), seg.pages)

    def test_checkpoint_dance_while_writing(self) -> None:
        """The space writes flat out while we ship and checkpoint: no errors, exact replica."""
        w = self.writer(autocheckpoint=1000)
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        rdb = self._open(min_checkpoint_pages=50, truncate_pages=1500, lock_timeout_ms=2000)
        snap, pages = rdb.snapshot()
        rep = Replica(os.path.join(self.dir, "replica.db"), snap, pages)
        pos = snap.position
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(w.send(op="loop", seconds=3)))
        t.start()
        modes: list[str] = []
        truncated = 0

        def capture(seg: Segment) -> None:
            rep.apply(self.wal_path, seg)

        while t.is_alive():
            seg = rdb.read_committed(pos)
            if seg is not None:  # None: truncated, not yet rewritten
                assert isinstance(seg, Segment), seg
                rep.apply(self.wal_path, seg)
                pos = seg.end
            mode = rdb.wanted_checkpoint(pos)
            if mode is not None:
                res = rdb.checkpoint(mode, pos, capture)
                self.assertIsNone(res.reset, res)
                if res.done:
                    modes.append(mode)
                    truncated += res.truncated
                    pos = res.position
            time.sleep(0.01)
        t.join()
        self.assertEqual(result["errors"], 0)
        self.assertGreater(result["n"], 100)
        seg = rdb.read_committed(pos)
        if seg is not None:
            assert isinstance(seg, Segment), seg
            rep.apply(self.wal_path, seg)
        self.assertTrue(modes)
        self.assertEqual(rep.dump(), dump(self.path))
        self.assertEqual(w.sql("PRAGMA integrity_check")[0][0], "ok")

    def test_checkpoint_without_capture_skips(self) -> None:
        w = self.writer()
        w.sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        rdb = self._open()
        w.sql("INSERT INTO t (v) VALUES (x'01')")
        res = rdb.checkpoint("PASSIVE", rdb._anchor)
        self.assertFalse(res.done)
        self.assertEqual(res.reason, "unshipped committed frames")
        seg = rdb.read_committed(rdb._anchor)
        assert isinstance(seg, Segment)
        res = rdb.checkpoint("TRUNCATE", seg.end)
        self.assertTrue(res.done, res)
        self.assertTrue(res.truncated, res)
        self.assertEqual(os.path.getsize(self.wal_path), 0)
        # The space writes into a fresh log; we follow it from our anchor.
        w.sql("INSERT INTO t (v) VALUES (x'02')")
        nxt = rdb.read_committed(res.position)
        assert isinstance(nxt, Segment), nxt
        self.assertTrue(nxt.restarted)
        self.assertFalse(nxt.empty)


class Workloads(Base):
    @settings(
        max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(
        st.lists(
            st.tuples(st.sampled_from(["ins", "upd", "del", "big", "ckpt"]), st.integers(0, 50)),
            min_size=1,
            max_size=25,
        )
    )
    def test_random_workload(self, ops: list[tuple[str, int]]) -> None:
        """In-process writer (cheap): any workload's committed frames rebuild the live database."""
        d = tempfile.mkdtemp(dir=self.dir)
        path = os.path.join(d, "w.db")
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=wal")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        rdb = ReplicaDB(path)
        rdb.open()
        try:
            snap, pages = rdb.snapshot()
            rep = Replica(os.path.join(d, "r.db"), snap, pages)
            pos = snap.position
            for op, n in ops:
                if op == "ins":
                    conn.execute("INSERT INTO t (v) VALUES (randomblob(?))", (n * 37,))
                elif op == "upd":
                    conn.execute("UPDATE t SET v = randomblob(?) WHERE id % 3 = ?", (n, n % 3))
                elif op == "del":
                    conn.execute("DELETE FROM t WHERE id % 4 = ?", (n % 4,))
                elif op == "big":
                    conn.execute("INSERT INTO t (v) VALUES (randomblob(?))", (n * 2000,))
                else:
                    seg = rdb.read_committed(pos)
                    if seg is not None:
                        assert isinstance(seg, Segment), seg
                        rep.apply(rdb.wal_path, seg)
                        pos = seg.end
                    res = rdb.checkpoint("TRUNCATE" if n % 2 else "PASSIVE", pos)
                    assert res.done, res
                    pos = res.position
            seg = rdb.read_committed(pos)
            if seg is not None:
                assert isinstance(seg, Segment), seg
                rep.apply(rdb.wal_path, seg)
            self.assertEqual(rep.dump(), dump(path))
        finally:
            rdb.close()
            conn.close()
            shutil.rmtree(d, ignore_errors=True)

    @given(st.binary(min_size=0, max_size=256).map(lambda b: b[: len(b) - len(b) % 8]))
    def test_checksum_byte_orders(self, data: bytes) -> None:
        """Big-endian words of the byte-swapped data give the little-endian result."""
        swapped = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))
        self.assertEqual(wal_checksum(data), wal_checksum(swapped, big_endian=True))


class DescriptorLockTests(unittest.TestCase):
    """POSIX drops all of a process's locks on a file when any descriptor of it closes: reading
    pages for a snapshot must not release SQLite's locks, or the space's last close deletes the
    WAL under our read transaction."""

    def test_a_snapshot_does_not_let_the_space_delete_the_wal(self) -> None:
        import subprocess
        import sys
        import tempfile

        from lchat.replica.db import ReplicaDB

        d = tempfile.mkdtemp(prefix="wl", dir="/tmp")
        self.addCleanup(__import__("shutil").rmtree, d, True)
        path = os.path.join(d, "space.db")
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (v BLOB)")
        conn.commit()
        conn.close()
        rdb = ReplicaDB(path)
        rdb.open()
        self.addCleanup(rdb.close)
        _, pages = rdb.snapshot()
        self.assertTrue(list(pages))
        script = (
            "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "c.execute('INSERT INTO t VALUES (randomblob(5000))'); c.commit(); c.close()"
        )
        subprocess.run([sys.executable, "-c", script, path], check=True, timeout=30)
        self.assertTrue(os.path.exists(path + "-wal"), "the space's close deleted the WAL")

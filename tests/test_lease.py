"""The lease (``lchat/lease.py``) against real stores: the file store, and moto over real HTTP.

No store is faked. Where the tests move time they move only the *lease code's* local clocks (the
reactor and the monotonic clock it is handed), or, in the state machine, the bucket's clock as a
whole (a wrapper that shifts ``now()`` and every ``Last-Modified`` alike over a real file store).
Scenarios that need a lease to expire on a real store use a TTL of a second or two and wait.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import IO, TYPE_CHECKING, Any, ClassVar, TypeVar

from attrs import evolve
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from prometheus_client import REGISTRY
from twisted.internet import task
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads, IReactorTime
from twisted.internet.threads import blockingCallFromThread, deferToThread
from twisted.protocols import portforward
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

from lchat import lease
from lchat.lease import HeldLease, LeaseHeld, LeaseKeeper, LeaseLost, LeaseRecord
from lchat.objstore import (
    UTC,
    NotFound,
    ObjectInfo,
    ObjectStore,
    PutResult,
    StoredObject,
    StoreUnavailable,
)
from lchat.objstore.file import FileStore
from lchat.reactors import installed
from lchat.threads import thread_runner
from tests import s3servers

reactor = installed()
T = TypeVar("T")
HOST = "chat-a.example.com"
# With TTLs of a second or two, the default 10% margin is a few reactor ticks on a busy CI box;
# tests that time the real loss against the real expiry ask for half a second.
MARGIN = 0.5
KEY = lease.lease_key("prod", HOST)


def d(coro: Coroutine[Any, Any, T]) -> Deferred[T]:
    return Deferred.fromCoroutine(coro)


async def sleep(seconds: float) -> None:
    await task.deferLater(reactor, seconds, lambda: None)


async def settle(*keepers: LeaseKeeper | None, within: float = 10.0) -> None:
    """Wait (real time) until no keeper has a renewal in flight."""
    deadline = time.monotonic() + within
    while any(k is not None and k.renewing for k in keepers):
        assert time.monotonic() < deadline, "renewal never finished"
        await sleep(0.005)


class Lost:
    """A ``lost`` callback that records each call with the real monotonic time it came at."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.fired: Deferred[str] = Deferred()

    def __call__(self, why: str) -> None:
        self.calls.append((why, time.monotonic()))
        if not self.fired.called:
            self.fired.callback(why)

    @property
    def reasons(self) -> list[str]:
        return [why for why, _ in self.calls]


@implementer(IReactorTime, IReactorFromThreads)
class LocalClock:
    """The real reactor as seen by a box whose wall clock is ``offset`` seconds off.

    ``timers`` replaces the timer wheel: a ``task.Clock`` nobody advances models a wall clock that
    stepped back (Twisted's timers run on the wall clock, so they all stall).
    """

    def __init__(self, offset: float = 0.0, timers: IReactorTime | None = None) -> None:
        self.offset = offset
        self._timers: Any = timers if timers is not None else reactor

    def seconds(self) -> float:
        return float(reactor.seconds()) + self.offset

    def callLater(
        self, delay: float, callable: Callable[..., Any], *args: object, **kwargs: object
    ) -> IDelayedCall:
        call: IDelayedCall = self._timers.callLater(delay, callable, *args, **kwargs)
        return call

    def getDelayedCalls(self) -> list[IDelayedCall]:
        calls: list[IDelayedCall] = self._timers.getDelayedCalls()
        return calls

    def callFromThread(self, callable: Callable[..., Any], *args: object, **kwargs: object) -> None:
        reactor.callFromThread(callable, *args, **kwargs)


def skewed_monotonic(offset: float) -> Callable[[], float]:
    return lambda: time.monotonic() + offset


async def acquire_when_free(
    store: ObjectStore, owner: str, ttl: float, within: float = 15.0, **kw: Any
) -> HeldLease:
    """Acquire, waiting out a live lease (by what ``LeaseHeld`` says is left, on the bucket)."""
    deadline = time.monotonic() + within
    kw.setdefault("monotonic", time.monotonic)
    while True:
        try:
            return await lease.acquire(store, KEY, owner, ttl, host=HOST, **kw)
        except LeaseHeld as e:
            assert time.monotonic() < deadline, f"still held: {e}"
            await sleep(min(max(e.retry_after, 0.05), 0.5))


async def read_record(store: ObjectStore) -> tuple[ObjectInfo, LeaseRecord]:
    obj = await store.get(KEY)
    return obj.info, LeaseRecord.parse(obj.body)


def metric(operation: str, outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "lchat_lease_operations_total", {"operation": operation, "outcome": outcome}
    )
    assert value is not None
    return value


def outcomes(results: list[tuple[bool, Any]]) -> tuple[list[HeldLease], list[LeaseHeld]]:
    won = [r for ok, r in results if ok]
    held = [r.value for ok, r in results if not ok and r.check(LeaseHeld)]
    others = [r for ok, r in results if not ok and not r.check(LeaseHeld)]
    assert not others, others
    return won, held


# --- the rule and the record, no store ----------------------------------------------------------


class RuleTests(SynchronousTestCase):
    def test_key(self) -> None:
        self.assertEqual(lease.lease_key("prod", "Chat-A.Example.com"), KEY)
        self.assertEqual(lease.lease_key("", HOST), f"{HOST}/lock.json")
        self.assertEqual(lease.lease_key("/a/b/", HOST), f"a/b/{HOST}/lock.json")

    def test_expiry_is_never_early(self) -> None:
        # Last-Modified 12:00:00 (truncated) may be a write at 12:00:00.999: count from 12:00:01.
        lm = datetime.datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
        self.assertEqual(lease.lease_expiry(lm, 10.0, 10.0), lm + datetime.timedelta(seconds=11))
        precise = lm + datetime.timedelta(milliseconds=999)
        self.assertEqual(
            lease.lease_expiry(precise, 10.0, 10.0), lm + datetime.timedelta(seconds=11)
        )
        # The larger TTL wins, the record's or ours; a record without one is judged by ours.
        self.assertEqual(lease.lease_expiry(lm, 60.0, 10.0), lm + datetime.timedelta(seconds=61))
        self.assertEqual(lease.lease_expiry(lm, 5.0, 10.0), lm + datetime.timedelta(seconds=11))
        self.assertEqual(lease.lease_expiry(lm, None, 10.0), lm + datetime.timedelta(seconds=11))
        # Fractional TTLs round up.
        self.assertEqual(lease.lease_expiry(lm, 1.2, 1.0), lm + datetime.timedelta(seconds=3))

    def test_record_round_trip_and_litestream_names(self) -> None:
        record = LeaseRecord(
            owner="box-1",
            generation=7,
            expires_at="2030-01-01T12:15:00Z",
            ttl_seconds=900.0,
            host=HOST,
            acquired_at="2030-01-01T12:00:00Z",
            version="0.1.0",
            lease_id="abc",
        )
        body = json.loads(record.to_json())
        self.assertEqual(
            (body["owner"], body["generation"], body["expires_at"]),
            ("box-1", 7, "2030-01-01T12:15:00Z"),
        )
        self.assertEqual(LeaseRecord.parse(record.to_json()), record)

    def test_unreadable_records_are_still_locks(self) -> None:
        for body in (
            b"",
            b"not json",
            b"[]",
            b'{"owner": 5, "generation": "x", "ttl_seconds": true}',
        ):
            record = LeaseRecord.parse(body)
            self.assertEqual((record.owner, record.generation, record.ttl_seconds), ("?", 0, None))
        litestream = LeaseRecord.parse(
            b'{"owner":"ls","generation":3,"expires_at":"2030-01-01T12:00:30Z"}'
        )
        self.assertEqual((litestream.owner, litestream.generation), ("ls", 3))
        self.assertIsNone(litestream.ttl_seconds)

    def test_rfc3339(self) -> None:
        when = datetime.datetime(2030, 1, 1, 12, 0, 0, 250000, tzinfo=UTC)
        self.assertEqual(lease.rfc3339(when), "2030-01-01T12:00:00.250Z")
        self.assertEqual(lease.rfc3339(when.replace(microsecond=0)), "2030-01-01T12:00:00Z")

    def test_keeper_refuses_impossible_timing(self) -> None:
        held = HeldLease(
            key=KEY,
            host=HOST,
            owner="a",
            generation=1,
            ttl=9.0,
            lease_id="x",
            etag="e",
            acquired_at=datetime.datetime.now(UTC),
            bucket_time=datetime.datetime.now(UTC),
            written_at=0.0,
        )
        clock = task.Clock()
        store: Any = None
        with self.assertRaises(ValueError):
            LeaseKeeper(clock, store, held, Lost(), renew_every=8.5, monotonic=time.monotonic)
        with self.assertRaises(ValueError):
            LeaseKeeper(clock, store, held, Lost(), safety_margin=9.0, monotonic=time.monotonic)
        keeper = LeaseKeeper(clock, store, held, Lost(), monotonic=clock.seconds)
        self.assertEqual((keeper.renew_every, keeper.safety_margin), (3.0, 0.9))
        self.assertAlmostEqual(keeper.deadline, 8.1)


# --- scenarios, against every store -------------------------------------------------------------

if TYPE_CHECKING:
    _Mixin = TestCase
else:
    _Mixin = object  # not a TestCase itself, or trial would run the hook-less base


class Scenarios(_Mixin):
    """The issue's list. A subclass says how to reach a fresh bucket (one per test).

    Every box gets a store of its own (its own connections); ``cut_off_view`` is one that the test
    can partition from the bucket while the other boxes still reach it.
    """

    ttl: ClassVar[float] = 1.0  # real seconds: these scenarios wait leases out on a real store
    timeout = 60

    async def make_view(self) -> ObjectStore:
        """Another box's store on this test's bucket."""
        raise NotImplementedError

    async def make_cut_off_view(
        self,
    ) -> tuple[ObjectStore, Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        """A store on this test's bucket, and (cut, heal) for its path to the bucket only."""
        raise NotImplementedError

    async def make_doomed_store(self) -> tuple[ObjectStore, Callable[[], Awaitable[None]]]:
        """A store on a bucket of its own, and a function that kills the whole backend."""
        raise NotImplementedError

    async def views(self, n: int) -> list[ObjectStore]:
        return [await self.make_view() for _ in range(n)]

    async def contend(self, n: int) -> None:
        stores = await self.views(n)
        attempts = [
            d(lease.acquire(store, KEY, f"box-{i}", self.ttl, host=HOST, monotonic=time.monotonic))
            for i, store in enumerate(stores)
        ]
        won, held = outcomes(await DeferredList(attempts, consumeErrors=True))
        self.assertEqual(len(won), 1, [w.owner for w in won])
        self.assertEqual(len(held), n - 1)
        winner = won[0]
        self.assertEqual(winner.generation, 1)
        self.assertEqual({e.owner for e in held}, {winner.owner})
        info, record = await read_record(stores[0])
        self.assertEqual(
            (record.owner, record.lease_id, info.etag), (winner.owner, winner.lease_id, winner.etag)
        )

    async def test_two_contenders(self) -> None:
        await self.contend(2)

    async def test_ten_contenders(self) -> None:
        await self.contend(10)

    async def test_live_lease_is_held(self) -> None:
        a, b = await self.views(2)
        held = await lease.acquire(a, KEY, "box-a", 600.0, host=HOST, monotonic=time.monotonic)
        bucket_now = await b.now()
        with self.assertRaises(LeaseHeld) as raised:
            await lease.acquire(b, KEY, "box-b", 5.0, host=HOST, monotonic=time.monotonic)
        e = raised.exception
        self.assertEqual((e.owner, e.generation), ("box-a", 1))
        # Judged by the holder's 600 s (larger than b's 5 s), counted from Last-Modified's second.
        info = await a.head(KEY)
        self.assertEqual(e.expires_at, lease.lease_expiry(info.last_modified, 600.0, 600.0))
        self.assertGreater(e.retry_after, 598.0)
        self.assertLessEqual(e.expires_at, bucket_now + datetime.timedelta(seconds=602))
        # Our own old lease is not ours to take either: a wedged old process may still hold it.
        with self.assertRaises(LeaseHeld):
            await lease.acquire(a, KEY, "box-a", 600.0, host=HOST, monotonic=time.monotonic)
        self.assertEqual((await a.head(KEY)).etag, held.etag)

    async def test_ten_contenders_for_an_expired_lease(self) -> None:
        """A 412 race on the takeover: one wins with generation + 1, the rest name the winner."""
        stores = await self.views(11)
        old = await lease.acquire(
            stores[0], KEY, "old", self.ttl, host=HOST, monotonic=time.monotonic
        )
        await self.wait_until_expired(stores[0])
        attempts = [
            d(lease.acquire(store, KEY, f"box-{i}", self.ttl, host=HOST, monotonic=time.monotonic))
            for i, store in enumerate(stores[1:])
        ]
        won, held = outcomes(await DeferredList(attempts, consumeErrors=True))
        self.assertEqual(len(won), 1)
        self.assertEqual(len(held), 9)
        self.assertEqual((won[0].generation, won[0].took_over_from), (old.generation + 1, "old"))
        self.assertEqual({e.owner for e in held}, {won[0].owner})
        _, record = await read_record(stores[0])
        self.assertEqual((record.owner, record.generation), (won[0].owner, 2))

    async def wait_until_expired(self, store: ObjectStore) -> None:
        """Until the bucket's clock says the current lock may be taken over (without taking it)."""
        info, record = await read_record(store)
        expiry = lease.lease_expiry(info.last_modified, record.ttl_seconds, self.ttl)
        while (now := await store.now()) < expiry:
            await sleep(min(0.25, (expiry - now).total_seconds() + 0.01))

    async def test_takeover_then_the_old_holder_is_lost_once(self) -> None:
        """Expiry takeover with generation + 1; the old holder's next renewal fails, ``lost`` fires
        once, and its release leaves the new lock alone."""
        a, b = await self.views(2)
        clock = task.Clock()  # a's keeper: its own deadline never passes, so it really tries
        old = await lease.acquire(a, KEY, "box-a", self.ttl, host=HOST, monotonic=clock.seconds)
        lost = Lost()
        keeper = LeaseKeeper(clock, a, old, lost, monotonic=clock.seconds)
        keeper.start()
        self.addCleanup(keeper.stop)

        takeovers = metric("takeover", "ok")
        new = await acquire_when_free(b, "box-b", self.ttl)
        self.assertEqual((new.generation, new.took_over_from), (old.generation + 1, "box-a"))
        self.assertEqual(metric("takeover", "ok"), takeovers + 1)
        info, record = await read_record(b)
        self.assertEqual((record.owner, record.generation, info.etag), ("box-b", 2, new.etag))

        losses = metric("renew", "lost")
        clock.advance(keeper.renew_every)  # a's renewal falls due
        await settle(keeper)
        self.assertEqual(lost.reasons, ["taken over by box-b"])
        self.assertEqual(metric("renew", "lost"), losses + 1)
        self.assertFalse(keeper.holds())
        self.assertRaises(LeaseLost, keeper.ensure_held)
        self.assertFalse(await keeper.renew_now())
        clock.advance(old.ttl * 3)
        await settle(keeper)
        self.assertEqual(len(lost.calls), 1)

        # Releasing after the takeover never deletes b's lock: not via the keeper, not directly.
        self.assertFalse(await keeper.release(5.0))
        self.assertFalse(await lease.release(reactor, a, keeper.lease, 5.0))
        info, record = await read_record(b)
        self.assertEqual((record.owner, info.etag), ("box-b", new.etag))
        # b's own release does delete it; the next holder starts again at generation 1.
        self.assertTrue(await lease.release(reactor, b, new, 5.0))
        with self.assertRaises(NotFound):
            await b.head(KEY)
        again = await lease.acquire(a, KEY, "box-a", self.ttl, host=HOST, monotonic=time.monotonic)
        self.assertEqual(again.generation, 1)

    async def test_skewed_box_cannot_steal(self) -> None:
        """A box whose local clocks run an hour ahead (or behind) meets a live lease: held."""
        a, b = await self.views(2)
        held = await lease.acquire(a, KEY, "box-a", 30.0, host=HOST, monotonic=time.monotonic)
        for offset in (3600.0, -3600.0):
            with self.assertRaises(LeaseHeld) as raised:
                await lease.acquire(
                    b, KEY, "box-b", 30.0, host=HOST, monotonic=skewed_monotonic(offset)
                )
            self.assertEqual(raised.exception.owner, "box-a")
            self.assertGreater(raised.exception.retry_after, 25.0)
        self.assertEqual((await a.head(KEY)).etag, held.etag)

    async def test_skewed_holder_hour_ahead_cannot_keep_it(self) -> None:
        await self.skewed_holder(3600.0)

    async def test_skewed_holder_hour_behind_cannot_keep_it(self) -> None:
        await self.skewed_holder(-3600.0)

    async def skewed_holder(self, offset: float) -> None:
        """A holder whose clocks are an hour off, cut off from the bucket, stands down before its
        lease expires on the bucket's clock; the takeover comes after; back online, it writes
        nothing."""
        ttl = max(self.ttl, 2.0)
        a, cut, heal = await self.make_cut_off_view()
        (b,) = await self.views(1)
        local = LocalClock(offset)
        mono = skewed_monotonic(offset)
        held = await lease.acquire(a, KEY, "box-a", ttl, host=HOST, monotonic=mono)
        lost = Lost()
        keeper = LeaseKeeper(local, a, held, lost, monotonic=mono, safety_margin=MARGIN)
        keeper.start()
        self.addCleanup(keeper.stop)
        await sleep(keeper.renew_every * 1.3)
        self.assertTrue(keeper.holds())
        self.assertGreater(keeper.lease.written_at, held.written_at)  # it renewed
        await cut()
        with self.assertRaises(LeaseHeld):
            await lease.acquire(b, KEY, "box-b", ttl, host=HOST, monotonic=time.monotonic)
        new = await acquire_when_free(b, "box-b", ttl)
        took_over = time.monotonic()
        self.assertEqual(lost.reasons, ["could not renew before expiry"])
        last_success = keeper.lease.written_at - offset  # back on the real monotonic clock
        self.assertLess(lost.calls[0][1], last_success + ttl)
        self.assertLess(lost.calls[0][1], took_over)
        self.assertEqual(new.took_over_from, "box-a")
        await heal()
        await sleep(keeper.renew_every * 2)
        info, record = await read_record(b)
        self.assertEqual((record.owner, info.etag), ("box-b", new.etag))
        self.assertEqual(len(lost.calls), 1)

    async def test_store_down_during_renewal(self) -> None:
        """The whole store dies: ``lost`` comes before the lease could expire (monotonic)."""
        ttl = max(self.ttl, 2.0)
        store, kill = await self.make_doomed_store()
        held = await lease.acquire(store, KEY, "box-a", ttl, host=HOST, monotonic=time.monotonic)
        lost = Lost()
        # Real clocks, watchdog on.
        keeper = LeaseKeeper(
            reactor, store, held, lost, safety_margin=MARGIN, monotonic=time.monotonic
        )
        keeper.start()
        self.addCleanup(keeper.stop)
        await sleep(keeper.renew_every * 1.3)
        self.assertGreater(keeper.lease.written_at, held.written_at)
        await kill()
        started = time.monotonic()
        why = await lost.fired.addTimeout(ttl * 3, reactor)
        self.assertEqual(why, "could not renew before expiry")
        at = lost.calls[0][1]
        last_success = keeper.lease.written_at
        self.assertLess(at, last_success + ttl)
        self.assertGreaterEqual(at, last_success + ttl - keeper.safety_margin - 0.01)
        self.assertGreater(at, started)
        await sleep(0.3)
        self.assertEqual(len(lost.calls), 1)

    async def test_release_frees_at_once(self) -> None:
        a, b = await self.views(2)
        held = await lease.acquire(a, KEY, "box-a", 600.0, host=HOST, monotonic=time.monotonic)
        self.assertTrue(await lease.release(reactor, a, held, 5.0))
        with self.assertRaises(NotFound):
            await a.head(KEY)
        self.assertEqual(
            (
                await lease.acquire(b, KEY, "box-b", 600.0, host=HOST, monotonic=time.monotonic)
            ).generation,
            1,
        )
        self.assertFalse(await lease.release(reactor, a, held, 5.0))  # twice: not ours any more
        self.assertEqual(LeaseRecord.parse((await b.get(KEY)).body).owner, "box-b")

    async def test_keeper_release_after_renewals(self) -> None:
        (a,) = await self.views(1)
        clock = task.Clock()
        held = await lease.acquire(a, KEY, "box-a", 600.0, host=HOST, monotonic=clock.seconds)
        keeper = LeaseKeeper(clock, a, held, Lost(), monotonic=clock.seconds)
        keeper.start()
        for _ in range(2):
            clock.advance(keeper.renew_every)
            await settle(keeper)
        self.assertNotEqual(keeper.lease.etag, held.etag)
        self.assertEqual((await a.head(KEY)).etag, keeper.lease.etag)
        self.assertTrue(await keeper.release(5.0))
        with self.assertRaises(NotFound):
            await a.head(KEY)
        self.assertEqual(clock.getDelayedCalls(), [])


class FileStoreLeaseTests(Scenarios, TestCase):
    """The scenarios on the file store; a box is cut off by removing its symlink to the root."""

    def setUp(self) -> None:
        self.base = os.path.abspath(self.mktemp())
        self.root = os.path.join(self.base, "bucket")
        os.makedirs(self.root)
        self.links = 0

    async def make_view(self) -> ObjectStore:
        return FileStore(reactor, self.root, run_in_thread=thread_runner(reactor))

    async def make_cut_off_view(
        self,
    ) -> tuple[ObjectStore, Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        self.links += 1
        link = os.path.join(self.base, f"link-{self.links}")
        os.symlink(self.root, link)

        async def cut() -> None:
            os.unlink(link)

        async def heal() -> None:
            os.symlink(self.root, link)

        return FileStore(reactor, link, run_in_thread=thread_runner(reactor)), cut, heal

    async def make_doomed_store(self) -> tuple[ObjectStore, Callable[[], Awaitable[None]]]:
        root = os.path.join(self.base, "doomed")
        os.makedirs(root)

        async def kill() -> None:
            os.rename(root, root + ".gone")  # an unmounted or deleted directory

        return FileStore(reactor, root, run_in_thread=thread_runner(reactor)), kill

    async def test_an_unreadable_lock_is_judged_by_our_ttl(self) -> None:
        store = await self.make_view()
        await store.put(KEY, b"\x00 not a lease", if_none_match=True)
        with self.assertRaises(LeaseHeld) as raised:
            await lease.acquire(store, KEY, "box-a", self.ttl, host=HOST, monotonic=time.monotonic)
        self.assertEqual(raised.exception.owner, "?")
        held = await acquire_when_free(store, "box-a", self.ttl)
        self.assertEqual((held.generation, held.took_over_from), (1, "?"))


class _Relay:
    """A TCP relay in front of an S3 server that a test can cut: one box partitioned from the
    bucket while the others still reach it."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port_number = 0
        self.listening: Any = None
        self.conns: set[portforward.ProxyServer] = set()

    def start(self) -> None:
        relay = self

        class Server(portforward.ProxyServer):
            def connectionMade(self) -> None:
                relay.conns.add(self)
                super().connectionMade()

            def connectionLost(self, reason: Any = None) -> None:
                relay.conns.discard(self)
                super().connectionLost(reason)

        factory = portforward.ProxyFactory("127.0.0.1", self.target)
        factory.protocol = Server
        factory.noisy = False
        # (typed for a ServerFactory; portforward's is a plain Factory, which listenTCP takes)
        self.listening = reactor.listenTCP(self.port_number, factory, interface="127.0.0.1")  # type: ignore[arg-type]
        self.port_number = self.listening.getHost().port

    async def cut(self) -> None:
        if self.listening is not None:
            listening, self.listening = self.listening, None
            await listening.stopListening()
        for conn in list(self.conns):
            transports: list[Any] = [conn.transport, conn.peer and conn.peer.transport]
            for transport in transports:
                if transport is not None:
                    transport.abortConnection()
        while self.conns:
            await sleep(0.01)

    async def heal(self) -> None:
        self.start()


class MotoLeaseTests(Scenarios, TestCase):
    """The scenarios over real HTTP against moto's server (one per process, a bucket per test)."""

    ttl = 1.0

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        async def set_up() -> None:
            # Started once per process (trial has no setUpClass), killed at exit.
            self.server = await s3servers.shared_server("moto")
            self.bucket = await self.server.new_bucket()

        return d(set_up())

    def s3(self, server: s3servers.S3Server, bucket: str, endpoint: str = "") -> ObjectStore:
        from lchat.objstore.s3 import S3Store

        store = S3Store(
            reactor,
            bucket,
            endpoint=endpoint or server.endpoint,
            region=server.region,
            credentials=server.credentials,
            timeout=5.0,
            run_in_thread=thread_runner(reactor),
            monotonic=time.monotonic,
        )
        self.addCleanup(lambda: d(store.close()))
        return store

    async def make_view(self) -> ObjectStore:
        return self.s3(self.server, self.bucket)

    async def make_cut_off_view(
        self,
    ) -> tuple[ObjectStore, Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
        relay = _Relay(self.server.port)
        relay.start()
        self.addCleanup(lambda: d(relay.cut()))  # after the store closes (cleanups run LIFO)
        store = self.s3(self.server, self.bucket, f"http://127.0.0.1:{relay.port_number}")
        return store, relay.cut, relay.heal

    async def make_doomed_store(self) -> tuple[ObjectStore, Callable[[], Awaitable[None]]]:
        server = await s3servers.start_server("moto")
        self.addCleanup(lambda: d(server.destroy()))
        return self.s3(server, server.bucket), server.stop


# --- the keeper's timing, driven by task.Clock over the real file store -------------------------


class KeeperTimingTests(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.root = os.path.abspath(self.mktemp())
        os.makedirs(self.root)
        self.store = FileStore(reactor, self.root, run_in_thread=thread_runner(reactor))
        self.clock = task.Clock()

    async def held(self, ttl: float = 30.0) -> HeldLease:
        return await lease.acquire(
            self.store, KEY, "box-a", ttl, host=HOST, monotonic=self.clock.seconds
        )

    def keeper(self, held: HeldLease, lost: Lost, **kw: Any) -> LeaseKeeper:
        keeper = LeaseKeeper(self.clock, self.store, held, lost, monotonic=self.clock.seconds, **kw)
        keeper.start()
        self.addCleanup(keeper.stop)
        return keeper

    async def step(self, keeper: LeaseKeeper, seconds: float) -> None:
        self.clock.advance(seconds)
        await settle(keeper)

    async def test_renews_every_third_and_stands_down_at_the_deadline(self) -> None:
        held = await self.held(30.0)
        lost = Lost()
        keeper = self.keeper(held, lost)
        self.assertEqual((keeper.renew_every, keeper.deadline), (10.0, 27.0))
        await self.step(keeper, 9.9)
        self.assertEqual(keeper.lease.etag, held.etag)  # not yet
        await self.step(keeper, 0.1)
        self.assertEqual(keeper.lease.written_at, 10.0)
        self.assertNotEqual(keeper.lease.etag, held.etag)
        self.assertEqual((await self.store.head(KEY)).etag, keeper.lease.etag)
        _, record = await read_record(self.store)
        self.assertEqual((record.generation, record.lease_id), (1, held.lease_id))
        await self.step(keeper, 10.0)
        self.assertEqual(keeper.lease.written_at, 20.0)

        # The disk goes away: renewals fail and are retried, lost comes at 20 + 30 - 3 exactly.
        os.rename(self.root, self.root + ".away")
        while self.clock.seconds() < 46.9:
            await self.step(keeper, 0.1)
            self.assertEqual(lost.calls, [])
            self.assertTrue(keeper.holds())
        await self.step(keeper, 0.1)
        self.assertEqual(lost.reasons, ["could not renew before expiry"])
        self.assertFalse(keeper.holds())

        # Back again: the keeper never writes once it has reported the loss.
        os.rename(self.root + ".away", self.root)
        for _ in range(5):
            await self.step(keeper, 10.0)
        self.assertEqual(len(lost.calls), 1)
        self.assertEqual((await self.store.head(KEY)).etag, keeper.lease.etag)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    async def test_a_deleted_lock_is_gone(self) -> None:
        held = await self.held()
        lost = Lost()
        keeper = self.keeper(held, lost)
        await self.store.delete(KEY)  # an operator, say
        await self.step(keeper, keeper.renew_every)
        self.assertEqual(lost.reasons, ["gone"])
        with self.assertRaises(NotFound):
            await self.store.head(KEY)  # and the keeper did not recreate it

    async def test_a_vanished_lock_is_retaken_and_writes_wait_for_the_check(self) -> None:
        """With ``verify_retake``, a lock that vanished is created again (generation + 1); until
        the check says yes, ``ensure_held`` tells writers to wait; a failed check is asked again
        after a short backoff, not a whole period."""
        held = await self.held()
        lost = Lost()
        answers: list[Any] = [StoreUnavailable("the LIST failed"), True]
        asked: list[HeldLease] = []

        async def verify(new: HeldLease) -> bool:
            asked.append(new)
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return bool(answer)

        keeper = self.keeper(held, lost, verify_retake=verify)
        retaken = metric("retake", "ok")
        await self.store.delete(KEY)  # the bucket forgot it
        await self.step(keeper, keeper.renew_every)
        self.assertEqual(lost.calls, [])
        self.assertEqual(metric("retake", "ok"), retaken + 1)
        _, record = await read_record(self.store)
        self.assertEqual((record.generation, record.owner), (2, "box-a"))
        self.assertNotEqual(record.lease_id, held.lease_id)
        self.assertEqual([a.lease_id for a in asked], [record.lease_id])
        self.assertTrue(keeper.holds())
        self.assertTrue(keeper.suspended)
        with self.assertRaises(lease.LeaseSuspended):
            keeper.ensure_held()
        await self.step(keeper, 1.0)  # the backoff (a tenth of the period at most), not 10 s
        self.assertEqual(len(asked), 2)
        self.assertFalse(keeper.suspended)
        keeper.ensure_held()
        self.assertEqual(keeper.lease.generation, 2)
        self.assertEqual(lost.calls, [])
        # And it is an ordinary lease again: renewed, then released.
        await self.step(keeper, keeper.renew_every)
        self.assertEqual((await self.store.head(KEY)).etag, keeper.lease.etag)
        self.assertTrue(await keeper.release(5.0))
        with self.assertRaises(NotFound):
            await self.store.head(KEY)

    async def test_a_vanished_lock_someone_else_wrote_under_is_a_takeover(self) -> None:
        held = await self.held()
        lost = Lost()

        async def verify(new: HeldLease) -> bool:
            return False  # files another writer wrote appeared meanwhile

        keeper = self.keeper(held, lost, verify_retake=verify)
        await self.store.delete(KEY)
        await self.step(keeper, keeper.renew_every)
        self.assertEqual(len(lost.calls), 1)
        self.assertTrue(lost.reasons[0].startswith("taken over"), lost.reasons)
        with self.assertRaises(NotFound):
            await self.store.head(KEY)  # what it re-took, it gave back
        self.assertFalse(keeper.holds())

    async def test_a_renewal_that_landed_unseen_is_ours(self) -> None:
        """A write of ours whose answer was lost (the next If-Match fails against it) is
        recognised by its lease_id, for renewal and for release."""
        held = await self.held()
        lost = Lost()
        keeper = self.keeper(held, lost)
        now = await self.store.now()
        landed = await self.store.put(
            KEY, held.record(now + datetime.timedelta(seconds=1)).to_json(), if_match=held.etag
        )
        self.assertTrue(await keeper.renew_now())
        self.assertEqual(keeper.lease.etag, landed.etag)
        self.assertEqual(lost.calls, [])
        # Release with the stale etag still finds and deletes our own version.
        self.assertTrue(await lease.release(reactor, self.store, held, 5.0))
        with self.assertRaises(NotFound):
            await self.store.head(KEY)

    async def test_every_answer_lost_after_landing(self) -> None:
        """A transport that retries every request once after it landed (the first answer lost):
        creates and renewals then fail their condition against our own write, and are
        recognised by their lease_id."""

        def twice(f: Callable[[], Any]) -> Deferred[Any]:
            def run() -> Any:
                with contextlib.suppress(Exception):
                    f()  # the first answer is lost, whatever it was
                return f()

            return deferToThread(run)

        doubled = FileStore(reactor, self.root, run_in_thread=twice)
        held = await lease.acquire(
            doubled, KEY, "box-a", 30.0, host=HOST, monotonic=self.clock.seconds
        )
        self.assertEqual((await self.store.head(KEY)).etag, held.etag)
        lost = Lost()
        keeper = LeaseKeeper(self.clock, doubled, held, lost, monotonic=self.clock.seconds)
        keeper.start()
        self.addCleanup(keeper.stop)
        await self.step(keeper, keeper.renew_every)
        self.assertEqual(lost.calls, [])
        self.assertEqual(keeper.lease.written_at, keeper.renew_every)
        self.assertEqual((await self.store.head(KEY)).etag, keeper.lease.etag)
        self.assertTrue(await keeper.release(5.0))  # the retried DELETE finds it gone: free
        with self.assertRaises(NotFound):
            await self.store.head(KEY)

    async def test_stop_mid_renewal_then_release(self) -> None:
        held = await self.held()
        keeper = self.keeper(held, Lost())
        self.clock.advance(keeper.renew_every)
        self.assertTrue(keeper.renewing)
        self.assertTrue(await keeper.release(5.0))  # whether or not the renewal landed
        with self.assertRaises(NotFound):
            await self.store.head(KEY)

    async def test_release_gives_up_within_its_budget(self) -> None:
        held = await self.held()
        hung = FileStore(reactor, self.root, run_in_thread=lambda f: Deferred())  # a hung disk
        started = time.monotonic()
        self.assertFalse(await lease.release(reactor, hung, held, 0.2))
        self.assertLess(time.monotonic() - started, 2.0)
        self.assertEqual((await self.store.head(KEY)).etag, held.etag)  # expires on its own

    async def test_lost_in_time_even_when_the_reactor_timers_stall(self) -> None:
        """The wall clock steps back an hour: Twisted's timers (wall-clock based) stall, but the
        monotonic watchdog still reports the loss before the lease could expire."""
        ttl = 1.0
        held = await lease.acquire(
            self.store, KEY, "box-a", ttl, host=HOST, monotonic=time.monotonic
        )
        lost = Lost()
        stalled = LocalClock(-3600.0, timers=task.Clock())  # nobody advances these timers
        keeper = LeaseKeeper(
            stalled, self.store, held, lost, safety_margin=MARGIN, monotonic=time.monotonic
        )
        keeper.start()
        self.addCleanup(keeper.stop)
        await lost.fired.addTimeout(5.0, reactor)
        self.assertEqual(lost.reasons, ["could not renew before expiry"])
        self.assertLess(lost.calls[0][1], held.written_at + ttl)
        self.assertGreaterEqual(lost.calls[0][1], keeper.deadline)


class _Disk:
    """A file store's ``run_in_thread`` that runs the disk work inline (no thread, no reactor)
    and records the fake clock's reading at each call; ``before[n]`` runs just before the n-th
    call (0-based), to put another box's write between two of ours."""

    def __init__(self, clock: task.Clock) -> None:
        self.clock = clock
        self.at: list[float] = []
        self.before: dict[int, Callable[[], object]] = {}

    def __call__(self, work: Callable[[], Any]) -> Deferred[Any]:
        hook = self.before.pop(len(self.at), None)
        self.at.append(self.clock.seconds())
        if hook is not None:
            hook()
        return maybeDeferred(work)


class KeeperClockTests(SynchronousTestCase):
    """The keeper's timing with nothing real but the disk: one ``task.Clock`` is its reactor and
    its monotonic clock (unless a test separates them), and the file store runs inline."""

    def setUp(self) -> None:
        self.root = os.path.abspath(self.mktemp())
        os.makedirs(self.root)
        self.clock = task.Clock()
        self.disk = _Disk(self.clock)
        self.store = FileStore(self.clock, self.root, run_in_thread=self.disk)

    def held(self, ttl: float, monotonic: Callable[[], float] | None = None) -> HeldLease:
        return self.successResultOf(
            d(
                lease.acquire(
                    self.store,
                    KEY,
                    "box-a",
                    ttl,
                    host=HOST,
                    monotonic=monotonic or self.clock.seconds,
                )
            )
        )

    def keeper(self, held: HeldLease, lost: Lost, **kw: Any) -> LeaseKeeper:
        kw.setdefault("monotonic", self.clock.seconds)
        keeper = LeaseKeeper(self.clock, self.store, held, lost, **kw)
        keeper.start()
        self.addCleanup(keeper.stop)
        return keeper

    def advance_to(self, when: float) -> None:
        """Move the clock to ``when``, stopping at every timer due on the way."""
        while True:
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= when]
            if not due:
                break
            self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
        self.clock.advance(max(0.0, when - self.clock.seconds()))

    def disk_away(self) -> None:
        os.rename(self.root, self.root + ".away")  # every operation: StoreUnavailable

    def disk_back(self) -> None:
        os.rename(self.root + ".away", self.root)

    def test_failed_renewals_back_off_doubling_up_to_the_deadline(self) -> None:
        """TTL 300: renewals every 100 s; a failed one is retried after 1, 2, 4, 8 s, then every
        10 s (a tenth of the period), the last retry cut short to the deadline (300 - 30), where
        the keeper stands down without trying again."""
        held = self.held(300.0)
        lost = Lost()
        keeper = self.keeper(held, lost)
        self.assertEqual((keeper.renew_every, keeper.deadline), (100.0, 270.0))
        errors = metric("renew", "error")
        self.advance_to(99.0)
        self.disk_away()
        calls = len(self.disk.at)
        self.advance_to(269.9)
        tries = [100.0, 101.0, 103.0, 107.0, 115.0, *range(125, 270, 10)]
        self.assertEqual(self.disk.at[calls:], tries)
        self.assertEqual(metric("renew", "error"), errors + len(tries))
        self.assertEqual(lost.calls, [])
        self.assertTrue(keeper.holds())
        self.advance_to(270.0)
        self.assertEqual(lost.reasons, ["could not renew before expiry"])
        self.assertEqual(self.disk.at[calls:], tries)  # not one more attempt at the deadline
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_renewal_that_succeeds_after_failures_restarts_the_cadence_and_the_backoff(
        self,
    ) -> None:
        held = self.held(300.0)
        lost = Lost()
        keeper = self.keeper(held, lost)
        self.advance_to(99.0)
        self.disk_away()
        calls = len(self.disk.at)
        self.advance_to(150.0)
        self.disk_back()
        self.advance_to(254.0)
        # The retry at 155 lands: the next renewal is a period after it, not on the old grid.
        self.assertEqual(
            self.disk.at[calls:], [100.0, 101.0, 103.0, 107.0, 115.0, 125.0, 135.0, 145.0, 155.0]
        )
        self.assertEqual((keeper.lease.written_at, keeper.deadline), (155.0, 425.0))
        self.advance_to(255.0)
        self.assertEqual(keeper.lease.written_at, 255.0)
        self.disk_away()
        calls = len(self.disk.at)
        self.advance_to(363.0)
        self.assertEqual(self.disk.at[calls:], [355.0, 356.0, 358.0, 362.0])  # 1 s again
        self.assertEqual(lost.calls, [])
        self.disk_back()
        self.advance_to(370.0)
        self.assertEqual(keeper.lease.written_at, 370.0)
        self.assertEqual((await_head(self, self.store)).etag, keeper.lease.etag)

    def test_holds_is_false_from_the_deadline_even_when_the_reactor_runs_late(self) -> None:
        """The reactor's timers have not fired (a blocked or late reactor): ``holds()`` still
        reads the monotonic clock itself, and reports the loss once."""
        monotonic = [0.0]
        held = self.held(30.0, monotonic=lambda: monotonic[0])
        lost = Lost()
        keeper = self.keeper(held, lost, monotonic=lambda: monotonic[0])
        calls = len(self.disk.at)
        monotonic[0] = 26.999
        self.assertTrue(keeper.holds())
        keeper.ensure_held()
        monotonic[0] = 27.0  # the deadline (30 - 3): the clock driving the timers never moved
        self.assertFalse(keeper.holds())
        self.assertEqual(lost.reasons, ["could not renew before expiry"])
        with self.assertRaises(LeaseLost):
            keeper.ensure_held()
        self.assertEqual(self.clock.getDelayedCalls(), [])  # the late timers are gone
        self.clock.advance(100.0)
        self.assertFalse(keeper.holds())
        self.assertEqual(len(lost.calls), 1)
        self.assertEqual(self.disk.at[calls:], [])  # no renewal after the loss
        # Nor a release: the lock is left to expire (it is still ours, untouched).
        self.assertFalse(self.successResultOf(d(keeper.release(5.0))))
        self.assertEqual(await_head(self, self.store).etag, held.etag)

    def test_release_never_deletes_a_lock_replaced_between_its_read_and_its_delete(self) -> None:
        """Our own renewal landed unseen (our etag is stale), so release reads the lock, finds
        our lease_id and deletes that version with If-Match; box-b's takeover lands between the
        read and the delete: the delete fails its condition and box-b's lock stays."""
        held = self.held(30.0)
        now = self.successResultOf(d(self.store.now()))
        unseen = self.successResultOf(
            d(self.store.put(KEY, held.record(now).to_json(), if_match=held.etag))
        )
        other = FileStore(self.clock, self.root, run_in_thread=maybeDeferred)
        theirs = evolve(held, owner="box-b", generation=2, lease_id="b" * 32)

        def takeover() -> None:
            body = theirs.record(now).to_json()
            self.successResultOf(d(other.put(KEY, body, if_match=unseen.etag)))

        # release: DELETE If-Match (stale: fails), GET (ours), [box-b's PUT], DELETE If-Match.
        self.disk.before[len(self.disk.at) + 2] = takeover
        lost_releases = metric("release", "lost")
        self.assertFalse(self.successResultOf(d(lease.release(self.clock, self.store, held, 5.0))))
        self.assertEqual(metric("release", "lost"), lost_releases + 1)
        _, record = self.successResultOf(d(read_record(self.store)))
        self.assertEqual((record.owner, record.lease_id), ("box-b", "b" * 32))


def await_head(test: SynchronousTestCase, store: ObjectStore) -> ObjectInfo:
    info: ObjectInfo = test.successResultOf(d(store.head(KEY)))
    return info


class ProcessContenderTests(TestCase):
    """Ten OS processes race for one lease on the file store (flock across processes)."""

    timeout = 60

    def test_ten_processes(self) -> Deferred[None]:
        root = os.path.abspath(self.mktemp())
        os.makedirs(root)
        script = (
            "import json, sys, time\n"
            "from twisted.internet import defer, task\n"
            "from lchat import lease\n"
            "from lchat.objstore.file import FileStore\n"
            "from lchat.threads import thread_runner\n"
            "root, key, owner, start = sys.argv[1:5]\n"
            "async def main(reactor):\n"
            "    store = FileStore(reactor, root, thread_runner(reactor))\n"
            "    time.sleep(max(0.0, float(start) - time.time()))\n"
            "    try:\n"
            "        held = await lease.acquire(store, key, owner, 60.0, monotonic=time.monotonic)\n"
            "        print(json.dumps({'won': held.owner, 'etag': held.etag}))\n"
            "    except lease.LeaseHeld as e:\n"
            "        print(json.dumps({'held': e.owner}))\n"
            "task.react(lambda r: defer.Deferred.fromCoroutine(main(r)))\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

        def race() -> list[dict[str, str]]:
            start = str(time.time() + 3.0)  # after every interpreter has imported Twisted
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", script, root, KEY, f"proc-{i}", start],
                    stdout=subprocess.PIPE,
                    env=env,
                )
                for i in range(10)
            ]
            return [json.loads(p.communicate(timeout=50)[0]) for p in procs]

        def check(results: list[dict[str, str]]) -> None:
            winners = [r["won"] for r in results if "won" in r]
            self.assertEqual(len(winners), 1, results)
            self.assertEqual({r["held"] for r in results if "held" in r}, set(winners))
            obj = FileStore(reactor, root, run_in_thread=thread_runner(reactor)).bucket.get(KEY)
            self.assertEqual(LeaseRecord.parse(obj.body).owner, winners[0])

        return in_thread(race).addCallback(check)


def in_thread(f: Callable[[], T]) -> Deferred[T]:
    """Run blocking ``f`` in a thread of its own (not the reactor's pool, which the stores use)."""
    result: Deferred[T] = Deferred()

    def run() -> None:
        try:
            value = f()
        except BaseException:
            failure = Failure()
            reactor.callFromThread(result.errback, failure)
        else:
            reactor.callFromThread(result.callback, value)

    threading.Thread(target=run, daemon=True).start()
    return result


# --- the state machine --------------------------------------------------------------------------


class ShiftedBucketClock:
    """A real store whose *bucket clock* runs ``clock.seconds()`` ahead of the real one.

    ``now()`` and every ``Last-Modified`` move together: a version carries the shift in force when
    it was written, so advancing the clock ages every lock as real time would. Everything else
    (conditional writes, ETags, reads) is the real store's.
    """

    def __init__(
        self, store: ObjectStore, clock: task.Clock, shifts: dict[str, float] | None = None
    ) -> None:
        self.store = store
        self.clock = clock
        self.shifts: dict[str, float] = {} if shifts is None else shifts  # by ETag

    def _info(self, info: ObjectInfo) -> ObjectInfo:
        shift = self.shifts.get(info.etag, 0.0)
        return evolve(info, last_modified=info.last_modified + datetime.timedelta(seconds=shift))

    def _wrote(self, result: PutResult) -> PutResult:
        self.shifts[result.etag] = self.clock.seconds()
        return result

    def describe(self) -> str:
        return f"{self.store.describe()} (bucket clock +{self.clock.seconds():g}s)"

    async def get(self, key: str) -> StoredObject:
        obj = await self.store.get(key)
        return StoredObject(self._info(obj.info), obj.body)

    async def get_to_file(self, key: str, path: str) -> ObjectInfo:
        return self._info(await self.store.get_to_file(key, path))

    async def get_into(self, key: str, sink: IO[bytes]) -> int:
        return await self.store.get_into(key, sink)

    async def head(self, key: str) -> ObjectInfo:
        return self._info(await self.store.head(key))

    async def put(
        self,
        key: str,
        body: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
        metadata: Mapping[str, str] | None = None,
        content_type: str = "application/octet-stream",
    ) -> PutResult:
        return self._wrote(
            await self.store.put(
                key,
                body,
                if_match=if_match,
                if_none_match=if_none_match,
                metadata=metadata,
                content_type=content_type,
            )
        )

    async def put_file(
        self, key: str, path: str, *, metadata: Mapping[str, str] | None = None
    ) -> PutResult:
        return self._wrote(await self.store.put_file(key, path, metadata=metadata))

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        await self.store.delete(key, if_match=if_match)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return [self._info(i) for i in await self.store.list(prefix)]

    async def copy(self, source: str, destination: str) -> PutResult:
        return self._wrote(await self.store.copy(source, destination))

    async def now(self) -> datetime.datetime:
        return await self.store.now() + datetime.timedelta(seconds=self.clock.seconds())

    async def close(self) -> None:
        await self.store.close()


MACHINE_TTL = 30.0  # virtual seconds


class LeaseMachine(RuleBasedStateMachine):
    """2-3 boxes acquire, renew, release, crash, get cut off from the bucket and heal, and let
    time pass, over one real file store.

    Runs in a thread of its own; every store call is made on the reactor thread. Virtual time (a
    ``task.Clock``) drives the keepers' timers, their monotonic clock and the bucket's clock alike;
    real time keeps passing underneath all three. Each box reaches the bucket through a symlink of
    its own, so one box can be partitioned (its renewals fail) while the others carry on.
    """

    base = ""  # set by the test: where the bucket roots go

    def __init__(self) -> None:
        super().__init__()
        self.clock = task.Clock()
        self.t0 = time.monotonic()
        self.dir = tempfile.mkdtemp(dir=self.base)
        self.root = os.path.join(self.dir, "bucket")
        os.mkdir(self.root)
        self.shifts: dict[str, float] = {}
        self.store = ShiftedBucketClock(
            FileStore(reactor, self.root, run_in_thread=thread_runner(reactor)),
            self.clock,
            self.shifts,
        )
        self.n = 3
        self.views: dict[int, ShiftedBucketClock] = {}
        self.cut: set[int] = set()
        self.keepers: dict[int, LeaseKeeper | None] = {}
        self.lost: dict[int, Lost] = {}

    def link(self, i: int) -> str:
        return os.path.join(self.dir, f"box-{i}")

    def mono(self) -> float:
        return self.clock.seconds() + time.monotonic() - self.t0

    def run(self, f: Callable[[], Coroutine[Any, Any, T]]) -> T:
        result: T = blockingCallFromThread(reactor, lambda: d(f()))  # type: ignore[arg-type]
        return result

    def on_reactor(self, f: Callable[[], T]) -> T:
        result: T = blockingCallFromThread(reactor, f)
        return result

    def box(self, i: int) -> int:
        return i % self.n

    @initialize(n=st.integers(2, 3))
    def boxes(self, n: int) -> None:
        self.n = n
        self.keepers = dict.fromkeys(range(n))
        for i in range(n):
            os.symlink(self.root, self.link(i))
            self.views[i] = ShiftedBucketClock(
                FileStore(reactor, self.link(i), run_in_thread=thread_runner(reactor)),
                self.clock,
                self.shifts,
            )

    @rule(i=st.integers(0, 2))
    def acquire(self, i: int) -> None:
        i = self.box(i)
        keeper = self.keepers[i]
        if keeper is not None and self.on_reactor(keeper.holds):
            return  # a holder does not acquire again
        try:
            held = self.run(
                lambda: lease.acquire(
                    self.views[i], KEY, f"box-{i}", MACHINE_TTL, host=HOST, monotonic=self.mono
                )
            )
        except LeaseHeld:
            return
        except StoreUnavailable:
            assert i in self.cut
            return
        lost = self.lost[i] = Lost()
        keeper = LeaseKeeper(self.clock, self.views[i], held, lost, monotonic=self.mono)
        self.keepers[i] = keeper
        self.on_reactor(keeper.start)

    def with_keeper(self, data: st.DataObject) -> tuple[int, LeaseKeeper]:
        """A box that has a keeper (holding, or lost and not yet told to let go)."""
        i = data.draw(st.sampled_from(sorted(i for i, k in self.keepers.items() if k)))
        keeper = self.keepers[i]
        assert keeper is not None
        return i, keeper

    @precondition(lambda self: any(self.keepers.values()))
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        _, keeper = self.with_keeper(data)
        self.run(keeper.renew_now)

    @precondition(lambda self: any(self.keepers.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i, keeper = self.with_keeper(data)
        self.run(lambda: keeper.release(5.0))
        self.keepers[i] = None

    @precondition(lambda self: any(self.keepers.values()))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        i, keeper = self.with_keeper(data)
        self.on_reactor(keeper.stop)  # no release: the lock stays until it expires
        self.keepers[i] = None

    @rule(i=st.integers(0, 2))
    def partition(self, i: int) -> None:
        """Cut box ``i`` off from the bucket, or reconnect it."""
        i = self.box(i)
        if i in self.cut:
            os.symlink(self.root, self.link(i))
            self.cut.discard(i)
        else:
            os.unlink(self.link(i))
            self.cut.add(i)

    @rule(dt=st.floats(0.5, MACHINE_TTL * 1.5), to_expiry=st.booleans())
    def advance(self, dt: float, to_expiry: bool) -> None:
        """Let ``dt`` seconds pass; or, with ``to_expiry``, go straight to ``dt / 20`` seconds past
        the moment the current lock may be taken over: the edge where a holder that believed too
        long would meet its successor."""
        if to_expiry:
            try:
                info, record = self.run(lambda: read_record(self.store))
            except NotFound:
                return
            now = self.run(self.store.now)
            expiry = lease.lease_expiry(info.last_modified, record.ttl_seconds, MACHINE_TTL)
            dt = (expiry - now).total_seconds() + dt / 20
            if dt <= 0:
                return
        self.on_reactor(lambda: self.clock.advance(dt))
        self.run(lambda: settle(*self.keepers.values()))

    @invariant()
    def one_writer(self) -> None:
        believers = self.on_reactor(
            lambda: [k for k in self.keepers.values() if k is not None and k.holds()]
        )
        # Never two holders whose leases are both valid on the bucket's clock; in fact never two
        # boxes that even believe they hold it.
        self.assertions(believers)

    def assertions(self, believers: list[LeaseKeeper]) -> None:
        assert len(believers) <= 1, [k.lease.owner for k in believers]
        for keeper in believers:
            info, record = self.run(lambda: read_record(self.store))
            now = self.run(self.store.now)
            assert record.lease_id == keeper.lease.lease_id, (record, keeper.lease)
            assert info.etag == keeper.lease.etag
            assert now < lease.lease_expiry(info.last_modified, record.ttl_seconds, MACHINE_TTL)
        for lost in self.lost.values():
            assert len(lost.calls) <= 1, lost.calls

    def teardown(self) -> None:
        for keeper in self.keepers.values():
            if keeper is not None:
                self.on_reactor(keeper.stop)


class StateMachineTests(TestCase):
    timeout = 120

    def test_one_writer(self) -> Deferred[None]:
        base = os.path.abspath(self.mktemp())
        os.makedirs(base)
        machine = type("Machine", (LeaseMachine,), {"base": base})
        return in_thread(
            lambda: run_state_machine_as_test(
                machine,
                settings=settings(
                    max_examples=80,
                    stateful_step_count=25,
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow],
                ),
            )
        )

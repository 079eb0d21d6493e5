"""The order the router stops in (``lchat/shutdown.py``), on a fake clock: each service's children
and collaborators stand for the real ones only by what the drain calls, and record when."""

from __future__ import annotations

import os

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import TestCase

from lchat.objstore.file import FileStore
from lchat.shutdown import (
    BackupService,
    BucketCheck,
    FrontDoor,
    HibernationService,
    InOrder,
    probe_done,
)
from tests.fakes import inline


class _Stops(Service):
    """A service whose stop is recorded in ``log`` and, with ``hold``, pending until released."""

    def __init__(self, name: str, log: list[str], hold: bool = False, fail: bool = False) -> None:
        self.setName(name)
        self._log = log
        self._hold = hold
        self._fail = fail
        self.stopping: Deferred[None] | None = None
        self.checked: Deferred[None] = succeed(None)  # as a BucketCheck's: the probe is over

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        self._log.append(f"stop {self.name}")
        if self._fail:
            raise RuntimeError("boom")
        if not self._hold:
            return None
        self.stopping = Deferred()
        return self.stopping

    def release(self) -> None:
        assert self.stopping is not None
        self._log.append(f"stopped {self.name}")
        self.stopping.callback(None)


class _Membership(_Stops):
    """The mesh's membership as the drain sees it: ``begin_drain``, then ``stopService``."""

    def __init__(self, log: list[str]) -> None:
        super().__init__("membership", log, hold=True)
        self.draining: Deferred[None] | None = None

    async def begin_drain(self) -> None:
        self._log.append("begin_drain membership")
        self.draining = Deferred()
        await self.draining


class _Store:
    def __init__(self, name: str, log: list[str]) -> None:
        self._name = name
        self._log = log

    async def close(self) -> None:
        self._log.append(f"close {self._name}")


class InOrderTests(TestCase):
    def test_children_stop_last_added_first_each_waited_for(self) -> None:
        log: list[str] = []
        spaces = InOrder("spaces")
        backup, units = _Stops("backup", log, hold=True), _Stops("units", log, hold=True)
        backup.setServiceParent(spaces)
        units.setServiceParent(spaces)
        spaces.startService()
        stopped = spaces.stopService()
        self.assertEqual(log, ["stop units"])  # the backup waits for the spaces' last writes
        units.release()
        self.assertEqual(log, ["stop units", "stopped units", "stop backup"])
        self.assertNoResult(stopped)
        backup.release()
        self.successResultOf(stopped)

    def test_a_child_that_fails_to_stop_does_not_keep_the_next_running(self) -> None:
        log: list[str] = []
        spaces = InOrder("spaces")
        _Stops("backup", log).setServiceParent(spaces)
        _Stops("units", log, fail=True).setServiceParent(spaces)
        spaces.startService()
        self.successResultOf(spaces.stopService())
        self.assertEqual(log, ["stop units", "stop backup"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class HibernationDrainTests(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.log: list[str] = []
        log = self.log
        self.check = _Stops("check", log)
        self.mesh_check = _Stops("mesh_check", log)
        self.membership = _Membership(log)
        self.activator = _Stops("activator", log, hold=True)
        self.sweeper = _Stops("sweeper", log)
        self.due_push = _Stops("due_push", log, hold=True)
        self.service = HibernationService(
            self.clock,
            _Store("store", log),  # type: ignore[arg-type]
            self.check,  # type: ignore[arg-type]
            self.activator,  # type: ignore[arg-type]
            self.sweeper,  # type: ignore[arg-type]
            self.membership,  # type: ignore[arg-type]
            None,
            self.due_push,  # type: ignore[arg-type]
            mesh_store=_Store("mesh_store", log),  # type: ignore[arg-type]
            mesh_check=self.mesh_check,  # type: ignore[arg-type]
        )
        self.user = _Stops("cert-cache", log, hold=True)
        self.service.add_bucket_user(self.user)
        self.service.startService()

    def test_the_drain_announces_first_and_closes_the_bucket_last(self) -> None:
        """Sweeps and probes stop at once; the heartbeat says "draining" while the bucket's other
        users stop; the activator drains (every lease released) only after both; the due times
        reach the peers; the heartbeat goes; then the bucket clients close."""
        stopped = self.service.stopService()
        self.assertEqual(
            self.log,
            [
                "stop sweeper",
                "stop check",
                "stop mesh_check",
                "stop cert-cache",
                "begin_drain membership",
            ],
        )
        self.user.release()
        self.assertNotIn("stop activator", self.log)  # the peers are told first
        assert self.membership.draining is not None
        self.membership.draining.callback(None)
        self.assertEqual(self.log[-1], "stop activator")
        self.activator.release()
        self.assertEqual(self.log[-1], "stop due_push")
        self.due_push.release()
        self.assertEqual(self.log[-1], "stop membership")
        self.assertNoResult(stopped)
        self.membership.release()
        self.successResultOf(stopped)
        self.assertEqual(self.log[-2:], ["close store", "close mesh_store"])

    def test_the_activator_waits_for_every_bucket_user(self) -> None:
        self.service.stopService()
        assert self.membership.draining is not None
        self.membership.draining.callback(None)
        self.assertNotIn("stop activator", self.log)
        self.user.release()
        self.assertEqual(self.log[-1], "stop activator")


class _Check(Service):
    """A bucket probe still in flight."""

    def __init__(self) -> None:
        self.checked: Deferred[None] = Deferred()


class ProbeDoneTests(TestCase):
    def test_a_probe_in_flight_is_waited_for_ten_seconds_at_most(self) -> None:
        clock = Clock()
        check = _Check()
        waited = Deferred.fromCoroutine(probe_done(check, clock))  # type: ignore[arg-type]
        clock.advance(9.9)
        self.assertNoResult(waited)
        clock.advance(0.1)
        self.successResultOf(waited)

    def test_a_probe_that_ends_ends_the_wait(self) -> None:
        clock = Clock()
        check = _Check()
        waited = Deferred.fromCoroutine(probe_done(check, clock))  # type: ignore[arg-type]
        check.checked.callback(None)
        self.successResultOf(waited)

    def test_the_backup_closes_its_bucket_only_after_its_probe(self) -> None:
        clock = Clock()
        log: list[str] = []
        check = _Check()
        backup = _Stops("backup", log, hold=True)
        service = BackupService(check, backup, clock)  # type: ignore[arg-type]
        service.startService()
        stopped = service.stopService()
        self.assertEqual(log, [])
        check.checked.callback(None)
        self.assertEqual(log, ["stop backup"])
        backup.release()
        self.successResultOf(stopped)


class _Factory:
    """A ProxyFactory as the front door's drain sees it: its connections, ``close``, and
    ``quiesced`` (fired by the test when its connections are gone)."""

    def __init__(self) -> None:
        self.connections: set[object] = set()
        self.waits: list[Deferred[None]] = []
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def quiesced(self, grace: float) -> Deferred[None]:
        if not self.connections:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self.waits.append(d)
        return d

    def quiet(self) -> None:
        self.connections.clear()
        for d in self.waits:
            d.callback(None)
        self.waits.clear()


class _Pool:
    closed = False

    async def close(self) -> None:
        self.closed = True


class FrontDoorDrainTests(TestCase):
    def door(self, *factories: _Factory, grace: float = 10.0) -> tuple[Clock, _Pool, FrontDoor]:
        clock, pool = Clock(), _Pool()
        door = FrontDoor(clock, pool, list(factories), grace=grace)  # type: ignore[arg-type]
        door.startService()
        return clock, pool, door

    def test_a_connection_that_appears_in_another_factory_is_waited_for(self) -> None:
        """While the drain waits for one factory, another gains a connection (a TLS handshake
        that finished): the drain waits for that one too before closing the pool (the process
        would otherwise exit under its request, unanswered)."""
        first, second = _Factory(), _Factory()
        second.connections.add("in flight")
        clock, pool, door = self.door(first, second)
        stopped = door.stopService()
        self.assertTrue(first.closed and second.closed)  # every answer closes its connection
        self.assertEqual(len(second.waits), 1)  # the first was quiet: waiting on the second
        first.connections.add("handshake done meanwhile")
        second.quiet()
        clock.advance(0.05)
        self.assertFalse(pool.closed)
        self.assertNoResult(stopped)
        self.assertEqual(len(first.waits), 1)  # now waiting for the newcomer
        first.quiet()
        clock.advance(0.05)
        self.successResultOf(stopped)
        self.assertTrue(pool.closed)

    def test_the_grace_bounds_the_drain(self) -> None:
        """Requests still in flight when the grace is over are not waited for (the real
        factory aborts them); the pool closes."""
        busy = _Factory()
        busy.connections.add("slow request")
        original = busy.quiesced

        def quiesced(grace: float) -> Deferred[None]:
            waiting = original(grace)
            clock.callLater(grace, busy.quiet)  # (the real factory aborts them then)
            return waiting

        busy.quiesced = quiesced  # type: ignore[method-assign]
        clock, pool, door = self.door(busy, grace=2.0)
        stopped = door.stopService()
        clock.advance(1.9)
        self.assertNoResult(stopped)
        clock.advance(0.1)
        self.successResultOf(stopped)
        self.assertTrue(pool.closed)


class BucketCheckTests(TestCase):
    """The boot probe, on a real file store: a bucket that is usable lets the router run; one that
    is not stops the reactor, and the process then exits with status 1."""

    def check(self, root: str) -> tuple[MemoryReactorClock, BucketCheck]:
        reactor = MemoryReactorClock()
        reactor.running = True
        store = FileStore(reactor, root, run_in_thread=inline)
        check = BucketCheck(reactor, store, "p/.lchat/probe/x", "LCHAT_HIBERNATE", "bucket")
        check.startService()
        return reactor, check

    def test_a_writable_bucket_is_checked_and_left_running(self) -> None:
        bucket = self.mktemp()
        os.makedirs(bucket)
        reactor, check = self.check(bucket)
        self.successResultOf(check.checked)
        self.assertFalse(reactor.hasStopped)

    def test_an_unusable_bucket_stops_the_router_with_status_1(self) -> None:
        blocked = self.mktemp()
        with open(blocked, "w") as f:
            f.write("a file where the bucket's directory should be\n")
        reactor, check = self.check(blocked)
        self.successResultOf(check.checked)
        self.assertTrue(reactor.hasStopped)
        after = reactor.triggers["after"]["shutdown"]
        self.assertEqual(after, [(os._exit, (1,), {})])

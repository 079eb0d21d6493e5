"""The activator's state machine (lchat/hibernation/activator.py and lifecycle.py) on a fake clock.

Procmon-style (Twisted's twisted/runner/test/test_procmon.py): one ``task.Clock`` is the reactor
and the clock, blocking work runs inline, and time moves only when a test moves it, so every test
runs in milliseconds and none waits on the wall clock. What decides is real: the activator, the
lifecycle, the lease and its keeper, replication (lchat.replica.replicator), the registry and its
RouteSource, a ``file:`` bucket in a temp dir, the box's config. The space's process and the
question put to it at sleep are the fakes of tests/fakes.py (:class:`~tests.fakes.FakeChild`
keeps :class:`lchat.child.RunningChild`'s contract and writes a real WAL database).

Times below are binary fractions (0.25, 2.5 ...): added to the clock's unix time they stay exact,
so "not at 4.75, at 5" means just that.

Not covered here: a staged bot sidecar (the sidecar step of a stand-down). lchat.supervise's
Supervisor spawns with the module's ``spawn`` and takes no spawner, so a sidecar means a real
process (tests/test_activator.py covers it end to end).
"""

from __future__ import annotations

import datetime
import os
import shutil
import sqlite3
import tempfile
import time
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from lchat import config, hosts, lease
from lchat.buckets import RegionBuckets
from lchat.hibernation.activator import Activator
from lchat.hibernation.floor import BEHIND_RECHECK, BEHIND_RETRY
from lchat.hibernation.lifecycle import Lifecycle
from lchat.hibernation.localdb import (
    LEASE_SUFFIX,
    MARKER_SUFFIX,
    Restorer,
    write_lease_generation,
)
from lchat.hibernation.sidecars import Sidecars
from lchat.hibernation.space import Budgets, WakeFailed
from lchat.lease import HeldLease, LeaseRecord
from lchat.objstore.file import FileStore
from lchat.registry import Registry, Route
from lchat.replica.restore import SNAPSHOT_LEVEL, replica_files, restore
from lchat.router import LocalResponse, LocalSocket, Target
from lchat.routesource import RouteSource
from lchat.supervise import Supervisor
from lchat.units import Claims
from tests.fakes import FakeChild, FakeContract, Journal, RecordingStore, Spawner, inline

EPOCH = 1_800_000_000.0  # the clock's unix time when each test starts (due times are unix)
TTL = 30.0  # LCHAT_LEASE_TTL: renewed every 10 s, lost 27 s after the last renewal
RENEW = TTL / 3
TOKEN = "a" * 32
# tmpfs when there is one: the file bucket fsyncs every write.
TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def messages(db: str) -> list[str]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [body for (body,) in conn.execute("SELECT body FROM messages ORDER BY id")]
    finally:
        conn.close()


class _Machine(SynchronousTestCase):
    """One box: an activator and everything it drives, on ``self.clock`` (no tests of its own)."""

    def setUp(self) -> None:
        self._reactor_guard()
        self.dir = tempfile.mkdtemp(prefix="lchat-machine-", dir=TMP)
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.data = os.path.join(self.dir, "data")
        self.run_dir = os.path.join(self.dir, "run")
        self.bucket = os.path.join(self.dir, "bucket")
        for d in (self.data, self.run_dir, self.bucket):
            os.makedirs(d)
        env_file = os.path.join(self.dir, "router.env")
        settings = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.run_dir,
            "LCHAT_UNITS": "builtin",
            "LCHAT_HIBERNATE_BUCKET": f"file:{self.bucket}",
            "LCHAT_LEASE_TTL": f"{TTL:g}s",
            **self.more_settings(),
        }
        with open(env_file, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in settings.items())
        self.cfg = config.load(env_file=env_file, environ={})

        self.clock = Clock()
        self.clock.advance(EPOCH)
        self.journal = Journal(self.clock)
        self.raw = FileStore(self.clock, self.bucket, run_in_thread=inline)  # the test's own view
        self.store = RecordingStore(
            FileStore(self.clock, self.bucket, run_in_thread=inline), self.journal
        )
        self.registry = Registry(self.cfg.registry, clock=self.clock.seconds)
        self.registry.migrate()
        self.routes = RouteSource(
            self.clock, self.registry, self.registry.load(), run_in_thread=inline
        )
        self.spawner = Spawner(self.journal)
        self.addCleanup(self.spawner.close)
        self.contract = FakeContract(self.journal)
        self.sidecars = Sidecars(self.clock, self.cfg, inline, Supervisor(self.clock))
        self.lifecycle = Lifecycle(
            self.clock,
            self.cfg,
            self.store,  # a recording wrapper of a real FileStore
            self.routes,
            inline,
            self.sidecars,
            spawner=self.spawner,  # type: ignore[arg-type]  # FakeChild keeps RunningChild's contract
            # One look at the WAL per second (``gap`` = ``interval`` = 1 s): a binary fraction. The
            # default watch (0.1 s, gap 0.85 s) can make the replicator reschedule its tick at the
            # very time it runs, forever, on a fake clock (see _tick: ``now - last < gap`` while
            # ``last + gap`` rounds to ``now``); a real reactor's time moves on.
            replicator_options={"run_in_thread": inline, "watch_interval": 1.0},
            contract=self.contract,
            monotonic=self.clock.seconds,
            regions=self.region_buckets(),
        )
        self.claims = Claims()
        self.released: list[str] = []
        self.claims.on_release(self.released.append)
        self.activator = Activator(self.clock, self.routes, self.lifecycle, self.claims)
        self.activator.startService()
        self.addCleanup(self._drain)

    def more_settings(self) -> dict[str, str]:
        """More of the box's settings (a subclass's)."""
        return {}

    def region_buckets(self) -> RegionBuckets | None:
        """The lifecycle's other regions' buckets (a subclass's; None: none)."""
        return None

    def _reactor_guard(self) -> None:
        """Nothing here may touch the global reactor: no timer, no thread pool."""
        from twisted.internet import reactor

        r: Any = reactor
        calls = set(r.getDelayedCalls())
        pool = getattr(r, "threadpool", None)

        def check() -> None:
            self.assertEqual(set(r.getDelayedCalls()), calls, "a timer on the global reactor")
            self.assertIs(getattr(r, "threadpool", None), pool, "the global thread pool started")

        self.addCleanup(check)

    def _drain(self) -> None:
        """Stop what the test left running, so that replicators and databases are closed."""
        if not self.activator.running:
            return
        for child in self.spawner.children:
            child.stop_delay = 0.0
        self.contract.hang.clear()
        d = self.activator.stopService()
        self.advance(120.0)
        self.successResultOf(d)

    # -- the world ---------------------------------------------------------------------------------

    def add_space(self, host: str, **row: Any) -> Route:
        env_file = hosts.env_path(self.data, host)
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"LCHAT_ADMIN_TOKEN={TOKEN}\n".encode())
        os.close(fd)
        fields: dict[str, Any] = {"hibernate": True, "status": "ready"}
        fields.update(row)
        self.registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=os.path.join(self.run_dir, f"{host}.sock"),
                **fields,
            )
        )
        self.successResultOf(self.routes.reload("test"))
        return self.route(host)

    def route(self, host: str) -> Route:
        route = self.routes.table.get(host)
        assert route is not None
        return route

    def update_row(self, host: str, **changes: Any) -> None:
        self.registry.update(host, **changes)
        self.successResultOf(self.routes.reload("test"))

    def next_due(self, host: str) -> int:
        return self.route(host).next_due

    def db(self, host: str) -> str:
        return hosts.db_path(self.data, host)

    def has_marker(self, host: str) -> bool:
        return os.path.exists(self.db(host) + MARKER_SUFFIX)

    def snapshots(self, host: str) -> list[str]:
        """The keys of ``host``'s snapshots in the bucket."""
        files = replica_files(self.raw.bucket.list(f"{host}/"))
        return [f.info.key for f in files if f.level == SNAPSHOT_LEVEL]

    def restored(self, host: str) -> list[str]:
        """The messages of ``host``'s replica as a restore from the bucket gets them."""
        out = os.path.join(self.dir, f"{host}.restored")
        self.successResultOf(
            Deferred.fromCoroutine(restore(self.raw, host, out, run_in_thread=inline))
        )
        return messages(out)

    def lock_owner(self, host: str) -> str | None:
        """Who ``host``'s lock.json names (None: no lock), read straight from the bucket."""
        try:
            body = self.raw.bucket.get(f"{host}/lock.json").body
        except Exception:
            return None
        return LeaseRecord.parse(body).owner

    def take_over(self, host: str, owner: str = "box-b") -> None:
        """Another box replaces the lock (as it does when it judges ours expired)."""
        record = LeaseRecord(
            owner=owner, generation=9, expires_at="", ttl_seconds=TTL, lease_id="theirs"
        )
        self.raw.bucket.put(f"{host}/lock.json", record.to_json())

    def hold_elsewhere(self, host: str, owner: str = "box-b") -> None:
        """Another box holds ``host``'s live lease."""
        self.successResultOf(
            Deferred.fromCoroutine(
                lease.acquire(self.raw, f"{host}/lock.json", owner, TTL, monotonic=time.monotonic)
            )
        )

    # -- time --------------------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock.seconds() - EPOCH

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds``, running each timer at its own time (as a reactor
        would: a timer that schedules another sees the time it was due at)."""
        target = self.clock.seconds() + seconds
        for _ in range(1_000_000):
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= target]
            if not due:
                break
            self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
        else:
            self.fail("the timers never settle")
        self.clock.advance(max(0.0, target - self.clock.seconds()))

    def run_until(self, d: Deferred[Any], limit: float = 600.0) -> Any:
        """Run timers one at a time until ``d`` fires (the clock stops right there)."""
        end = self.clock.seconds() + limit
        while not d.called:
            calls = self.clock.getDelayedCalls()
            self.assertTrue(calls, "nothing left to run and it has not fired")
            when = min(c.getTime() for c in calls)
            self.assertLessEqual(when, end, "did not fire in time")
            self.clock.advance(max(0.0, when - self.clock.seconds()))
        return d

    # -- the activator -----------------------------------------------------------------------------

    def awake(self, host: str) -> FakeChild:
        """Wake ``host`` (its child answers at once) and return its child."""
        self.successResultOf(self.activator.wake(self.route(host), "request"))
        self.assertEqual(self.activator.state(host), "awake")
        return self.spawner.last(host)

    def target(self, result: Target | Deferred[Target]) -> Target:
        """The routed target, which must be there now."""
        if isinstance(result, Deferred):
            return self.successResultOf(result)
        return result

    def refused(self, result: Target | Deferred[Target], reason: str) -> LocalResponse:
        """A 503 for ``reason`` (its metrics label says which)."""
        answer = self.target(result)
        assert isinstance(answer, LocalResponse), answer
        self.assertEqual((answer.status, answer.label), (503, f"wake_{reason}"), answer.body)
        self.assertTrue(dict(answer.headers).get(b"retry-after"))
        return answer

    def wake_failure(self, d: Deferred[None]) -> WakeFailed:
        failure: Failure = self.failureResultOf(d, WakeFailed)
        assert isinstance(failure.value, WakeFailed)
        return failure.value


# -- waking ------------------------------------------------------------------------------------------


class WakeTests(_Machine):
    def test_concurrent_requests_and_wakes_share_one_spawn_and_are_all_answered(self) -> None:
        route = self.add_space("a.example")
        self.spawner.ready = False
        coalesced = metric("lchat_wake_coalesced_total")
        requests = [self.activator.route(route) for _ in range(50)]
        wakes = [self.activator.wake(route, "admin") for _ in range(3)]
        self.assertEqual(len(self.spawner.of("a.example")), 1)
        self.assertEqual(self.activator.state("a.example"), "waking")
        self.assertFalse(any(d.called for d in [*requests, *wakes]))  # type: ignore[union-attr]
        self.advance(2.5)
        self.spawner.last("a.example").become_ready()
        targets = [self.target(d) for d in requests]
        for d in wakes:
            self.assertIsNone(self.successResultOf(d))
        self.assertEqual(len(self.spawner.of("a.example")), 1)
        self.assertEqual(metric("lchat_wake_coalesced_total"), coalesced + 52)
        socket = os.path.join(self.run_dir, "a.example.sock")
        first = targets[0]
        assert isinstance(first, LocalSocket), first
        for target in targets:
            assert isinstance(target, LocalSocket), target
            self.assertEqual(target.path, socket)
            # Every request that waited says how long, and holds the space's ticket.
            self.assertEqual(target.response_headers, ((b"x-lchat-wake", b"2.500s"),))
            self.assertIsNotNone(target.inflight)
            self.assertIs(target.inflight, first.inflight)
        self.assertEqual(self.activator.state("a.example"), "awake")
        self.assertEqual(self.lock_owner("a.example"), self.cfg.box_id)

    def test_an_awake_space_is_routed_at_once_with_its_inflight_ticket(self) -> None:
        route = self.add_space("t.example")
        self.awake("t.example")
        routed = self.activator.route(route)
        assert isinstance(routed, LocalSocket), routed  # not a Deferred: nobody waits
        self.assertEqual(routed.response_headers, ())  # no x-lchat-wake once awake
        ticket = routed.inflight
        assert ticket is not None
        ticket.request_started(upgrade=False)
        self.assertEqual(self.activator.status()["t.example"]["inflight"], 1)
        ticket.request_ended(upgrade=False)
        self.assertEqual(self.activator.status()["t.example"]["inflight"], 0)

    def test_a_sidecar_request_never_wakes_and_gets_no_ticket(self) -> None:
        route = self.add_space("bot.example")
        answer = self.refused(self.activator.route(route, sidecar=True), "sidecar")
        self.assertEqual(answer.refusal, "")
        self.assertEqual(
            (self.activator.state("bot.example"), self.spawner.children), ("asleep", [])
        )
        self.awake("bot.example")
        routed = self.activator.route(route, sidecar=True)
        assert isinstance(routed, LocalSocket), routed
        self.assertIsNone(routed.inflight)  # sidecar traffic earns no idle credit

    def test_a_request_waits_at_most_the_queue_budget_while_the_wake_goes_on(self) -> None:
        route = self.add_space("slow.example")
        self.activator.budgets = Budgets(queue=5.0, ready=30.0)
        self.spawner.ready = False
        d = self.activator.route(route)
        assert isinstance(d, Deferred)
        self.advance(4.75)
        self.assertFalse(d.called)
        self.advance(0.25)
        answer = self.refused(d, "queue_timeout")
        self.assertIn(b"still waking", answer.body)
        self.assertEqual(self.activator.state("slow.example"), "waking")
        self.advance(10.0)
        self.spawner.last("slow.example").become_ready()  # 15 s in: within the ready budget
        self.assertEqual(self.activator.state("slow.example"), "awake")
        self.assertIsInstance(self.activator.route(route), LocalSocket)
        self.assertEqual(len(self.spawner.children), 1)

    def test_a_space_that_never_answers_fails_its_wake_after_the_ready_budget(self) -> None:
        route = self.add_space("mute.example")
        self.activator.budgets = Budgets(queue=60.0, ready=5.0, stop=2.0)
        self.spawner.ready = False
        d = self.activator.route(route)
        self.advance(5.0)
        self.refused(d, "not_ready")
        child = self.spawner.last("mute.example")
        self.assertEqual(child.terminations, [(EPOCH + 5.0, 2.0)])  # SIGTERM, SIGKILL after 2 s
        self.assertEqual(self.activator.state("mute.example"), "asleep")
        self.assertIsNone(self.lock_owner("mute.example"))  # released


# -- failing and backing off ---------------------------------------------------------------------


class BackoffTests(_Machine):
    def test_failed_wakes_back_off_per_host_doubling_to_a_minute(self) -> None:
        route = self.add_space("bin.example")
        other = self.add_space("fine.example")
        self.spawner.refuse = "no such file: /usr/bin/space"  # fails every wake of bin.example
        expected = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
        for n, delay in enumerate(expected, start=1):
            self.assertEqual(
                self.wake_failure(self.activator.wake(route, "request")).reason, "spawn"
            )
            self.assertEqual(self.journal.events().count("spawn"), n)
            # Right after: refused from memory, saying when to come back.
            backoff = self.wake_failure(self.activator.wake(route, "request"))
            self.assertEqual((backoff.reason, backoff.retry_after), ("backoff", delay))
            self.refused(self.activator.route(route), "backoff")
            self.advance(delay - 0.25)
            self.assertEqual(
                self.wake_failure(self.activator.wake(route, "request")).reason, "backoff"
            )
            self.assertEqual(self.journal.events().count("spawn"), n)
            self.advance(0.25)
        # Another host is not held back by this one's failures.
        self.spawner.refuse = None
        self.successResultOf(self.activator.wake(other, "request"))

    def test_a_space_that_cannot_start_is_a_503_that_names_no_path(self) -> None:
        route = self.add_space("nobin.example")
        self.spawner.refuse = "/opt/secret/space-bin: No such file or directory"
        answer = self.refused(self.activator.route(route), "spawn")
        self.assertIn(b"nobin.example could not start", answer.body)
        self.assertNotIn(b"/opt/secret", answer.body)  # paths are for the log, not for clients
        self.assertEqual(self.activator.state("nobin.example"), "asleep")
        self.assertIsNone(self.lock_owner("nobin.example"))  # the failed wake released it

    def test_a_successful_wake_clears_the_backoff(self) -> None:
        route = self.add_space("flaky.example")
        self.spawner.refuse = "cannot exec"
        self.wake_failure(self.activator.wake(route, "request"))
        self.advance(1.0)
        self.wake_failure(self.activator.wake(route, "request"))
        self.assertEqual(self.wake_failure(self.activator.wake(route, "request")).retry_after, 2.0)
        self.advance(2.0)
        self.spawner.refuse = None
        self.awake("flaky.example")
        self.successResultOf(self.activator.sleep("flaky.example", "idle"))
        self.spawner.refuse = "cannot exec"
        self.wake_failure(self.activator.wake(route, "request"))
        self.assertEqual(self.wake_failure(self.activator.wake(route, "request")).retry_after, 1.0)

    def test_a_lease_held_elsewhere_is_a_503_that_costs_no_backoff(self) -> None:
        route = self.add_space("held.example")
        self.hold_elsewhere("held.example")
        d = self.activator.route(route)
        assert isinstance(d, Deferred)
        self.assertFalse(d.called)  # asked again for ~0.3 s: a draining holder lets go
        self.run_until(d)
        answer = self.refused(d, "lease_held")
        self.assertIn(b"served elsewhere", answer.body)
        self.assertEqual(dict(answer.headers)[b"retry-after"], b"10")  # soon, capped
        self.assertEqual(answer.refusal, "")  # not a drain's refusal: no other box would do
        self.assertEqual(
            (self.activator.state("held.example"), self.spawner.children), ("asleep", [])
        )
        self.assertFalse(os.path.exists(self.db("held.example")))
        self.assertEqual(self.lock_owner("held.example"), "box-b")

    def test_a_held_lease_is_answered_from_memory_for_a_quarter_second_then_asked_again(
        self,
    ) -> None:
        route = self.add_space("busy.example")
        self.hold_elsewhere("busy.example")
        first = self.run_until(self.activator.wake(route, "request"))
        self.assertEqual(self.wake_failure(first).reason, "lease_held")
        asked = self.store.count()
        for step in (0.0, 0.125, 0.125 - 2**-10):  # up to just before 0.25 s
            self.advance(step)
            self.refused(self.activator.route(route), "lease_held")
            held = self.wake_failure(self.activator.wake(route, "request"))
            self.assertEqual(held.reason, "lease_held")
            self.assertEqual(self.store.count(), asked, "asked the bucket again")
        self.advance(2**-10)
        d = self.activator.route(route)
        assert isinstance(d, Deferred)
        self.assertFalse(d.called)
        self.assertGreater(self.store.count(), asked)  # the bucket is asked again
        self.run_until(d)
        self.refused(d, "lease_held")

    def test_a_build_missing_here_is_answered_from_memory_briefly_not_backed_off(self) -> None:
        """A wake refused because this box lacks the build the space last ran (build_behind) is
        not the space failing: its refusal is answered again from memory for BEHIND_RECHECK
        (no bucket read per request), saying why, and never grows into the wake backoff, so
        the first wake after the operator installs the build runs."""
        route = self.add_space("behind.example")
        self.spawner.fail_with = WakeFailed(
            "behind.example", "build_behind", "behind.example ran 1.4, not installed", BEHIND_RETRY
        )
        for _ in range(3):  # (three failed wakes would back off 1 + 2 + 4 s)
            first = self.wake_failure(self.activator.wake(route, "request"))
            self.assertEqual((first.reason, first.retry_after), ("build_behind", BEHIND_RETRY))
            spawned = self.journal.events().count("spawn")
            for _ in range(int(BEHIND_RECHECK)):  # (whole seconds: exact on the clock)
                again = self.wake_failure(self.activator.wake(route, "request"))
                self.assertEqual((again.reason, again.retry_after), ("build_behind", BEHIND_RETRY))
                answer = self.refused(self.activator.route(route), "build_behind")
                self.assertIn(b"until it is updated", answer.body)
                self.assertEqual(self.journal.events().count("spawn"), spawned)
                self.advance(1.0)
        self.spawner.fail_with = None  # the operator fetched the build
        self.awake("behind.example")


# -- sleeping ----------------------------------------------------------------------------------------


class SleepTests(_Machine):
    def test_a_graceful_sleep_stands_down_in_order(self) -> None:
        """Next due asked and recorded, the requests in flight finished, SIGTERM, the final flush
        (the last write shipped), the lease released, then the clean-sleep marker."""
        route = self.add_space("s.example")
        child = self.awake("s.example")
        self.contract.due["s.example"] = int(EPOCH) + 3600
        routed = self.activator.route(route)
        assert isinstance(routed, LocalSocket) and routed.inflight is not None
        ticket = routed.inflight
        ticket.request_started(upgrade=False)
        at_release: list[bool] = []
        self.store.observe = lambda method, key: (
            at_release.append(self.has_marker("s.example"))
            if (method, key) == ("delete", "s.example/lock.json")
            else None
        )
        mark = self.journal.mark()
        d = self.activator.sleep("s.example", "idle")
        self.assertEqual(self.activator.state("s.example"), "stopping")
        self.assertEqual(self.next_due("s.example"), int(EPOCH) + 3600)
        self.assertEqual(child.terminations, [])  # the request in flight finishes first
        self.advance(2.5)
        self.assertEqual(child.terminations, [])
        child.write("the last word")  # written while answering, not shipped yet
        ticket.request_ended(upgrade=False)
        self.successResultOf(d)
        steps = [
            (event, detail)
            for _, event, detail in self.journal.entries[mark:]
            if event in ("next_due", "terminate", "exit", "store.put_file", "store.delete")
        ]
        self.assertEqual(
            steps[:3],
            [("next_due", "s.example"), ("terminate", "s.example"), ("exit", "s.example")],
        )
        self.assertEqual(steps[-1], ("store.delete", "s.example/lock.json"))
        self.assertTrue(any(e == "store.put_file" for e, _ in steps[3:-1]), steps)  # the flush
        self.assertEqual(at_release, [False])  # no marker until the lease is released
        self.assertTrue(self.has_marker("s.example"))
        self.assertEqual(self.activator.state("s.example"), "asleep")
        self.assertIsNone(self.lock_owner("s.example"))
        self.assertEqual(child.terminations, [(EPOCH + 2.5, Budgets().stop)])
        # The bucket has the last write: another box (no local copy) wakes the space with it.
        for name in os.listdir(self.data):
            if name.startswith("s.example.db"):
                os.unlink(os.path.join(self.data, name))
        woken = self.awake("s.example")
        assert woken.db is not None
        rows = woken.db.execute("SELECT body FROM messages").fetchall()
        self.assertEqual(rows, [("the last word",)])

    def test_a_graceful_sleep_gives_up_on_requests_after_the_requests_budget(self) -> None:
        route = self.add_space("stuck.example")
        child = self.awake("stuck.example")
        self.activator.budgets = Budgets(requests=10.0)
        routed = self.activator.route(route)
        assert isinstance(routed, LocalSocket) and routed.inflight is not None
        routed.inflight.request_started(upgrade=False)  # never ends (a hung long-poll)
        d = self.activator.sleep("stuck.example", "idle")
        self.advance(9.75)
        self.assertEqual(child.terminations, [])
        self.advance(0.25)
        self.assertEqual(child.terminations, [(EPOCH + 10.0, Budgets().stop)])
        self.successResultOf(d)
        self.assertEqual(self.activator.state("stuck.example"), "asleep")
        self.assertIsNone(self.lock_owner("stuck.example"))

    def test_a_graceful_sleep_waits_for_plain_requests_but_not_for_upgrades(self) -> None:
        route = self.add_space("ws.example")
        child = self.awake("ws.example")
        routed = self.activator.route(route)
        assert isinstance(routed, LocalSocket) and routed.inflight is not None
        ticket = routed.inflight
        ticket.request_started(upgrade=True)  # a WebSocket: open for hours
        ticket.request_started(upgrade=False)
        d = self.activator.sleep("ws.example", "admin")
        self.advance(1.0)
        self.assertEqual(child.terminations, [])
        ticket.request_ended(upgrade=False)
        self.assertEqual(len(child.terminations), 1)  # the tunnel is still open: not waited for
        self.successResultOf(d)

    def test_a_sleep_with_only_an_upgrade_open_terminates_at_once(self) -> None:
        route = self.add_space("ws2.example")
        child = self.awake("ws2.example")
        routed = self.activator.route(route)
        assert isinstance(routed, LocalSocket) and routed.inflight is not None
        routed.inflight.request_started(upgrade=True)
        self.successResultOf(self.activator.sleep("ws2.example", "admin"))
        self.assertEqual(child.terminations, [(EPOCH, Budgets().stop)])

    def test_a_next_due_that_does_not_answer_costs_its_budget_and_is_not_recorded(self) -> None:
        self.add_space("quiet.example", next_due=int(EPOCH) + 99)
        child = self.awake("quiet.example")
        self.contract.hang.add("quiet.example")
        d = self.activator.sleep("quiet.example", "idle")
        self.advance(Budgets().next_due - 0.25)
        self.assertEqual(child.terminations, [])
        self.advance(0.25)
        self.successResultOf(d)
        self.assertEqual(len(child.terminations), 1)
        self.assertEqual(self.next_due("quiet.example"), int(EPOCH) + 99)  # left as it was
        self.assertTrue(self.has_marker("quiet.example"))

    def test_idle_hosts_never_include_a_space_with_a_request_in_flight(self) -> None:
        route = self.add_space("i.example")
        self.awake("i.example")
        routed = self.activator.route(route)
        assert isinstance(routed, LocalSocket) and routed.inflight is not None
        ticket = routed.inflight
        self.advance(60.0)
        self.assertEqual(self.activator.idle_hosts(60.0), ["i.example"])
        for upgrade in (False, True):
            ticket.request_started(upgrade=upgrade)
            self.advance(600.0)
            self.assertEqual(self.activator.idle_hosts(60.0), [])
            self.assertEqual(self.activator.idle_hosts(2**-10), [])
            ticket.request_ended(upgrade=upgrade)
            self.assertEqual(self.activator.idle_hosts(60.0), [])  # idle from the end, not before
            self.advance(60.0)
            self.assertEqual(self.activator.idle_hosts(60.0), ["i.example"])

    def test_a_failed_wake_stands_down_without_next_due_or_marker(self) -> None:
        route = self.add_space("f.example")
        self.activator.budgets = Budgets(ready=5.0)
        self.spawner.ready = False
        mark = self.journal.mark()
        d = self.activator.wake(route, "request")
        self.advance(5.0)
        self.assertEqual(self.wake_failure(d).reason, "not_ready")
        events = self.journal.events(since=mark)
        self.assertNotIn("next_due", events)
        self.assertIn("terminate", events)
        self.assertEqual(self.activator.state("f.example"), "asleep")
        self.assertIsNone(self.lock_owner("f.example"))  # nothing replicated: released
        self.assertTrue(os.path.exists(self.db("f.example")))  # what the child created stays
        self.assertFalse(self.has_marker("f.example"))  # but is not vouched for

    def test_a_child_that_dies_while_awake_is_recycled_and_woken_again_with_its_data(
        self,
    ) -> None:
        route = self.add_space("k.example")
        child = self.awake("k.example")
        child.write("kept")
        exited = metric("lchat_sleeps_total", reason="child_exited")
        mark = self.journal.mark()
        child.crash()
        self.assertEqual(self.activator.state("k.example"), "asleep")
        events = self.journal.events(since=mark)
        self.assertNotIn("next_due", events)  # nobody to ask
        self.assertIn("store.put_file", events)  # flushed what it had written
        self.assertEqual(metric("lchat_sleeps_total", reason="child_exited"), exited + 1)
        self.assertIsNone(self.lock_owner("k.example"))
        # The flush made the local file exactly the bucket's state: vouched for.
        self.assertTrue(self.has_marker("k.example"))
        target = self.target(self.activator.route(route))
        assert isinstance(target, LocalSocket), target
        second = self.spawner.last("k.example")
        self.assertIsNot(second, child)
        assert second.db is not None
        self.assertEqual(second.db.execute("SELECT body FROM messages").fetchall(), [("kept",)])

    def test_clearing_the_hibernate_flag_sleeps_the_space_without_a_marker(self) -> None:
        self.add_space("off.example")
        self.awake("off.example")
        mark = self.journal.mark()
        off = metric("lchat_sleeps_total", reason="hibernate off")
        self.update_row("off.example", hibernate=False)
        self.assertEqual(self.activator.state("off.example"), "asleep")
        self.assertIn("next_due", self.journal.events(since=mark))  # a graceful sleep
        self.assertEqual(metric("lchat_sleeps_total", reason="hibernate off"), off + 1)
        self.assertIsNone(self.lock_owner("off.example"))  # flushed and released
        # Builtin units run it from now on: a marker could not stay true.
        self.assertFalse(self.has_marker("off.example"))
        self.assertEqual(self.released, ["off.example"])

    def test_clearing_the_hibernate_flag_calls_off_a_wake_under_way(self) -> None:
        route = self.add_space("offw.example")
        self.spawner.ready = False
        d = self.activator.route(route)
        self.update_row("offw.example", hibernate=False)
        self.refused(d, "cancelled")
        self.assertEqual(self.activator.state("offw.example"), "asleep")
        self.assertIsNone(self.lock_owner("offw.example"))
        self.assertEqual(self.released, ["offw.example"])


# -- wake again, claims -----------------------------------------------------------------------------


class WakeAgainTests(_Machine):
    def test_a_request_while_stopping_wakes_the_space_again_once_asleep(self) -> None:
        route = self.add_space("again.example")
        first = self.awake("again.example")
        first.stop_delay = 3.0
        slept = self.activator.sleep("again.example", "idle")
        self.assertEqual(self.activator.state("again.example"), "stopping")
        d = self.activator.route(route)
        assert isinstance(d, Deferred)
        self.advance(2.75)
        self.assertFalse(d.called)
        self.assertEqual(len(self.spawner.of("again.example")), 1)  # never two at once
        self.advance(0.25)
        self.successResultOf(slept)
        target = self.target(d)
        assert isinstance(target, LocalSocket), target
        self.assertEqual(target.response_headers, ((b"x-lchat-wake", b"3.000s"),))
        second = self.spawner.last("again.example")
        self.assertIsNot(second, first)
        self.assertGreaterEqual(second.started_at, EPOCH + 3.0)  # after the first exited
        self.assertEqual(self.activator.state("again.example"), "awake")

    def test_a_request_queued_on_a_stopping_space_is_refused_once_the_router_drains(
        self,
    ) -> None:
        route = self.add_space("late.example")
        self.awake("late.example").stop_delay = 3.0
        self.activator.sleep("late.example", "idle")
        d = self.activator.route(route)
        drained = self.activator.stopService()
        self.advance(3.0)
        self.successResultOf(drained)
        answer = self.refused(d, "stood_down")
        self.assertEqual(answer.refusal, "stopping")  # a forwarding peer may send it elsewhere
        self.assertEqual(len(self.spawner.of("late.example")), 1)
        self.assertEqual(self.activator.state("late.example"), "asleep")

    def test_a_host_is_claimed_from_wake_start_to_the_end_of_its_stand_down(self) -> None:
        route = self.add_space("c.example")
        self.spawner.ready = False
        self.assertNotIn("c.example", self.claims)
        self.activator.wake(route, "request")
        self.assertIn("c.example", self.claims)  # waking: builtin units keep off
        child = self.spawner.last("c.example")
        child.stop_delay = 2.0
        child.become_ready()
        self.assertIn("c.example", self.claims)
        d = self.activator.sleep("c.example", "idle")
        self.advance(1.75)
        self.assertIn("c.example", self.claims)  # stopping: still ours
        self.assertEqual(self.released, [])
        self.advance(0.25)
        self.successResultOf(d)
        self.assertNotIn("c.example", self.claims)
        self.assertEqual(self.released, ["c.example"])

    def test_a_failed_wake_releases_its_claim(self) -> None:
        route = self.add_space("cf.example")
        self.spawner.refuse = "cannot exec"
        self.wake_failure(self.activator.wake(route, "request"))
        self.assertNotIn("cf.example", self.claims)
        self.assertEqual(self.released, ["cf.example"])


# -- the lease ---------------------------------------------------------------------------------------


class LeaseLossTests(_Machine):
    def test_a_lease_taken_over_mid_wake_calls_the_wake_off_without_releasing(self) -> None:
        route = self.add_space("mid.example")
        self.spawner.ready = False
        d = self.activator.route(route)
        child = self.spawner.last("mid.example")
        self.take_over("mid.example")
        self.advance(RENEW)  # the keeper's renewal finds box-b's lock
        self.refused(d, "cancelled")
        self.assertEqual(self.activator.state("mid.example"), "asleep")
        self.assertEqual(child.terminations, [(EPOCH + RENEW, Budgets().lease_lost_stop)])
        self.assertEqual(self.lock_owner("mid.example"), "box-b")  # never released: theirs
        # Taken over: the bucket is the truth now, the local copy is moved aside.
        self.assertFalse(os.path.exists(self.db("mid.example")))
        self.assertTrue(any(".lease-lost-" in n for n in os.listdir(self.data)))
        self.assertFalse(self.has_marker("mid.example"))
        # No backoff: the next request asks the lease again (and finds it held).
        d = self.activator.route(route)
        self.run_until(d)  # type: ignore[arg-type]
        self.refused(d, "lease_held")

    def test_a_lease_taken_over_while_awake_stops_the_space_and_writes_nothing_more(
        self,
    ) -> None:
        self.add_space("lost.example")
        child = self.awake("lost.example")
        child.write("mine")
        self.take_over("lost.example")
        child.write("after the takeover")
        mark = self.journal.mark()
        lost = metric("lchat_sleeps_total", reason="lease_lost")
        self.advance(RENEW)  # the keeper's renewal finds box-b's lock
        self.assertEqual(self.activator.state("lost.example"), "asleep")
        self.assertEqual(metric("lchat_sleeps_total", reason="lease_lost"), lost + 1)
        self.assertEqual(child.terminations, [(EPOCH + RENEW, Budgets().lease_lost_stop)])
        # From that renewal on: no final flush, no release, no write of any kind.
        after = [(event, key) for _, event, key in self.journal.entries[mark:]]
        renewal = after.index(("store.put", "lost.example/lock.json"))
        writes = [e for e, _ in after[renewal + 1 :] if e.startswith("store.") and e != "store.get"]
        self.assertEqual(writes, [])
        self.assertEqual(self.lock_owner("lost.example"), "box-b")
        self.assertFalse(os.path.exists(self.db("lost.example")))
        self.assertFalse(self.has_marker("lost.example"))

    def test_a_lease_not_renewed_in_time_keeps_the_local_db(self) -> None:
        """The bucket stopped answering: nobody is known to hold the lease, and the local file
        has writes the bucket lacks. It is kept where it is, unvouched (no marker)."""
        self.add_space("outage.example")
        child = self.awake("outage.example")
        child.write("during the outage")
        away = self.bucket + ".away"
        os.rename(self.bucket, away)
        try:
            self.advance(TTL - TTL / 10 - 0.25)
            self.assertEqual(self.activator.state("outage.example"), "awake")  # still serving
            self.advance(0.25)  # the keeper's deadline: ttl - safety margin after the last write
            self.assertEqual(self.activator.state("outage.example"), "asleep")
        finally:
            os.rename(away, self.bucket)
        self.assertEqual(len(child.terminations), 1)
        self.assertTrue(os.path.exists(self.db("outage.example")))
        self.assertFalse(any(".lease-lost-" in n for n in os.listdir(self.data)))
        self.assertFalse(self.has_marker("outage.example"))

    def test_a_vanished_lock_is_retaken_and_the_space_keeps_serving(self) -> None:
        """Deleting lock.json is not a takeover (a takeover replaces it): the keeper re-takes it."""
        self.add_space("gone.example")
        self.awake("gone.example")
        self.raw.bucket.delete("gone.example/lock.json")
        self.advance(RENEW)
        self.assertEqual(self.activator.state("gone.example"), "awake")
        self.assertEqual(self.lock_owner("gone.example"), self.cfg.box_id)


# -- due wakes ---------------------------------------------------------------------------------------


class DueWakeTests(_Machine):
    def test_a_due_wake_clears_the_due_time_it_honoured(self) -> None:
        due = int(EPOCH) - 5
        route = self.add_space("due.example", next_due=due)
        self.successResultOf(self.activator.wake(route, "due"))
        self.assertEqual(self.activator.status()["due.example"]["reason"], "due")
        self.assertEqual(self.next_due("due.example"), 0)

    def test_a_due_wake_leaves_a_newer_due_time_alone(self) -> None:
        due = int(EPOCH) - 5
        route = self.add_space("newer.example", next_due=due)
        self.spawner.ready = False
        d = self.activator.wake(route, "due")
        self.update_row("newer.example", next_due=due + 600)  # recorded meanwhile
        self.spawner.last("newer.example").become_ready()
        self.successResultOf(d)
        self.assertEqual(self.next_due("newer.example"), due + 600)

    def test_a_due_time_already_honoured_reported_again_at_sleep_is_recorded_as_none(
        self,
    ) -> None:
        due = int(EPOCH) - 5
        route = self.add_space("once.example", next_due=due)
        self.successResultOf(self.activator.wake(route, "due"))
        for reported in (due, due - 60):  # the space still lists the delivery it was woken for
            self.contract.due["once.example"] = reported
            self.successResultOf(self.activator.sleep("once.example", "idle"))
            self.assertEqual(self.next_due("once.example"), 0)  # woken once, not in a loop
            self.update_row("once.example", next_due=due)
            self.successResultOf(self.activator.wake(self.route("once.example"), "due"))

    def test_a_later_due_time_reported_at_sleep_is_recorded(self) -> None:
        due = int(EPOCH) - 5
        route = self.add_space("later.example", next_due=due)
        self.successResultOf(self.activator.wake(route, "due"))
        self.contract.due["later.example"] = due + 3600
        self.successResultOf(self.activator.sleep("later.example", "idle"))
        self.assertEqual(self.next_due("later.example"), due + 3600)

    def test_a_request_wake_does_not_clear_a_due_time(self) -> None:
        route = self.add_space("req.example", next_due=int(EPOCH) + 60)
        self.successResultOf(self.activator.wake(route, "request"))
        self.assertEqual(self.next_due("req.example"), int(EPOCH) + 60)


# -- the states and who owns the database ----------------------------------------------------------


class TransitionTests(_Machine):
    def test_a_space_moves_only_as_the_table_says(self) -> None:
        space = self.lifecycle.new_space("t.example", self.add_space("t.example"), "request")
        with self.assertRaises(AssertionError):
            space.move("asleep")  # a waking space stands down first
        space.move("waking")  # staying is no move
        space.move("awake")
        with self.assertRaises(AssertionError):
            space.move("waking")
        space.move("stopping")
        space.move("asleep")
        self.assertEqual(space.state, "stopping")  # asleep: the activator forgets it

    def test_a_wake_waits_for_every_other_owner_to_let_go_of_the_database(self) -> None:
        route = self.add_space("owned.example")
        let_go: Deferred[None] = Deferred()
        asked: list[tuple[str, str]] = []

        def backup(host: str, db: str) -> Deferred[None]:
            asked.append((host, db))
            return let_go

        self.claims.on_hand_over(backup)
        d = self.activator.wake(route, "request")
        self.assertEqual(asked, [("owned.example", self.db("owned.example"))])
        self.assertIn("owned.example", self.claims)  # claimed before the hand-over
        self.assertIsNone(self.lock_owner("owned.example"))  # no lease, no spawn yet
        self.assertEqual(self.spawner.of("owned.example"), [])
        let_go.callback(None)
        self.successResultOf(d)
        self.assertEqual(self.lock_owner("owned.example"), self.cfg.box_id)


# -- the wake's database step ------------------------------------------------------------------------


class DatabaseStepTests(_Machine):
    def test_a_cold_wake_restores_from_the_bucket(self) -> None:
        self.add_space("cold.example")
        self.awake("cold.example").write("one")
        self.successResultOf(self.activator.sleep("cold.example", "admin"))
        for name in os.listdir(self.data):
            if name.startswith("cold.example.db"):
                os.unlink(os.path.join(self.data, name))  # another box: no local copy
        child = self.awake("cold.example")
        self.assertEqual(messages(child.db_path), ["one"])

    def test_a_warm_wake_continues_the_replica_without_a_snapshot(self) -> None:
        self.add_space("warm.example")
        self.awake("warm.example").write("1")
        self.successResultOf(self.activator.sleep("warm.example", "admin"))
        snapshots = self.snapshots("warm.example")
        self.assertEqual(len(snapshots), 1)
        for body in ("2", "3"):
            self.awake("warm.example").write(body)
            self.successResultOf(self.activator.sleep("warm.example", "admin"))
        # Two more wakes, no more snapshots: each continued the replica after its marker.
        self.assertEqual(self.snapshots("warm.example"), snapshots)
        self.assertEqual(self.restored("warm.example"), ["1", "2", "3"])

    def test_a_stale_local_copy_is_moved_aside_and_the_bucket_restored(self) -> None:
        """The bucket moved on past the local copy (another box served the space meanwhile)."""
        self.add_space("stale.example")
        self.awake("stale.example").write("a")
        self.successResultOf(self.activator.sleep("stale.example", "admin"))
        db = self.db("stale.example")
        old = os.path.join(self.dir, "old.db")
        suffixes = ("", "-wal", "-shm", MARKER_SUFFIX)
        _move(db, old, suffixes)  # renames keep inode and mtime: the marker still holds
        self.awake("stale.example").write("b")  # "another box": a cold wake from the bucket
        self.successResultOf(self.activator.sleep("stale.example", "admin"))
        for suffix in suffixes:
            if os.path.exists(db + suffix):
                os.unlink(db + suffix)
        _move(old, db, suffixes)  # this box's copy, as it slept: one write behind
        child = self.awake("stale.example")
        self.assertEqual(messages(child.db_path), ["a", "b"])
        self.assertTrue(any(".stale-" in name for name in os.listdir(self.data)))

    def test_a_local_copy_changed_while_asleep_gets_a_snapshot(self) -> None:
        """The marker no longer vouches for a file written after the sleep: the wake trusts the
        file and ships a fresh snapshot (never a delta on top of an unknown base)."""
        self.add_space("touched.example")
        self.awake("touched.example").write("a")
        self.successResultOf(self.activator.sleep("touched.example", "admin"))
        conn = sqlite3.connect(self.db("touched.example"))
        conn.execute("INSERT INTO messages(body) VALUES ('written outside')")
        conn.commit()
        conn.close()
        snapshots = self.snapshots("touched.example")
        self.awake("touched.example")
        self.successResultOf(self.activator.sleep("touched.example", "admin"))
        self.assertNotEqual(self.snapshots("touched.example"), snapshots)
        self.assertEqual(self.restored("touched.example"), ["a", "written outside"])

    def test_a_lease_this_box_left_behind_is_reclaimed_at_once(self) -> None:
        """A router that crashed left its live lease: its next process takes it back without
        waiting for the expiry, and trusts the local database (the newest copy)."""
        route = self.add_space("crash.example")
        self.hold_elsewhere("crash.example", owner=self.cfg.box_id)
        target = self.target(self.activator.route(route))  # no wait on the clock
        assert isinstance(target, LocalSocket), target
        self.assertEqual(self.lock_owner("crash.example"), self.cfg.box_id)

    def test_our_own_lease_taken_back_trusts_only_the_copy_of_that_holding(self) -> None:
        """A mesh box's own lease, taken back (``own``), vouches for its unmarked local copy only
        when that copy was the space's copy under the holding taken back (``<db>-lease.json``).
        The fence model's case: an isolated box's copy of an old tenure; another box held the
        space and shipped writes; this box's late lock PUT (its wake had given up) named it
        again; the next wake took back "its own" lease and served the old copy, losing the
        writes that had shipped. Now the bucket decides, and the old copy is moved aside."""
        host = "gap.example"
        self.add_space(host)
        self.awake(host).write("ours")
        db = self.db(host)
        self.assertTrue(os.path.exists(db + LEASE_SUFFIX))  # each wake records its generation
        self.successResultOf(self.activator.sleep(host, "admin"))
        old = os.path.join(self.dir, "old-tenure")
        os.makedirs(old)
        for suffix in ("", "-wal", LEASE_SUFFIX):
            if os.path.exists(db + suffix):
                shutil.copy2(db + suffix, os.path.join(old, "copy" + suffix))
        self.awake(host).write("theirs")  # (a later tenure: its writes shipped)
        self.successResultOf(self.activator.sleep(host, "admin"))
        for suffix in ("", "-wal", MARKER_SUFFIX, LEASE_SUFFIX):
            if os.path.exists(db + suffix):
                os.unlink(db + suffix)
        for suffix in ("", "-wal", LEASE_SUFFIX):
            if os.path.exists(os.path.join(old, "copy" + suffix)):
                shutil.copy2(os.path.join(old, "copy" + suffix), db + suffix)
        restorer = Restorer(self.raw, inline, self.cfg.box_id, True, self.data, self.clock)

        def taken_back(generation: int) -> HeldLease:
            return HeldLease(
                key=f"{host}/lock.json",
                host=host,
                owner=self.cfg.box_id,
                generation=generation,
                ttl=TTL,
                lease_id="again",
                etag="e",
                acquired_at=datetime.datetime.now(datetime.UTC),
                bucket_time=datetime.datetime.now(datetime.UTC),
                written_at=0.0,
                took_over_from=self.cfg.box_id,
                took_over_because="own",
            )

        self.successResultOf(
            Deferred.fromCoroutine(restorer.prepare(host, db, host, taken_back(40)))
        )
        self.assertEqual(messages(db), ["ours", "theirs"])  # the bucket's, not the old copy
        write_lease_generation(db, 40)  # (the wake records it once its space is ready)
        # The copy now is that of generation 40: taken back from it, it is trusted as is.
        conn = sqlite3.connect(db)
        conn.execute("INSERT INTO messages (body) VALUES ('not shipped yet')")
        conn.commit()
        conn.close()
        self.successResultOf(
            Deferred.fromCoroutine(restorer.prepare(host, db, host, taken_back(41)))
        )
        self.assertEqual(messages(db), ["ours", "theirs", "not shipped yet"])


class HomeBucketTests(_Machine):
    """A space homed in a region whose replicas live in another bucket (``LCHAT_REGION_BUCKETS``
    ``fi``, a ``file:`` bucket of its own) wakes from that bucket and sleeps into it, its lease
    there: never this box's own copy (the regional failover's lifecycle, docs/mesh.md)."""

    def more_settings(self) -> dict[str, str]:
        self.fi_dir = os.path.join(self.dir, "fi-bucket")
        os.makedirs(self.fi_dir)
        return {"LCHAT_REGION_BUCKETS": f"fi=file:{self.fi_dir}"}

    def region_buckets(self) -> RegionBuckets | None:
        self.opened: list[str] = []
        self.open_error: Exception | None = None

        async def opener(reactor: Any, cfg: Any, where: Any, what: str) -> FileStore:
            self.opened.append(what)
            if self.open_error is not None:
                raise self.open_error
            return FileStore(self.clock, where.directory, run_in_thread=inline)

        return RegionBuckets(self.clock, self.cfg, opener)  # type: ignore[arg-type]

    def fi_keys(self, host: str) -> list[str]:
        return [i.key for i in self.fi.bucket.list(f"{host}/")]

    def fi_restored(self, host: str) -> list[str]:
        out = os.path.join(self.dir, f"{host}.fi-restored")
        self.successResultOf(
            Deferred.fromCoroutine(restore(self.fi, host, out, run_in_thread=inline))
        )
        return messages(out)

    def forget_local(self, host: str) -> None:
        for name in os.listdir(self.data):
            if name.startswith(f"{host}.db"):
                os.unlink(os.path.join(self.data, name))

    def setUp(self) -> None:
        super().setUp()
        self.fi = FileStore(self.clock, self.fi_dir, run_in_thread=inline)

    def test_a_space_homed_in_another_buckets_region_lives_in_that_bucket_only(self) -> None:
        host = "h.example"
        # An older copy in this box's own bucket (the space lived here once).
        self.add_space(host)
        self.awake(host).write("stale")
        self.successResultOf(self.activator.sleep(host, "admin"))
        self.forget_local(host)
        ours = sorted(i.key for i in self.raw.bucket.list(f"{host}/"))

        self.update_row(host, home_region="fi")
        child = self.awake(host)
        self.assertEqual(messages(child.db_path), [])  # fi's (empty), never our older copy
        record = LeaseRecord.parse(self.fi.bucket.get(f"{host}/lock.json").body)
        self.assertEqual(record.owner, self.cfg.box_id)
        self.assertIsNone(self.lock_owner(host))
        self.assertEqual(self.activator.status()[host]["bucket_region"], "fi")
        child.write("in fi")
        # Its route says "here" meanwhile: it sleeps into the bucket it woke from all the same.
        self.update_row(host, home_region="")
        self.successResultOf(self.activator.sleep(host, "admin"))
        self.assertNotIn(f"{host}/lock.json", self.fi_keys(host))  # released there
        self.assertEqual(self.fi_restored(host), ["in fi"])
        self.assertEqual(sorted(i.key for i in self.raw.bucket.list(f"{host}/")), ours)
        self.assertEqual(self.restored(host), ["stale"])
        self.assertEqual(self.opened, ["region fi"])  # opened once, kept

        # Homed in fi again, on another box (no local copy): fi's newest, every write.
        self.update_row(host, home_region="fi")
        self.forget_local(host)
        child = self.awake(host)
        self.assertEqual(messages(child.db_path), ["in fi"])
        self.assertEqual(self.opened, ["region fi"])

    def test_a_home_bucket_that_cannot_be_opened_is_a_503_and_our_copy_stays_asleep(
        self,
    ) -> None:
        route = self.add_space("h.example", home_region="fi")
        self.open_error = config.ConfigError("region fi's keys are in FI_KEY, which is unset")
        self.refused(self.activator.route(route), "bucket")
        self.assertEqual(self.activator.state("h.example"), "asleep")
        self.assertEqual(self.raw.bucket.list("h.example/"), [])
        self.assertEqual(self.fi_keys("h.example"), [])
        # Not remembered: the next wake (after the backoff) opens it again, and wakes.
        self.open_error = None
        self.advance(60.0)
        self.awake("h.example")
        self.assertEqual(self.opened, ["region fi", "region fi"])
        self.assertIn("h.example/lock.json", self.fi_keys("h.example"))


def _move(src: str, dst: str, suffixes: tuple[str, ...]) -> None:
    for suffix in suffixes:
        if os.path.exists(src + suffix):
            os.rename(src + suffix, dst + suffix)


# -- the drain ---------------------------------------------------------------------------------------


class DrainTests(_Machine):
    def test_the_drain_sleeps_every_awake_space_in_parallel(self) -> None:
        names = [f"d{i}.example" for i in range(5)]
        children = []
        for host in names:
            self.add_space(host)
            child = self.awake(host)
            child.write(host)
            child.stop_delay = 4.0
            children.append(child)
        shutdown = metric("lchat_sleeps_total", reason="shutdown")
        d = self.activator.stopService()
        for child in children:
            self.assertEqual(child.terminations, [(EPOCH, Budgets().stop)])  # all at once
        self.advance(3.75)
        self.assertFalse(d.called)
        self.advance(0.25)
        self.successResultOf(d)
        self.assertEqual(metric("lchat_sleeps_total", reason="shutdown"), shutdown + 5)
        for host in names:
            self.assertEqual(self.activator.state(host), "asleep")
            self.assertIsNone(self.lock_owner(host), host)
            self.assertTrue(self.has_marker(host), host)

    def test_once_draining_requests_get_503_shutdown_marked_as_refused_while_stopping(
        self,
    ) -> None:
        awake = self.add_space("up.example")
        asleep = self.add_space("down.example")
        self.awake("up.example").stop_delay = 4.0
        d = self.activator.stopService()
        for route in (asleep, awake):
            answer = self.refused(self.activator.route(route), "shutdown")
            self.assertEqual(answer.refusal, "stopping")
            self.assertIn(b"the router is stopping", answer.body)
        self.assertEqual(self.spawner.of("down.example"), [])
        self.advance(4.0)
        self.successResultOf(d)
        self.assertEqual(self.spawner.of("down.example"), [])
        self.assertEqual(len(self.spawner.of("up.example")), 1)

    def test_the_drain_calls_off_a_wake_under_way(self) -> None:
        route = self.add_space("w.example")
        self.spawner.ready = False
        d = self.activator.route(route)
        drained = self.activator.stopService()
        self.successResultOf(drained)
        answer = self.refused(d, "cancelled")
        self.assertEqual(answer.refusal, "stopping")
        self.assertIsNone(self.lock_owner("w.example"))

    def test_no_wake_starts_once_the_drain_began(self) -> None:
        route = self.add_space("admin.example")
        self.successResultOf(self.activator.stopService())
        d = self.activator.wake(route, "admin")  # POST /wake, or a due sweep still running
        self.assertEqual(self.spawner.of("admin.example"), [])
        self.assertEqual(self.wake_failure(d).reason, "shutdown")

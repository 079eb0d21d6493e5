"""The hibernation sweeps (lchat/hibernation/sweeper.py) on a fake clock.

The idle sweep sleeps what the activator reports idle, every ``sweep`` seconds; the due sweep wakes
a sleeping space whose ``next_due`` has passed, at start and every ``due_sweep`` seconds, once per
due time, only where ``may_wake`` says (the mesh owner), and never once stopped. The clock is a
``task.Clock`` set to a unix time (``next_due`` is unix seconds, as the reactor's clock is); the
times below are seconds since the sweeper started.

The route table is real (a registry in a temp dir behind a RouteSource whose SQLite work runs
inline); ``next_due`` changes go through ``RouteSource.record_next_due`` as the activator's do.
The activator is reduced to what the sweeper calls (:class:`Spaces`), and keeps to the real one's
contract: ``idle_hosts`` lists only awake spaces idle for the window, ``state`` is "asleep" for
anything it does not hold, a due wake that succeeds clears the due time it honoured.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from lchat.hibernation import sweeper as sweeper_module
from lchat.hibernation.sweeper import Sweeper
from lchat.mesh.routing import MeshRouter
from lchat.objstore.file import FileStore
from lchat.registry import Registry, Route
from lchat.routesource import RouteSource
from tests.test_mesh_routing import DOMAIN, SELF, B, Peer, Running, View, box_config, host_owned_by

EPOCH = 1_800_000_000  # unix seconds when the sweeper starts (the tests' time 0)
IDLE, SWEEP, DUE_SWEEP = 60.0, 5.0, 30.0


def _inline(work: Any) -> Deferred[Any]:
    """SQLite and disk work inline: with a fake clock there is no reactor thread to hop back to."""
    return maybeDeferred(work)


class Spaces:
    """The activator as the sweeper uses it: ``idle_hosts``, ``sleep``, ``state``, ``wake``.

    Sleeps and wakes stay under way until the test ends them (:meth:`finish`); a due wake that
    succeeds clears the due time it honoured, as the activator does (``record_next_due`` with
    ``only_if``). ``broken`` hosts make ``sleep``/``wake`` raise (a bug, say); ``refusing`` ones
    fail their wake (WakeFailed, as a backoff or a held lease does).
    """

    def __init__(self, clock: Clock, routes: RouteSource) -> None:
        self._clock = clock
        self.routes = routes
        self.states: dict[str, str] = {}  # host -> awake / waking / stopping (absent: asleep)
        self.last_active: dict[str, float] = {}
        self.under_way: dict[str, tuple[Deferred[None], int]] = {}  # host -> (task, due woken)
        self.sleeps: list[tuple[float, str, str]] = []  # (clock, host, reason)
        self.wakes: list[tuple[float, str, str]] = []
        self.idle_asked: list[tuple[float, float]] = []  # (clock, idle window)
        self.broken: set[str] = set()
        self.refusing: set[str] = set()

    def awake(self, host: str, last_active: float) -> None:
        self.states[host] = "awake"
        self.last_active[host] = last_active

    def state(self, host: str) -> str:
        return self.states.get(host, "asleep")

    def now(self) -> float:
        """Seconds since the test's time 0."""
        return self._clock.seconds() - EPOCH

    def idle_hosts(self, idle: float) -> list[str]:
        now = self.now()
        self.idle_asked.append((now, idle))
        return [
            h for h, s in self.states.items() if s == "awake" and now - self.last_active[h] >= idle
        ]

    def sleep(self, host: str, reason: str) -> Deferred[None]:
        self.sleeps.append((self.now(), host, reason))
        if host in self.broken:
            raise RuntimeError(f"{host}: sleep blew up")
        if self.state(host) != "awake":
            return succeed(None)
        self.states[host] = "stopping"
        task: Deferred[None] = Deferred()
        self.under_way[host] = (task, 0)
        return task

    def wake(self, route: Route, reason: str) -> Deferred[None]:
        host = route.host
        self.wakes.append((self.now(), host, reason))
        if host in self.broken:
            raise RuntimeError(f"{host}: wake blew up")
        if host in self.refusing:
            return fail(sweeper_module.WakeFailed(host, "backoff", "a recent wake failed", 5.0))
        self.states[host] = "waking"
        task: Deferred[None] = Deferred()
        self.under_way[host] = (task, route.next_due if reason == "due" else 0)
        return task

    def finish(self, host: str) -> None:
        """The sleep or wake under way for ``host`` is done."""
        task, due_woken = self.under_way.pop(host)
        if self.states[host] == "stopping":
            del self.states[host]
        else:
            self.awake(host, self.now())
            if due_woken:
                self.routes.record_next_due(host, 0, only_if=due_woken)
        task.callback(None)


def due_wakes(outcome: str) -> float:
    return REGISTRY.get_sample_value("lchat_due_wakes_total", {"outcome": outcome}) or 0.0


class _Base(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.clock = Clock()
        self.clock.advance(EPOCH)
        self.registry = Registry(os.path.join(self.dir, "registry.db"), clock=self.clock.seconds)
        self.registry.migrate()
        self.routes = RouteSource(
            self.clock, self.registry, self.registry.load(), run_in_thread=_inline
        )
        self.spaces = Spaces(self.clock, self.routes)

    def sweeper(self, **kw: Any) -> Sweeper:
        activator: Any = self.spaces  # the sweeper's annotation names the real Activator
        sweeper = Sweeper(
            self.clock,
            activator,
            self.routes,
            idle=IDLE,
            sweep=SWEEP,
            due_sweep=DUE_SWEEP,
            **kw,
        )
        sweeper.startService()
        self.addCleanup(lambda: sweeper.stopService() if sweeper.running else None)
        return sweeper

    def register(self, host: str, next_due: int = 0, **kw: Any) -> None:
        self.registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=f"/run/{host}.sock",
                status="ready",
                next_due=next_due,
                **kw,
            )
        )
        self.successResultOf(self.routes.reload("test"))

    def record_next_due(self, host: str, due: int) -> None:
        """The space reports its next due time as it goes to sleep (the activator records it)."""
        self.assertTrue(self.successResultOf(self.routes.record_next_due(host, due)))

    def advance_to(self, seconds: float) -> None:
        """Move the clock to ``seconds`` after the test's time 0, stopping at every timer due on
        the way (each runs at its own time, as a real reactor would run it)."""
        target = EPOCH + seconds
        while True:
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= target]
            if not due:
                break
            self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
        self.clock.advance(max(0.0, target - self.clock.seconds()))

    def woken(self) -> list[tuple[float, str]]:
        return [(at, host) for at, host, reason in self.spaces.wakes if reason == "due"]


class IdleSweepTests(_Base):
    def test_the_idle_sweep_runs_every_sweep_seconds_from_one_period_after_start(self) -> None:
        self.spaces.awake("idle.example", last_active=-IDLE)
        self.sweeper()
        self.advance_to(SWEEP - 0.1)
        self.assertEqual((self.spaces.idle_asked, self.spaces.sleeps), ([], []))
        self.advance_to(3 * SWEEP)
        self.assertEqual(
            self.spaces.idle_asked, [(SWEEP, IDLE), (2 * SWEEP, IDLE), (3 * SWEEP, IDLE)]
        )
        self.assertEqual(self.spaces.sleeps, [(SWEEP, "idle.example", "idle")])

    def test_an_idle_space_is_put_to_sleep_once_while_its_sleep_runs(self) -> None:
        self.spaces.awake("a.example", last_active=0.0)  # idle from t=60
        self.spaces.awake("busy.example", last_active=0.0)
        sweeper = self.sweeper()
        self.advance_to(IDLE - 1)
        self.spaces.last_active["busy.example"] = IDLE - 1  # a request came in
        self.advance_to(IDLE)
        self.assertEqual(self.spaces.sleeps, [(IDLE, "a.example", "idle")])
        # The sleep takes a while (final flush, release): the sweeps meanwhile leave it alone.
        self.advance_to(IDLE + 10 * SWEEP)
        self.assertEqual([host for _, host, _ in self.spaces.sleeps], ["a.example"])
        self.spaces.finish("a.example")
        self.advance_to(IDLE + 20 * SWEEP)
        self.assertEqual(
            [(at, host) for at, host, _ in self.spaces.sleeps],
            [(IDLE, "a.example"), (2 * IDLE, "busy.example")],  # idle from 119: the tick at 120
        )
        self.assertEqual(sweeper.sweep_idle(), [])  # nothing left awake

    def test_a_sleep_that_raises_for_one_space_does_not_stop_the_sweep(self) -> None:
        self.addCleanup(self.flushLoggedErrors, RuntimeError)  # the sweep logs what it caught
        self.spaces.awake("broken.example", last_active=-IDLE)
        self.spaces.awake("fine.example", last_active=-IDLE)
        self.spaces.broken.add("broken.example")
        self.sweeper()
        self.advance_to(SWEEP)
        self.assertIn((SWEEP, "fine.example", "idle"), self.spaces.sleeps)
        self.spaces.awake("later.example", last_active=SWEEP - IDLE)
        self.advance_to(2 * SWEEP)
        self.assertIn((2 * SWEEP, "later.example", "idle"), self.spaces.sleeps)


class DueSweepTests(_Base):
    def test_the_due_sweep_runs_at_start_then_every_due_sweep(self) -> None:
        self.register("overdue.example", next_due=EPOCH - 100, hibernate=True)  # passed while down
        self.register("soon.example", next_due=EPOCH + 45, hibernate=True)
        self.sweeper()
        self.assertEqual(self.woken(), [(0.0, "overdue.example")])
        self.advance_to(DUE_SWEEP)
        self.assertEqual(self.woken(), [(0.0, "overdue.example")])  # not due at 30 yet
        self.advance_to(2 * DUE_SWEEP)
        self.assertEqual(self.woken(), [(0.0, "overdue.example"), (60.0, "soon.example")])

    def test_a_due_wake_is_honoured_once_not_in_a_loop(self) -> None:
        host = "due.example"
        self.register(host, next_due=EPOCH - 10, hibernate=True)
        ok = due_wakes("ok")
        self.sweeper()
        self.assertEqual(self.woken(), [(0.0, host)])
        self.advance_to(3 * DUE_SWEEP)  # the wake is slow: the ticks meanwhile leave it alone
        self.assertEqual(len(self.woken()), 1)
        self.spaces.finish(host)  # awake; the honoured due time is cleared
        self.assertEqual(due_wakes("ok"), ok + 1)
        self.assertEqual(self.routes.table.get(host).next_due, 0)  # type: ignore[union-attr]
        self.advance_to(4 * DUE_SWEEP)
        self.spaces.sleep(host, "idle")
        self.spaces.finish(host)  # asleep again, with nothing due
        self.advance_to(10 * DUE_SWEEP)
        self.assertEqual(len(self.woken()), 1)
        # It reported its next due time as it slept: that one is honoured, once, on time.
        self.record_next_due(host, EPOCH + 400)
        self.advance_to(13 * DUE_SWEEP)
        self.assertEqual(len(self.woken()), 1)
        self.advance_to(14 * DUE_SWEEP)
        self.assertEqual(self.woken(), [(0.0, host), (420.0, host)])
        self.spaces.finish(host)
        self.advance_to(20 * DUE_SWEEP)
        self.assertEqual(len(self.woken()), 2)

    def test_a_due_time_moved_before_it_fires_is_the_one_honoured(self) -> None:
        host = "moved.example"
        self.register(host, next_due=EPOCH + 100, hibernate=True)
        self.sweeper()
        self.record_next_due(host, EPOCH + 200)
        self.advance_to(7 * DUE_SWEEP)
        self.assertEqual(self.woken(), [(210.0, host)])

    def test_only_sleeping_hibernating_instances_are_due_woken(self) -> None:
        self.register("off.example", next_due=EPOCH - 10)  # hibernate off: always running
        self.register("awake.example", next_due=EPOCH - 10, hibernate=True)
        self.register("stopping.example", next_due=EPOCH - 10, hibernate=True)
        self.spaces.awake("awake.example", last_active=0.0)
        self.spaces.states["stopping.example"] = "stopping"
        self.sweeper()
        self.advance_to(2 * DUE_SWEEP)
        self.assertEqual(self.woken(), [])

    def test_a_failed_due_wake_is_retried_on_the_next_tick(self) -> None:
        self.register("refused.example", next_due=EPOCH - 10, hibernate=True)
        self.register("fine.example", next_due=EPOCH - 10, hibernate=True)
        self.spaces.refusing.add("refused.example")
        failed, ok = due_wakes("failed"), due_wakes("ok")
        self.sweeper()
        # One host's failure does not keep the other from waking in the same sweep.
        self.assertEqual(sorted(self.woken()), [(0.0, "fine.example"), (0.0, "refused.example")])
        self.assertEqual(due_wakes("failed"), failed + 1)
        self.spaces.refusing.clear()
        self.advance_to(DUE_SWEEP)
        self.assertEqual(self.woken()[-1], (DUE_SWEEP, "refused.example"))
        self.assertEqual(len(self.woken()), 3)
        self.spaces.finish("refused.example")
        self.spaces.finish("fine.example")
        self.assertEqual((due_wakes("failed"), due_wakes("ok")), (failed + 1, ok + 2))

    def test_a_wake_that_raises_for_one_space_does_not_stop_the_sweep(self) -> None:
        self.addCleanup(self.flushLoggedErrors, RuntimeError)  # the sweep logs what it caught
        self.register("broken.example", next_due=EPOCH - 10, hibernate=True)
        self.register("fine.example", next_due=EPOCH - 10, hibernate=True)
        self.spaces.broken.add("broken.example")  # sorts first: woken first
        self.sweeper()
        self.assertIn((0.0, "fine.example"), self.woken())
        self.register("later.example", next_due=EPOCH + 10, hibernate=True)
        self.advance_to(DUE_SWEEP)
        self.assertIn((DUE_SWEEP, "later.example"), self.woken())

    def test_no_sweep_runs_once_stopped(self) -> None:
        """The drain stops the sweeps first: no due wake and no idle sleep races it."""
        self.register("due.example", next_due=EPOCH + 10, hibernate=True)
        self.spaces.awake("idle.example", last_active=0.0)
        sweeper = self.sweeper()
        sweeper.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.advance_to(10 * DUE_SWEEP)
        self.assertEqual(self.woken(), [])
        self.assertEqual(self.spaces.sleeps, [])
        self.assertEqual([at for at, _ in self.spaces.idle_asked], [])


class MeshDueSweepTests(_Base):
    """With the mesh, a due wake fires only on the space's owner (MeshRouter.is_owner)."""

    def test_only_the_owner_wakes_a_due_space(self) -> None:
        cfg = box_config(self.dir)
        os.makedirs(os.path.join(self.dir, "bucket"))
        view = View(Peer(SELF), Peer(B, age=40.0))
        mesh = MeshRouter(
            cfg,
            FileStore(self.clock, os.path.join(self.dir, "bucket"), run_in_thread=_inline),
            view,
            Running(),
            reactor=self.clock,
        )
        theirs, mine = host_owned_by(B, SELF, B), host_owned_by(SELF, SELF, B)
        for host in (theirs, mine, "elsewhere.example"):  # the last is out of the mesh's scope
            self.register(host, next_due=EPOCH - 10, hibernate=True)
        self.sweeper(may_wake=mesh.is_owner)
        self.advance_to(2 * DUE_SWEEP)
        self.assertEqual(sorted(self.woken()), sorted([(0.0, mine), (0.0, "elsewhere.example")]))
        self.assertTrue(theirs.endswith("." + DOMAIN))
        view.read(Peer(SELF))  # B's heartbeat aged out: this box owns everything now
        self.advance_to(3 * DUE_SWEEP)
        self.assertEqual(self.woken()[-1], (3 * DUE_SWEEP, theirs))
        self.assertEqual(len(self.woken()), 3)

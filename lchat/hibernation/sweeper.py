"""The two background sweeps of hibernation (docs/design.md §7).

- The idle sweep (``LCHAT_HIBERNATE_SWEEP``, every few seconds) sleeps each awake space with no
  request in flight for the whole idle window. It looks only at awake spaces: O(awake) per tick.
- The due sweep (``LCHAT_DUE_SWEEP``, 30 s) wakes each sleeping space whose ``next_due`` (stored in
  the registry at sleep, so it survives restarts) has passed. It keeps the due rows sorted, rebuilt
  only when the route table changes, so a tick costs O(due), not O(registered). A successful due
  wake clears ``next_due``; the space reports its next one when it sleeps again, so a due time in
  the past is honoured once, not in a loop. A failed due wake is retried on the next tick.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from prometheus_client import Counter
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.hibernation.activator import Activator
from lchat.hibernation.space import WakeFailed
from lchat.registry import Route, RouteTable
from lchat.routesource import RouteSource

_log = Logger(namespace="lchat.sweeper")

_due_wakes = Counter("lchat_due_wakes_total", "Due wakes started by the due sweep", ["outcome"])


class Sweeper(Service):
    name = "sweeper"

    def __init__(
        self,
        reactor: IReactorTime,
        activator: Activator,
        routes: RouteSource,
        *,
        idle: float,
        sweep: float = 5.0,
        due_sweep: float = 30.0,
        may_wake: Callable[[Route], bool] = lambda route: True,  # the mesh: only the owner
    ) -> None:
        self._reactor = reactor
        self._activator = activator
        self._routes = routes
        self.idle = idle
        self._may_wake = may_wake
        self._idle_loop = LoopingCall(self.sweep_idle)
        self._idle_loop.clock = reactor
        self._due_loop = LoopingCall(self.sweep_due)
        self._due_loop.clock = reactor
        self._sweep = sweep
        self._due_sweep = due_sweep
        self._due: list[tuple[int, str]] = []
        self._index(routes.table)
        routes.subscribe(lambda old, new: self._index(new))

    def startService(self) -> None:
        super().startService()
        self._idle_loop.start(self._sweep, now=False).addErrback(self._loop_failed, "idle")
        # At start too: a due time that passed while the router was down fires now.
        self._due_loop.start(self._due_sweep, now=True).addErrback(self._loop_failed, "due")

    def stopService(self) -> None:
        super().stopService()
        for loop in (self._idle_loop, self._due_loop):
            if loop.running:
                loop.stop()

    def _loop_failed(self, failure: Failure, which: str) -> None:
        _log.failure("the {which} sweep stopped", failure, which=which)

    def _index(self, table: RouteTable) -> None:
        self._due = sorted((r.next_due, r.host) for r in table if r.hibernating and r.next_due > 0)

    def sweep_idle(self) -> list[str]:
        """Put to sleep every space idle for the whole window; returns their names. One space
        that fails does not stop the others, nor the next sweep."""
        sleeping = []
        for host in self._activator.idle_hosts(self.idle):
            try:
                self._activator.sleep(host, "idle")
            except Exception:
                _log.failure("activator: {host} could not be put to sleep", host=host)
                continue
            sleeping.append(host)
        return sleeping

    def sweep_due(self) -> list[str]:
        """Wake every sleeping space whose due time has passed; returns their names."""
        now = self._reactor.seconds()  # next_due is unix time, as the reactor's clock is
        end = bisect.bisect_right(self._due, (int(now), "\uffff"))
        woken = []
        table = self._routes.table
        for due, host in self._due[:end]:
            route = table.get(host)
            try:
                if (
                    route is None
                    or route.next_due != due
                    or self._activator.state(host) != "asleep"
                    or not self._may_wake(route)
                ):
                    continue
                _log.info(
                    "activator: {host} due wake (due {late:.0f}s ago)",
                    host=host,
                    late=now - due,
                    due=due,
                )
                d = self._activator.wake(route, "due")
            except Exception:
                # One space (a host placement cannot judge, an activator bug) must not stop
                # the others' due wakes, nor the sweep itself.
                _due_wakes.labels("failed").inc()
                _log.failure("activator: {host} due wake could not start", host=host)
                continue
            d.addCallbacks(
                lambda _: _due_wakes.labels("ok").inc(), self._due_failed, errbackArgs=(host,)
            )
            woken.append(host)
        return woken

    def _due_failed(self, failure: Failure, host: str) -> None:
        _due_wakes.labels("failed").inc()
        why = failure.value.message if isinstance(failure.value, WakeFailed) else failure.value
        _log.warn(
            "activator: {host} due wake failed ({why}); next sweep retries", host=host, why=why
        )

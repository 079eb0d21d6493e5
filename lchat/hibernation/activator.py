"""The activator: hibernating spaces sleep in the bucket and wake on the next request (docs/design.md §7).

It exists only when ``LCHAT_HIBERNATE_BUCKET`` is set, and manages only rows flagged ``hibernate``.
Per host: ``asleep`` (no :class:`~lchat.hibernation.space.Space`) -> ``waking`` -> ``awake`` ->
``stopping`` -> ``asleep``. This module is the state machine; the steps of a wake and a stand-down
are :class:`~lchat.hibernation.lifecycle.Lifecycle`'s.

Invariants:

- One wake per host at a time: every request arriving meanwhile joins it (coalescing), and waits at
  most ``Budgets.queue`` for it (then 503 ``queue_timeout``; the wake goes on).
- A failed wake stands down what it started and forgets the entry, so the next request starts
  clean, but not sooner than its backoff (1 s, doubling to 60 s); a lease held elsewhere is
  answered from memory for 0.25 s instead of asking the bucket again per request.
- A request that arrives while its space is stopping waits, and wakes it again once stopped.
- Every request routed to an awake space holds the space's in-flight ticket until it ends: the
  idle sweep never sleeps a space with anything in flight, and a graceful sleep waits for them.
- Once stopping (the router's drain), no wake starts: requests get 503 ``shutdown``, marked for a
  mesh peer that forwarded them (lchat.router.unavailable).
- The states move only as :data:`~lchat.hibernation.space.TRANSITIONS` says (:meth:`Space.move`).
- Capacity (memory, ``LCHAT_MAX_AWAKE``) and the operator's holds: lchat.hibernation.capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.backoff import Backoff
from lchat.child import RunningChild
from lchat.deferutil import fire, relay, settled
from lchat.hibernation.capacity import Capacity, Holds, Memory
from lchat.hibernation.floor import BEHIND_RECHECK
from lchat.hibernation.lifecycle import LEASE_CONFLICTS, Lifecycle
from lchat.hibernation.moved import MovedCheck
from lchat.hibernation.outage import OutageWrites, WriteWitness, stale
from lchat.hibernation.recovery import LocalCopies
from lchat.hibernation.space import STATES, Budgets, Space, WakeFailed
from lchat.lease import BOX_NOT_ALIVE
from lchat.registry import Route, RouteTable
from lchat.router import Header, LocalResponse, LocalSocket, Target, unavailable
from lchat.routesource import RouteSource
from lchat.units import Claims

_log = Logger(namespace="lchat.activator")

_wake_seconds = Histogram(
    "lchat_wake_seconds",
    "Wake latency by phase (total = lease + floor + restore + spawn + ready + replicate, + capacity: "
    "waiting for room: a victim's sleep, at the memory limit or LCHAT_MAX_AWAKE)",
    ["phase"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
_wakes = Counter("lchat_wakes_total", "Wakes by reason and outcome", ["reason", "outcome"])
_sleeps = Counter("lchat_sleeps_total", "Sleeps by reason", ["reason"])
_coalesced = Counter("lchat_wake_coalesced_total", "Requests that joined a wake already under way")
_awake = Gauge(
    "lchat_awake_spaces", "Hibernating spaces awake (or waking, or stopping) by state", ["state"]
)

# After a failed wake, the next attempt waits 1 s, 2 s, 4 s ... up to 60 s: a broken space must
# not cost a lease write, a LIST and an upload on every request.
WAKE_BACKOFF = Backoff(1.0, 60.0)
LEASE_HELD_CACHE = 0.25  # seconds a "held elsewhere" answer is reused without asking the bucket
# Refusals answered again from memory for a moment instead of the wake backoff (they are not the
# space's failure), and how long: a lease held elsewhere, a build missing on this box.
REMEMBERED = {"lease_held": LEASE_HELD_CACHE, "build_behind": BEHIND_RECHECK}
BUCKET_RETRY = 5.0  # a wake refused because the bucket is out of reach: Retry-After


class Activator(Service):
    """Wakes, tracks and sleeps hibernating spaces; the router's branch for them (:meth:`route`)."""

    name = "activator"

    def __init__(
        self,
        reactor: IReactorTime,
        routes: RouteSource,
        lifecycle: Lifecycle,
        claims: Claims,
        *,
        resident: Callable[[], int] | None = None,
        max_instances: int = 0,
        max_awake: int = 0,
        memory: Memory | None = None,
        lapsed: Callable[[], bool] | None = None,
        witness: WriteWitness | None = None,
        bucket_reachable: Callable[[], bool] | None = None,
    ) -> None:
        """``resident``: how many always-on space processes run on this box now (builtin units'
        children), shown against ``max_instances`` (LCHAT_MAX_INSTANCES, the always-on cap that
        add-instance enforces); neither blocks a wake, and always-on spaces are never slept.
        ``memory``: admits a wake by the box's memory; ``max_awake`` (LCHAT_MAX_AWAKE; 0: none)
        caps the hibernating spaces awake (lchat.hibernation.capacity). ``lapsed``: on a mesh box, whether its liveness has lapsed (neither its
        heartbeat nor its peers' word covers it: lchat.mesh.membership): no request is served
        meanwhile (docs/lease.md). ``witness``: on a mesh box, asked before a write is passed to
        a space whose backlog is older than its replication class promises.
        ``bucket_reachable``: whether the bucket answered this box's last heartbeat (a wake needs
        it: refused at once while not)."""
        self._reactor = reactor
        self._lapsed = lapsed
        self._outage = OutageWrites(reactor, witness, self._unavailable)
        self._bucket_reachable = bucket_reachable
        # Local copies that may hold writes the bucket lacks (lchat.hibernation.recovery).
        self.copies = LocalCopies(
            routes,
            lifecycle.run_in_thread,
            lifecycle.cfg.data_dir,
            lifecycle.cfg.box_id,
            lifecycle.lease_owner,
        )
        self._routes = routes
        self._life = lifecycle
        self._claims = claims  # the hosts this activator runs: builtin units leave them alone
        self._spaces: dict[str, Space] = {}
        self._failures: dict[str, tuple[int, float]] = {}  # host -> (failed wakes, retry at)
        # host -> (answer from memory until, reason, Retry-After, why): a refusal that is not the
        # space's failure, answered again from memory a moment (REMEMBERED): its lease seen held
        # elsewhere, or its build missing here
        self._held: dict[str, tuple[float, str, float, str]] = {}
        self._holds = Holds(reactor)  # the operator's (lchat relocate)
        self._capacity = Capacity(
            reactor,
            self._spaces,
            self.sleep,
            resident=resident,
            max_instances=max_instances,
            max_awake=max_awake,
            memory=memory,
        )
        self._stopping = False
        routes.subscribe(self._table_changed)

    @property
    def budgets(self) -> Budgets:
        return self._life.budgets

    @budgets.setter
    def budgets(self, budgets: Budgets) -> None:
        self._life.budgets = budgets

    @property
    def moved(self) -> MovedCheck:
        """The wake's check of a relocated copy (its ``on_moved`` is wired by the router)."""
        return self._life.moved

    # -- status ----------------------------------------------------------------------------------

    def holds(self, host: str) -> bool:
        """True while this activator has anything running (or stopping) for ``host``."""
        return host in self._spaces

    def lease_lost(self, host: str) -> bool:
        """True while ``host``'s space stands down here because its lease was lost (taken over,
        or this box's liveness lapsed): its requests belong to the new holder, not to a wake
        here."""
        space = self._spaces.get(host)
        return space is not None and space.lost is not None

    def socket_of(self, host: str) -> str | None:
        """The socket of ``host``'s space while it is awake here (the readiness probe reads its
        version there), else None. Takes no in-flight ticket: the caller's read is not a
        member's request and earns the space no idle credit."""
        space = self._spaces.get(host)
        return space.socket if space is not None and space.state == "awake" else None

    def state(self, host: str) -> str:
        space = self._spaces.get(host)
        return "asleep" if space is None else space.state

    def held_asleep(self) -> dict[str, float]:
        return self._holds.held_asleep()

    def hold(self, host: str, seconds: float, why: str) -> None:
        """No wake of ``host`` on this box for ``seconds`` (at most an hour), whoever asks: a
        request gets 503 ``held`` with a short Retry-After, the due sweep and ``/wake`` fail. An
        awake space is not touched (the caller sleeps it: :meth:`sleep`); requests that queued on
        it while it stops are refused rather than waking it again."""
        self._holds.hold(host, seconds, why)

    def release_hold(self, host: str) -> bool:
        """End ``host``'s hold (the next request wakes it); whether there was one (Holds.release)."""
        return self._holds.release(host)

    def idle_hosts(self, idle: float) -> list[str]:
        """Awake spaces with nothing in flight for ``idle`` seconds (O(awake))."""
        now = self._reactor.seconds()
        return [
            h for h, s in self._spaces.items() if s.state == "awake" and s.idle_for(now) >= idle
        ]

    def slots_held(self) -> int:
        """The slots hibernating spaces hold (lchat.hibernation.capacity)."""
        return self._capacity.slots_held()

    def capacity(self) -> dict[str, int]:
        """The capacity figures for ``GET /status`` (Capacity.status)."""
        return self._capacity.status()

    def measure_memory(self) -> int:
        """Read awake spaces' memory now (Capacity.measure; also done every few seconds)."""
        return self._capacity.measure()

    def status(self) -> dict[str, dict[str, Any]]:
        """Every space this activator holds, as ``GET /status`` shows it."""
        now = self._reactor.seconds()
        out = {host: s.describe(now) for host, s in self._spaces.items()}
        for host, entry in out.items():
            sidecar = self._life.sidecars.status(host)
            if sidecar is not None:
                entry["sidecar"] = sidecar
        return out

    # -- the router's branch ---------------------------------------------------------------------

    def route(
        self, route: Route, sidecar: bool = False, write: bool = False
    ) -> Target | Deferred[Target]:
        """The target for a request to hibernating ``route``: its socket now if awake (with the
        space's in-flight ticket, unless the request is its sidecar's own), after a wake
        otherwise, or a 503 with ``Retry-After``. ``write``: the request may change the space
        (its method is not a safe one): on a mesh box that cannot ship it now, it waits for the
        peers' word, or is refused (lchat.hibernation.outage)."""
        host = route.host
        space = self._spaces.get(host)
        if self._lapsed is not None and self._lapsed():
            # Past this box's liveness deadline (a mesh box cut off from its bucket and its
            # peers, or just thawed from a freeze before its timer ran): nothing is written or
            # woken; a space already awake here answers reads from its copy (read-only).
            self.box_not_alive()
            if space is None or not space.fenced or space.state != "awake":
                return self._unavailable(host, "not_alive")
        if space is not None and space.state == "awake" and space.fenced:
            return self._outage.read_only(space, sidecar, write)
        if space is not None and space.state == "awake":
            if self._outage.must_wait(space, write):
                return self._outage.write_target(space, sidecar, self._awake)
            # Sidecar traffic earns no idle credit: an orphaned bot would keep it awake forever.
            return LocalSocket(host=host, path=space.socket, inflight=None if sidecar else space)
        if sidecar:
            return self._unavailable(host, "sidecar")
        if self._stopping:
            return self._unavailable(host, "shutdown")
        started = self._reactor.seconds()
        d = self.wake(route, "request")
        result: Deferred[Target] = Deferred()
        timer = self._reactor.callLater(self.budgets.queue, d.cancel)

        def done(outcome: object) -> None:
            if timer.active():
                timer.cancel()
            result.callback(self._routed(host, outcome, started))

        d.addBoth(done)
        return result

    def backlog(self) -> bool:
        """Does this box hold writes the bucket lacks beyond what the class promises allow: a
        space here whose oldest unshipped commit is older than its class promises, a read-only
        space (its replication stopped), or a local copy not cleanly slept
        (lchat.hibernation.recovery)? What its beats tell its peers (lchat.mesh.witness)."""
        return bool(self.copies) or any(s.fenced or stale(s) for s in self._spaces.values())

    @property
    def stopping(self) -> bool:
        return self._stopping

    def recover(self) -> Deferred[None]:
        """This box may take leases (again): the spaces it kept read-only while cut off stand
        down, then the local copies that may hold writes the bucket lacks are shipped (a wake
        here from each: lchat.hibernation.recovery). Never fails."""
        return Deferred.fromCoroutine(self._recover())

    async def _recover(self) -> None:
        fenced = [s for s in self._spaces.values() if s.fenced and s.state == "awake"]
        for space in fenced:
            _log.info(
                "activator: {host}: this box is alive again: the read-only copy stands down "
                "(it is shipped from here, or was taken over meanwhile)",
                host=space.host,
            )
            self._stand_down_now(space, "fenced")
        waits = [settled(s.task) for s in fenced if s.task is not None]
        if waits:
            await DeferredList(waits, consumeErrors=True)
        await self.copies.recover(self)

    def awake_hosts(self) -> list[str]:
        """The hosts awake here (a routing hint for the peers)."""
        return [h for h, s in self._spaces.items() if s.state == "awake"]

    def _routed(self, host: str, outcome: object, started: float) -> Target:
        if isinstance(outcome, Failure):
            if outcome.check(CancelledError):
                return self._unavailable(host, "queue_timeout")
            if isinstance(outcome.value, WakeFailed):
                return self._unavailable(host, outcome.value.reason, outcome.value.retry_after)
            _log.failure("wake of {host} failed", outcome, host=host)
            return self._unavailable(host, "error")
        space = self._spaces.get(host)
        if space is None or space.state != "awake":
            return self._unavailable(host, "stood_down")
        waited: Header = (b"x-lchat-wake", f"{self._reactor.seconds() - started:.3f}s".encode())
        return LocalSocket(host=host, path=space.socket, response_headers=(waited,), inflight=space)

    def _unavailable(self, host: str, reason: str, retry_after: float = 0.0) -> LocalResponse:
        return unavailable(host, reason, retry_after, stopping=self._stopping)

    # -- waking ----------------------------------------------------------------------------------

    def wake(self, route: Route, reason: str) -> Deferred[None]:
        """Fires once ``route``'s space is awake (at once if it is), or fails with
        :class:`WakeFailed`. Cancelling the returned Deferred stops waiting, not the wake."""
        host = route.host
        space = self._spaces.get(host)
        if space is not None and space.state == "awake":
            return succeed(None)
        now = self._reactor.seconds()
        if space is None and self._stopping:
            # (route() refuses first; this is for the other callers: /wake, the due sweep.)
            return fail(WakeFailed(host, "shutdown", "the router is stopping"))
        # Checked before the capacity and lease paths: a held space costs no bucket call.
        held = self._holds.refusal(host) if space is None else None
        if held is not None:
            return fail(held)
        if space is None and host in self._failures:
            left = self._failures[host][1] - now
            if left > 0:
                return fail(WakeFailed(host, "backoff", "a recent wake failed", left))
        if space is None and self._bucket_reachable is not None and not self._bucket_reachable():
            # A wake needs the bucket (the lease, at least): while this box's heartbeat cannot
            # land, refuse at once rather than after the store's timeouts.
            return fail(
                WakeFailed(
                    host, "bucket", "the bucket is out of reach (no heartbeat lands)", BUCKET_RETRY
                )
            )
        if space is None and host in self._held:
            # Held elsewhere (or its build missing here) a moment ago: answer from that, not
            # with another PUT and GET of the lock or read of the build record (a busy space
            # on a dead box would otherwise cost two requests per request).
            until, refusal, retry_after, why = self._held[host]
            if now < until:
                if refusal == "lease_held":
                    LEASE_CONFLICTS.inc()
                return fail(WakeFailed(host, refusal, why, retry_after))
            del self._held[host]
        victim = None
        short = self._capacity.short() if space is None else None
        if short is not None:
            victim = self._capacity.victim()
            if victim is None:
                _wakes.labels(reason, "capacity").inc()
                return fail(self._capacity.refusal(host, short))
        waiter: Deferred[None] = Deferred(lambda d: self._drop_waiter(host, d))
        if space is None:
            space = self._life.new_space(host, route, reason)
            self._spaces[host] = space
            self._claims.claim(host)
            freed = None
            if victim is not None:
                assert short is not None
                freed = self._capacity.hand_on(victim, space, short)
            self._update_gauge()
            space.waiters.append(waiter)
            steps = self._life.wake(
                space,
                self._claims,
                on_lost=lambda why: self._lease_lost(space, why),
                on_exit=lambda child, info: self._child_ended(space, child, info),
            )
            space.task = Deferred.fromCoroutine(
                steps if freed is None else self._capacity.when_freed(freed, space, steps)
            )
            space.task.addTimeout(self.budgets.wake, self._reactor)
            space.task.addBoth(self._wake_done, space)
        else:
            _coalesced.inc()
            space.waiters.append(waiter)
            if space.state == "stopping":
                space.wake_again = True
        return waiter

    def _drop_waiter(self, host: str, d: Deferred[None]) -> None:
        space = self._spaces.get(host)
        if space is not None and d in space.waiters:
            space.waiters.remove(d)

    def _wake_done(self, outcome: object, space: Space) -> None:
        host = space.host
        space.task = None
        if self._spaces.get(host) is not space:
            return
        waiters, space.waiters = space.waiters, []
        if isinstance(outcome, Failure):
            failure = self._wake_failed(space, outcome)
            reason = failure.value.reason  # type: ignore[union-attr]  # always a WakeFailed
            self._stand_down_now(space, reason)
            fire(waiters, failure)
            return
        timings: dict[str, float] = outcome  # type: ignore[assignment]
        now = self._reactor.seconds()
        timings["total"] = now - space.since
        for phase, seconds in timings.items():
            _wake_seconds.labels(phase).observe(seconds)
        space.move("awake")
        space.last_active = now
        self._capacity.awake(space)  # its memory measured: counted once from now on
        self.copies.awake(host)
        self._failures.pop(host, None)
        self._held.pop(host, None)
        self._update_gauge()
        _wakes.labels(space.reason, "ok").inc()
        _log.info(
            "activator: {host} awake ({total:.1f}s)",
            host=host,
            total=timings["total"],
            timings={k: round(v, 4) for k, v in timings.items()},
        )
        self._life.due_honoured(space)
        self._life.sidecars.start(space, lambda: self._awake(space))
        fire(waiters, None)

    def _awake(self, space: Space) -> bool:
        return self._spaces.get(space.host) is space and space.state == "awake"

    def _wake_failed(self, space: Space, outcome: Failure) -> Failure:
        """Name a failed wake, remember its backoff (or, for a refusal that is not the space's
        failure, the refusal itself: REMEMBERED), log it; returns the failure its waiters get
        (always a :class:`WakeFailed`)."""
        host = space.host
        why = WakeFailed.of(host, outcome, self.budgets.wake)
        outcome = outcome if why is outcome.value else Failure(why)
        reason = why.reason
        _wakes.labels(space.reason, reason).inc()
        now = self._reactor.seconds()
        remembered = REMEMBERED.get(reason)
        if remembered is not None:
            if len(self._held) > 10_000:
                self._held.clear()
            until = now + min(why.retry_after, remembered)
            self._held[host] = (until, reason, why.retry_after, why.message)
        delay = min(why.retry_after, remembered) if remembered is not None else 0.0
        # (Not the space's fault: capacity, a lease held elsewhere, a build missing here.)
        if reason not in ("cancelled", "capacity", *REMEMBERED):
            count = self._failures.get(host, (0, 0.0))[0] + 1
            delay = WAKE_BACKOFF.delay(count)
            self._failures[host] = (count, now + delay)
        _log.warn(
            "activator: {host} wake failed ({reason}); the next request retries{after}",
            host=host,
            reason=reason,
            after=f" after {delay:g}s" if delay else "",
        )
        return outcome

    # -- sleeping and standing down --------------------------------------------------------------

    def sleep(self, host: str, reason: str) -> Deferred[None]:
        """Put an awake space to sleep; fires when it is asleep (never fails)."""
        space = self._spaces.get(host)
        if space is None:
            return succeed(None)
        if space.state == "stopping" and space.task is not None:
            return settled(space.task)
        if space.state == "waking" and space.task is not None:
            self._call_off(space)  # _wake_done stands it down (synchronously sets the new task)
            return settled(space.task) if space.task is not None else succeed(None)
        space.task = Deferred.fromCoroutine(self._stand_down(space, reason, graceful=True))
        return settled(space.task)

    def _stand_down_now(self, space: Space, reason: str) -> None:
        """Stand ``space`` down at once (not a sleep: a failed wake, a dead child, a lost
        lease); its task is the stand-down."""
        space.task = Deferred.fromCoroutine(self._stand_down(space, reason, graceful=False))

    def _call_off(self, space: Space) -> None:
        """A wake under way is cancelled: :meth:`_wake_done` stands it down."""
        if space.state == "waking" and space.task is not None:
            space.task.cancel()

    async def _stand_down(self, space: Space, reason: str, *, graceful: bool) -> None:
        """Stop everything ``space`` runs, flush, release, forget; then serve whoever queued
        meanwhile (a new wake), unless the router is stopping. ``graceful``: a sleep; otherwise
        a failed wake, a dead child or a lost lease."""
        host = space.host
        if space.state == "stopping" and not graceful:
            return
        space.move("stopping")
        space.since = self._reactor.seconds()
        self._update_gauge()
        if graceful:
            _log.info("activator: {host} sleeping ({reason})", host=host, reason=reason)
        try:
            await self._life.stand_down(space, reason, graceful=graceful)
        finally:
            if self._spaces.get(host) is space:
                space.move("asleep")
                del self._spaces[host]
            self._capacity.stood_down(space)
            self._update_gauge()
            self._claims.release(host)
            self.copies.stood_down(host, space.db, self.holds)
        if graceful:
            _sleeps.labels(reason).inc()
            _log.info("activator: {host} asleep ({reason})", host=host, reason=reason)
        waiters = [d for d in space.waiters if not d.called]
        space.waiters = []
        route = self._routes.table.get(host)
        if waiters and not self._stopping and space.wake_again and route and route.hibernating:
            for d in waiters:
                self.wake(route, "request").addBoth(relay, d)
            return
        fire(waiters, Failure(WakeFailed(host, "stood_down", f"{host} stood down; try again")))

    def _child_ended(self, space: Space, child: RunningChild, info: Any) -> None:
        if self._spaces.get(space.host) is not space or space.child is not child:
            return
        if space.state == "awake":
            _log.warn(
                "activator: {host} exited unexpectedly ({info}) — recycling",
                host=space.host,
                info=info.describe(),
            )
            _sleeps.labels("child_exited").inc()
            self._stand_down_now(space, "child_exited")
        # While waking, wait_ready reports it.

    def _lease_lost(self, space: Space, why: str) -> None:
        if (
            why == BOX_NOT_ALIVE
            and space.state == "awake"
            and self._lapsed is not None
            and self._spaces.get(space.host) is space
        ):
            self._outage.fence(space)
            return
        space.lost = why
        _log.error(
            "activator: {host} lease lost ({why}); stopping it now", host=space.host, why=why
        )
        if self._spaces.get(space.host) is not space:
            return
        if space.replicator is not None:
            Deferred.fromCoroutine(space.replicator.stop())
        if space.state == "awake":
            _sleeps.labels("lease_lost").inc()
            self._stand_down_now(space, "lease_lost")
        else:
            self._call_off(space)

    def box_not_alive(self) -> None:
        """The mesh's liveness deadline passed (no heartbeat landed in ``dead_after - margin``):
        peers may soon judge this box dead and take its spaces over, so every space stops now —
        each lease keeper reports the loss (its ``alive`` check), which stands the space down at
        once (SIGTERM, no further upload: docs/lease.md)."""
        for space in list(self._spaces.values()):
            if space.keeper is not None:
                space.keeper.holds()  # lost now: on_lost -> _lease_lost
            else:
                self._call_off(space)

    def _table_changed(self, old: RouteTable, new: RouteTable) -> None:
        for host, space in list(self._spaces.items()):
            route = new.get(host)
            if route is None or not route.hibernating:
                why = "removed" if route is None else "hibernate off"
                if space.state == "awake":
                    self.sleep(host, why)
                else:
                    self._call_off(space)
            elif space.state != "stopping":
                space.route = route

    # -- lifecycle -------------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._life.sidecars.startService()
        self._capacity.start()
        self._update_gauge()
        # Recovered once scanned (a mesh box's recovery wake waits for its first landed
        # heartbeat; it recovers again each time it is alive again: Membership.on_alive).
        scan = Deferred.fromCoroutine(self.copies.scan(self.holds))
        scan.addCallback(lambda _: self.recover())
        scan.addErrback(lambda f: _log.failure("activator: scanning local copies failed", f))

    def stopService(self) -> Deferred[None]:
        """Drain: every awake space flushed and released, in parallel, in bounded time."""
        super().stopService()
        self._stopping = True
        self._capacity.stop()
        hosts_now = list(self._spaces)
        if hosts_now:
            _log.info("activator: draining {n} spaces", n=len(hosts_now))
        waits = [self.sleep(host, "shutdown") for host in hosts_now]
        d: Deferred[Any] = DeferredList(waits, consumeErrors=True)
        d.addCallback(lambda _: self._life.sidecars.stopService())
        return d.addCallback(lambda _: None)

    def _update_gauge(self) -> None:
        for state in STATES:
            _awake.labels(state).set(sum(1 for s in self._spaces.values() if s.state == state))

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
- Capacity (``LCHAT_MAX_INSTANCES``, docs/hibernation.md "Capacity"): the always-on space
  processes (``resident``) plus the slots the hibernating spaces hold never exceed the limit
  because of a wake. Every space waking, awake or stopping holds a slot; a stopping one whose slot
  was handed to a waiting wake is counted once, for that wake. A wake at the limit takes the slot
  of a space already stopping, else sleeps the awake space idle longest with nothing in flight
  (never an always-on one), and spawns only once that stand-down is done; with neither, it is
  refused at once: 503 ``capacity`` with ``Retry-After``. A slot is handed on at most once.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.backoff import Backoff
from lchat.deferutil import relay, settled
from lchat.hibernation.lifecycle import LEASE_CONFLICTS, Lifecycle
from lchat.hibernation.recovery import LocalCopies
from lchat.hibernation.space import STATES, Budgets, Space, WakeFailed
from lchat.lease import BOX_NOT_ALIVE
from lchat.registry import Route, RouteSource, RouteTable
from lchat.router import Header, LocalResponse, LocalSocket, Target, unavailable
from lchat.supervise import RunningChild
from lchat.units import Claims

_log = Logger(namespace="lchat.activator")

_wake_seconds = Histogram(
    "lchat_wake_seconds",
    "Wake latency by phase (total = lease + restore + spawn + ready + replicate, + capacity: "
    "waiting for a slot at LCHAT_MAX_INSTANCES)",
    ["phase"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
_wakes = Counter("lchat_wakes_total", "Wakes by reason and outcome", ["reason", "outcome"])
_sleeps = Counter("lchat_sleeps_total", "Sleeps by reason", ["reason"])
_coalesced = Counter("lchat_wake_coalesced_total", "Requests that joined a wake already under way")
_awake = Gauge(
    "lchat_awake_spaces", "Hibernating spaces awake (or waking, or stopping) by state", ["state"]
)

_capacity = Gauge(
    "lchat_capacity_instances",
    "Resident space processes against LCHAT_MAX_INSTANCES by kind: always_on, hibernating (the "
    "slots hibernating spaces hold), max (the limit; 0 = none)",
    ["kind"],
)
_holds_total = Counter(
    "lchat_holds_total",
    "Operator holds on a space's wakes (lchat relocate) by event: held, released, expired",
    ["event"],
)
for _event in ("held", "released", "expired"):
    _holds_total.labels(_event)
_evictions = Counter(
    "lchat_capacity_evictions_total",
    "Awake hibernating spaces slept to make room for another's wake (LCHAT_MAX_INSTANCES)",
)

# After a failed wake, the next attempt waits 1 s, 2 s, 4 s ... up to 60 s: a broken space must
# not cost a lease write, a LIST and an upload on every request.
WAKE_BACKOFF = Backoff(1.0, 60.0)
LEASE_HELD_CACHE = 0.25  # seconds a "held elsewhere" answer is reused without asking the bucket
# A wake refused at capacity (everything resident busy): the client asks again this much later;
# requests usually end within seconds, and then the longest-idle space can be slept.
CAPACITY_RETRY = 5.0
HOLD_RETRY_AFTER = 5.0  # a held space's Retry-After (a relocation usually ends within seconds)
CAPACITY_LOG_EVERY = 10.0  # seconds between "503: nothing can be slept" lines (a storm is one)
# A write to a space whose backlog is older than its class promises waits at most this long for
# the peers to know of it (docs/lease.md, "Writes during an outage"), then gets a 503.
WITNESS_WAIT = 0.75
REFUSED_LOG_EVERY = 10.0  # seconds between "writes refused" lines for one host
BUCKET_RETRY = 5.0  # a wake refused because the bucket is out of reach: Retry-After

_fenced = Counter(
    "lchat_spaces_read_only_total",
    "Spaces kept answering reads (writes refused, nothing shipped) because this mesh box was "
    "cut off from the bucket and its peers (its liveness lapsed)",
)
_refused_writes = Counter(
    "lchat_writes_refused_total",
    "Writes answered 503 because their space's backlog is older than its replication class "
    "promises and this box's peers could not be told (it is isolated from bucket and peers)",
)


class WriteWitness(Protocol):
    """What the activator asks a mesh box's membership before acknowledging a write that cannot
    ship now (lchat.mesh.membership.Membership)."""

    def writes_safe(self) -> bool: ...

    def writes_known(self, timeout: float) -> Deferred[bool]: ...


def _no_resident() -> int:
    return 0


class Activator(Service):
    """Wakes, tracks and sleeps hibernating spaces; the router's branch for them (:meth:`route`)."""

    name = "activator"

    def __init__(
        self,
        reactor: Any,
        routes: RouteSource,
        lifecycle: Lifecycle,
        claims: Claims,
        *,
        resident: Callable[[], int] = _no_resident,
        max_instances: int = 0,
        lapsed: Callable[[], bool] | None = None,
        witness: WriteWitness | None = None,
        bucket_reachable: Callable[[], bool] | None = None,
    ) -> None:
        """``resident``: how many always-on space processes run on this box now (builtin units'
        children), which count against ``max_instances`` (LCHAT_MAX_INSTANCES; 0: no limit) but
        are never slept. ``lapsed``: on a mesh box, whether its liveness has lapsed (neither its
        heartbeat nor its peers' word covers it: lchat.mesh.membership): no request is served
        meanwhile (docs/lease.md). ``witness``: on a mesh box, asked before a write is passed to
        a space whose backlog is older than its replication class promises.
        ``bucket_reachable``: whether the bucket answered this box's last heartbeat (a wake needs
        it: refused at once while not)."""
        self._reactor = reactor
        self._lapsed = lapsed
        self._witness = witness
        self._bucket_reachable = bucket_reachable
        self._refusals_logged: dict[str, float] = {}  # host -> last "writes refused" line
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
        # host -> (answer from memory until, Retry-After, why): a lease seen held elsewhere
        self._held: dict[str, tuple[float, float, str]] = {}
        # host -> (no wake until, why): an operator's hold (`lchat relocate` sleeps a space and
        # keeps it asleep while it copies the replica elsewhere).
        self._holds: dict[str, tuple[float, str]] = {}
        self._stopping = False
        self._resident = resident
        self._max_instances = max_instances
        # A stopping space -> the waiting wake its slot was handed to (LCHAT_MAX_INSTANCES).
        self._handed_on: dict[Space, Space] = {}
        self._refused_since_log = 0  # capacity refusals not logged yet (one line per storm)
        self._refusal_logged = float("-inf")
        routes.subscribe(self._table_changed)

    @property
    def budgets(self) -> Budgets:
        return self._life.budgets

    @budgets.setter
    def budgets(self, budgets: Budgets) -> None:
        self._life.budgets = budgets

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

    def state(self, host: str) -> str:
        space = self._spaces.get(host)
        return "asleep" if space is None else space.state

    def held_asleep(self) -> dict[str, float]:
        """The hosts held asleep (:meth:`hold`) and the seconds each hold has left."""
        now = self._reactor.seconds()
        return {h: round(until - now, 1) for h, (until, _) in self._holds.items() if until > now}

    def hold(self, host: str, seconds: float, why: str) -> None:
        """No wake of ``host`` on this box for ``seconds`` (at most an hour), whoever asks: a
        request gets 503 ``held`` with a short Retry-After, the due sweep and ``/wake`` fail. An
        awake space is not touched (the caller sleeps it: :meth:`sleep`); requests that queued on
        it while it stops are refused rather than waking it again. Ends at the deadline or at
        :meth:`release_hold`, so a crashed caller cannot keep a space down for long."""
        seconds = max(0.0, min(seconds, 3600.0))
        self._holds[host] = (self._reactor.seconds() + seconds, why)
        _holds_total.labels("held").inc()
        _log.info(
            "activator: {host} held asleep for up to {seconds:g}s ({why})",
            host=host,
            seconds=seconds,
            why=why,
        )

    def release_hold(self, host: str) -> bool:
        """End ``host``'s hold (the next request wakes it); whether there was one (a hold past
        its deadline had already ended: counted ``expired``, not released)."""
        held = self._holds.pop(host, None)
        if held is None:
            return False
        if held[0] <= self._reactor.seconds():
            _holds_total.labels("expired").inc()
            return False
        _holds_total.labels("released").inc()
        _log.info("activator: {host} hold released ({why})", host=host, why=held[1])
        return True

    def idle_hosts(self, idle: float) -> list[str]:
        """Awake spaces with nothing in flight for ``idle`` seconds (O(awake))."""
        now = self._reactor.seconds()
        return [
            h for h, s in self._spaces.items() if s.state == "awake" and s.idle_for(now) >= idle
        ]

    def slots_held(self) -> int:
        """The LCHAT_MAX_INSTANCES slots hibernating spaces hold: every one waking, awake or
        stopping, a stopping one whose slot was handed to a waiting wake counted once."""
        return len(self._spaces) - len(self._handed_on)

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
        peers' word, or is refused (:meth:`_write_target`)."""
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
            return self._read_only(space, sidecar, write)
        if space is not None and space.state == "awake":
            if write and self._witness is not None and self._stale(space):
                return self._write_target(space, sidecar)
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

    # -- writes that cannot ship now (docs/lease.md, "Writes during an outage") ------------------

    def _read_only(self, space: Space, sidecar: bool, write: bool) -> Target:
        """A fenced space (its box is isolated): reads from its copy, marked; writes refused."""
        host = space.host
        if write or sidecar:
            _refused_writes.inc()
            now = self._reactor.seconds()
            if now - self._refusals_logged.get(host, float("-inf")) >= REFUSED_LOG_EVERY:
                self._refusals_logged[host] = now
                _log.warn(
                    "activator: {host}: writes refused (503): this box is cut off from the "
                    "bucket and its peers; reads are answered from its copy, which may be "
                    "behind (X-Lchat-Read-Only: isolated)",
                    host=host,
                )
            return self._unavailable(host, "not_witnessed", 1.0)
        marked: Header = (b"x-lchat-read-only", b"isolated")
        return LocalSocket(host=host, path=space.socket, response_headers=(marked,), inflight=space)

    @staticmethod
    def _stale(space: Space) -> bool:
        """Is ``space``'s oldest commit not in the bucket older than its class promises?"""
        replicator = space.replicator
        return replicator is not None and replicator.lag() > replicator.interval

    def backlog(self) -> bool:
        """Does this box hold writes the bucket lacks beyond what the class promises allow: a
        space here whose oldest unshipped commit is older than its class promises, a read-only
        space (its replication stopped), or a local copy not cleanly slept
        (lchat.hibernation.recovery)? What its beats tell its peers (lchat.mesh.witness)."""
        return bool(self.copies) or any(s.fenced or self._stale(s) for s in self._spaces.values())

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
            space.task = Deferred.fromCoroutine(self._stand_down(space, "fenced", graceful=False))
        waits = [settled(s.task) for s in fenced if s.task is not None]
        if waits:
            await DeferredList(waits, consumeErrors=True)
        await self.copies.recover(self)

    def awake_hosts(self) -> list[str]:
        """The hosts awake here (a routing hint for the peers)."""
        return [h for h, s in self._spaces.items() if s.state == "awake"]

    def _write_target(self, space: Space, sidecar: bool) -> Target | Deferred[Target]:
        """A write to ``space``, whose backlog cannot ship now: passed on once every peer that
        could take this box's spaces over knows it holds such writes (then none will, and the
        write ships when the bucket is back); else, after at most :data:`WITNESS_WAIT`, a 503:
        this box is isolated, and a write acknowledged now could be lost to a takeover."""
        assert self._witness is not None
        host = space.host

        def target(safe: bool) -> Target:
            current = self._spaces.get(host)
            if current is not space or space.state != "awake":
                return self._unavailable(host, "stood_down")
            if safe:
                return LocalSocket(
                    host=host, path=space.socket, inflight=None if sidecar else space
                )
            _refused_writes.inc()
            now = self._reactor.seconds()
            if now - self._refusals_logged.get(host, float("-inf")) >= REFUSED_LOG_EVERY:
                self._refusals_logged[host] = now
                replicator = space.replicator
                _log.warn(
                    "activator: {host}: writes refused (503): {lag:.1f}s of its writes are not "
                    "in the bucket yet, and no peer could be told so: this box cannot reach the "
                    "bucket or its peers; reads are still served",
                    host=host,
                    lag=replicator.lag() if replicator is not None else 0.0,
                )
            return self._unavailable(host, "not_witnessed", 1.0)

        if self._witness.writes_safe():
            return target(True)
        return self._witness.writes_known(WITNESS_WAIT).addCallback(target)

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
        if space is None and host in self._holds:
            until, why = self._holds[host]
            if now < until:
                # Checked before the capacity and lease paths: a held space costs no bucket call.
                return fail(WakeFailed(host, "held", why, min(until - now, HOLD_RETRY_AFTER)))
            del self._holds[host]
            _holds_total.labels("expired").inc()
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
            # Held elsewhere a moment ago: answer from that, not with another PUT and GET of the
            # lock (a busy space on a dead box would otherwise cost two requests per request).
            until, retry_after, why = self._held[host]
            if now < until:
                LEASE_CONFLICTS.inc()
                return fail(WakeFailed(host, "lease_held", why, retry_after))
            del self._held[host]
        victim = None
        if space is None and self._at_capacity():
            victim = self._victim()
            if victim is None:
                return self._refuse_at_capacity(host, reason)
        waiter: Deferred[None] = Deferred(lambda d: self._drop_waiter(host, d))
        if space is None:
            space = self._life.new_space(host, route, reason)
            if reason == "due":
                space.due_woken = route.next_due
            self._spaces[host] = space
            self._claims.claim(host)
            freed = None
            if victim is not None:
                # Handed on before the sleep starts: a stand-down that ends at once must find it.
                self._handed_on[victim] = space
                freed = self._make_room(victim, host)
            self._update_gauge()
            space.waiters.append(waiter)
            steps = self._life.wake(
                space,
                on_lost=lambda why: self._lease_lost(space, why),
                on_exit=lambda child, info: self._child_ended(space, child, info),
            )
            space.task = Deferred.fromCoroutine(
                steps if freed is None else self._wake_when_freed(freed, steps)
            )
            space.task.addTimeout(self.budgets.wake, self._reactor)
            space.task.addBoth(self._wake_done, space)
        else:
            _coalesced.inc()
            space.waiters.append(waiter)
            if space.state == "stopping":
                space.wake_again = True
        return waiter

    # -- capacity (LCHAT_MAX_INSTANCES) -----------------------------------------------------------

    def _at_capacity(self) -> bool:
        """Would one more space process exceed the limit?"""
        if self._max_instances <= 0:
            return False
        held = self.slots_held()
        return held >= self._max_instances or held + self._resident() >= self._max_instances

    def _victim(self) -> Space | None:
        """Whose slot a wake at capacity takes: a space already stopping (free soon and at no
        cost; not one whose own queued requests will wake it again), the one stopping longest;
        else the awake space idle longest with nothing in flight. Never a slot already handed
        on, never an always-on space (the activator does not run those)."""
        stopping = [
            s
            for s in self._spaces.values()
            if s.state == "stopping" and s not in self._handed_on and not s.wake_again
        ]
        if stopping:
            return min(stopping, key=lambda s: s.since)
        idle = [s for s in self._spaces.values() if s.state == "awake" and s.inflight == 0]
        return min(idle, key=lambda s: s.last_active, default=None)

    def _make_room(self, victim: Space, host: str) -> Deferred[None]:
        """Sleep ``victim`` (unless it is stopping already) for ``host``'s wake; fires once its
        stand-down is done and its process gone."""
        resident = self._resident() + self.slots_held()
        if victim.state == "stopping":
            _log.info(
                "activator: at capacity ({resident} resident, LCHAT_MAX_INSTANCES={limit}): "
                "{host} waits for {victim} to finish sleeping",
                resident=resident,
                limit=self._max_instances,
                host=host,
                victim=victim.host,
            )
            return settled(victim.task) if victim.task is not None else succeed(None)
        idle = self._reactor.seconds() - victim.last_active
        _evictions.inc()
        _log.info(
            "activator: at capacity ({resident} resident, LCHAT_MAX_INSTANCES={limit}): "
            "sleeping {victim} (idle {idle}) to wake {host}",
            resident=resident,
            limit=self._max_instances,
            victim=victim.host,
            idle=_span(idle),
            host=host,
        )
        return self.sleep(victim.host, "capacity")

    async def _wake_when_freed(
        self, freed: Deferred[None], steps: Coroutine[Any, Any, dict[str, float]]
    ) -> dict[str, float]:
        """The wake's steps, once the slot it was handed is free (within the wake budget: the
        task's timeout covers the wait)."""
        started = self._reactor.seconds()
        try:
            await freed
        except BaseException:
            steps.close()  # never started: no "coroutine was never awaited" warning
            raise
        waited = self._reactor.seconds() - started
        timings: dict[str, float] = await steps
        timings["capacity"] = waited
        return timings

    def _refuse_at_capacity(self, host: str, reason: str) -> Deferred[None]:
        """Nothing can be slept: 503 ``capacity`` with ``Retry-After``; logged once per
        CAPACITY_LOG_EVERY with how many were refused meanwhile."""
        _wakes.labels(reason, "capacity").inc()
        now = self._reactor.seconds()
        self._refused_since_log += 1
        if now - self._refusal_logged >= CAPACITY_LOG_EVERY:
            states = [s.state for s in self._spaces.values()]
            _log.warn(
                "activator: at capacity ({resident} resident, LCHAT_MAX_INSTANCES={limit}: "
                "{always_on} always-on, {awake} awake and busy, {waking} waking, {stopping} "
                "stopping): {host} answered 503: nothing can be slept ({refused} refused since "
                "the last such line); raise LCHAT_MAX_INSTANCES if this box has room",
                resident=self._resident() + self.slots_held(),
                limit=self._max_instances,
                always_on=self._resident(),
                awake=states.count("awake"),
                waking=states.count("waking"),
                stopping=states.count("stopping"),
                host=host,
                refused=self._refused_since_log,
            )
            self._refusal_logged = now
            self._refused_since_log = 0
        return fail(
            WakeFailed(
                host,
                "capacity",
                f"this box is at capacity (LCHAT_MAX_INSTANCES={self._max_instances}) and "
                f"every resident space is busy",
                CAPACITY_RETRY,
            )
        )

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
            space.task = Deferred.fromCoroutine(self._stand_down(space, reason, graceful=False))
            for d in waiters:
                if not d.called:
                    d.errback(failure)
            return
        timings: dict[str, float] = outcome  # type: ignore[assignment]
        now = self._reactor.seconds()
        timings["total"] = now - space.since
        for phase, seconds in timings.items():
            _wake_seconds.labels(phase).observe(seconds)
        space.state = "awake"
        space.last_active = now
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
        if space.due_woken:
            self._routes.record_next_due(host, 0, only_if=space.due_woken)
        self._life.sidecars.start(space, lambda: self._awake(space))
        for d in waiters:
            if not d.called:
                d.callback(None)

    def _awake(self, space: Space) -> bool:
        return self._spaces.get(space.host) is space and space.state == "awake"

    def _wake_failed(self, space: Space, outcome: Failure) -> Failure:
        """Name a failed wake, remember its backoff (or the held lease), log it; returns the
        failure its waiters get (always a :class:`WakeFailed`)."""
        host = space.host
        why = WakeFailed.of(host, outcome, self.budgets.wake)
        outcome = outcome if why is outcome.value else Failure(why)
        reason = why.reason
        _wakes.labels(space.reason, reason).inc()
        now = self._reactor.seconds()
        if reason == "lease_held":
            if len(self._held) > 10_000:
                self._held.clear()
            until = now + min(why.retry_after, LEASE_HELD_CACHE)
            self._held[host] = (until, why.retry_after, why.message)
        delay = 0.0
        if reason not in ("lease_held", "cancelled"):
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
            space.task.cancel()  # _wake_done stands it down (synchronously sets the new task)
            return settled(space.task) if space.task is not None else succeed(None)
        space.task = Deferred.fromCoroutine(self._stand_down(space, reason, graceful=True))
        return settled(space.task)

    async def _stand_down(self, space: Space, reason: str, *, graceful: bool) -> None:
        """Stop everything ``space`` runs, flush, release, forget; then serve whoever queued
        meanwhile (a new wake), unless the router is stopping. ``graceful``: a sleep; otherwise
        a failed wake, a dead child or a lost lease."""
        host = space.host
        if space.state == "stopping" and not graceful:
            return
        space.state = "stopping"
        space.since = self._reactor.seconds()
        self._update_gauge()
        if graceful:
            _log.info("activator: {host} sleeping ({reason})", host=host, reason=reason)
        try:
            await self._life.stand_down(space, reason, graceful=graceful)
        finally:
            if self._spaces.get(host) is space:
                del self._spaces[host]
            # Its slot is free now (or the wake it was handed to holds it); and a waiting wake
            # that ends before the space it waits for gives that space its slot back.
            self._handed_on.pop(space, None)
            for victim in [v for v, taker in self._handed_on.items() if taker is space]:
                del self._handed_on[victim]
            self._update_gauge()
            self._claims.release(host)
            self.copies.stood_down(host, space.db, self.holds)
        if graceful:
            _sleeps.labels(reason).inc()
            _log.info("activator: {host} asleep ({reason})", host=host, reason=reason)
        waiters = [d for d in space.waiters if not d.called]
        space.waiters = []
        route = self._routes.table.get(host)
        if (
            waiters
            and not self._stopping
            and space.wake_again
            and route is not None
            and route.hibernate
            and route.kind == "instance"
        ):
            for d in waiters:
                self.wake(route, "request").addBoth(relay, d)
            return
        for d in waiters:
            d.errback(WakeFailed(host, "stood_down", f"{host} stood down; try again"))

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
            space.task = Deferred.fromCoroutine(
                self._stand_down(space, "child_exited", graceful=False)
            )
        # While waking, wait_ready reports it.

    def _lease_lost(self, space: Space, why: str) -> None:
        if (
            why == BOX_NOT_ALIVE
            and space.state == "awake"
            and self._lapsed is not None
            and self._spaces.get(space.host) is space
        ):
            self._fence(space)
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
            space.task = Deferred.fromCoroutine(
                self._stand_down(space, "lease_lost", graceful=False)
            )
        elif space.state == "waking" and space.task is not None:
            space.task.cancel()

    def _fence(self, space: Space) -> None:
        """The box is not alive: ``space`` writes nothing more (its lease is lost, its
        replicator stopped) but keeps answering reads from its copy, until the box is alive
        again (:meth:`recover` stands it down) or it is slept."""
        space.lost = BOX_NOT_ALIVE
        space.fenced = True
        _fenced.inc()
        if space.replicator is not None:
            Deferred.fromCoroutine(space.replicator.stop())
        _log.error(
            "activator: {host}: this box is cut off from the bucket and its peers: read-only "
            "now (reads answered from its copy, writes refused, nothing shipped) until it is "
            "alive again",
            host=space.host,
        )

    def box_not_alive(self) -> None:
        """The mesh's liveness deadline passed (no heartbeat landed in ``dead_after - margin``):
        peers may soon judge this box dead and take its spaces over, so every space stops now —
        each lease keeper reports the loss (its ``alive`` check), which stands the space down at
        once (SIGTERM, no further upload: docs/lease.md)."""
        for space in list(self._spaces.values()):
            if space.keeper is not None:
                space.keeper.holds()  # lost now: on_lost -> _lease_lost
            elif space.state == "waking" and space.task is not None:
                space.task.cancel()

    def _table_changed(self, old: RouteTable, new: RouteTable) -> None:
        for host, space in list(self._spaces.items()):
            route = new.get(host)
            if route is None or not route.hibernate or route.kind != "instance":
                why = "removed" if route is None else "hibernate off"
                if space.state == "awake":
                    self.sleep(host, why)
                elif space.state == "waking" and space.task is not None:
                    space.task.cancel()
            elif space.state != "stopping":
                space.route = route

    # -- lifecycle -------------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._life.sidecars.startService()
        # Read at each scrape: the always-on count changes without telling the activator.
        _capacity.labels("always_on").set_function(lambda: self._resident())
        _capacity.labels("hibernating").set_function(self.slots_held)
        _capacity.labels("max").set(self._max_instances)
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


def _span(seconds: float) -> str:
    """``42s``, ``12m``, ``3h05m``: an idle time as an operator reads it."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"

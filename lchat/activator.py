"""The activator: hibernating spaces sleep in the bucket and wake on the next request (DESIGN.md §7).

It exists only when ``LCHAT_HIBERNATE_BUCKET`` is set, and manages only rows flagged ``hibernate``.
Per host: ``asleep`` (no entry) -> ``waking`` -> ``awake`` -> ``stopping`` -> ``asleep``.

Wake (a request, or the due sweep): every request arriving meanwhile joins the same wake — one lease
claim, one restore, one spawn. In order: acquire ``<prefix>/<host>/lock.json`` (held elsewhere: 503
with ``Retry-After``); restore from the bucket only when the local database is missing (or is known
to be older than the bucket's copy); spawn the space with its env file plus ``LCHAT_HOST``,
``LCHAT_SOCKET``, ``LCHAT_DB``; wait for ``GET /api/version``; start replication at the row's class;
co-spawn the staged bot sidecar. The whole wake has a budget; a request waits at most ``queue``
seconds for it, then gets 503 + ``Retry-After``. A failed wake undoes what it did and forgets the
entry, so the next request starts clean.

Sleep (idle, hibernate turned off, router shutdown), each step under its own budget so nothing
strands the lease: stop the sidecar; ask ``GET /api/next-due`` and store it in the registry; SIGTERM
the space (SIGKILL after the grace); flush replication; release the lease; forget. The local
database stays as the warm cache, with a marker recording the txid it matches in the bucket.

Failure is the wake path: a child that dies, a lost lease, a failed flush — the entry stands down
and the next request wakes it again. A lost lease stops the child at once and writes nothing more;
its local database is moved aside (another box may have written since), so the next wake restores.

A bucket that forgets (docs/hibernation.md, "When the bucket forgets"): a lock that vanishes while
awake is re-taken and the replica re-seeded from the local database (the keeper's
``verify_retake``, the replicator's ``recheck``), and a wake never restores a bucket state older
than a local copy it can date — the live file's clean-sleep marker, or the record kept beside a
moved-aside copy: it wakes from that copy (an empty or unrestorable bucket) or refuses (503
``diverged``, with recovery steps in the log) rather than start empty or older.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from attrs import Factory, define, evolve, frozen
from prometheus_client import Counter, Gauge, Histogram
from twisted.application.service import Service
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    DeferredList,
    TimeoutError,
    fail,
    succeed,
)
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import hosts, unixhttp
from lchat.config import BoxConfig, read_env_file
from lchat.deferutil import settled
from lchat.lease import HeldLease, LeaseHeld, LeaseKeeper, acquire
from lchat.objstore import ObjectInfo, ObjectStore, ObjectStoreError
from lchat.registry import Route, RouteSource, RouteTable
from lchat.replica.replicator import INTERVALS, RESEEDS, Replicator, ReplicatorStopped
from lchat.replica.restore import RestoreError, plan_files, replica_files, restore
from lchat.router import RETRY_AFTER_SECONDS, Header, LocalResponse, LocalSocket, Target, plain
from lchat.supervise import ChildSpec, NotReady, RunningChild, SpawnError, Supervisor, spawn
from lchat.units import EnvFileError, space_env

_log = Logger(namespace="lchat.activator")

State = Literal["waking", "awake", "stopping"]
RunInThread = Callable[[Callable[[], Any]], Deferred[Any]]

PHASES = ("lease", "restore", "spawn", "ready", "replicate", "total")
_wake_seconds = Histogram(
    "lchat_wake_seconds",
    "Wake latency by phase (total = lease + restore + spawn + ready + replicate)",
    ["phase"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
_wakes = Counter("lchat_wakes_total", "Wakes by reason and outcome", ["reason", "outcome"])
_sleeps = Counter("lchat_sleeps_total", "Sleeps by reason", ["reason"])
_coalesced = Counter("lchat_wake_coalesced_total", "Requests that joined a wake already under way")
_unavailable = Counter(
    "lchat_activator_unavailable_total", "503s answered by the activator, by reason", ["reason"]
)
_lease_conflicts = Counter(
    "lchat_lease_conflicts_total", "Wakes refused because another holder has the lease"
)
_awake = Gauge(
    "lchat_awake_spaces", "Hibernating spaces awake (or waking, or stopping) by state", ["state"]
)
_sleep_step_failures = Counter(
    "lchat_sleep_step_failures_total", "Sleep steps that failed or ran out of time", ["step"]
)

# What a 503 tells the world, by reason (the details go to the log, never to a client).
_PUBLIC = {
    "lease_held": "{host} is being served elsewhere right now",
    "queue_timeout": "{host} is still waking",
    "sidecar": "{host} is asleep (sidecar requests never wake it)",
    "shutdown": "the router is stopping",
    "backoff": "{host} failed to wake a moment ago",
    "spawn": "{host} could not start",
    "not_ready": "{host} could not start",
    "bucket": "{host} cannot wake while storage is unreachable",
    "diverged": "{host} cannot wake until an operator checks its storage",
}
# 503s that mean "this box is stopping, and the request was never acted on": while the router
# drains, a request refused for one of these is marked (LocalResponse.refusal) so that a mesh peer
# that forwarded it sends it elsewhere. Never lease_held, backoff, bucket, spawn, not_ready or
# queue_timeout: those say nothing about this box going away (another box would meet the same
# lease, or start a second wake racing this one), and never a space's own 503 (a space's answer is
# not a LocalResponse at all).
_DRAIN_REFUSALS = frozenset(
    {
        "shutdown",  # the router is stopping: no new wake here
        "stood_down",  # queued on a space that went to sleep as the drain began
        "cancelled",  # waiting for a wake the drain called off
    }
)

# After a failed wake, the next attempt waits 1 s, 2 s, 4 s ... up to this: a broken space must
# not cost a lease write, a LIST and an upload on every request.
MAX_WAKE_BACKOFF = 60.0
LEASE_HELD_RETRY = 10.0  # the longest Retry-After a lease held elsewhere earns
LEASE_HELD_RETRIES = (0.1, 0.2, 0.4)  # seconds between asking a held lease again in one wake
LEASE_HELD_CACHE = 0.25  # seconds a "held elsewhere" answer is reused without asking the bucket

MARKER_SUFFIX = "-lchat.json"  # <db>-lchat.json: the txid a cleanly slept local DB matches
# Sleeps after which someone else runs the database: no marker (it could not stay true).
_HANDED_BACK = ("hibernate off", "removed")


@frozen
class Budgets:
    """Seconds each step may take (DESIGN.md §7)."""

    wake: float = 300.0  # the whole wake
    queue: float = 30.0  # a request waiting for a wake
    ready: float = 30.0  # the space answering GET /api/version
    next_due: float = 10.0
    requests: float = 10.0  # a graceful sleep: requests already sent to the space finishing
    stop: float = 20.0  # SIGTERM -> SIGKILL
    flush: float = 60.0  # the final replication flush (retried within)
    release: float = 10.0
    sidecar_stop: float = 10.0
    lease_lost_stop: float = 2.0  # a space whose lease is gone: SIGKILL soon


class WakeFailed(Exception):
    """A wake that did not complete; ``reason`` labels the 503 and the metrics."""

    def __init__(self, host: str, reason: str, message: str, retry_after: float = 0.0) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host
        self.reason = reason
        self.message = message
        self.retry_after = retry_after


@define(eq=False)
class _Space:
    host: str
    route: Route
    state: State
    since: float
    socket: str
    db: str
    reason: str  # what woke it
    waiters: list[Deferred[None]] = Factory(list)
    inflight: int = 0
    requests: int = 0  # of inflight, the plain requests (not upgrades): a graceful sleep waits
    requests_done: list[Deferred[None]] = Factory(list)  # fired when requests reaches 0
    last_active: float = 0.0
    woke_at: float = 0.0
    lease: HeldLease | None = None
    keeper: LeaseKeeper | None = None
    replicator: Replicator | None = None
    child: RunningChild | None = None
    task: Deferred[Any] | None = None
    lost: str | None = None
    replicating: bool = False  # the replicator started (its flush means something)
    due_woken: int = 0  # the next_due this wake honoured (a due time is honoured once)
    wake_again: bool = False  # requests queued while stopping: wake once stopped


class Activator(Service):
    """Wakes, tracks and sleeps hibernating spaces. Plug into the router (:meth:`route`) and the
    proxy (as its request observer)."""

    name = "activator"

    def __init__(
        self,
        reactor: Any,
        cfg: BoxConfig,
        routes: RouteSource,
        store: ObjectStore,
        *,
        budgets: Budgets = Budgets(),
        replicator_options: Mapping[str, Any] | None = None,
        run_in_thread: RunInThread | None = None,
        sidecars: Supervisor | None = None,
        lease_renew_every: float | None = None,
        drop_idle: Callable[[str], object] = lambda socket: None,
        released: Callable[[str], object] = lambda host: None,
    ) -> None:
        assert cfg.hibernate is not None, "the activator needs LCHAT_HIBERNATE_BUCKET"
        self._reactor = reactor
        self._cfg = cfg
        self._hib = cfg.hibernate
        self._routes = routes
        self._store = store
        self.budgets = budgets
        self._replicator_options = dict(replicator_options or {})
        self._run = run_in_thread or routes.run_in_thread
        self._renew_every = lease_renew_every
        self._drop_idle = drop_idle  # the proxy pool's kept-alive connections to a socket
        self.released = released  # told when a host is forgotten (builtin units may take it)
        self._spaces: dict[str, _Space] = {}
        self._by_head: dict[int, _Space] = {}  # id(request head) -> the entry it counts against
        self._sidecars = sidecars or Supervisor(reactor, max_restart_delay=60.0)
        self._sidecar_specs: dict[str, ChildSpec] = {}
        self._failures: dict[str, tuple[int, float]] = {}  # host -> (failed wakes, retry at)
        # host -> (answer from cache until, Retry-After, why): a lease seen held elsewhere
        self._held: dict[str, tuple[float, float, str]] = {}
        self._stopping = False
        routes.subscribe(self._table_changed)

    # -- status ----------------------------------------------------------------------------------

    def holds(self, host: str) -> bool:
        """True while this activator has anything running (or stopping) for ``host``."""
        return host in self._spaces

    def state(self, host: str) -> str:
        space = self._spaces.get(host)
        return "asleep" if space is None else space.state

    def awake_hosts(self) -> list[str]:
        return [h for h, s in self._spaces.items() if s.state == "awake"]

    def idle_hosts(self, idle: float) -> list[str]:
        """Awake spaces with nothing in flight for ``idle`` seconds (O(awake))."""
        now = self._reactor.seconds()
        return [
            h
            for h, s in self._spaces.items()
            if s.state == "awake" and s.inflight <= 0 and now - s.last_active >= idle
        ]

    def status(self) -> dict[str, dict[str, Any]]:
        now = self._reactor.seconds()
        out: dict[str, dict[str, Any]] = {}
        for host, s in self._spaces.items():
            entry: dict[str, Any] = {
                "state": s.state,
                "for": round(now - s.since, 3),
                "reason": s.reason,
                "inflight": s.inflight,
                "idle": round(now - s.last_active, 3) if s.state == "awake" else None,
                "pid": s.child.pid if s.child is not None else None,
                "replication": s.route.replication,
            }
            if s.replicator is not None:
                entry["txid"] = s.replicator.txid
            sidecar = self._sidecars.status().get(_sidecar_name(host))
            if sidecar is not None:
                entry["sidecar"] = {"state": sidecar.state, "pid": sidecar.pid}
            out[host] = entry
        return out

    # -- the router's branch ---------------------------------------------------------------------

    def route(self, route: Route, sidecar: bool = False) -> Target | Deferred[Target]:
        """The target for a request to hibernating ``route``: its socket now if awake, after a
        wake otherwise, or a 503 with ``Retry-After``."""
        host = route.host
        space = self._spaces.get(host)
        if space is not None and space.state == "awake":
            return LocalSocket(host=host, path=space.socket)
        if sidecar:
            # Sidecar traffic never wakes a space: an orphaned bot would keep it awake forever.
            return self._unavailable(
                host, "sidecar", f"{host} is asleep (sidecar requests never wake it)"
            )
        if self._stopping:
            return self._unavailable(host, "shutdown", "the router is stopping")
        started = self._reactor.seconds()
        d = self.wake(route, "request")
        result: Deferred[Target] = Deferred()

        def timed_out() -> None:
            if not result.called:
                d.cancel()

        timer = self._reactor.callLater(self.budgets.queue, timed_out)

        def done(outcome: object) -> None:
            if timer.active():
                timer.cancel()
            if result.called:
                return
            if isinstance(outcome, Failure):
                if outcome.check(CancelledError):
                    result.callback(
                        self._unavailable(
                            host, "queue_timeout", f"{host} is still waking; try again"
                        )
                    )
                elif outcome.check(WakeFailed):
                    e = outcome.value
                    assert isinstance(e, WakeFailed)
                    result.callback(self._unavailable(host, e.reason, e.message, e.retry_after))
                else:
                    _log.failure("wake of {host} failed", outcome, host=host)
                    result.callback(self._unavailable(host, "error", f"{host} could not wake"))
                return
            space = self._spaces.get(host)
            if space is None or space.state != "awake":
                result.callback(
                    self._unavailable(host, "stood_down", f"{host} stood down; try again")
                )
                return
            waited = self._reactor.seconds() - started
            wake_header: Header = (b"x-lchat-wake", f"{waited:.3f}s".encode())
            result.callback(
                LocalSocket(host=host, path=space.socket, response_headers=(wake_header,))
            )

        d.addBoth(done)
        return result

    def _unavailable(
        self, host: str, reason: str, message: str, retry_after: float = 0.0
    ) -> LocalResponse:
        """A 503 with ``Retry-After``. The body says what kind of trouble in public words only:
        ``message`` (paths, owners, store errors) is for the log, which already has it."""
        _unavailable.labels(reason).inc()
        seconds = max(1, min(int(retry_after + 0.999) or RETRY_AFTER_SECONDS, 3600))
        public = _PUBLIC.get(reason, "{host} is temporarily unavailable").format(host=host)
        response = plain(
            503,
            f"503 Service Unavailable: {public}; try again in {seconds}s",
            (b"retry-after", str(seconds).encode()),
            label=f"wake_{reason}",
        )
        if self._stopping and reason in _DRAIN_REFUSALS:
            response = evolve(response, refusal="stopping")
        return response

    # -- the proxy's observer --------------------------------------------------------------------

    def request_started(self, head: Any, target: Target) -> None:
        if head.sidecar or not isinstance(target, LocalSocket):
            return  # sidecar traffic earns no idle credit
        space = self._spaces.get(target.host)
        if space is None or space.socket != target.path:
            return
        space.inflight += 1
        if not head.upgrade:
            space.requests += 1
        space.last_active = self._reactor.seconds()
        self._by_head[id(head)] = space

    def request_ended(self, head: Any, target: Target) -> None:
        space = self._by_head.pop(id(head), None)
        if space is None:
            return
        space.inflight -= 1
        if not head.upgrade:
            space.requests -= 1
            if space.requests <= 0:
                done, space.requests_done = space.requests_done, []
                for d in done:
                    if not d.called:  # (a wait whose budget ran out was cancelled)
                        d.callback(None)
        space.last_active = self._reactor.seconds()

    # -- waking ----------------------------------------------------------------------------------

    def wake(self, route: Route, reason: str) -> Deferred[None]:
        """Fires once ``route``'s space is awake (at once if it is), or fails with
        :class:`WakeFailed`. Cancelling the returned Deferred stops waiting, not the wake."""
        host = route.host
        space = self._spaces.get(host)
        if space is not None and space.state == "awake":
            return succeed(None)
        if space is None and host in self._failures:
            retry_at = self._failures[host][1]
            left = retry_at - self._reactor.seconds()
            if left > 0:
                return fail(WakeFailed(host, "backoff", "a recent wake failed", left))
        if space is None and host in self._held:
            # Held elsewhere a moment ago: answer from that, not with another PUT and GET of the
            # lock (a busy space on a dead box would otherwise cost two requests per request).
            until, retry_after, why = self._held[host]
            if self._reactor.seconds() < until:
                _lease_conflicts.inc()
                return fail(WakeFailed(host, "lease_held", why, retry_after))
            del self._held[host]
        waiter: Deferred[None] = Deferred(lambda d: self._drop_waiter(host, d))
        if space is None:
            space = self._new_entry(route, reason)
            space.waiters.append(waiter)
            space.task = Deferred.fromCoroutine(self._wake(space))
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

    def _new_entry(self, route: Route, reason: str) -> _Space:
        host = route.host
        now = self._reactor.seconds()
        space = _Space(
            host=host,
            route=route,
            state="waking",
            since=now,
            socket=route.socket or hosts.socket_path(self._cfg.run_dir, host),
            db=route.db_path or hosts.db_path(self._cfg.data_dir, host),
            reason=reason,
            last_active=now,
        )
        if reason == "due":
            space.due_woken = route.next_due
        self._spaces[host] = space
        self._update_gauge()
        return space

    async def _wake(self, space: _Space) -> dict[str, float]:
        host = space.host
        timings: dict[str, float] = {}
        clock = self._reactor.seconds
        t = clock()
        try:
            lease = await self._acquire(host)
        except LeaseHeld as e:
            _lease_conflicts.inc()
            _log.info(
                "activator: {host} not woken: lease held by {owner}", host=host, owner=e.owner
            )
            # The holder may be draining (seconds) or dead (until expiry): ask for a retry soon
            # either way rather than at the lease's expiry.
            raise WakeFailed(
                host,
                "lease_held",
                f"{host} is being served elsewhere ({e})",
                min(e.retry_after, LEASE_HELD_RETRY),
            ) from e
        except ObjectStoreError as e:
            raise WakeFailed(host, "bucket", f"the bucket is unavailable: {e}") from e
        space.lease = lease
        space.keeper = LeaseKeeper(
            self._reactor,
            self._store,
            lease,
            lambda why: self._lease_lost(space, why),
            renew_every=self._renew_every,
            verify_retake=lambda held: self._lease_retaken(space, held),
        )
        space.keeper.start()
        timings["lease"] = clock() - t
        _log.info("activator: {host} waking (lease acquired)", host=host, reason=space.reason)

        t = clock()
        plan = await self._prepare_db(space)
        listing, resume = plan.listing, plan.resume
        timings["restore"] = clock() - t

        if resume is not None:
            # The local database is exactly the bucket's newest state and nobody writes it yet:
            # replication starts first and continues the replica without a snapshot.
            t = clock()
            await self._start_replication(space, listing, resume)
            timings["replicate"] = clock() - t

        t = clock()
        await self._evict_orphan(space)
        try:
            env = await self._run(lambda: space_env(self._cfg, host, space.socket))
            env["LCHAT_DB"] = space.db
            spec = ChildSpec(
                name=host,
                argv=tuple(self._cfg.space_argv(host)),
                env=env,
                ready_socket=space.socket,
            )
            space.child = spawn(self._reactor, spec)
        except (EnvFileError, SpawnError, hosts.InvalidHost) as e:
            _log.error("activator: {host} cannot start: {error}", host=host, error=e)
            raise WakeFailed(host, "spawn", f"{host} cannot start: {e}") from e
        child = space.child
        child.ended.addCallback(lambda info: self._child_ended(space, child, info))
        timings["spawn"] = clock() - t

        t = clock()
        try:
            # Poll often: a refused connect costs microseconds, and every poll interval is wake
            # latency a member waits through.
            await child.wait_ready(timeout=self.budgets.ready, interval=0.02)
        except NotReady as e:
            _log.error("activator: {host} did not become ready: {error}", host=host, error=e)
            raise WakeFailed(host, "not_ready", f"{host} did not start: {e}") from e
        timings["ready"] = clock() - t

        if resume is None:
            # A new database (the space created it) or one of unknown lineage: snapshot.
            t = clock()
            await self._start_replication(space, listing, None, plan.floor)
            timings["replicate"] = clock() - t
        return timings

    async def _evict_orphan(self, space: _Space) -> None:
        """A space still listening on the socket now can only be one a previous router process
        of this box left behind (we hold the lease, and the run dir is ours): it would make the
        new child refuse to start. Stop it — SIGTERM, then SIGKILL — before spawning."""
        pid = await self._run(lambda: _listener_pid(space.socket))
        if pid is None or pid == os.getpid():
            return
        _log.warn(
            "activator: {host}: pid {pid} (left by a previous router) still listens on "
            "{socket}: stopping it",
            host=space.host,
            pid=pid,
            socket=space.socket,
        )
        _signal_group(pid, signal.SIGTERM)
        deadline = self._reactor.seconds() + self.budgets.stop
        while await self._run(lambda: _listener_pid(space.socket)) == pid:
            if self._reactor.seconds() >= deadline:
                _signal_group(pid, signal.SIGKILL)
                await deferLater(self._reactor, 0.2, lambda: None)
                break
            await deferLater(self._reactor, 0.1, lambda: None)

    async def _start_replication(
        self,
        space: _Space,
        listing: Sequence[ObjectInfo] | None,
        resume: int | None,
        floor: int = 0,
    ) -> None:
        space.replicator = Replicator(
            self._reactor,
            self._store,
            space.db,
            self._replica_path(space.host),
            interval=INTERVALS.get(space.route.replication, INTERVALS["stream"]),
            keeper=space.keeper,
            **self._replicator_options,
        )
        try:
            await space.replicator.start(listing, resume_txid=resume, txid_floor=floor)
        except (ObjectStoreError, ReplicatorStopped) as e:
            raise WakeFailed(space.host, "bucket", f"replication could not start: {e}") from e
        space.replicating = True
        # From here the bucket moves on past the marker: it no longer describes the local file.
        await self._run(lambda: _remove(space.db + MARKER_SUFFIX))

    async def _acquire(self, host: str) -> HeldLease:
        """Take the space's lease. Held by someone else, it is asked again a few times over
        ~0.7 s first: a holder that is draining (a box stopping, or a mesh peer handing over)
        releases it within moments, and waiting beats a 503."""
        for delay in (*LEASE_HELD_RETRIES, None):
            try:
                return await acquire(
                    self._store,
                    self._lease_key(host),
                    self._cfg.box_id,
                    self._hib.lease_ttl,
                    host=host,
                    reclaim_own=True,
                )
            except LeaseHeld:
                if delay is None:
                    raise
            await deferLater(self._reactor, delay, lambda: None)
        raise AssertionError("unreachable")

    async def _prepare_db(self, space: _Space) -> _DBPlan:
        """Restore the database unless a local copy must be used (docs/hibernation.md, "Waking"
        and "When the bucket forgets"). The plan carries the LIST of the replica when one was
        made (the replicator reuses it), the txid the local database is known to match (then
        replication resumes instead of snapshotting), and the txid replication must continue
        above (a re-seed from a local copy of a known txid)."""
        host = space.host
        path = self._replica_path(host)
        local = await self._run(lambda: _local_state(space.db))
        reclaimed = space.lease is not None and space.lease.took_over_from == self._cfg.box_id
        if local.present and local.marker_txid is None and (self._cfg.mesh is None or reclaimed):
            # Not cleanly slept here (a crash, or created before hibernation): it is the newest
            # copy — on one box nobody else can have written since, and in a mesh the lease we
            # just took back was still our own (nobody held it in between).
            _log.info("activator: {host} restored: local db present, skipping restore", host=host)
            return _DBPlan(None)
        try:
            listing = await self._store.list(path + "/")
        except ObjectStoreError as e:
            if local.present:
                raise WakeFailed(host, "bucket", f"the bucket is unavailable: {e}") from e
            raise WakeFailed(host, "bucket", f"cold wake needs the bucket: {e}") from e
        bucket = _judge_bucket(listing)
        newest = bucket.newest
        if local.present and local.marker_txid is None and newest == 0:
            # A mesh box's unvouched copy, but the bucket has nothing: it is all there is.
            _log.info("activator: {host} restored: local db present, skipping restore", host=host)
            return _DBPlan(listing)
        if local.present and local.marker_txid is not None:
            mine = local.marker_txid
            if mine == newest:
                _log.info(
                    "activator: {host} restored: local db present, skipping restore", host=host
                )
                return _DBPlan(listing, resume=newest or None)
            if bucket.lost_everything_up_to(mine):
                # Slept here cleanly at txid `mine`, and the bucket has none of it (or only files
                # that restore to nothing): the bucket forgot. The local file is the space.
                self._bucket_forgot(host, space.db, mine, bucket, moved_back=False)
                return _DBPlan(listing, floor=mine)
            if newest < mine or not bucket.restorable:
                raise self._diverged(host, space.db, mine, bucket, live=True)
            # The bucket moved on past the local copy (another box served it): restore below.
        if local.present:
            if not bucket.restorable:
                _log.error(
                    "activator: {host} restore failed: {error}; the local db {db} (txid "
                    "unknown) is kept where it is",
                    host=host,
                    error=bucket.error,
                    db=space.db,
                )
                raise WakeFailed(host, "restore", f"restore failed: {bucket.error}")
            aside = await self._run(lambda: _move_aside(space.db, "stale"))
            _log.warn(
                "activator: {host}: local db matches txid {mine}, the bucket has {newest}: "
                "moved it to {aside} and restoring",
                host=host,
                mine=local.marker_txid if local.marker_txid is not None else "unknown",
                newest=newest,
                aside=aside,
            )
        else:
            # No local file. A copy this box moved aside must not lose to an emptier bucket.
            asides = await self._run(lambda: _moved_aside(space.db))
            dated = [a for a in asides if a.txid is not None]
            best = max(dated, key=lambda a: (a.txid or 0, a.path)) if dated else None
            if best is not None and best.txid:
                if bucket.lost_everything_up_to(best.txid):
                    await self._run(lambda: _move_back(best.path, space.db))
                    self._bucket_forgot(host, best.path, best.txid, bucket, moved_back=True)
                    return _DBPlan(listing, floor=best.txid)
                if bucket.restorable and newest < best.txid:
                    raise self._diverged(host, best.path, best.txid, bucket, live=False)
            if newest == 0 and asides:
                # Copies whose txid nobody recorded (an older router, or lost before
                # replicating): whether they hold the space cannot be told, and an empty start
                # would hide them. An operator decides.
                raise self._diverged(host, asides[0].path, None, bucket, live=False)
        if newest == 0:
            _log.info("activator: {host} restored: no replica yet, starting empty", host=host)
            return _DBPlan(listing)
        try:
            result = await restore(self._store, path, space.db)
        except (RestoreError, ObjectStoreError) as e:
            _log.error("activator: {host} restore failed: {error}", host=host, error=e)
            raise WakeFailed(host, "restore", f"restore failed: {e}") from e
        _log.info(
            "activator: {host} restored: {result}", host=host, result=_describe_restore(result)
        )
        return _DBPlan(listing, resume=result.txid)

    def _bucket_forgot(
        self, host: str, copy: str, txid: int, bucket: _Bucket, *, moved_back: bool
    ) -> None:
        RESEEDS.labels("wake").inc()
        _log.error(
            "activator: {host}: THE BUCKET LOST DATA: it has {what}, but {copy} holds txid "
            "{txid}{moved}: waking from that copy and re-seeding the bucket from it (a snapshot "
            "at txid {next}). Find out why the bucket forgot.",
            host=host,
            what=bucket.describe(),
            copy=copy,
            txid=txid,
            moved=" (moved back into place)" if moved_back else "",
            next=txid + 1,
        )

    def _diverged(
        self, host: str, copy: str, txid: int | None, bucket: _Bucket, *, live: bool
    ) -> WakeFailed:
        """A local copy and the bucket that cannot both be right: refuse, keep both, and say in
        the log how to choose (nothing here can tell which one holds the writes that matter)."""
        db = hosts.db_path(self._cfg.data_dir, host) if not live else copy
        if live:
            keep_copy = f"rm {db}{MARKER_SUFFIX}"
            keep_bucket = f"mv {db} {db}.kept (with its -wal, and rm {db}{MARKER_SUFFIX})"
        else:
            keep_copy = f"mv {copy} {db} (with its -wal), then rm {copy}{MARKER_SUFFIX}"
            keep_bucket = f"mv {copy} {copy}.kept (and its -wal and {MARKER_SUFFIX} files)"
        dated = f"txid {txid}" if txid is not None else "a txid nobody recorded"
        _log.error(
            "activator: {host} not woken: the bucket has {what}, but {copy} holds {dated}: the "
            "bucket lost files, or the space was started afresh elsewhere. Refusing to wake so "
            "that neither copy is lost. To serve that copy (and re-seed the bucket from it): "
            "{keep_copy}. To serve the bucket's copy instead: {keep_bucket}. Then wake it "
            "again (POST /wake?host={host}).",
            host=host,
            what=bucket.describe(),
            copy=copy,
            dated=dated,
            keep_copy=keep_copy,
            keep_bucket=keep_bucket,
        )
        return WakeFailed(
            host, "diverged", f"{copy} ({dated}) and the bucket ({bucket.describe()})"
        )

    async def _lease_retaken(self, space: _Space, held: HeldLease) -> bool:
        """The keeper re-took the space's lock after it vanished from the bucket: is the replica
        still only this box's? The replicator compares, and re-seeds what the bucket lost; False
        (someone else wrote meanwhile) makes the keeper report a takeover."""
        space.lease = held
        _log.error(
            "activator: {host}: its lease vanished from the bucket while awake here; re-took it "
            "(generation {generation}) and keeps serving; checking the replica",
            host=space.host,
            generation=held.generation,
        )
        replicator = space.replicator
        if replicator is None or replicator.stopped:
            return True  # nothing shipped under this lease yet: replication's start LISTs itself
        return await replicator.recheck("lease")

    def _wake_done(self, outcome: object, space: _Space) -> None:
        host = space.host
        space.task = None
        if self._spaces.get(host) is not space:
            return
        waiters, space.waiters = space.waiters, []
        if isinstance(outcome, Failure):
            why = outcome.value
            if isinstance(why, WakeFailed):
                reason, failure = why.reason, outcome
            elif outcome.check(TimeoutError):
                reason = "timeout"
                failure = Failure(
                    WakeFailed(host, reason, f"wake took longer than {self.budgets.wake:g}s")
                )
            elif outcome.check(CancelledError):
                reason = "cancelled"
                failure = Failure(WakeFailed(host, reason, "the wake was called off"))
            else:
                _log.failure("activator: {host} wake failed", outcome, host=host)
                reason, failure = "error", Failure(WakeFailed(host, "error", str(why)))
            _wakes.labels(space.reason, reason).inc()
            if reason == "lease_held" and isinstance(why, WakeFailed):
                if len(self._held) > 10_000:
                    self._held.clear()
                self._held[host] = (
                    self._reactor.seconds() + min(why.retry_after, LEASE_HELD_CACHE),
                    why.retry_after,
                    why.message,
                )
            if reason not in ("lease_held", "cancelled"):
                count = self._failures.get(host, (0, 0.0))[0] + 1
                delay = min(2.0 ** (count - 1), MAX_WAKE_BACKOFF)
                self._failures[host] = (count, self._reactor.seconds() + delay)
            else:
                delay = 0.0
            _log.warn(
                "activator: {host} wake failed ({reason}); the next request retries{after}",
                host=host,
                reason=reason,
                after=f" after {delay:g}s" if delay else "",
            )
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
        space.woke_at = space.last_active = now
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
            self._write_next_due(host, 0, only_if=space.due_woken)
        self._start_sidecar(space)
        for d in waiters:
            if not d.called:
                d.callback(None)

    # -- sidecars --------------------------------------------------------------------------------

    def _start_sidecar(self, space: _Space) -> None:
        host = space.host
        bot_env = hosts.bot_env_path(self._cfg.data_dir, host)

        def build() -> ChildSpec | None:
            if not os.path.exists(bot_env):
                return None
            env = space_env(self._cfg, host, space.socket, env_file=bot_env)
            env["LCHAT_DB"] = space.db
            return ChildSpec(
                name=_sidecar_name(host), argv=tuple(self._cfg.sidecar_argv(host)), env=env
            )

        def got(spec: ChildSpec | None) -> None:
            if spec is None or self._spaces.get(host) is not space or space.state != "awake":
                return
            _log.info("activator: {host} starting its bot sidecar", host=host)
            self._want_sidecar(host, spec)

        def failed(f: Failure) -> None:
            # Members before bots: a sidecar that cannot start never fails the wake.
            _log.error(
                "activator: {host} sidecar not started: {error}",
                host=host,
                error=f.getErrorMessage(),
            )

        self._run(build).addCallbacks(got, failed)

    def _want_sidecar(self, host: str, spec: ChildSpec | None) -> None:
        name = _sidecar_name(host)
        if spec is None:
            self._sidecar_specs.pop(name, None)
        else:
            self._sidecar_specs[name] = spec
        self._sidecars.want(self._sidecar_specs)

    async def _stop_sidecar(self, host: str) -> None:
        name = _sidecar_name(host)
        if name not in self._sidecar_specs:
            return
        child = self._sidecars.child(name)
        self._want_sidecar(host, None)
        if child is not None:
            ended = child.ended
            ended.addTimeout(self.budgets.sidecar_stop, self._reactor)
            try:
                await ended
            except CancelledError:
                _sleep_step_failures.labels("sidecar").inc()
                _log.warn("activator: {host} sidecar did not stop in time", host=host)

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

    async def _stand_down(self, space: _Space, reason: str, *, graceful: bool) -> None:
        """Stop everything ``space`` runs, flush, release, forget. ``graceful``: ask the space
        for its next due time first (sleep); otherwise it is a failed wake or a dead child."""
        host = space.host
        if space.state == "stopping" and not graceful:
            return
        space.state = "stopping"
        space.since = self._reactor.seconds()
        self._update_gauge()
        if graceful:
            _log.info("activator: {host} sleeping ({reason})", host=host, reason=reason)
        try:
            await self._step(
                host, "sidecar", self._stop_sidecar(host), self.budgets.sidecar_stop + 1
            )
            if graceful and space.child is not None and space.child.exit_info is None:
                due = await self._step(
                    host, "next_due", self._ask_next_due(space), self.budgets.next_due
                )
                if isinstance(due, int):
                    if due and space.due_woken and due <= space.due_woken:
                        due = 0  # honoured already: a past due time wakes once, not in a loop
                    self._write_next_due(host, due)
            if graceful and space.requests > 0 and space.child is not None:
                # New requests queue (state "stopping"); those already sent to the space are
                # let finish first. SIGTERM now would race them: the space closes the kept-alive
                # connections it has not read a request on yet, so a request written a moment
                # ago would go unanswered (the owner of a drain could not even say it was never
                # processed).
                await self._step(
                    host, "requests", self._requests_finished(space), self.budgets.requests
                )
            self._drop_idle(space.socket)
            if space.child is not None:
                grace = self.budgets.lease_lost_stop if space.lost else self.budgets.stop
                await space.child.terminate(timeout=grace)
            flushed = False
            if space.replicator is not None:
                if space.lost is None and space.replicating:
                    flushed = await self._flush(space)
                await space.replicator.stop()
            if space.keeper is not None:
                if space.lost is not None:
                    pass  # never write again: it is someone else's now
                elif flushed or not space.replicating:
                    released = await space.keeper.release(self.budgets.release)
                    if not released:
                        _sleep_step_failures.labels("release").inc()
                else:
                    # Invariant 2: no release without a flush. The lease expires on its own;
                    # until then only this box (reclaim_own) can wake the space, from its newest
                    # local copy.
                    space.keeper.stop()
                    _log.error(
                        "activator: {host} final flush failed: lease left to expire "
                        "(only this box can wake it until then)",
                        host=host,
                    )
            if flushed and space.replicator is not None and reason not in _HANDED_BACK:
                txid = space.replicator.txid
                await self._run(lambda: _write_marker(space.db, txid))
            if space.lost is not None and _taken(space.lost):
                # What the copy holds at least (every txid the replicator read from it): a wake
                # compares it with the bucket, so it is never lost to an emptier bucket.
                dated = space.replicator.txid if space.replicating and space.replicator else None
                aside = await self._run(lambda: _move_aside(space.db, "lease-lost", dated))
                if aside:
                    _log.warn(
                        "activator: {host} local db moved to {aside} (lease {why}: the bucket "
                        "is the truth now)",
                        host=host,
                        aside=aside,
                        why=space.lost,
                    )
            elif space.lost is not None:
                # Not renewed in time (the bucket was unreachable): nobody is known to have
                # taken it, and the local file holds writes the bucket may lack. No marker: the
                # next wake on this box trusts it and snapshots it.
                _log.warn(
                    "activator: {host} lease lost ({why}): keeping the local db (newer than "
                    "the bucket); the next wake snapshots it",
                    host=host,
                    why=space.lost,
                )
        except Exception:
            _log.failure("activator: {host} standing down failed", host=host)
        finally:
            if self._spaces.get(host) is space:
                del self._spaces[host]
            for key in [k for k, s in self._by_head.items() if s is space]:
                del self._by_head[key]
            self._update_gauge()
            self.released(host)
        if graceful:
            _sleeps.labels(reason).inc()
            _log.info("activator: {host} asleep ({reason})", host=host, reason=reason)
        waiters, space.waiters = space.waiters, []
        waiters = [d for d in waiters if not d.called]
        if waiters and not self._stopping and space.wake_again:
            # Requests arrived while it was stopping: wake it again for them.
            route = self._routes.table.get(host)
            if route is not None and route.hibernate and route.kind == "instance":
                for d in waiters:
                    self.wake(route, "request").addBoth(_relay, d)
                return
        for d in waiters:
            if not d.called:
                d.errback(WakeFailed(host, "stood_down", f"{host} stood down; try again"))

    async def _requests_finished(self, space: _Space) -> None:
        if space.requests > 0:
            done: Deferred[None] = Deferred()
            space.requests_done.append(done)
            await done

    async def _step(self, host: str, name: str, work: Any, budget: float) -> Any:
        d = Deferred.fromCoroutine(work)
        d.addTimeout(budget, self._reactor)
        try:
            return await d
        except (CancelledError, TimeoutError):
            _sleep_step_failures.labels(name).inc()
            _log.warn(
                "activator: {host} sleep step {step} ran out of time ({budget:g}s)",
                host=host,
                step=name,
                budget=budget,
            )
        except Exception as e:
            _sleep_step_failures.labels(name).inc()
            _log.warn(
                "activator: {host} sleep step {step} failed: {error}",
                host=host,
                step=name,
                error=e,
            )
        return None

    async def _ask_next_due(self, space: _Space) -> int | None:
        env = await self._run(lambda: read_env_file(hosts.env_path(self._cfg.data_dir, space.host)))
        token = env.get("LCHAT_ADMIN_TOKEN", "")
        resp = await unixhttp.request(
            self._reactor,
            space.socket,
            "GET",
            "/api/next-due",
            host=space.host,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=self.budgets.next_due,
        )
        if resp.status != 200:
            raise ValueError(f"GET /api/next-due answered {resp.status}")
        due = json.loads(resp.body).get("due")
        if not isinstance(due, int) or isinstance(due, bool) or due < 0:
            raise ValueError(f"GET /api/next-due: not a due time: {due!r}")
        _log.info("activator: {host} next due {due}", host=space.host, due=due or "none")
        return due

    async def _flush(self, space: _Space) -> bool:
        """Flush, retrying within the budget: True once everything is in the bucket."""
        assert space.replicator is not None
        deadline = self._reactor.seconds() + self.budgets.flush
        delay = 0.5
        while True:
            # check: the last flush before sleep LISTs once, so a bucket that forgot the space
            # is re-seeded now, not at the next wake (the bucket is then all there is off-box).
            attempt = Deferred.fromCoroutine(space.replicator.flush(check=True))
            attempt.addTimeout(max(deadline - self._reactor.seconds(), 0.01), self._reactor)
            try:
                await attempt
                return True
            except ReplicatorStopped as e:
                _log.error("activator: {host} flush impossible: {error}", host=space.host, error=e)
                return False
            except (ObjectStoreError, CancelledError, OSError) as e:
                _sleep_step_failures.labels("flush").inc()
                left = deadline - self._reactor.seconds()
                _log.error(
                    "activator: {host} flush failed ({error}); {left:.0f}s left",
                    host=space.host,
                    error=e if not isinstance(e, CancelledError) else "timed out",
                    left=max(left, 0),
                )
                if left <= delay:
                    return False
            await deferLater(self._reactor, delay, lambda: None)
            delay = min(delay * 2, 10.0)

    def _child_ended(self, space: _Space, child: RunningChild, info: Any) -> None:
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
        elif space.state == "waking" and space.task is not None:
            pass  # wait_ready reports it

    def _lease_lost(self, space: _Space, why: str) -> None:
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

    # -- registry --------------------------------------------------------------------------------

    def _write_next_due(self, host: str, due: int, only_if: int | None = None) -> None:
        registry = self._routes.registry

        def write() -> bool:
            row = registry.get(host)
            if row is None or (only_if is not None and row.next_due != only_if):
                return False
            if row.next_due != due:
                registry.update(host, next_due=due)
                return True
            return False

        d = self._run(write)
        d.addCallback(lambda changed: self._routes.reload(f"{host} next due") if changed else None)
        d.addErrback(lambda f: _log.failure("could not record next due of {host}", f, host=host))

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
        self._sidecars.startService()
        self._update_gauge()

    def stopService(self) -> Deferred[None]:
        """Drain: every awake space flushed and released, in parallel, in bounded time."""
        super().stopService()
        self._stopping = True
        hosts_now = list(self._spaces)
        if hosts_now:
            _log.info("activator: draining {n} spaces", n=len(hosts_now))
        waits = [self.sleep(host, "shutdown") for host in hosts_now]
        d: Deferred[Any] = DeferredList(waits, consumeErrors=True)
        d.addCallback(lambda _: self._sidecars.stopService())
        return d.addCallback(lambda _: None)

    # -- names -----------------------------------------------------------------------------------

    def _lease_key(self, host: str) -> str:
        return self._hib.key(host, "lock.json")

    def _replica_path(self, host: str) -> str:
        return self._hib.key(host)

    def _update_gauge(self) -> None:
        for state in ("waking", "awake", "stopping"):
            _awake.labels(state).set(sum(1 for s in self._spaces.values() if s.state == state))


# -- helpers -------------------------------------------------------------------------------------


def _taken(why: str) -> bool:
    """Did someone else take the lease (rather than our renewals failing)?"""
    return why.startswith(("taken over", "gone", "replaced"))


def _sidecar_name(host: str) -> str:
    return f"{host}-bot"


def _relay(result: object, d: Deferred[None]) -> None:
    if d.called:
        return
    if isinstance(result, Failure):
        d.errback(result)
    else:
        d.callback(None)


@frozen
class _Local:
    present: bool
    marker_txid: int | None  # None: no marker, or the files changed since it was written


@frozen
class _DBPlan:
    """What the wake's database step decided (see ``_prepare_db``)."""

    listing: Sequence[ObjectInfo] | None
    resume: int | None = None  # the local database is exactly this txid of the bucket's
    floor: int = 0  # replication's txids continue above this


@frozen
class _Bucket:
    """The replica as one LIST shows it."""

    newest: int  # the highest txid of any file (0: none)
    restorable: bool  # a restore reaches ``newest`` (a snapshot, no gap)
    error: str = ""  # why not

    def lost_everything_up_to(self, txid: int) -> bool:
        """Nothing here that a copy at ``txid`` lacks: no files, or files that restore to
        nothing and reach no further (a forgetful bucket's stray incrementals)."""
        return self.newest == 0 or (not self.restorable and self.newest <= txid)

    def describe(self) -> str:
        if self.newest == 0:
            return "no replica files"
        if not self.restorable:
            return f"files up to txid {self.newest} that cannot be restored ({self.error})"
        return f"txid {self.newest}"


def _judge_bucket(listing: Sequence[ObjectInfo]) -> _Bucket:
    files = replica_files(list(listing))
    newest = max((f.max_txid for f in files), default=0)
    if newest == 0:
        return _Bucket(0, True)
    try:
        reached = plan_files(files)[-1].max_txid
    except RestoreError as e:
        return _Bucket(newest, False, str(e))
    return _Bucket(newest, reached == newest, "" if reached == newest else "files beyond a gap")


@frozen
class _Aside:
    path: str  # <db>.stale-<stamp> or <db>.lease-lost-<stamp>
    txid: int | None  # what it holds at least, from its record (None: unrecorded or changed)


_ASIDE_NAME = re.compile(r"\.(?:stale|lease-lost)-\d{8}T\d{6}")


def _moved_aside(db: str) -> list[_Aside]:
    """The copies of ``db`` moved aside by :func:`_move_aside`, newest name first."""
    directory, base = os.path.split(db)
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return []
    found = []
    for name in names:
        if name.startswith(base) and _ASIDE_NAME.fullmatch(name[len(base) :]):
            path = os.path.join(directory, name)
            found.append(_Aside(path, _local_state(path).marker_txid))
    return sorted(found, key=lambda a: a.path, reverse=True)


def _move_back(aside: str, db: str) -> None:
    """Put a moved-aside copy back as ``db`` (with its WAL), without its record: the wake then
    trusts it as a local file of unknown lineage and ships a snapshot of it."""
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(aside + suffix):
            os.replace(aside + suffix, db + suffix)
    _remove(aside + MARKER_SUFFIX)
    _remove(db + MARKER_SUFFIX)


def _fingerprint(db: str) -> list[list[int] | None]:
    """What the database and its WAL look like on disk: a later write changes it."""
    out: list[list[int] | None] = []
    for path in (db, db + "-wal"):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            out.append(None)
        else:
            out.append([st.st_ino, st.st_size, st.st_mtime_ns])
    return out


def _local_state(db: str) -> _Local:
    present = os.path.exists(db)
    marker: int | None = None
    if present:
        try:
            with open(db + MARKER_SUFFIX, "rb") as f:
                record = json.load(f)
            value = record.get("txid")
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and record.get("files") == _fingerprint(db)
            ):
                marker = value
        except (OSError, ValueError, AttributeError):
            marker = None
    return _Local(present, marker)


def _write_marker(db: str, txid: int) -> None:
    """Record that the local database is exactly the bucket's state at ``txid`` — valid only
    while the files are untouched (anything else writing them voids it)."""
    tmp = db + MARKER_SUFFIX + ".tmp"
    record = {"txid": txid, "slept_at": int(time.time()), "files": _fingerprint(db)}
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, db + MARKER_SUFFIX)


def _listener_pid(path: str) -> int | None:
    """The pid of the process listening on unix socket ``path`` (SO_PEERCRED), or None."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(path)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    finally:
        sock.close()
    pid = struct.unpack("3i", creds)[0]
    return pid if pid > 0 else None


def _signal_group(pid: int, signum: int) -> None:
    """Signal the process group ``pid`` leads (our children are session leaders), else ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _move_aside(db: str, why: str, txid: int | None = None) -> str | None:
    """Rename the database and its -wal/-shm/marker out of the way; returns the new name.

    ``txid``: the copy holds at least that state (its replicator had read that far), recorded
    beside it in the marker's format (``<new name>-lchat.json``), so a later wake can tell
    whether the bucket is behind it. Without it, a moved marker still dates the copy."""
    if not os.path.exists(db):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = f"{db}.{why}-{stamp}"
    for suffix in ("", "-wal", "-shm", MARKER_SUFFIX):
        if os.path.exists(db + suffix):
            os.replace(db + suffix, target + suffix)
    if txid is not None:
        _write_marker(target, txid)
    return target


def _describe_restore(result: Any) -> str:
    parts = []
    for name in ("txid", "files", "pages", "bytes_downloaded"):
        value = getattr(result, name, None)
        if value is not None:
            parts.append(f"{name}={value}")
    return ", ".join(parts) or "done"


def iter_hibernating(table: RouteTable) -> Iterable[Route]:
    return (r for r in table if r.hibernate and r.kind == "instance")

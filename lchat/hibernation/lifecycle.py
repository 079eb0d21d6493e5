"""How one hibernating space is brought up and put down: the steps of a wake and of a stand-down,
each under its budget (docs/hibernation.md, "Waking", "Sleeping", "Budgets").

The activator (lchat.hibernation.activator) decides *when* and keeps the states; a
:class:`Lifecycle` does the work on a :class:`~lchat.hibernation.space.Space` it is handed:

- which bucket: this box's own, or, for a space homed in a region that keeps its replicas in
  another bucket (``LCHAT_REGION_BUCKETS``; the mesh routes one here only under the operator's
  regional failover: lchat.mesh.routing), that region's bucket (:class:`WakeBucket`): every step
  below then reads and writes there, never this box's older copy;
- wake: take the lease (asking a held one again for ~0.7 s: a draining holder releases it within
  moments) and keep it renewed; refuse a copy the space was relocated away from
  (lchat.hibernation.moved: a box that missed the fan-out); hold the build to the space's floor (lchat.hibernation.floor: the
  build the live link resolves to, never older than the newest the space ran); the database step (lchat.hibernation.localdb); replication, first
  when the local file is exactly the bucket's newest state, else once the space is ready; spawn
  the space (after evicting a leftover on its socket) and wait for ``GET /api/version``;
- stand-down: stop the sidecar; ask the next due time (graceful only); let the requests already
  sent finish (graceful only); SIGTERM, SIGKILL after the grace; flush; release the lease (never
  without a flush); write the clean-sleep marker, or move the database aside when someone else
  took the lease.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from attrs import define, field, frozen
from prometheus_client import Counter
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from lchat import builds, hosts, unixhttp
from lchat.backoff import Backoff
from lchat.buckets import RegionBuckets
from lchat.builds import record_quietly
from lchat.child import ChildSpec, NotReady, RunningChild, SpawnError, evict_listener, spawn
from lchat.config import BoxConfig, ConfigError, read_env_file
from lchat.hibernation import localdb
from lchat.hibernation.floor import BuildFloor
from lchat.hibernation.localdb import DBPlan, Restorer
from lchat.hibernation.moved import MovedCheck
from lchat.hibernation.sidecars import STEP_FAILURES, Sidecars
from lchat.hibernation.space import Budgets, Space, WakeFailed
from lchat.isolation import IsolationError
from lchat.lease import (
    HeldLease,
    LeaseHeld,
    LeaseKeeper,
    LeaseRecord,
    NotAlive,
    acquire,
    lease_key,
)
from lchat.objstore import NotFound, ObjectStore, ObjectStoreError, StoreUnavailable
from lchat.objstore.aws import NoCredentials
from lchat.objstore.where import Where
from lchat.reactors import TimeReactor
from lchat.registry import Route
from lchat.replica.replicator import INTERVALS, Replicator, ReplicatorStopped
from lchat.routesource import RouteSource
from lchat.threads import RunInThread
from lchat.units import Claims, EnvFileError, space_env, space_user

_log = Logger(namespace="lchat.activator")

LEASE_CONFLICTS = Counter(
    "lchat_lease_conflicts_total", "Wakes refused because another holder has the lease"
)

LEASE_HELD_RETRY = 10.0  # the longest Retry-After a lease held elsewhere earns
LEASE_READ_TIMEOUT = 10.0  # a read of a lease outside a wake (the recovery of local copies)
# Seconds between asking a held lease again in one wake: a draining holder that lets go within
# ~0.3 s is taken over at once; else a 503 + Retry-After within ~0.5 s (never a slow refusal).
LEASE_HELD_RETRIES = (0.1, 0.2)
FLUSH_RETRY = Backoff(0.5, 10.0)  # a failed flush before sleep, retried within the flush budget
# Sleeps after which someone else runs the database: no marker (it could not stay true).
HANDED_BACK = ("hibernate off", "removed")

Spawner = Callable[[IReactorTime, ChildSpec], RunningChild]  # (reactor, spec): lchat.child.spawn


class Contract(Protocol):
    """What a stand-down asks a space (:class:`SpaceContract` over its socket)."""

    async def next_due(self, host: str, socket: str, timeout: float) -> int: ...  # noqa: ASYNC109


@frozen
class SpaceContract:
    """Asks a space what the activator needs to know (docs/design.md §8): ``GET /api/next-due``
    with its admin token, at every graceful sleep, so that a scheduled delivery wakes it again
    (docs/hibernation.md, "Scheduled deliveries"). ``run_in_thread`` reads its env file."""

    reactor: TimeReactor
    run_in_thread: RunInThread
    data_dir: str

    async def next_due(self, host: str, socket: str, timeout: float) -> int:  # noqa: ASYNC109 (a Twisted timeout, not asyncio)
        """The space's earliest pending delivery (unix seconds, 0: none). Raises ValueError for
        an answer that is not one, and the transport's errors as they are."""
        env = await self.run_in_thread(lambda: read_env_file(hosts.env_path(self.data_dir, host)))
        token = env.get("LCHAT_ADMIN_TOKEN", "")
        resp = await unixhttp.request(
            self.reactor,
            socket,
            "GET",
            "/api/next-due",
            host=host,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=timeout,
        )
        if resp.status != 200:
            raise ValueError(f"GET /api/next-due answered {resp.status}")
        due = json.loads(resp.body).get("due")
        if not isinstance(due, int) or isinstance(due, bool) or due < 0:
            raise ValueError(f"GET /api/next-due: not a due time: {due!r}")
        _log.info("activator: {host} next due {due}", host=host, due=due or "none")
        return due


class Fence(Protocol):
    """The mesh's liveness fence, as the lifecycle sees it (lchat.mesh.fence.BoxFence)."""

    @property
    def box(self) -> str: ...

    @property
    def epoch(self) -> str: ...

    @property
    def epoch_started(self) -> float: ...

    def alive(self) -> bool: ...

    async def holder_check(self, record: LeaseRecord) -> str | None: ...

    async def ready(self, reactor: IReactorTime, budget: float) -> None: ...


def _alive_in(fence: Fence, epoch: str) -> Callable[[], bool]:
    """A lease keeper's liveness: the box is alive *and* still in the epoch the lease was taken
    in (a lapse starts a new epoch: nothing of the old one counts again, docs/lease.md)."""
    return lambda: fence.alive() and fence.epoch == epoch


def _read_failed(failure: Any) -> None:
    if failure.check(TimeoutError, CancelledError):
        raise StoreUnavailable(f"no answer within {LEASE_READ_TIMEOUT:g}s")
    failure.raiseException()


def taken(why: str) -> bool:
    """Did someone else take the lease (rather than our renewals failing)?"""
    return why.startswith(("taken over", "gone", "replaced"))


@frozen
class WakeBucket:
    """The bucket a space wakes from and sleeps into, with the wake's bucket steps bound to it:
    the lease (``lock.json``), the moved marker, the build floor's record, the replica. Chosen
    once per wake (:meth:`Lifecycle.bucket_for`) and kept on the :class:`Space`: its keeper and
    replicator write nowhere else until it is asleep, whatever its route says meanwhile."""

    region: str  # "": this box's own (LCHAT_HIBERNATE_*); else the home region it belongs to
    store: ObjectStore
    where: Where
    moved: MovedCheck
    floor: BuildFloor
    restorer: Restorer

    def lease_key(self, host: str) -> str:
        return lease_key(self.where.prefix, host)

    def replica_path(self, host: str) -> str:
        return self.where.key(host)


@define
class Lifecycle:
    """The steps of one box's wakes and stand-downs. Every collaborator is given here."""

    reactor: IReactorTime  # spawning and asking a space adapt it: IReactorProcess, IReactorUNIX
    cfg: BoxConfig
    store: ObjectStore
    routes: RouteSource  # next due times are recorded in the registry (only here)
    run_in_thread: RunInThread
    sidecars: Sidecars
    budgets: Budgets = field(factory=Budgets)
    spawner: Spawner | None = None  # None: lchat.child.spawn
    drop_idle: Callable[[str], object] = lambda socket: None  # the proxy's kept-alive connections
    renew_every: float | None = None  # the lease keeper's period (default: TTL / 3)
    # The clock the lease's deadline is kept on (``acquire`` and ``LeaseKeeper`` share it): the
    # router passes ``time.monotonic``, which also arms lchat.lease's watchdog thread; a test on
    # a fake clock passes that clock's ``seconds``.
    monotonic: Callable[[], float] = field(kw_only=True)
    replicator_options: Mapping[str, Any] = field(factory=dict)
    contract: Contract | None = None  # None: SpaceContract, GET /api/next-due on its socket
    # On a mesh box: its liveness fences its leases (docs/lease.md). No lease is taken while the
    # box is not alive; the leases it takes name it and its epoch; a peer's lease whose box is
    # dead (its heartbeat stale and its silence witnessed) is taken over before its expiry.
    fence: Fence | None = None
    # The other regions' buckets (LCHAT_REGION_BUCKETS): a space homed in one that is not this
    # box's wakes from its own region's bucket (bucket_for). None: every space wakes from ours.
    regions: RegionBuckets | None = None
    own: WakeBucket = field(init=False)  # this box's bucket (LCHAT_HIBERNATE_*)
    restorer: Restorer = field(init=False)  # own's (the steps every space homed here takes)
    floor: BuildFloor = field(init=False)
    moved: MovedCheck = field(init=False)
    _foreign: dict[str, WakeBucket] = field(init=False, factory=dict)  # region -> its bucket

    def __attrs_post_init__(self) -> None:
        hib = self.cfg.hibernate
        here = hib.where if hib is not None else Where("", "")
        # Only with per-region buckets can a space's copy here be one it was moved away from.
        per_region = hib is not None and any(
            not b.same_place(here) for b in self.cfg.region_buckets.values()
        )
        self.own = self._bucket("", self.store, here, per_region)
        self.moved, self.floor, self.restorer = self.own.moved, self.own.floor, self.own.restorer
        if self.contract is None:
            self.contract = SpaceContract(self.reactor, self.run_in_thread, self.cfg.data_dir)

    def _bucket(self, region: str, store: ObjectStore, where: Where, moves: bool) -> WakeBucket:
        """The wake's bucket steps on ``store`` (``where``); ``moves``: read its moved markers."""
        return WakeBucket(
            region,
            store,
            where,
            MovedCheck(
                store,
                where.prefix,
                moves,
                # (The router wires the repair on this box's own check: every bucket's calls it.)
                on_moved=self._moved_repair if region else None,
                clock=self.reactor.seconds,
            ),
            BuildFloor(
                store, where.prefix, self.cfg.box_id, self.run_in_thread, clock=self.reactor.seconds
            ),
            Restorer(
                store,
                self.run_in_thread,
                self.cfg.box_id,
                self.cfg.mesh is not None,
                self.cfg.data_dir,
                self.reactor,
            ),
        )

    def _moved_repair(self, host: str) -> object:
        repair = self.moved.on_moved
        return repair(host) if repair is not None else None

    async def bucket_for(self, route: Route) -> WakeBucket:
        """The bucket ``route``'s space wakes from and sleeps into: this box's own, unless its
        home region keeps its replicas in another bucket (``LCHAT_REGION_BUCKETS``); then that
        region's, opened once and kept. Never this box's copy of such a space (older, or none).
        Raises :class:`WakeFailed` (``bucket``) when that bucket cannot be opened."""
        region = route.home_region
        regions = self.regions
        where = regions.foreign(region) if regions is not None else None
        if regions is None or where is None:
            return self.own
        have = self._foreign.get(region)
        if have is not None:
            return have
        try:
            store = await regions.store(region)
        except (ConfigError, NoCredentials, ObjectStoreError, OSError) as e:
            raise WakeFailed(
                route.host, "bucket", f"region {region}'s bucket cannot be opened: {e}"
            ) from e
        have = self._foreign.setdefault(region, self._bucket(region, store, where, True))
        return have

    def new_space(self, host: str, route: Any, reason: str) -> Space:
        now = self.reactor.seconds()
        return Space(
            host=host,
            route=route,
            state="waking",
            since=now,
            socket=route.socket
            or hosts.socket_path(
                self.cfg.run_dir, host, isolated=hosts.isolated(self.cfg.data_dir)
            ),
            db=route.database(self.cfg.data_dir),
            reason=reason,
            clock=self.reactor.seconds,
            last_active=now,
            due_woken=route.next_due if reason == "due" else 0,
        )

    def replica_path(self, host: str) -> str:
        assert self.cfg.hibernate is not None
        return self.cfg.hibernate.key(host)

    def lease_owner(self, host: str) -> Deferred[str | None]:
        """Who ``host``'s lease names now (None: no lease), read from the bucket its route
        wakes from (:meth:`bucket_for`) within :data:`LEASE_READ_TIMEOUT` (a store error or a
        timeout fails it)."""
        assert self.cfg.hibernate is not None
        route = self.routes.table.get(host)

        async def read() -> str | None:
            try:
                bucket = self.own if route is None else await self.bucket_for(route)
            except WakeFailed as e:  # (its region's bucket cannot be opened: not read)
                raise StoreUnavailable(str(e)) from e
            try:
                got = await bucket.store.get(bucket.lease_key(host))
            except NotFound:
                return None
            return LeaseRecord.parse(got.body).owner

        d = Deferred.fromCoroutine(read())
        d.addTimeout(LEASE_READ_TIMEOUT, self.reactor)
        d.addErrback(_read_failed)
        return d

    # -- waking ----------------------------------------------------------------------------------

    async def wake(
        self,
        space: Space,
        claims: Claims,
        on_lost: Callable[[str], None],
        on_exit: Callable[[RunningChild, Any], None],
    ) -> dict[str, float]:
        """Bring ``space`` up (its host claimed in ``claims``); returns the seconds each phase
        took. Raises :class:`WakeFailed`; whatever it started stays on ``space`` for the
        stand-down to undo. First whoever else runs the database lets go of it (the claims'
        hand-over: the fleet backup), so one database never has two replicators."""
        host = space.host
        timings: dict[str, float] = {}
        clock = self.reactor.seconds
        t = clock()
        await claims.hand_over(host, space.db)
        bucket = space.bucket = await self.bucket_for(space.route)
        if bucket.region:
            _log.info(
                "activator: {host} wakes from region {region}'s bucket {bucket} (its home; "
                "this box's own copy is never used for it)",
                host=host,
                region=bucket.region,
                bucket=bucket.where.bucket,
            )
        lease = await self._acquire(host, bucket)
        space.lease = lease
        space.keeper = LeaseKeeper(
            self.reactor,
            bucket.store,
            lease,
            on_lost,
            renew_every=self.renew_every,
            verify_retake=lambda held: self._retaken(space, held),
            monotonic=self.monotonic,
            alive=_alive_in(self.fence, lease.epoch) if self.fence is not None else None,
        )
        space.keeper.start()
        timings["lease"] = clock() - t
        _log.info("activator: {host} waking (lease acquired)", host=host, reason=space.reason)

        # Which build, before anything else runs: a refusal costs no restore. First, whether
        # this bucket's copy is still the space's (lchat.hibernation.moved: one GET, only with
        # per-region buckets); a copy it was relocated away from is never restored.
        t = clock()
        await bucket.moved.check(host, space.route.home_region, space.route.settings_gen)
        try:
            argv = builds.space_argv(self.cfg.space_command, host)
        except hosts.InvalidHost as e:
            raise WakeFailed(host, "spawn", f"{host} cannot start: {e}") from e
        held = await bucket.floor.hold(host, argv)
        if held[:1] != argv[:1]:
            space.lifted_to = os.path.dirname(held[0])
        argv = held
        timings["floor"] = clock() - t

        t = clock()
        plan = await bucket.restorer.prepare(host, space.db, bucket.replica_path(host), lease)
        timings["restore"] = clock() - t
        if plan.resume is not None:
            # The local database is exactly the bucket's newest state and nobody writes it yet:
            # replication starts first and continues the replica without a snapshot.
            t = clock()
            await self._start_replication(space, plan)
            timings["replicate"] = clock() - t

        t = clock()
        child = await self._spawn(space, argv)
        child.ended.addCallback(lambda info: on_exit(child, info))
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
        await self._record_lease(space, lease)

        if plan.resume is None:
            # A new database (the space created it) or one of unknown lineage: snapshot.
            t = clock()
            await self._start_replication(space, plan)
            timings["replicate"] = clock() - t
        return timings

    async def _record_lease(self, space: Space, lease: HeldLease) -> None:
        """The local database is the space's copy under ``lease`` now (``<db>-lease.json``:
        what a later own reclaim trusts it by, lchat.hibernation.localdb). A record that cannot
        be written leaves the older one: that reclaim would then restore from the bucket and
        move this copy aside (kept), so it is said loudly."""
        generation = lease.generation
        try:
            await self.run_in_thread(lambda: localdb.write_lease_generation(space.db, generation))
        except OSError as e:
            _log.error(
                "activator: {host}: cannot record lease generation {generation} beside {db} "
                "({error}): if this box restarts with writes not yet shipped, its next wake "
                "restores from the bucket and moves them aside",
                host=space.host,
                generation=generation,
                db=space.db,
                error=e,
            )

    async def _acquire(self, host: str, bucket: WakeBucket) -> HeldLease:
        assert self.cfg.hibernate is not None
        fence = self.fence
        if fence is not None:
            try:
                await fence.ready(self.reactor, self.budgets.wake)
            except NotAlive as e:
                raise WakeFailed(host, "not_alive", f"{host} not woken: {e}") from e
        for delay in (*LEASE_HELD_RETRIES, None):
            try:
                return await acquire(
                    bucket.store,
                    bucket.lease_key(host),
                    self.cfg.box_id,
                    self.cfg.hibernate.lease_ttl,
                    host=host,
                    reclaim_own=True,
                    monotonic=self.monotonic,
                    box=fence.box if fence is not None else "",
                    epoch=fence.epoch if fence is not None else "",
                    epoch_started=fence.epoch_started if fence is not None else None,
                    holder_check=fence.holder_check if fence is not None else None,
                )
            except LeaseHeld as e:
                if delay is None:
                    LEASE_CONFLICTS.inc()
                    _log.info(
                        "activator: {host} not woken: lease held by {owner}",
                        host=host,
                        owner=e.owner,
                    )
                    # The holder may be draining (seconds) or dead (until expiry): ask for a
                    # retry soon either way rather than at the lease's expiry.
                    raise WakeFailed(
                        host,
                        "lease_held",
                        f"{host} is being served elsewhere ({e})",
                        min(e.retry_after, LEASE_HELD_RETRY),
                    ) from e
            except ObjectStoreError as e:
                raise WakeFailed(host, "bucket", f"the bucket is unavailable: {e}") from e
            await deferLater(self.reactor, delay, lambda: None)
        raise AssertionError("unreachable")

    async def _spawn(self, space: Space, argv: list[str]) -> RunningChild:
        host = space.host
        await evict_listener(
            self.reactor,
            self.run_in_thread,
            space.socket,
            self.budgets.stop,
            name=f"activator: {host}",
        )
        try:
            env = await self.run_in_thread(lambda: space_env(self.cfg, host, space.socket))
            env["LCHAT_DB"] = space.db
            user = await self.run_in_thread(lambda: space_user(self.cfg, host, space.socket))
            spec = ChildSpec(
                name=host,
                argv=tuple(argv),
                env=env,
                ready_socket=space.socket,
                user=user,
            )
            # Which build this wake runs (live/<host> resolved, or the floor's): `lchat rollback`
            # reads it, after the bucket's record.
            await self.run_in_thread(record_quietly, self.cfg.data_dir, host, spec.argv[0])
            space.child = (self.spawner or spawn)(self.reactor, spec)
        except (EnvFileError, SpawnError, hosts.InvalidHost, IsolationError, OSError) as e:
            _log.error("activator: {host} cannot start: {error}", host=host, error=e)
            raise WakeFailed(host, "spawn", f"{host} cannot start: {e}") from e
        return space.child

    async def _start_replication(self, space: Space, plan: DBPlan) -> None:
        bucket = space.bucket or self.own
        space.replicator = Replicator(
            self.reactor,
            bucket.store,
            space.db,
            bucket.replica_path(space.host),
            interval=INTERVALS.get(space.route.replication, INTERVALS["stream"]),
            keeper=space.keeper,
            **self.replicator_options,
        )
        took_over = space.lease is not None and space.lease.took_over_from is not None
        try:
            await space.replicator.start(
                plan.listing,
                resume_txid=None if took_over else plan.resume,
                txid_floor=plan.floor,
                after_takeover=took_over,
            )
        except (ObjectStoreError, ReplicatorStopped) as e:
            raise WakeFailed(space.host, "bucket", f"replication could not start: {e}") from e
        space.replicating = True
        # From here the bucket moves on past the marker: it no longer describes the local file.
        await self.run_in_thread(lambda: localdb.forget_marker(space.db))

    async def _retaken(self, space: Space, held: HeldLease) -> bool:
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

    # -- the next due time: the one writer of a hibernating row's ``next_due`` -------------------

    def due_honoured(self, space: Space) -> None:
        """``space`` is awake: clear the due time its wake honoured, only that one (a newer time
        recorded meanwhile stays)."""
        if space.due_woken:
            self.routes.record_next_due(space.host, 0, only_if=space.due_woken)

    def _due_reported(self, space: Space, due: int) -> None:
        """At a graceful sleep: the space's earliest pending delivery. One its wake honoured
        already is recorded as none: a past due time wakes once, not in a loop."""
        if due and space.due_woken and due <= space.due_woken:
            due = 0
        self.routes.record_next_due(space.host, due)

    # -- standing down ---------------------------------------------------------------------------

    async def stand_down(self, space: Space, reason: str, *, graceful: bool) -> None:
        """Stop everything ``space`` runs, flush, release; each step under its budget, so that
        nothing strands the lease. Never raises."""
        host = space.host
        try:
            await self._step(
                host,
                "sidecar",
                self.sidecars.stop(host, self.budgets.sidecar_stop),
                self.budgets.sidecar_stop + 1,
            )
            if graceful and space.child is not None and space.child.exit_info is None:
                assert self.contract is not None
                due = await self._step(
                    host,
                    "next_due",
                    self.contract.next_due(host, space.socket, self.budgets.next_due),
                    self.budgets.next_due,
                )
                if isinstance(due, int):
                    self._due_reported(space, due)
            if graceful and space.requests > 0 and space.child is not None:
                # New requests queue (state "stopping"); those already sent to the space are
                # let finish first. SIGTERM now would race them: the space closes the kept-alive
                # connections it has not read a request on yet, so a request written a moment
                # ago would go unanswered (the owner of a drain could not even say it was never
                # processed).
                await self._step(host, "requests", space.requests_finished(), self.budgets.requests)
            self.drop_idle(space.socket)
            if space.child is not None:
                grace = self.budgets.lease_lost_stop if space.lost else self.budgets.stop
                await space.child.terminate(timeout=grace)
            await self._release(space, reason)
        except Exception:
            _log.failure("activator: {host} standing down failed", host=host)

    async def _release(self, space: Space, reason: str) -> None:
        host = space.host
        flushed = False
        if space.replicator is not None:
            try:
                if space.lost is None and space.replicating:
                    flushed = await self._flush(space)
            finally:
                # Whatever the flush raised: the claim is released after this stand-down, and
                # then the fleet backup may start its own replicator on the database.
                await space.replicator.stop()
        if space.keeper is not None:
            if space.lost is not None:
                pass  # never write again: it is someone else's now
            elif flushed or not (
                space.replicating or (space.replicator is not None and space.replicator.wrote)
            ):
                # (A replication start that failed may have sent its first upload, which can
                # still land: released, the next holder would be no taker, resume without
                # TAKEOVER_TXID_GAP and meet it. Then the lease expires, or this box reclaims
                # it: a takeover.)
                released = await space.keeper.release(self.budgets.release)
                if not released:
                    STEP_FAILURES.labels("release").inc()
            else:
                # Invariant 2: no release without a flush. The lease expires on its own; until
                # then only this box (reclaim_own) can wake the space, from its newest local copy.
                space.keeper.stop()
                _log.error(
                    "activator: {host} final flush failed: lease left to expire "
                    "(only this box can wake it until then)",
                    host=host,
                )
        now = self.reactor.seconds()
        if flushed and space.replicator is not None and reason not in HANDED_BACK:
            txid = space.replicator.txid
            await self.run_in_thread(lambda: localdb.write_marker(space.db, txid, now))
        if space.lost is not None and taken(space.lost):
            # What the copy holds at least (every txid the replicator read from it): a wake
            # compares it with the bucket, so it is never lost to an emptier bucket.
            dated = space.replicator.txid if space.replicating and space.replicator else None
            aside = await self.run_in_thread(
                lambda: localdb.move_aside(space.db, "lease-lost", now, dated)
            )
            if aside:
                _log.warn(
                    "activator: {host} local db moved to {aside} (lease {why}: the bucket "
                    "is the truth now)",
                    host=host,
                    aside=aside,
                    why=space.lost,
                )
        elif space.lost is not None:
            # Not renewed in time (the bucket was unreachable): nobody is known to have taken
            # it, and the local file holds writes the bucket may lack. No marker: the next wake
            # on this box trusts it and snapshots it.
            _log.warn(
                "activator: {host} lease lost ({why}): keeping the local db (newer than "
                "the bucket); the next wake snapshots it",
                host=host,
                why=space.lost,
            )

    async def _step(self, host: str, name: str, work: Any, budget: float) -> Any:
        """Run one stand-down step; its failure or timeout is counted and logged, never raised."""
        d = Deferred.fromCoroutine(work)
        d.addTimeout(budget, self.reactor)
        try:
            return await d
        except (CancelledError, TimeoutError):
            STEP_FAILURES.labels(name).inc()
            _log.warn(
                "activator: {host} sleep step {step} ran out of time ({budget:g}s)",
                host=host,
                step=name,
                budget=budget,
            )
        except Exception as e:
            STEP_FAILURES.labels(name).inc()
            _log.warn(
                "activator: {host} sleep step {step} failed: {error}",
                host=host,
                step=name,
                error=e,
            )
        return None

    async def _flush(self, space: Space) -> bool:
        """Flush, retrying within the budget: True once everything is in the bucket."""
        assert space.replicator is not None
        deadline = self.reactor.seconds() + self.budgets.flush
        delays = FLUSH_RETRY.delays()
        while True:
            # check: the last flush before sleep LISTs once, so a bucket that forgot the space
            # is re-seeded now, not at the next wake (the bucket is then all there is off-box).
            attempt = Deferred.fromCoroutine(space.replicator.flush(check=True))
            attempt.addTimeout(max(deadline - self.reactor.seconds(), 0.01), self.reactor)
            try:
                await attempt
                return True
            except ReplicatorStopped as e:
                _log.error("activator: {host} flush impossible: {error}", host=space.host, error=e)
                return False
            except (ObjectStoreError, CancelledError, OSError) as e:
                STEP_FAILURES.labels("flush").inc()
                left = deadline - self.reactor.seconds()
                _log.error(
                    "activator: {host} flush failed ({error}); {left:.0f}s left",
                    host=space.host,
                    error=e if not isinstance(e, CancelledError) else "timed out",
                    left=max(left, 0),
                )
                delay = delays.next()
                if left <= delay:
                    return False
            await deferLater(self.reactor, delay, lambda: None)

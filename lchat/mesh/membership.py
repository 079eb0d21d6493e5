"""Membership (docs/design.md §9): this box's heartbeat in the bucket, its peers' witness, and
its view of the mesh (:class:`Membership`).

The keys, the bodies and who is live: :mod:`lchat.mesh.members`; the peers' witness:
:mod:`lchat.mesh.witness` and :mod:`lchat.mesh.peering`; this box's deadline:
:mod:`lchat.mesh.liveness`; what crashed boxes leave behind: :class:`~lchat.mesh.members.Janitor`.

Failures are soft (they are logged and counted in ``lchat_mesh_heartbeat_failures_total{op}``): a
failed PUT leaves our beat to age (peers take over our hosts after ``dead_after``, the lease
arbitrates any overlap), a failed read keeps the last view. Draining deletes our heartbeat first
(:meth:`Membership.stopService`), so peers drop this box at their next read instead of after
``dead_after``.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from attrs import evolve
from prometheus_client import Counter, Gauge
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

import lchat
from lchat.config import MeshConfig
from lchat.deferutil import observe
from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.liveness import LIVENESS_MARGIN, Liveness
from lchat.mesh.members import (
    FAILURES,
    JANITOR_DEAD_AFTERS,
    BodyCache,
    Janitor,
    KeyPrefix,
    Member,
    describe_failure,
    log,
    member_key,
    member_of_key,
    members_prefix,
    read_view,
)
from lchat.mesh.peering import PeerBeating
from lchat.mesh.placement import normalise_member_url
from lchat.mesh.witness import PeerChannel, Witnesses
from lchat.objstore import (
    UTC,
    NotFound,
    ObjectInfo,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
)

_T = TypeVar("_T")

STOP_TIMEOUT = 5.0  # stopService's delete of our heartbeat gives up after this (seconds)

_BUCKET = Gauge(
    "lchat_mesh_bucket_reachable",
    "1 while this box's last heartbeat PUT succeeded, 0 after one failed (the bucket is out of "
    "reach: wakes are refused at once, the peers are asked to relay the heartbeat)",
)
MEMBERS_LIVE = Gauge(
    "lchat_mesh_members_live", "Live mesh members in this box's view (self included)"
)
CHANGES = Counter(
    "lchat_mesh_membership_changes_total",
    "Changes of the set of live mesh members (URL and region) seen by this box",
)


def _urls(members: Sequence[Member]) -> frozenset[tuple[str, str]]:
    return frozenset((m.url, m.region) for m in members)


class RegionsSeen:
    """Since when each region has had no live member, on one clock (the membership's monotonic
    one, which its liveness is judged on): the regional failover's grace (lchat.mesh.routing,
    docs/mesh.md, "Regional failover") counts from here.

    Invariant: a region with a live member in the last view has no "empty since"; one that left
    the view is empty since the view that first lacked it (not since its last beat: a later
    time, so a grace is never shortened); one never seen is empty since ``started`` (this box's
    start), never "forever": a box that boots into a fleet without that region waits the whole
    grace like everyone else."""

    def __init__(self, started: float) -> None:
        self._started = started
        self._live: frozenset[str] = frozenset()
        self._empty_from: dict[str, float] = {}  # region -> when it left the view

    def saw(self, members: Sequence[Member], now: float) -> None:
        """A new view (every read of the membership, changed or not)."""
        live = frozenset(m.region for m in members if m.region)
        for region in self._live - live:
            self._empty_from[region] = now
        for region in live:
            self._empty_from.pop(region, None)
        self._live = live

    def empty_since(self, region: str) -> float | None:
        """None while ``region`` has a live member; else since when it has had none."""
        if region in self._live:
            return None
        return self._empty_from.get(region, self._started)


class Membership(PeerBeating, Service):
    """This box's heartbeat, its peers' witness, and its view of the mesh (docs/mesh.md).

    On start it beats at once, then every ``mesh.heartbeat`` seconds: PUT our heartbeat, one
    :func:`~lchat.mesh.members.read_view` (bodies cached by ETag), then the janitor's step
    (:meth:`~lchat.mesh.members.Janitor.sweep`). Each operation is bounded by
    ``max(mesh.heartbeat, 1 s)``. :attr:`members` is the last view: live members, this box
    included. It is never empty: until a read shows anybody, and whenever our latest PUT
    succeeded but the listing does not show it yet, this box is in it (so placement always has a
    fleet).

    With a peer channel (``peers``; the router always has one) it also beats the peers and
    answers theirs (:class:`~lchat.mesh.peering.PeerBeating`): a peer heard within
    ``dead_after`` is in the view even when its heartbeat in the bucket is too old, and this
    box's liveness (:class:`~lchat.mesh.liveness.Liveness`) counts its required peers' word.
    Without one, liveness is the bucket's alone (``W1``).
    """

    def __init__(
        self,
        reactor: IReactorTime,
        store: ObjectStore,
        hib: KeyPrefix,
        mesh: MeshConfig,
        *,
        started_at: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        epoch: str | None = None,
        peers: PeerChannel | None = None,
        process: str | None = None,
    ) -> None:
        """``monotonic``: the clock this box's liveness deadline is kept on (the one the lease
        keepers use). ``epoch``: this process's first heartbeat epoch (random when not given);
        ``process``: its process id (random when not given). ``peers``: how beats reach the
        peers' mesh API (None: no witness, the bucket alone)."""
        self._reactor = reactor
        self._store = store
        self._hib = hib
        self._monotonic = monotonic
        self._peers = peers
        self.url = normalise_member_url(mesh.self_url)
        self.region = mesh.region
        self.key = member_key(hib, self.url)
        self.heartbeat = mesh.heartbeat
        self.dead_after = mesh.dead_after
        self.timeout = max(mesh.heartbeat, 1.0)  # per store operation of a beat
        self.stop_timeout = STOP_TIMEOUT
        self.keys = HeartbeatKeys.of(mesh.token, mesh.accept_token)
        self.body = self.keys.sign(
            Heartbeat(
                url=self.url,
                region=mesh.region,
                version=lchat.__version__,
                # Informational: when this router started (it builds its membership at start).
                started_at=round(reactor.seconds() if started_at is None else started_at, 3),
                epoch=uuid.uuid4().hex if epoch is None else epoch,
                process=(uuid.uuid4().hex if process is None else process) if peers else "",
            )
        )
        self.margin = mesh.dead_after * LIVENESS_MARGIN
        self.witnesses = Witnesses(
            self.url,
            mesh.dead_after,
            self.margin,
            mesh.outage_tolerance,
            mesh.heartbeat,
            started=monotonic(),
        )
        self.liveness = Liveness(
            reactor,
            monotonic,
            self.url,
            mesh.dead_after,
            self.margin,
            self.witnesses,
            witnessed=peers is not None,
            epoch=lambda: self.body.epoch,
            renew=self._renew,
        )
        self._draining: frozenset[str] = frozenset()  # peers whose heartbeat says "draining"
        self._bodies: BodyCache = {}
        self._bucket_members: list[Member] = []  # the last listing's live members
        self._listed_at: float | None = None  # when that listing was read (monotonic)
        self._members: list[Member] = [self._self_member(None)]
        self._regions = RegionsSeen(monotonic())
        self._regions.saw(self._members, monotonic())
        self._subscribers: list[Callable[[list[Member], list[Member]], object]] = []
        self._loop = LoopingCall(self._tick)
        self._loop.clock = reactor
        self._beat: Deferred[None] | None = None
        self._putting: Deferred[Any] | None = None
        self._put_failed = False  # our last heartbeat PUT failed: the bucket is out of reach
        self._stopping = False
        self._etag = ""  # of our last landed PUT: the drain deletes only that version
        self._left: Deferred[None] | None = None
        self.beats = 0  # completed beats (PUT and read attempted), for tests and the admin API
        # The janitor deletes member keys older than this (bucket clock). Ten dead_afters, and
        # never before a holder could have lived on its peers' word (the slow path's age,
        # lchat.mesh.witness): a box that is only cut off or frozen for a while keeps its key
        # (and ``lchat mesh`` shows it as dead meanwhile); only what a crash left for good is
        # cleaned up.
        self.janitor_after = JANITOR_DEAD_AFTERS * mesh.dead_after
        if peers is not None:
            self.janitor_after = max(
                self.janitor_after, self.witnesses.slow_after() + mesh.dead_after
            )
        self.janitor_beats = 0  # beats whose janitor step is over (whatever it did), for tests
        self._janitor = Janitor(
            store, members_prefix(hib), self.key, self.janitor_after, self._bounded, self.timeout
        )
        self._init_peering(reactor, mesh.heartbeat, mesh.dead_after)

    # -- the view ------------------------------------------------------------------------------

    @property
    def members(self) -> list[Member]:
        """The last view: the live members, this box included (never empty)."""
        return list(self._members)

    def live(self) -> list[Member]:
        """Same as :attr:`members`."""
        return list(self._members)

    @property
    def epoch(self) -> str:
        """This liveness period's heartbeat epoch (written into the leases it takes)."""
        return self.body.epoch

    def now(self) -> float:
        """This box's monotonic clock (the one its deadline and its witness records are on)."""
        return self._monotonic()

    def alive(self) -> bool:
        """May this box write on its leases now? True from the first landed beat until its
        deadline (W1 or W2, monotonic clock), while the heartbeat exists. Peers cannot judge this
        box dead before that (docs/lease.md)."""
        return self.liveness.alive()

    def bucket_reachable(self) -> bool:
        """Did our last heartbeat PUT succeed? (False: the bucket is out of reach: a wake, which
        needs it, is refused at once rather than after the store's timeouts.)"""
        return not self._put_failed

    def draining(self) -> frozenset[str]:
        """The peers whose heartbeat said "draining" at the last read (out of :meth:`live`, but
        alive: they release their leases within moments)."""
        return self._draining

    def lapsed(self) -> bool:
        """A beat landed once, and this box is not alive now: it serves and writes nothing until
        it is again (before the first beat a wake waits for it instead)."""
        return self.liveness.lapsed()

    def first_beat(self) -> Deferred[None]:
        """Fires once a beat has landed (at once if one has): a mesh box takes no lease before."""
        return observe(self.liveness.first_beat)

    def on_alive(self, fn: Callable[[], object]) -> None:
        """``fn()`` each time this box becomes alive: its first landed heartbeat, and every time
        it is alive again after a lapse (the activator recovers its local copies then)."""
        self.liveness.on_alive(fn)

    def on_not_alive(self, fn: Callable[[], object]) -> None:
        """``fn()`` when this box's liveness deadline passes: every space it runs must stand down
        now (the activator's hook)."""
        self.liveness.on_not_alive(fn)

    def peers(self) -> list[Member]:
        """The live members other than this box."""
        return [m for m in self._members if not m.self]

    def subscribe(self, fn: Callable[[list[Member], list[Member]], object]) -> Callable[[], None]:
        """Call ``fn(old, new)`` (lists of :class:`Member`) whenever the set of live (URL,
        region) pairs changes; returns an unsubscribe."""
        self._subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return unsubscribe

    def status(self) -> dict[str, Any]:
        """What ``GET /status`` shows of the mesh (the admin API's ``mesh``)."""
        live = self.live()
        return {
            "alive": self.alive(),
            "epoch": self.epoch,
            "live": len(live),
            "members": [
                {
                    "url": m.url,
                    "region": m.region,
                    "version": m.version,
                    "age": round(m.age, 1),
                    "self": m.self,
                }
                for m in live
            ],
            "witness": self.witness_status(),
        }

    def known(self, url: str) -> bool:
        """Is ``url`` a mesh box's, as far as this box can tell: a live member, or a peer of the
        witness's roster (its heartbeat's MAC verified within the janitor's age, or it beat this
        box with the mesh token)? Only such a URL is sent the mesh token, a forward or a route
        (a ``lives_at`` naming anything else is refused: lchat.mesh.api)."""
        return (
            url == self.url
            or url in self.witnesses.peers
            or any(m.url == url for m in self._members)
        )

    def region_empty_since(self, region: str) -> float | None:
        """Since when (:meth:`now`'s clock) ``region`` has had no live member in this box's
        view; None while it has one (:class:`RegionsSeen`)."""
        return self._regions.empty_since(region)

    def fresh_in_bucket(self, url: str) -> bool:
        """Is ``url``'s heartbeat younger than ``dead_after`` in the bucket, as the last listing
        showed it and aged by the time since (this box's clock)?"""
        if self._listed_at is None:
            return False
        since = self._monotonic() - self._listed_at
        return any(m.url == url and m.age + since < self.dead_after for m in self._bucket_members)

    # -- lifecycle -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        log.info(
            "mesh: beating as {url} (region {region}) every {heartbeat:g}s, dead after "
            "{dead_after:g}s, key {key}{witness}",
            url=self.url,
            region=self.region or "-",
            heartbeat=self.heartbeat,
            dead_after=self.dead_after,
            key=self.key,
            witness=(
                f"; witnessed by its peers for up to {self.witnesses.tolerance:g}s of bucket outage"
                if self._peers is not None
                else ""
            ),
        )
        self._loop.start(self.heartbeat, now=True).addErrback(
            lambda f: log.failure("mesh: heartbeat loop crashed", f)
        )
        if self._peers is not None:
            self._peer_loop.start(self.heartbeat, now=False).addErrback(
                lambda f: log.failure("mesh: peer beat loop crashed", f)
            )

    def stopService(self) -> Deferred[None]:
        """Stop beating and delete our heartbeat first; fires when the delete is done or failed
        (at most :attr:`stop_timeout` seconds), then tells the peers it left. Never fails."""
        super().stopService()
        self._stopping = True
        for loop in (self._loop, self._peer_loop, self._fast_loop):
            if loop.running:
                loop.stop()
        if self._left is None or self._left.called:
            left = Deferred.fromCoroutine(self._leave())
            left.addTimeout(self.stop_timeout, self._reactor)
            left.addErrback(self._leave_failed)
            left.addCallback(lambda _: Deferred.fromCoroutine(self._goodbye()))
            self._left = left
        return observe(self._left)

    async def _leave(self) -> None:
        self.liveness.leave()  # nothing is written on our leases once the heartbeat goes
        putting = self._putting
        if putting is not None:
            # A PUT landing after our DELETE would bring the beat back: let it finish first.
            wait = observe(putting)
            wait.addTimeout(self.stop_timeout / 2, self._reactor)
            try:
                await wait
            except CancelledError:
                raise  # our own budget is spent
            except Exception:  # noqa: S110 -- timed out (cut short below), or logged by the beat
                pass
            if not putting.called:
                putting.cancel()
        if self._beat is not None:
            self._beat.cancel()  # the read part, if any: nobody needs the view any more
        try:
            # Only our own last body: a successor process of this box (another epoch, another
            # ETag) may beat already; a late delete of ours must never remove its heartbeat.
            await self._store.delete(self.key, if_match=self._etag or None)
        except (PreconditionFailed, NotFound):
            log.info(
                "mesh: heartbeat {key} is no longer ours (another process of {url} beats, or it "
                "is gone): left alone",
                key=self.key,
                url=self.url,
            )
            return
        except CancelledError:
            raise
        except Exception:
            FAILURES.labels("delete").inc()
            raise
        log.info("mesh: heartbeat {key} deleted: peers drop {url} now", key=self.key, url=self.url)

    def _leave_failed(self, failure: Failure) -> None:
        if failure.check(CancelledError, defer.TimeoutError):
            FAILURES.labels("delete").inc()
            error = f"no answer within {self.stop_timeout:g}s"
        else:
            error = describe_failure(failure.value, self.stop_timeout)
        log.warn(
            "mesh: could not delete heartbeat {key} ({error}); peers drop {url} after "
            "{dead_after:g}s",
            key=self.key,
            url=self.url,
            error=error,
            dead_after=self.dead_after,
        )

    # -- beating into the bucket -----------------------------------------------------------------

    def _tick(self) -> Deferred[None]:
        beat = Deferred.fromCoroutine(self._beat_once())
        self._beat = beat

        def done(result: object) -> None:
            if self._beat is beat:
                self._beat = None
            if isinstance(result, Failure) and not result.check(CancelledError):
                log.failure("mesh: heartbeat crashed", result)

        beat.addBoth(done)
        return observe(beat)

    async def _beat_once(self) -> None:
        put_ok = await self._put()
        if self._stopping:
            return
        phase = ["list"]
        listing: list[ObjectInfo] = []
        draining: set[str] = set()
        try:
            now, view = await self._bounded(
                read_view(
                    self._store,
                    self._hib,
                    self.dead_after,
                    self._bodies,
                    self.url,
                    False,
                    phase,
                    listing,
                    draining,
                    keys=self.keys,
                    read_within=self.janitor_after,
                )
            )
        except CancelledError:
            raise  # the drain: not a failure
        except Exception as e:
            if isinstance(e, ObjectStoreError | defer.TimeoutError):
                FAILURES.labels(phase[0]).inc()
            log.warn(
                "mesh: could not read the membership ({error}); keeping the last view of "
                "{count} member(s)",
                error=describe_failure(e, self.timeout),
                count=len(self._members),
            )
            self._update(self._view(None), None)
            return
        finally:
            self.beats += 1
        self._draining = frozenset(draining)
        self._bucket_members = view
        self._listed_at = self._monotonic()
        self._listed(listing, view, now)
        members = self._view(view)
        if not any(m.self for m in members) and (put_ok or not members):
            members = sorted([*members, self._self_member(now)], key=lambda m: m.url)
        self._update(members, now)
        if put_ok and not self._stopping:
            await self._janitor.sweep(self._members, listing, now)
        self.janitor_beats += 1

    def _listed(
        self, listing: Sequence[ObjectInfo], view: list[Member], now: datetime.datetime
    ) -> None:
        """What a listing tells the witness: the peers to beat, the older lchats among the live
        ones (judged by the bucket alone, as they judge us), and the required peers that lapsed
        (:meth:`Witnesses.retire`)."""
        if self._peers is None:
            return
        prefix = members_prefix(self._hib)
        ages: dict[str, float] = {}
        authentic: set[str] = set()
        for info in listing:
            url = member_of_key(info.key, prefix)
            if url is not None and url != self.url:
                ages[url] = (now - info.last_modified).total_seconds()
                cached = self._bodies.get(info.key)
                if cached is not None and cached[0] == info.etag and cached[1] is not None:
                    authentic.add(url)  # its body's MAC verified (_heartbeat)
        # Only a URL whose heartbeat authenticates is beaten (with the mesh token): a key planted
        # by a bucket writer, whatever its name, is never contacted.
        new = self.witnesses.know(
            u for u, age in ages.items() if u in authentic and age < self.janitor_after
        )
        if new and not self._stopping and self._peer_loop.running:
            # Beat them now rather than at the next round: until a peer has answered a beat of
            # ours, its silence proves nothing here (no permission yet: lchat.mesh.witness).
            self._reactor.callLater(0, self._peer_round)
        older = {m.url for m in view if not m.self and not m.process}
        for url, peer in self.witnesses.peers.items():
            peer.legacy = url in older or (peer.legacy and peer.process == "" and url in ages)
        retired = self.witnesses.retire(ages, self._monotonic())
        for peer in retired:
            log.info(
                "mesh: {peer} no longer witnesses {url}: silent for {dead_after:g}s and its "
                "heartbeat is stale (its own liveness lapsed)",
                peer=peer.url,
                url=self.url,
                dead_after=self.dead_after,
            )
        self.liveness.recheck()  # (a retired peer, or an older lchat among the live ones, moves it)
        self.witnesses.forget(
            u for u, p in list(self.witnesses.peers.items()) if u not in ages and not p.required
        )

    def _view(self, bucket: list[Member] | None) -> list[Member]:
        """The live members: those the bucket shows live (the last listing's when ``bucket`` is
        None), and the peers heard within ``dead_after`` (their word counts as much as the
        bucket's: a box cut off from it, or every box during its outage, stays in the view)."""
        base = self._bucket_members if bucket is None else bucket
        if bucket is None and not base:
            base = [m for m in self._members if m.self]
        members = {m.url: m for m in base}
        now = self._monotonic()
        for peer in self.witnesses.heard_within(self.dead_after, now):
            if peer.url not in members and peer.url not in self._draining and peer.process:
                members[peer.url] = Member(
                    url=peer.url,
                    region=peer.region,
                    version=peer.version,
                    started_at=0.0,
                    last_modified=datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC),
                    age=now - (peer.heard or now),
                    key=member_key(self._hib, peer.url),
                    process=peer.process,
                )
        return sorted(members.values(), key=lambda m: m.url)

    async def _put(self) -> bool:
        sent = self._monotonic()
        epoch = self.body.epoch  # the body this PUT carries
        putting = Deferred.fromCoroutine(
            self._store.put(self.key, self.body.to_json(), content_type="application/json")
        )
        putting.addTimeout(self.timeout, self._reactor)
        self._putting = putting
        try:
            put = await observe(putting)
            self._etag = getattr(put, "etag", "") or ""
        except CancelledError:
            raise
        except Exception as e:
            FAILURES.labels("put").inc()
            if not self._put_failed:
                log.warn(
                    "mesh: heartbeat PUT failed ({error}); {fallback}",
                    error=describe_failure(e, self.timeout),
                    fallback=(
                        "asking the peers to relay it, and to witness this box meanwhile"
                        if self._peers is not None
                        else f"peers drop {self.url} after {self.dead_after:g}s without one"
                    ),
                    url=self.url,
                    dead_after=self.dead_after,
                )
            self._put_failed = True
            _BUCKET.set(0)
            return False
        finally:
            if self._putting is putting:
                self._putting = None
        if self._put_failed:
            log.info("mesh: heartbeat {url} lands in the bucket again", url=self.url)
        self._put_failed = False
        _BUCKET.set(1)
        if self.liveness.leaving:
            return True  # the heartbeat is being deleted: no liveness from a late PUT
        self.liveness.beat_landed(sent, epoch)
        return True

    def _renew(self) -> None:
        """After a lapse (:class:`~lchat.mesh.liveness.Liveness`): beat under a new epoch."""
        old = self.body.epoch
        self.body = self.keys.sign(
            evolve(
                self.body,
                epoch=uuid.uuid4().hex,
                started_at=round(max(self._reactor.seconds(), self.body.started_at + 0.001), 3),
            )
        )
        log.info(
            "mesh: {url} beats under a new epoch {epoch} (was {old}): nothing of the old one counts",
            url=self.url,
            epoch=self.body.epoch[:8],
            old=old[:8],
        )

    async def begin_drain(self) -> None:
        """The drain's first step: beat once with ``draining`` set, so peers drop this box from
        placement at their next read, while its leases stay fenced by a live heartbeat (its last
        flushes still land). Beats go on until :meth:`stopService` deletes the heartbeat. Never
        fails (a failed beat is logged; peers then drop us after ``dead_after``)."""
        if self.body.draining:
            return
        self.body = self.keys.sign(evolve(self.body, draining=True))
        putting = self._putting
        if putting is not None:
            try:
                await observe(putting)
            except Exception:  # noqa: S110 -- logged by the beat
                pass
        try:
            await self._put()
        except CancelledError:
            return
        log.info("mesh: {url} draining: announced in its heartbeat", url=self.url)

    async def _bounded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        d = Deferred.fromCoroutine(coro)
        d.addTimeout(self.timeout, self._reactor)
        return await d

    def _self_member(self, now: datetime.datetime | None) -> Member:
        if now is None:
            now = datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC)
        return Member(
            url=self.url,
            region=self.region,
            version=self.body.version,
            started_at=self.body.started_at,
            last_modified=now,
            age=0.0,
            key=self.key,
            is_self=True,
            process=self.body.process,
        )

    def _update(self, members: list[Member], now: datetime.datetime | None) -> None:
        if now is None:
            now = datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC)
        old = self._members
        self._members = members
        self._regions.saw(members, self._monotonic())
        MEMBERS_LIVE.set(len(members))
        if _urls(old) == _urls(members):
            return
        CHANGES.inc()
        before = {m.url: m for m in old}
        after = {m.url: m for m in members}
        for url, m in after.items():
            was = before.get(url)
            if was is None:
                log.info(
                    "mesh: member joined {url} (region {region})",
                    url=url,
                    region=m.region or "-",
                    version=m.version,
                    started_at=m.started_at,
                )
            elif was.region != m.region:
                log.info(
                    "mesh: member {url} changed region {old_region} -> {region}",
                    url=url,
                    old_region=was.region or "-",
                    region=m.region or "-",
                )
        for url, was in before.items():
            if url not in after:
                ago = (now - was.last_modified).total_seconds()
                log.info(
                    "mesh: member gone {url} (last beat {ago:.0f}s ago)",
                    url=url,
                    region=was.region or "-",
                    ago=ago,
                )
        for fn in list(self._subscribers):
            try:
                fn(list(old), list(members))  # copies of their own for each
            except Exception:
                log.failure("mesh: membership subscriber {fn!r} failed", fn=fn)

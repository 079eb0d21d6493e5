"""Which box serves an in-scope hibernating space (docs/design.md §9): here, or forward once.

For a host equal to or directly under ``LCHAT_MESH_DOMAINS`` (every other host is always local):

1. a request that arrives with an authentic forwarded marker is served here (one hop only: the
   lease settles whatever disagreement sent it);
2. a space this box is running (or waking, or stopping) is served here;
3. a space awake elsewhere — its lease names a live member — is forwarded to that holder (it
   stays where it is until it sleeps, whatever the hash now says);
4. otherwise the owner by rendezvous hashing over the live members (scoped to the route's
   ``home_region`` when a live member advertises it) serves it: this box, or forward to it.

A box that wins the lease serves, whatever the hash said: "here" always means the activator,
which takes the lease or answers 503. The lease holder is read from ``lock.json`` at most once
per ``holder_ttl`` seconds per host (one GET), and only for spaces not running here.

A space homed in a region that keeps its replicas in another bucket (``LCHAT_REGION_BUCKETS``) is
never woken from this box's bucket. When placement falls back to this box because that region has
no live box, it answers 503 ``region_down``, unless the operator consented to a regional
failover (``LCHAT_REGION_FAILOVER_AFTER``) and the region has had no live box for that long: then
this box, the whole fleet's owner, serves it from the home region's own bucket, under a lease in
that bucket (lchat.hibernation.lifecycle.WakeBucket), after one read of that lease proves the
bucket answers (an unreadable one is 503 ``region_down``: never a wake of an older copy). Due
wakes never fail over (:meth:`MeshRouter.is_owner`): only a request does.

A drain: a box that is stopping refuses the forwarded requests it has not processed with a 503
marked ``X-Lchat-Refused: stopping`` (only on a request whose forwarded marker authenticated; the
activator says which refusals qualify), and the forwarding box routes such a request again, once,
without that peer. While a peer that refused so still holds a space's lease, requests for the
space wait here (at most :data:`RELEASE_WAIT`, reading ``lock.json`` every :data:`RELEASE_POLL`)
for the release its drain is about to make, instead of a wake meeting the held lease and
answering ``503 lease_held``. A peer that leaves the membership view while its heartbeat was
fresh deleted it, which only a drain does: its leases are awaited the same way (one that ages out
is dead or cut off, and its leases last until they expire).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
from prometheus_client import Counter
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from lchat.buckets import RegionBuckets
from lchat.config import BoxConfig, ConfigError
from lchat.deferutil import observe
from lchat.lease import LeaseRecord, lease_key
from lchat.mesh import forward, placement
from lchat.objstore import NotFound, ObjectStore, ObjectStoreError
from lchat.objstore.aws import NoCredentials
from lchat.proxy.http import REFUSED
from lchat.registry import Route
from lchat.router import (
    RETRY_AFTER_SECONDS,
    SAFE_METHODS,
    Hibernation,
    LocalResponse,
    RemotePeer,
    RequestHead,
    Target,
    plain,
)

_log = Logger(namespace="lchat.mesh")

_forwards = Counter(
    "lchat_mesh_forwards_total",
    "Mesh routing decisions for in-scope hibernating spaces",
    ["outcome"],  # docs/mesh.md ("Metrics") says what each one means
)
_ownership_changes = Counter(
    "lchat_mesh_ownership_changes_total", "In-scope hosts whose computed owner changed"
)
_release_waits = Counter(
    "lchat_mesh_release_waits_total",
    "Requests that waited for a draining peer to release a space's lease, by how it ended",
    ["outcome"],  # released, timed_out
)

# A peer that refused a request because it is stopping releases its leases within its drain
# (about 0.1 s typically; a slow final flush can take longer): requests wait this long for it.
RELEASE_WAIT = 10.0
REGION_DOWN_LOG_EVERY = 60.0  # seconds between "not woken here" lines for one host
RELEASE_POLL = 0.1  # seconds between reads of lock.json while waiting (shared by all requests)
# A read of lock.json on a request's path gives up after this long (a frozen bucket must not hold
# requests up: the routing then goes by what it knows without it).
HOLDER_READ_TIMEOUT = 2.0


class Activator(Hibernation, Protocol):
    """The activator as the mesh sees it (lchat.hibernation.activator.Activator): "here" always
    means it, which takes the lease or answers 503."""

    def holds(self, host: str) -> bool:
        """Is it running (or waking, or stopping) anything for ``host`` on this box?"""

    def lease_lost(self, host: str) -> bool:
        """Is ``host`` standing down on this box because its lease was taken?"""


class MeshRouter:
    def __init__(
        self,
        cfg: BoxConfig,
        store: ObjectStore,
        membership: Any,  # lchat.mesh.membership.Membership: .live() -> members with .url, .self
        activator: Activator,
        *,
        reactor: IReactorTime,  # its clock: caches, waits, forwarded-marker stamps (unix time)
        holder_ttl: float = 2.0,
        regions: RegionBuckets | None = None,  # the other regions' buckets (regional failover)
    ) -> None:
        assert cfg.mesh is not None and cfg.hibernate is not None
        self._mesh = cfg.mesh
        self._hib = cfg.hibernate
        self._store = store
        self._membership = membership
        self._activator = activator
        self._holder_ttl = holder_ttl
        self._clock = reactor.seconds
        self._reactor = reactor
        self._mono: Callable[[], float] = getattr(membership, "now", reactor.seconds)
        self._self_url = placement.normalise_member_url(cfg.mesh.self_url)
        self._holders: dict[str, tuple[float, str | None]] = {}  # host -> (read at, owner url)
        self._owners: dict[str, str] = {}  # host -> last computed owner (for the metric)
        # peer url -> (left out of placement until, when it failed: the membership's clock)
        self._unreachable: dict[str, tuple[float, float]] = {}
        self._draining: dict[str, float] = {}  # peer url -> it is stopping: await releases until
        # Peers left out because their port refused a forward (not silent): stopping or dead,
        # so a wake here meets their lease (released, or judged) rather than a 503 (_cut_off).
        self._refused: set[str] = set()
        # host -> (the peer that refused a forward of it unprocessed because it does not hold
        # it, ignored as its holder until): its beats or its lease said so a moment before.
        self._not_holding: dict[str, tuple[str, float]] = {}
        self._reading: dict[str, Deferred[str | None]] = {}  # host -> the GET of its lease
        # LCHAT_REGION_BUCKETS: regions whose replicas live in a bucket other than ours. A space
        # homed in one of them is never woken here (our bucket's copy of it is stale or absent).
        # (config.load made our own region's entry, if any, name our hibernation bucket.)
        here = cfg.hibernate.where
        self._foreign_regions = frozenset(
            label for label, b in cfg.region_buckets.items() if not b.same_place(here)
        )
        self._region_down_logged: dict[str, float] = {}  # host -> last "not woken here" line
        # LCHAT_REGION_FAILOVER_AFTER (None: off): the operator's consent to serve such a space
        # here, from its home bucket, once its region has had no live box for that long.
        self._failover_after = cfg.mesh.region_failover_after
        self._regions = regions
        self._failover_logged: dict[str, float] = {}  # host -> last "serving from" line
        # host -> (read at, the home bucket answered, the holder its lease names)
        self._home_holders: dict[str, tuple[float, bool, str | None]] = {}
        if self._failover_after is not None and self._foreign_regions:
            _log.info(
                "mesh: regional failover consented (LCHAT_REGION_FAILOVER_AFTER={after}): a space "
                "homed in {regions} whose region has had no live box that long is served, when "
                "this box owns it, from its region's bucket",
                after=_span(self._failover_after),
                regions=", ".join(sorted(self._foreign_regions)),
            )
        subscribe = getattr(membership, "subscribe", None)
        if subscribe is not None:
            subscribe(self._members_changed)

    def in_scope(self, host: str) -> bool:
        return placement.in_scope(host, self._mesh.domains)

    def owner_url(self, route: Route) -> str:
        """The live member that owns ``route`` by the hash (this box when alone)."""
        members = self._live()
        chosen = placement.owner(route.host, members, route.home_region)
        url = placement.normalise_member_url(chosen.url) if chosen is not None else self._self_url
        previous = self._owners.get(route.host)
        if previous != url:
            if previous is not None:
                _ownership_changes.inc()
                _log.info(
                    "mesh: {host} now owned by {owner} (was {previous})",
                    host=route.host,
                    owner=url,
                    previous=previous,
                )
            self._owners[route.host] = url
        return url

    @property
    def self_url(self) -> str:
        """This box's ``LCHAT_MESH_SELF``, normalised as member URLs are."""
        return self._self_url

    async def answering_box(self, route: Route) -> str:
        """The member URL that answers for ``route`` now (wake-free stats, lchat.spacestats):
        the live box holding it awake (a peer's word, else its lease), else the owner by the
        hash; :attr:`self_url` when that is this box. Never forwards and never wakes anything;
        at most one GET of ``lock.json`` (the cache :meth:`route` shares). A lease naming a box
        that is not live names nobody to ask (its spaces fail over to the owner). A space homed
        in a region with a bucket of its own is asked of that bucket's lease: this box's bucket
        holds at most a lease of the copy it had before it moved."""
        host = route.host
        told = self._membership.holding(host)
        if told is not None:
            holder: str | None = told
        elif self._foreign(route) and self._regions is not None:
            holder = (await self._home_holder(route))[1]
        else:
            holder = await self._holder(host)
        if holder is not None and (
            holder == self._self_url
            or holder in {placement.normalise_member_url(m.url) for m in self._live()}
        ):
            return holder
        return self.owner_url(route)

    def is_owner(self, route: Route) -> bool:
        """Due wakes fire only on the owner of an in-scope space (anywhere for the rest), and
        never here for a space whose replica is in another region's bucket: not even under a
        regional failover, which serves requests only (a scheduled delivery waits for a
        request, or for its region's return)."""
        if not self.in_scope(route.host):
            return True
        return self.owner_url(route) == self._self_url and not self._foreign(route)

    def _foreign(self, route: Route) -> bool:
        """Is ``route`` homed in a region that keeps its replicas in another bucket than this
        box's (``LCHAT_REGION_BUCKETS``)? Such a space must be woken by a box of that region:
        our bucket holds at most the copy it had before it moved."""
        return bool(route.home_region) and route.home_region in self._foreign_regions

    def _region_down(self, route: Route, why: str = "") -> Target:
        """The 503 for a space whose home region has no live box and whose replica this box
        does not serve (placement fell back to us): never a wake of a stale copy. ``why``: the
        failover was due but could not happen."""
        host = route.host
        _forwards.labels("region_down").inc()
        now = self._clock()
        said = f"{host} {why}" if why else host  # (a failover that cannot happen: said at once)
        if now - self._region_down_logged.get(said, float("-inf")) >= REGION_DOWN_LOG_EVERY:
            if len(self._region_down_logged) > 100_000:
                self._region_down_logged.clear()
            self._region_down_logged[said] = now
            after = self._failover_after
            _log.warn(
                "mesh: {host} is homed in region {region}, which has no live box, and keeps its "
                "replica in another bucket (LCHAT_REGION_BUCKETS): answering 503 instead of "
                "waking this box's older copy ({failover}; start a {region} box, or `lchat "
                "relocate {host} --to` a region that has one)",
                host=host,
                region=route.home_region,
                failover=f"failing over is due, but {why}"
                if why
                else "LCHAT_REGION_FAILOVER_AFTER is off"
                if after is None
                else f"it fails over once {route.home_region} has had no live box for "
                f"{_span(after)}, LCHAT_REGION_FAILOVER_AFTER",
            )
        return _unavailable(host, "region_down")

    def _failover_due(self, route: Route) -> float | None:
        """How long ``route``'s home region has had no live box, when the operator consented to
        a failover (``LCHAT_REGION_FAILOVER_AFTER``) and that is at least the grace; else None.
        (On the membership's clock, the one it judges liveness on.)"""
        after = self._failover_after
        if after is None or self._regions is None:
            return None
        since = getattr(self._membership, "region_empty_since", lambda region: None)(
            route.home_region
        )
        if since is None:
            return None
        empty_for = self._mono() - since
        return empty_for if empty_for >= after else None

    async def _failover(self, route: Route, head: RequestHead, *, forwarded: bool) -> Target:
        """A space homed in a region with another bucket, placed on this box (or forwarded here
        by a peer that placed it so): 503 ``region_down``, or, under a due failover, served here
        from its home bucket, unless that bucket's lease names another live box (forwarded
        there, one hop only)."""
        empty_for = self._failover_due(route)
        if empty_for is None:
            if forwarded and any(m.region == route.home_region for m in self._live()):
                return self._not_holding_here(route)
            return self._region_down(route)
        host = route.host
        answered, holder = await self._home_holder(route)
        if not answered:
            return self._region_down(route, why="its home bucket did not answer")
        if (
            not forwarded
            and holder is not None
            and holder != self._self_url
            and holder in {placement.normalise_member_url(m.url) for m in self._live()}
        ):
            _forwards.labels("to_holder").inc()
            return self._to(holder, route, head)
        _forwards.labels("region_failover").inc()
        now = self._clock()
        if now - self._failover_logged.get(host, float("-inf")) >= REGION_DOWN_LOG_EVERY:
            if len(self._failover_logged) > 100_000:
                self._failover_logged.clear()
            self._failover_logged[host] = now
            assert self._failover_after is not None
            _log.warn(
                "mesh: {host} homed in {region} (no live box for {empty}): serving from "
                "{region}'s bucket on this box (LCHAT_REGION_FAILOVER_AFTER={after}); it goes "
                "home at its first sleep after a {region} box is back",
                host=host,
                region=route.home_region,
                empty=_span(empty_for),
                after=_span(self._failover_after),
            )
        here = self._here(route, head)
        return await here if isinstance(here, Deferred) else here

    def _not_holding_here(self, route: Route) -> Target:
        """A request forwarded here for a space homed in a region with a box live again, which
        this box does not hold: its sender went by a word (our beats, or a lease) from before
        this box slept the space it had failed over. Refused unprocessed, marked
        ``X-Lchat-Refused: not_holding`` (:func:`_refusal_for_peer`), so that the sender routes
        it again without taking this box for its holder (:meth:`reroute`): home, where it wakes
        with every write — rather than a 503 for as long as the sender's word is stale."""
        _forwards.labels("not_holding").inc()
        refused = _unavailable(route.host, "not_holding")
        assert isinstance(refused, LocalResponse)
        return attrs.evolve(refused, refusal="not_holding")

    async def _home_holder(self, route: Route) -> tuple[bool, str | None]:
        """(did ``route``'s home bucket answer, the member its lease names): one GET of
        ``lock.json`` there within :data:`HOLDER_READ_TIMEOUT`, remembered ``holder_ttl``
        seconds (a bucket that does not answer, too: requests then get their 503 at once)."""
        host = route.host
        now = self._clock()
        cached = self._home_holders.get(host)
        if cached is not None and now - cached[0] < self._holder_ttl - 1e-6:
            return cached[1], cached[2]
        assert self._regions is not None
        region = route.home_region
        where = self._regions.foreign(region)
        assert where is not None  # (_foreign: the same LCHAT_REGION_BUCKETS entries)
        answered, owner = False, None
        try:
            store = await self._regions.store(region)
            reading = Deferred.fromCoroutine(store.get(lease_key(where.prefix, host)))
            reading.addTimeout(HOLDER_READ_TIMEOUT, self._reactor)
            got = await reading
            answered, owner = True, _member_url(LeaseRecord.parse(got.body).owner)
        except NotFound:
            answered = True
        except TimeoutError:
            _log.warn(
                "mesh: region {region}'s bucket did not answer within {timeout:g}s (the lease of "
                "{host})",
                region=region,
                host=host,
                timeout=HOLDER_READ_TIMEOUT,
            )
        except (ObjectStoreError, ConfigError, NoCredentials, OSError) as e:
            _log.warn(
                "mesh: region {region}'s bucket failed (the lease of {host}): {e}",
                region=region,
                host=host,
                e=e,
            )
        except Exception as e:  # a lock.json we cannot parse names nobody we can forward to
            _log.warn(
                "mesh: unreadable lease of {host} in {region}: {e}", host=host, region=region, e=e
            )
            answered = True
        if len(self._home_holders) > 100_000:
            self._home_holders.clear()
        self._home_holders[host] = (self._clock(), answered, owner)
        return answered, owner

    def route(self, route: Route, head: RequestHead) -> Target | Deferred[Target]:
        host = route.host
        if head.forwarded is not None:
            if self._authentic(head, host):
                if self._foreign(route) and not self._activator.holds(host):
                    failover = Deferred.fromCoroutine(self._failover(route, head, forwarded=True))
                    return failover.addCallback(_refusal_for_peer)
                told = self._told_by_a_peer_in_reach(host)
                if told is not None:
                    return Deferred.fromCoroutine(self._forwarded_unless_held(route, head, told))
                return self._forwarded_here(route, head)
            _forwards.labels("bad_marker").inc()  # stripped already; routed like any request
        if self._activator.holds(host) and not self._activator.lease_lost(host):
            _forwards.labels("local_running").inc()
            return self._here(route, head)
        return self._route_elsewhere(route, head)

    def _route_elsewhere(self, route: Route, head: RequestHead) -> Target | Deferred[Target]:
        """A request this box's running space does not answer: by the peers' word and the lease
        (:meth:`_route_remote`), or at once while this box is not alive (:meth:`_route_isolated`)."""
        if self._membership.lapsed():
            return self._route_isolated(route, head)
        return Deferred.fromCoroutine(self._route_remote(route, head))

    def _route_isolated(self, route: Route, head: RequestHead) -> Target | Deferred[Target]:
        """A request while this box is past its liveness deadline (cut off from its bucket and
        its peers: Membership.lapsed): answered now, never after a lease read that would hang or
        a dial to a peer that does not answer beats (tests.test_mesh_cuts, d: 503s slower than a
        second while isolated). A space a peer in reach holds (its beats say so, and it answered
        ours lately: both cut off from the bucket, not from each other) is forwarded to it; one
        this box holds is the activator's (a read-only copy: reads served, writes refused; one
        standing down: 503); anything else gets a 503 with Retry-After at once (no wake here)."""
        host = route.host
        holder = self._membership.holding(host) or self._holders.get(host, (0.0, None))[1]
        said = self._not_holding.get(host)
        if said is not None and said[1] > self._clock() and holder == said[0]:
            holder = None  # it said otherwise a moment ago (reroute, "not_holding")
        if (
            holder is not None
            and holder != self._self_url
            and holder not in self._draining_peers()  # (it would refuse: stopping)
            and holder in {placement.normalise_member_url(m.url) for m in self._live()}
            and self._membership.answered_since(holder, self._mono() - self._mesh.dead_after)
        ):
            _forwards.labels("to_holder").inc()
            return self._to(holder, route, head)
        if self._activator.holds(host):
            # (The activator answers at once for a box that is not alive: never a wake.)
            _forwards.labels("local_isolated").inc()
            return self._here(route, head)
        _forwards.labels("isolated").inc()
        return _unavailable(host, "isolated")

    def _forwarded_here(self, route: Route, head: RequestHead) -> Target | Deferred[Target]:
        _forwards.labels("local_forwarded").inc()
        target = self._here(route, head)
        if isinstance(target, Deferred):
            return target.addCallback(_refusal_for_peer)
        return _refusal_for_peer(target)

    def _told_by_a_peer_in_reach(self, host: str) -> str | None:
        """The peer whose beats say ``host`` is awake on it, when that peer answered this box's
        last beat (and this box does not run ``host``): a request forwarded here for it may be
        one its sender could not deliver to that peer (a cut between the two)."""
        told = self._membership.holding(host)
        if told is None or told == self._self_url or self._activator.holds(host):
            return None
        since = self._mono() - self._mesh.dead_after
        return told if self._membership.answered_since(told, since) else None

    async def _forwarded_unless_held(self, route: Route, head: RequestHead, told: str) -> Target:
        """A request forwarded here for a space that ``told``, a peer in this box's reach, says
        it holds: when its lease still names ``told`` (one GET, shared and cached), a wake here
        would only meet that lease — and this box's own clients' requests for the space would
        join that doomed wake meanwhile instead of going to the holder (test_mesh_cuts, a 3-box
        pair cut: a refusal through the uncut box). Answered 503 at once; the sender's client
        retries. A lease released or taken since (a drain's hand-over: its beats may say so
        only a heartbeat later) is served here as any forwarded request."""
        host = route.host
        if await self._holder(host) == told:
            _forwards.labels("forwarded_held_elsewhere").inc()
            return _unavailable(host, "lease_held")
        here = self._forwarded_here(route, head)
        return await here if isinstance(here, Deferred) else here

    def _here(self, route: Route, head: RequestHead) -> Target | Deferred[Target]:
        """Served on this box: the activator's, which wakes the space or answers 503."""
        return self._activator.route(route, head.sidecar, head.method not in SAFE_METHODS)

    def _authentic(self, head: RequestHead, host: str) -> bool:
        """Does ``head`` carry a forwarded marker to honour here: authentic, fresh, and bound to
        this request and to this box as the peer it was sent to?"""
        return head.forwarded is not None and forward.authentic(
            head.forwarded,
            self._mesh.token,
            host,
            self._clock,
            self._mesh.accept_token,
            bound=forward.Bound(method=head.method, target=head.target, peer=self._self_url),
        )

    def forward_elsewhere(self, route: Route, head: RequestHead) -> Target:
        """A "lives elsewhere" row (``route.lives_at``): the space runs always-on on that box, so
        every request for it is forwarded there, marked like any mesh forward (verified TLS
        against the space's name, one hop). It is never served, woken or run here: a request
        that arrives already forwarded (its sender thinks this box runs the space), or a peer
        that cannot take it, gets a 503, not a wake of a stale copy."""
        host = route.host
        peer = route.lives_at
        forwarded = self._authentic(head, host)
        if forwarded or placement.normalise_member_url(peer) == self._self_url:
            _forwards.labels("elsewhere_loop").inc()
            _log.warn(
                "mesh: {host} lives at {peer} by this box's row, but {why}: answering 503 (check "
                "`lchat instances` on both boxes; `lchat mesh-seed --prune` from the box that "
                "runs it)",
                host=host,
                peer=peer,
                why="a peer forwarded it here"
                if forwarded
                else "that is this box, which has no always-on row for it",
            )
            return _unavailable(host, "elsewhere_loop")
        if not peer.startswith("https://") and self._self_url.startswith("https://"):
            # (The mesh API refuses such a row; one from elsewhere is never followed in clear.)
            _forwards.labels("elsewhere_unreachable").inc()
            _log.warn(
                "mesh: {host} lives at {peer}, which is not https: answering 503 (a space's "
                "traffic is never forwarded in clear text on an HTTPS mesh)",
                host=host,
                peer=peer,
            )
            return _unavailable(host, "elsewhere_unreachable")
        _forwards.labels("to_elsewhere").inc()
        return self._to(peer, route, head)

    def reroute(
        self, route: Route, head: RequestHead, peer: RemotePeer, why: str
    ) -> Target | Deferred[Target]:
        """``peer`` could not take ``head`` (``why``: :class:`~lchat.router.RemotePeer`) and
        nothing of it was acted on. A lives-elsewhere row runs only there: 503. Otherwise the peer
        is left out a while and the request routed again without it: until its heartbeat ages
        out of everyone's view, a stopping or dead peer would keep its spaces dark."""
        host = route.host
        if route.elsewhere:
            _forwards.labels("elsewhere_unreachable").inc()
            _log.warn(
                "mesh: {host} lives at {peer}, which could not take the request ({why}): "
                "answering 503 (it runs only there)",
                host=host,
                peer=route.lives_at,
                why=why,
            )
            return _unavailable(host, "elsewhere_unreachable")
        member = peer.member
        now = self._clock()
        if why == "not_holding":
            # It answers, and it said it does not hold the space (_not_holding_here): whatever
            # its last beat or the lease said. Not left out of placement, only not the holder,
            # until its next beats have told everyone.
            _forwards.labels("peer_not_holding").inc()
            if len(self._not_holding) > 100_000:
                self._not_holding.clear()
            self._not_holding[host] = (member, now + 2 * self._mesh.heartbeat)
            self._holders.pop(host, None)
            return self._route_elsewhere(route, head)
        if why == "stopping":
            # It refused the request unprocessed because it is draining: its leases are
            # released within moments, worth waiting for (_released).
            _forwards.labels("peer_stopping").inc()
            self._draining[member] = max(self._draining.get(member, 0.0), now + RELEASE_WAIT)
        else:
            _forwards.labels("peer_unreachable").inc()
        if why == "refused":
            # Its port refused the connection: the box is up and its router is not (stopping,
            # or killed). Unlike a silent cut, nothing of it can be serving the space.
            self._refused.add(member)
        else:
            self._refused.discard(member)
        self._unreachable[member] = (now + self._mesh.dead_after, self._mono())
        self._holders.pop(host, None)
        return self._route_elsewhere(route, head)

    async def _route_remote(self, route: Route, head: RequestHead) -> Target:
        host = route.host
        told = self._membership.holding(host)
        # A peer said it has the space awake (its beats: no bucket read), else the lease says.
        holder = told if told is not None else await self._holder(host)
        said = self._not_holding.get(host)
        if said is not None:
            if said[1] <= self._clock():
                del self._not_holding[host]
            elif holder == said[0]:
                holder = None  # it said otherwise a moment ago (reroute, "not_holding")
        if holder is not None and holder in self._draining_peers():
            holder = await self._released(host, holder)
        live = {placement.normalise_member_url(m.url) for m in self._live()}
        if holder is not None and holder != self._self_url and self._cut_off(holder):
            # Alive (its heartbeat, or a peer's word, says so) but out of this box's reach (its
            # beats or a forward went unanswered): a forward would wait for a dial that fails,
            # and a wake here would meet its lease. Refuse at once; the client retries.
            return self._holder_unreachable(host, holder)
        if holder is not None and holder != self._self_url and holder in live:
            _forwards.labels("to_holder").inc()
            return self._to(holder, route, head)
        owner = self.owner_url(route)
        if (
            holder is not None
            and holder != self._self_url
            and holder not in self._unreachable
            # (A lease may name anything: forwarded only to a box that proved it holds the
            # mesh token, its heartbeat authenticated or its beat to us: Membership.known.)
            and self._membership.known(holder)
            and self._activator.lease_lost(host)
        ):
            # Our copy stands down because the lease was taken: the taker serves it (once it is
            # back in our view), never a wake here.
            _forwards.labels("to_holder").inc()
            return self._to(holder, route, head)
        if owner == self._self_url and self._foreign(route) and not self._activator.holds(host):
            return await self._failover(route, head, forwarded=False)
        if owner == self._self_url or self._activator.holds(host):
            _forwards.labels("local_owner").inc()
            here = self._here(route, head)
            return await here if isinstance(here, Deferred) else here
        _forwards.labels("to_owner").inc()
        return self._to(owner, route, head)

    def _cut_off(self, peer: str) -> bool:
        """Is ``peer`` alive — its heartbeat fresh in the bucket, or heard lately — but out of
        this box's reach now? (Neither fresh nor heard for ``dead_after``, it may be dead: a wake
        then judges it, and takes its lease over if it is.)"""
        membership = self._membership
        silent = membership.silent_for(peer) >= self._mesh.dead_after
        if silent and not membership.fresh_in_bucket(peer):
            return False
        self._live()  # (forgets the marks of peers that answer again)
        unreachable = peer in self._unreachable and peer not in self._refused
        return unreachable or bool(membership.peer_unreachable(peer))

    def _holder_unreachable(self, host: str, holder: str) -> Target:
        _forwards.labels("holder_unreachable").inc()
        self._membership.kick(holder)  # a beat now: back in reach as soon as it answers
        now = self._clock()
        if now - self._region_down_logged.get(host, float("-inf")) >= REGION_DOWN_LOG_EVERY:
            self._region_down_logged[host] = now
            _log.warn(
                "mesh: {host} is awake on {holder}, which this box cannot reach (its beats go "
                "unanswered): answering 503 until it can, or until it is judged dead",
                host=host,
                holder=holder,
            )
        return _unavailable(host, "holder_unreachable")

    def _live(self) -> list[Any]:
        """The membership's live view minus peers that just refused a forwarded request."""
        now = self._clock()
        for url, (until, failed) in list(self._unreachable.items()):
            if until <= now or self._membership.answered_since(url, failed):
                del self._unreachable[url]  # (it answers this box's beats again: back)
                self._refused.discard(url)
        members = self._membership.live()
        if not self._unreachable:
            return list(members)
        return [
            m for m in members if placement.normalise_member_url(m.url) not in self._unreachable
        ]

    def _to(self, peer: str, route: Route, head: RequestHead) -> Target:
        return forward.peer_target(
            peer,
            route.host,
            self._mesh.token,
            now=self._clock,
            method=head.method,
            target=head.target,
        )

    def _members_changed(self, old: list[Any], new: list[Any]) -> None:
        """A member that left the view because its heartbeat says "draining" (Membership.
        begin_drain) releases its leases within moments: its spaces wait here for them. One that
        left otherwise (its heartbeat aged out or vanished) is dead: a wake takes its leases over
        at once (docs/lease.md). One that (re)joins is not draining any more."""
        still = {placement.normalise_member_url(m.url) for m in new}
        for url in still - {placement.normalise_member_url(m.url) for m in old}:
            self._draining.pop(url, None)
        leaving = {placement.normalise_member_url(u) for u in self._membership.draining()}
        now = self._clock()
        for member in old:
            url = placement.normalise_member_url(member.url)
            if url in still or url == self._self_url or url not in leaving:
                continue
            self._draining[url] = max(self._draining.get(url, 0.0), now + RELEASE_WAIT)
            _log.info(
                "mesh: {url} left (its heartbeat says it is draining): its spaces wait up to "
                "{wait:g}s here for their leases",
                url=url,
                wait=RELEASE_WAIT,
            )

    def _draining_peers(self) -> dict[str, float]:
        now = self._clock()
        for url, until in list(self._draining.items()):
            if until <= now:
                del self._draining[url]
        return self._draining

    async def _released(self, host: str, peer: str) -> str | None:
        """Wait until draining ``peer`` no longer holds ``host``'s lease, at most until the
        deadline :meth:`_to` set; returns the holder then (still ``peer`` if time ran out: the
        wake here then answers 503 lease_held as for any held lease)."""
        holder: str | None = peer
        started = self._clock()
        while holder == peer and self._clock() < self._draining.get(peer, 0.0):
            await deferLater(self._reactor, RELEASE_POLL, lambda: None)
            holder = await self._holder(host, max_age=RELEASE_POLL)
        outcome = "released" if holder != peer else "timed_out"
        _release_waits.labels(outcome).inc()
        if outcome == "released":
            _log.debug(
                "mesh: {peer} (stopping) released {host} after {waited:.2f}s",
                peer=peer,
                host=host,
                waited=self._clock() - started,
            )
        else:
            _log.warn(
                "mesh: {peer} is stopping but still holds the lease of {host} after {waited:.1f}s"
                " (a slow final flush?): waking it here meets the held lease",
                peer=peer,
                host=host,
                waited=self._clock() - started,
            )
        return holder

    async def _holder(self, host: str, max_age: float | None = None) -> str | None:
        """Who holds ``host``'s lease now (a member URL), from a cache younger than ``max_age``
        (default ``holder_ttl``) or one GET; any number of requests arriving together share
        that GET."""
        now = self._clock()
        cached = self._holders.get(host)
        ttl = self._holder_ttl if max_age is None else max_age
        # (A microsecond of slack: an entry read exactly ``ttl`` ago on the clock's float is old.)
        if cached is not None and now - cached[0] < ttl - 1e-6:
            return cached[1]
        reading = self._reading.get(host)
        if reading is None:
            reading = Deferred.fromCoroutine(self._read_holder(host))
            self._reading[host] = reading

            def done(result: object) -> object:
                self._reading.pop(host, None)
                return result

            reading.addBoth(done)
        return await observe(reading)  # _read_holder never fails: errors mean "nobody"

    async def _read_holder(self, host: str) -> str | None:
        owner: str | None = None
        if not self._membership.bucket_reachable():
            # The bucket is out of reach (this box's heartbeat does not land): what was read
            # before, however old, rather than a read that hangs.
            return self._holders.get(host, (0.0, None))[1]
        try:
            reading = Deferred.fromCoroutine(self._store.get(lease_key(self._hib.prefix, host)))
            reading.addTimeout(HOLDER_READ_TIMEOUT, self._reactor)
            got = await reading
            owner = _member_url(LeaseRecord.parse(got.body).owner)
        except NotFound:
            owner = None
        except TimeoutError:
            _log.warn(
                "mesh: the lease of {host} could not be read within {timeout:g}s",
                host=host,
                timeout=HOLDER_READ_TIMEOUT,
            )
            return self._holders.get(host, (0.0, None))[1]  # (what was read before, if anything)
        except ObjectStoreError as e:
            # Not known, rather than "nobody": not remembered, so the next request asks again
            # (a box just reconnected to its bucket must not route by a failed read for 2 s).
            _log.warn("mesh: could not read the lease of {host}: {e}", host=host, e=e)
            return None
        except Exception as e:  # a lock.json we cannot parse names nobody we can forward to
            _log.warn("mesh: unreadable lease of {host}: {e}", host=host, e=e)
            owner = None
        if len(self._holders) > 100_000:
            self._holders.clear()
        self._holders[host] = (self._clock(), owner)
        return owner


def _unavailable(host: str, label: str) -> Target:
    """The mesh's own 503 (``label`` names why, in metrics only): a client is told no more than
    that ``host`` is temporarily unavailable, and when to try again."""
    return plain(
        503,
        f"503 Service Unavailable: {host} is temporarily unavailable; try again in "
        f"{RETRY_AFTER_SECONDS}s",
        (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
        label=label,
    )


def _span(seconds: float) -> str:
    """A duration as the settings spell it: ``5m``, ``1h30m``, ``3s``, ``1.5s``."""
    whole = int(seconds)
    if whole != seconds or whole < 60:
        return f"{seconds:g}s" if seconds < 60 else f"{whole // 60}m{whole % 60}s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return text + (f"{secs}s" if secs else "")


def _refusal_for_peer(target: Target) -> Target:
    """This box's answer to a request a peer forwarded: a refusal made because this box is
    stopping (LocalResponse.refusal) carries ``X-Lchat-Refused`` so that the peer sends the
    request elsewhere. Only a router's own LocalResponse can carry it: every space's response has
    the header dropped (lchat.proxy.http.INTERNAL), and a client's request never gets here."""
    if isinstance(target, LocalResponse) and target.refusal:
        marker = (REFUSED, target.refusal.encode("ascii"))
        return attrs.evolve(target, headers=(*target.headers, marker))
    return target


def _member_url(owner: str) -> str | None:
    """A lease owner as a member URL, or None (a non-mesh box id names nobody to forward to)."""
    if not owner.startswith(("http://", "https://")):
        return None
    try:
        return placement.normalise_member_url(owner)
    except ValueError:
        return None

"""MeshRouter (lchat/mesh/routing.py) as a state machine on a fake clock.

Where an in-scope hibernating space is served: the owner by rendezvous hash (scoped to a home
region), the lease holder while the space is awake elsewhere, here for a request a peer forwarded
with an authentic marker. Then the routing state kept between requests: the lease-holder cache
(one GET per host per ``holder_ttl``, shared by requests arriving together), a peer left out of
placement for ``dead_after`` after it could not take a request, and a draining peer's leases
awaited (at most RELEASE_WAIT) instead of met held.

Everything runs on one ``task.Clock`` (the router's clock and reactor) over a real ``file:`` store
whose disk work runs inline (or is held back by the test to make requests overlap): no thread,
no reactor, no wall-clock wait. The membership and the activator are reduced to what MeshRouter
reads of them: ``live()`` and ``subscribe()``, and ``holds()``.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from typing import Any

from attrs import evolve, frozen
from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from lchat.buckets import RegionBuckets
from lchat.config import BoxConfig, ConfigError, HibernateConfig, MeshConfig, parse_bucket_url
from lchat.lease import acquire
from lchat.mesh import forward, placement, routing
from lchat.mesh.routing import MeshRouter
from lchat.objstore.file import FileStore
from lchat.objstore.where import Where
from lchat.proxy.http import REFUSED
from lchat.registry import Route
from lchat.router import LocalResponse, RemotePeer, RequestHead, Target

SELF = "http://a.example.net"
B = "http://b.example.net"
C = "http://c.example.net:8080"
DOMAIN = "mesh.example"
# What a marker on a request routed by these tests (POST /, to SELF) is bound to.
BOUND = forward.Bound(method=b"POST", target=b"/", peer=SELF)
EPOCH = 10_000.0  # the clock's start: forwarded markers carry it (small: float steps stay exact)
TOKEN = "routing-token-" + "z" * 20
HEARTBEAT, DEAD_AFTER = 15.0, 45.0
SERVED_HERE = LocalResponse(200, b"served here\n")


@frozen
class Peer:
    """A member as the membership's view holds it (lchat.mesh.members.Member, reduced)."""

    url: str
    region: str = ""
    age: float = 1.0  # seconds since its last beat at the read that saw it


class View:
    """The membership (lchat.mesh.membership.Membership) as MeshRouter uses it; ``read()`` replaces the view as a heartbeat read would, telling the
    subscribers (old, new) when the set of (URL, region) pairs changed."""

    def __init__(self, *members: Peer) -> None:
        self.members = list(members)
        self.leaving: frozenset[str] = frozenset()
        self._subscribers: list[Callable[[list[Peer], list[Peer]], object]] = []
        # URLs whose heartbeat authenticated once (the witness's roster): Membership.known.
        self.seen = {m.url for m in members}

    def live(self) -> list[Peer]:
        return list(self.members)

    def known(self, url: str) -> bool:
        return url in self.seen or any(m.url == url for m in self.members)

    def draining(self) -> frozenset[str]:
        return self.leaving

    def subscribe(self, fn: Callable[[list[Peer], list[Peer]], object]) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    # The witness's answers, as for a box whose peers' beats it has not heard (a holder it may
    # not judge: never cut off) and whose bucket is in reach.
    def holding(self, host: str) -> str | None:
        return None

    def peer_unreachable(self, url: str) -> bool:
        return False

    def silent_for(self, url: str) -> float:
        return float("inf")

    def fresh_in_bucket(self, url: str) -> bool:
        return False

    def kick(self, url: str) -> None:
        pass

    def answered_since(self, url: str, since: float) -> bool:
        return False

    def bucket_reachable(self) -> bool:
        return True

    def lapsed(self) -> bool:  # this box is alive (a lapsed one: IsolatedTests)
        return False

    def read(self, *members: Peer, draining: tuple[str, ...] = ()) -> None:
        """``draining``: peers whose heartbeat said "draining" at this read."""
        self.leaving = frozenset(draining)
        old, self.members = self.members, list(members)
        self.seen |= {m.url for m in members}
        if {(m.url, m.region) for m in old} != {(m.url, m.region) for m in members}:
            for fn in list(self._subscribers):
                fn(list(old), list(members))


class Running:
    """The activator as MeshRouter sees it: ``holds(host)`` while it runs anything for it; what
    it was asked to serve "here" is recorded in ``served`` (answered SERVED_HERE), unless
    ``answer`` is set (then that answers, unrecorded)."""

    def __init__(self) -> None:
        self.hosts: set[str] = set()
        self.lost: set[str] = set()  # standing down here because the lease was taken
        self.served: list[str] = []  # hosts the activator was asked to serve ("here")
        self.answer: Callable[[], Target | Deferred[Target]] | None = None

    def route(
        self, route: Route, sidecar: bool = False, write: bool = False
    ) -> Target | Deferred[Target]:
        if self.answer is not None:
            return self.answer()
        self.served.append(route.host)
        return SERVED_HERE

    def holds(self, host: str) -> bool:
        return host in self.hosts

    def lease_lost(self, host: str) -> bool:
        return host in self.lost


class Disk:
    """The file store's ``run_in_thread``: runs the disk work inline and counts the calls; while
    :meth:`hold` is on, the work waits until :meth:`release` (requests then overlap)."""

    def __init__(self) -> None:
        self.calls = 0
        self._held: list[tuple[Callable[[], Any], Deferred[Any]]] | None = None

    def __call__(self, work: Callable[[], Any]) -> Deferred[Any]:
        self.calls += 1
        if self._held is None:
            return maybeDeferred(work)
        waiting: Deferred[Any] = Deferred()
        self._held.append((work, waiting))
        return waiting

    def hold(self) -> None:
        self._held = []

    def release(self) -> None:
        held, self._held = self._held or [], None
        for work, waiting in held:
            maybeDeferred(work).chainDeferred(waiting)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def forwards(outcome: str) -> float:
    return sample("lchat_mesh_forwards_total", outcome=outcome)


def owner_by_score(host: str, *urls: str) -> str:
    """The rendezvous winner, straight from the score's specification (placement.score)."""
    return max(urls, key=lambda url: (placement.score(url, host), url))


def host_owned_by(url: str, *urls: str, but_not: tuple[str, ...] = ()) -> str:
    """An in-scope host that ``url`` wins among ``urls``, and that no member set in ``but_not``
    would give to ``url`` when ``url`` is missing (for the 'another owner' cases)."""
    for i in range(10_000):
        host = f"s{i}.{DOMAIN}"
        if owner_by_score(host, *urls) == url and host not in but_not:
            return host
    raise AssertionError("no such host")


def hibernating(host: str, home_region: str = "") -> Route:
    return Route(
        host=host,
        kind="instance",
        socket="/nonexistent.sock",
        status="ready",
        hibernate=True,
        home_region=home_region,
    )


def box_config(directory: str) -> BoxConfig:
    """A mesh box's settings: this box is SELF, the bucket is ``<directory>/bucket``."""
    return BoxConfig(
        env_file="",
        data_dir=os.path.join(directory, "data"),
        run_dir=os.path.join(directory, "run"),
        registry=os.path.join(directory, "registry.db"),
        acme_cache="",
        cert_cache="dir",
        https_addr=None,
        http_addr=None,
        fallback_url="",
        units="builtin",
        space_command=(),
        sidecar_command=(),
        hibernate=HibernateConfig(
            bucket=f"file:{os.path.join(directory, 'bucket')}",
            region="",
            prefix="prod",
            endpoint="",
            idle=60.0,
        ),
        mesh=MeshConfig(
            self_url=SELF,
            domains=(DOMAIN,),
            token=TOKEN,
            region="",
            heartbeat=HEARTBEAT,
            dead_after=DEAD_AFTER,
        ),
        wildcard_domains=(),
    )


class _Base(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(self.dir, "bucket"))
        self.clock = Clock()
        self.clock.advance(EPOCH)  # the reactor's clock is unix time: forwarded markers carry it
        self.disk = Disk()
        self.bucket = os.path.join(self.dir, "bucket")
        self.store = FileStore(self.clock, self.bucket, run_in_thread=self.disk)
        self.cfg = box_config(self.dir)
        assert self.cfg.hibernate is not None
        self.hib = self.cfg.hibernate
        self.running = Running()
        self.served = self.running.served

    def mesh(self, view: View, holder_ttl: float = 2.0) -> MeshRouter:
        return MeshRouter(
            self.cfg,
            self.store,
            view,
            self.running,
            holder_ttl=holder_ttl,
            reactor=self.clock,
        )

    def mesh_of(self, *urls: str) -> MeshRouter:
        return self.mesh(View(*(Peer(u) for u in urls)))

    def hold_lease(self, host: str, owner: str) -> str:
        key = self.hib.key(host, "lock.json")
        self.successResultOf(
            Deferred.fromCoroutine(
                acquire(self.store, key, owner, 900.0, host=host, monotonic=self.clock.seconds)
            )
        )
        return key

    def release_lease(self, key: str) -> None:
        self.successResultOf(Deferred.fromCoroutine(self.store.delete(key)))

    def route(
        self,
        mesh: MeshRouter,
        host: str,
        forwarded: bytes | None = None,
        local: Callable[[], Target | Deferred[Target]] | None = None,
        home_region: str = "",
    ) -> Deferred[Target]:
        """``mesh.route`` for a POST to ``host``, always as a Deferred (fired or not); ``local``:
        what the activator answers instead of SERVED_HERE."""
        head = RequestHead(method=b"POST", target=b"/", host=host, forwarded=forwarded)
        self.running.answer = local
        target = mesh.route(hibernating(host, home_region), head)
        return target if isinstance(target, Deferred) else succeed(target)

    def routed(self, mesh: MeshRouter, host: str, **kw: Any) -> Target:
        """Where a request for ``host`` goes, decided without waiting (the clock does not move)."""
        return self.successResultOf(self.route(mesh, host, **kw))

    def reroute(self, mesh: MeshRouter, target: RemotePeer, why: str) -> Deferred[Target]:
        """What the proxy asks when the forward of :meth:`route`'s POST to ``target`` failed
        (``why``): ``mesh.reroute``, as ``Router.reroute`` calls it, always as a Deferred."""
        head = RequestHead(method=b"POST", target=b"/", host=target.host)
        return _deferred(mesh.reroute(hibernating(target.host), head, target, why))

    def assertForwardedTo(self, target: Target, peer: str, host: str) -> RemotePeer:
        assert isinstance(target, RemotePeer), target
        parts = placement.normalise_member_url(peer).split("://", 1)[1].split(":")
        self.assertEqual(
            (target.host, target.address, target.server_name, target.tls),
            (host, parts[0], host, False),
        )
        self.assertEqual(target.port, int(parts[1]) if len(parts) > 1 else 80)
        ((name, value),) = target.add_headers
        self.assertEqual(name, forward.HEADER)
        to = forward.Bound(b"POST", b"/", placement.normalise_member_url(peer))
        self.assertTrue(forward.authentic(value, TOKEN, host, now=self.clock.seconds, bound=to))
        self.assertEqual(target.member, placement.normalise_member_url(peer))
        return target

    def advance(self, seconds: float, step: float = 0.05) -> None:
        for _ in range(round(seconds / step)):
            self.clock.advance(step)

    def advance_until(self, d: Deferred[Any], limit: float, step: float = 0.05) -> float:
        """Move the clock in small steps until ``d`` fires; the clock reading it fired at."""
        while not d.called:
            self.assertLess(self.clock.seconds(), limit, "still waiting")
            self.clock.advance(step)
        return self.clock.seconds()


class OwnershipTests(_Base):
    """Who owns an in-scope host: rendezvous hashing over the live view, region first."""

    def test_the_owner_is_the_highest_score_among_live_members(self) -> None:
        mesh = self.mesh_of(SELF, B, C)
        owners = set()
        for i in range(30):
            host = f"s{i}.{DOMAIN}"
            expected = owner_by_score(host, SELF, B, C)
            self.assertEqual(mesh.owner_url(hibernating(host)), expected, host)
            self.assertEqual(mesh.is_owner(hibernating(host)), expected == SELF, host)
            owners.add(expected)
        self.assertEqual(owners, {SELF, B, C})  # 30 hosts spread over all three

    def test_an_owned_host_is_served_here_a_peers_is_forwarded_to_it(self) -> None:
        mesh = self.mesh_of(SELF, B, C)
        mine, theirs = host_owned_by(SELF, SELF, B, C), host_owned_by(C, SELF, B, C)
        here, there = forwards("local_owner"), forwards("to_owner")
        self.assertIs(self.routed(mesh, mine), SERVED_HERE)
        self.assertEqual(self.served, [mine])
        target = self.assertForwardedTo(self.routed(mesh, theirs), C, theirs)
        self.assertEqual(target.port, 8080)
        self.assertEqual(self.served, [mine])
        self.assertEqual((forwards("local_owner"), forwards("to_owner")), (here + 1, there + 1))
        self.assertEqual(self.disk.calls, 2)  # one lease read per host: nobody holds either

    def test_the_home_region_scopes_ownership_while_a_member_is_live_there(self) -> None:
        view = View(Peer(SELF, "ie"), Peer(B, "us"), Peer(C, "us"))
        mesh = self.mesh(view)
        # A host this box would win over the whole fleet...
        host = host_owned_by(SELF, SELF, B, C)
        in_us = owner_by_score(host, B, C)
        # ...goes to the US members for a US space, here for an Irish one, and to the whole
        # fleet's winner when its region has no live member (availability over residency).
        self.assertEqual(mesh.owner_url(hibernating(host, "us")), in_us)
        self.assertEqual(mesh.owner_url(hibernating(host, "ie")), SELF)
        self.assertEqual(mesh.owner_url(hibernating(host, "jp")), SELF)
        self.assertEqual(mesh.owner_url(hibernating(host)), SELF)
        self.assertForwardedTo(self.routed(mesh, host, home_region="us"), in_us, host)
        self.assertFalse(mesh.is_owner(hibernating(host, "us")))
        # The US members go: the US space comes home to the fleet's winner (here).
        view.read(Peer(SELF, "ie"))
        self.assertIs(self.routed(mesh, host, home_region="us"), SERVED_HERE)
        self.assertTrue(mesh.is_owner(hibernating(host, "us")))

    def test_alone_this_box_owns_every_host(self) -> None:
        for view in (View(Peer(SELF)), View()):  # a view is never empty; if it were: here
            mesh = self.mesh(view)
            host = host_owned_by(B, SELF, B)
            self.assertEqual(mesh.owner_url(hibernating(host)), SELF)
            self.assertIs(self.routed(mesh, host), SERVED_HERE)

    def test_only_the_mesh_domains_and_their_direct_children_are_placed(self) -> None:
        mesh = self.mesh_of(SELF, B, C)
        self.assertTrue(mesh.in_scope(DOMAIN))
        self.assertTrue(mesh.in_scope(f"s1.{DOMAIN}"))
        self.assertFalse(mesh.in_scope(f"a.b.{DOMAIN}"))  # directly under only
        self.assertFalse(mesh.in_scope("chat.other.org"))
        # A host out of scope is owned wherever it is (its due wakes fire here).
        self.assertTrue(mesh.is_owner(hibernating("chat.other.org")))
        self.assertTrue(mesh.is_owner(hibernating(f"a.b.{DOMAIN}")))

    def test_an_ownership_change_is_counted_once_per_change(self) -> None:
        view = View(Peer(SELF))
        mesh = self.mesh(view)
        host = host_owned_by(B, SELF, B)
        changes = sample("lchat_mesh_ownership_changes_total")
        for _ in range(3):  # the first computation is not a change, nor is the same answer
            self.assertEqual(mesh.owner_url(hibernating(host)), SELF)
        self.assertEqual(sample("lchat_mesh_ownership_changes_total"), changes)
        view.read(Peer(SELF), Peer(B, age=40.0))  # B joins and wins the host
        for _ in range(3):
            self.assertForwardedTo(self.routed(mesh, host), B, host)
        self.assertEqual(sample("lchat_mesh_ownership_changes_total"), changes + 1)
        view.read(Peer(SELF))  # and leaves (aged out: not a drain)
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual(sample("lchat_mesh_ownership_changes_total"), changes + 2)


class ForwardingTests(_Base):
    """Here, to the holder, or to the owner; the forwarded marker."""

    def test_a_space_running_here_is_served_here_without_reading_its_lease(self) -> None:
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(B, SELF, B)
        self.running.hosts.add(host)  # awake (or waking, or stopping) on this box
        counted = forwards("local_running")
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual(forwards("local_running"), counted + 1)
        self.assertEqual(self.disk.calls, 0)

    def test_a_copy_standing_down_after_a_takeover_sends_requests_to_the_taker(self) -> None:
        """Our copy lost its lease (taken over while this box was frozen or cut off) and still
        stops: its requests go to the new holder — even before the holder is back in our view —
        never into a wake here that would only meet the held lease."""
        view = View(Peer(SELF))  # a view that has not seen B again yet
        view.seen.add(B)  # (but B's heartbeat authenticated before: a member it knows)
        mesh = self.mesh(view)
        host = host_owned_by(SELF, SELF, B)
        self.running.hosts.add(host)
        self.running.lost.add(host)
        self.hold_lease(host, B)
        self.assertForwardedTo(self.routed(mesh, host), B, host)

    def test_a_lease_naming_no_member_gets_no_request(self) -> None:
        """Issue 29: a lease in the bucket may name any URL (a bucket writer's): a copy standing
        down here never sends a request to a holder whose heartbeat never authenticated."""
        mesh = self.mesh_of(SELF)
        host = host_owned_by(SELF, SELF, B)
        self.running.hosts.add(host)
        self.running.lost.add(host)
        self.hold_lease(host, B)  # B: never a member this box knows
        self.assertIs(self.routed(mesh, host), SERVED_HERE)  # (its activator refuses the wake)

    def test_a_space_awake_elsewhere_goes_to_its_lease_holder_whatever_the_hash_says(self) -> None:
        mesh = self.mesh_of(SELF, B, C)
        mine, bs = host_owned_by(SELF, SELF, B, C), host_owned_by(B, SELF, B, C)
        for host in (mine, bs):
            self.hold_lease(host, C)
        counted = forwards("to_holder")
        self.assertForwardedTo(self.routed(mesh, mine), C, mine)
        self.assertForwardedTo(self.routed(mesh, bs), C, bs)
        self.assertEqual(forwards("to_holder"), counted + 2)
        self.assertEqual(self.served, [])

    def test_a_lease_naming_nobody_to_forward_to_is_routed_by_the_hash(self) -> None:
        mesh = self.mesh_of(SELF, B)
        cases = {
            "a member not in the view": "http://d.example.net",
            "a box outside the mesh": "box-1",
            "an unreadable lock.json": None,
        }
        for why, holder in cases.items():
            host = host_owned_by(SELF, SELF, B, but_not=tuple(self.served))
            if holder is None:
                key = self.hib.key(host, "lock.json")
                self.successResultOf(Deferred.fromCoroutine(self.store.put(key, b"{not json")))
            else:
                self.hold_lease(host, holder)
            self.assertIs(self.routed(mesh, host), SERVED_HERE, why)
            self.assertEqual(self.served[-1], host, why)

    def test_a_bucket_that_cannot_be_read_names_no_holder(self) -> None:
        mesh = self.mesh_of(SELF, B)
        mine, bs = host_owned_by(SELF, SELF, B), host_owned_by(B, SELF, B)
        os.rename(self.bucket, self.bucket + ".away")  # the store answers StoreUnavailable
        self.assertIs(self.routed(mesh, mine), SERVED_HERE)
        self.assertForwardedTo(self.routed(mesh, bs), B, bs)

    def test_an_authentic_marker_is_served_here_whatever_this_box_thinks(self) -> None:
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(B, SELF, B)
        self.hold_lease(host, B)  # even a lease elsewhere: the activator settles it
        counted, reads = forwards("local_forwarded"), self.disk.calls
        marker = forward.marker(TOKEN, host, self.clock.seconds, BOUND)
        self.assertIs(self.routed(mesh, host, forwarded=marker), SERVED_HERE)
        self.assertEqual(forwards("local_forwarded"), counted + 1)
        self.assertEqual(self.disk.calls, reads)  # one hop only: nothing read, nothing asked

    def test_a_forged_stale_or_misdirected_marker_is_routed_like_any_request(self) -> None:
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(B, SELF, B)
        other = host_owned_by(B, SELF, B, but_not=(host,))
        markers = {
            "another token": forward.marker("not-the-token", host, self.clock.seconds, BOUND),
            "stamped 1000 s ago": forward.marker(TOKEN, host, lambda: EPOCH - 1000, BOUND),
            "stamped 1000 s ahead": forward.marker(TOKEN, host, lambda: EPOCH + 1000, BOUND),
            "another host's": forward.marker(TOKEN, other, self.clock.seconds, BOUND),
            "garbage": b"v1 garbage",
            # Issue 29: a marker captured where it was sent replays nowhere else.
            "another path's": forward.marker(
                TOKEN, host, self.clock.seconds, forward.Bound(b"POST", b"/admin", SELF)
            ),
            "another method's": forward.marker(
                TOKEN, host, self.clock.seconds, forward.Bound(b"GET", b"/", SELF)
            ),
            "another peer's": forward.marker(
                TOKEN, host, self.clock.seconds, forward.Bound(b"POST", b"/", B)
            ),
            "an older lchat's (v1, bound to the host only)": b"v1 %d %s"
            % (
                EPOCH,
                hmac.new(TOKEN.encode(), b"v1\n%d\n%s" % (EPOCH, host.encode()), "sha256")
                .hexdigest()
                .encode(),
            ),
        }
        bad = forwards("bad_marker")
        for why, marker in markers.items():
            self.assertForwardedTo(self.routed(mesh, host, forwarded=marker), B, host)
            self.assertEqual(self.served, [], why)
        self.assertEqual(forwards("bad_marker"), bad + len(markers))

    def test_only_a_stopping_refusal_of_an_authentic_forwarded_request_is_marked(self) -> None:
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(SELF, SELF, B)
        stopping = LocalResponse(503, b"stopping\n", ((b"retry-after", b"5"),), refusal="stopping")
        busy = LocalResponse(503, b"busy\n", ((b"retry-after", b"5"),))
        marked = (*stopping.headers, (REFUSED, b"stopping"))
        authentic = forward.marker(TOKEN, host, self.clock.seconds, BOUND)
        forged = forward.marker("not-the-token", host, self.clock.seconds, BOUND)

        def at_once() -> Target:
            return stopping

        def after_a_wait() -> Deferred[Target]:
            return succeed(stopping)

        for local in (at_once, after_a_wait):
            got = self.routed(mesh, host, forwarded=authentic, local=local)
            assert isinstance(got, LocalResponse)
            self.assertEqual((got.status, got.headers), (503, marked))
        for head in (None, forged):  # a client's own request: the plain 503
            got = self.routed(mesh, host, forwarded=head, local=at_once)
            assert isinstance(got, LocalResponse)
            self.assertEqual(got.headers, stopping.headers)
        self.assertEqual(self.routed(mesh, host, forwarded=authentic, local=lambda: busy), busy)

    def test_a_forward_for_a_space_a_peer_in_reach_holds_is_refused_not_woken(self) -> None:
        """A 3-box pair cut: A cannot reach the holder B, so A's reroute forwards to C; C hears
        B, whose beats say the space is awake there, and its lease names B. A wake on C would
        only meet that lease, and C's own clients' requests for the space would join it
        meanwhile (a 503 through C, which the cut does not concern): C answers the forward 503
        ``lease_held`` at once. A lease released since (a drain's hand-over, which B's beats may
        say only a heartbeat later), or a holder that stopped answering C too (dead), is not
        that: the wake goes on."""
        host = host_owned_by(SELF, SELF, B)
        answering = {B}

        class Told(View):
            def holding(self, asked: str) -> str | None:
                return B if asked == host else None

            def answered_since(self, url: str, since: float) -> bool:
                return url in answering

        mesh = self.mesh(Told(Peer(SELF), Peer(B)))
        key = self.hold_lease(host, B)
        marker = forward.marker(TOKEN, host, self.clock.seconds, BOUND)
        before = forwards("forwarded_held_elsewhere")
        got = self.routed(mesh, host, forwarded=marker)
        assert isinstance(got, LocalResponse)
        self.assertEqual((got.status, got.label), (503, "lease_held"))
        self.assertEqual(self.served, [])
        self.assertEqual(forwards("forwarded_held_elsewhere"), before + 1)
        # Released (B drained it), its beats not yet saying so: served here.
        self.release_lease(key)
        self.clock.advance(2.0)  # (the lease read is cached holder_ttl)
        self.assertIs(self.routed(mesh, host, forwarded=marker), SERVED_HERE)
        self.assertEqual(self.served, [host])
        # Held by B again, but B stopped answering this box's beats: the wake here judges it.
        self.hold_lease(host, B)
        self.clock.advance(2.0)  # (the lease read is cached holder_ttl)
        answering.clear()
        self.assertIs(self.routed(mesh, host, forwarded=marker), SERVED_HERE)
        self.assertEqual(self.served, [host, host])


class HolderCacheTests(_Base):
    """lock.json is read at most once per host per ``holder_ttl``, by one GET shared by every
    request that arrives while it is under way."""

    def test_the_lease_is_read_once_per_host_per_holder_ttl(self) -> None:
        mesh = self.mesh_of(SELF, B, C)
        host = host_owned_by(SELF, SELF, B, C)
        key = self.hold_lease(host, C)
        reads = self.disk.calls
        for _ in range(5):
            self.assertForwardedTo(self.routed(mesh, host), C, host)
        self.assertEqual(self.disk.calls, reads + 1)
        other = host_owned_by(SELF, SELF, B, C, but_not=(host,))
        self.assertIs(self.routed(mesh, other), SERVED_HERE)
        self.assertEqual(self.disk.calls, reads + 2)  # each host its own read
        self.clock.advance(1.0)
        self.release_lease(key)  # C's space sleeps
        reads = self.disk.calls
        self.clock.advance(0.99)
        # Still forwarded from the cache: C answers for the space (it wakes or redirects)...
        self.assertForwardedTo(self.routed(mesh, host), C, host)
        self.assertEqual(self.disk.calls, reads)
        self.clock.advance(0.01)  # ...until the entry is holder_ttl old: read again
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual(self.disk.calls, reads + 1)

    def test_the_ttl_is_the_routers_setting(self) -> None:
        mesh = self.mesh(View(Peer(SELF), Peer(C)), holder_ttl=10.0)
        host = host_owned_by(SELF, SELF, C)
        key = self.hold_lease(host, C)
        self.assertForwardedTo(self.routed(mesh, host), C, host)
        self.release_lease(key)
        reads = self.disk.calls
        self.clock.advance(9.9)
        self.assertForwardedTo(self.routed(mesh, host), C, host)
        self.assertEqual(self.disk.calls, reads)
        self.clock.advance(0.1)
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual(self.disk.calls, reads + 1)

    def test_requests_arriving_together_share_one_read(self) -> None:
        mesh = self.mesh_of(SELF, B, C)
        host = host_owned_by(SELF, SELF, B, C)
        self.hold_lease(host, C)
        reads = self.disk.calls
        self.disk.hold()  # the GET takes a while
        waiting = [self.route(mesh, host) for _ in range(10)]
        self.assertEqual([d.called for d in waiting], [False] * 10)
        self.assertEqual(self.disk.calls, reads + 1)
        self.disk.release()
        for d in waiting:
            self.assertForwardedTo(self.successResultOf(d), C, host)
        self.assertEqual(self.disk.calls, reads + 1)
        # The next arrival finds the answer cached; a new read after the TTL is a new GET.
        self.assertForwardedTo(self.routed(mesh, host), C, host)
        self.clock.advance(2.0)
        self.assertForwardedTo(self.routed(mesh, host), C, host)
        self.assertEqual(self.disk.calls, reads + 2)


class UnreachablePeerTests(_Base):
    """A peer that could not take a request is left out of placement for ``dead_after`` (its
    heartbeat would take that long to age out of every view), not waited for."""

    def test_an_unreachable_owner_is_left_out_for_dead_after_then_tried_again(self) -> None:
        for why in ("unreachable", "closed"):
            mesh = self.mesh_of(SELF, B)
            started = self.clock.seconds()
            first = host_owned_by(B, SELF, B)
            second = host_owned_by(B, SELF, B, but_not=(first,))
            counted = forwards("peer_unreachable")
            target = self.assertForwardedTo(self.routed(mesh, first), B, first)
            # Routed again at once without B: here is the owner now.
            self.assertIs(self.successResultOf(self.reroute(mesh, target, why)), SERVED_HERE)
            self.assertEqual(forwards("peer_unreachable"), counted + 1)
            self.assertEqual(self.clock.getDelayedCalls(), [])  # nothing to wait for
            # Every host B owns stays here while B is left out...
            self.clock.advance(DEAD_AFTER - 0.1)
            self.assertIs(self.routed(mesh, second), SERVED_HERE, why)
            self.assertTrue(mesh.is_owner(hibernating(second)), why)  # its due wakes too
            # ...and goes back to B after dead_after (B still live in the view: it recovered).
            self.clock.advance(0.1)
            self.assertEqual(self.clock.seconds(), started + DEAD_AFTER)
            self.assertForwardedTo(self.routed(mesh, second), B, second)
            self.assertFalse(mesh.is_owner(hibernating(second)), why)

    def test_an_unreachable_lease_holder_is_not_waited_for(self) -> None:
        """A peer that cannot be reached may be dead: its lease lasts until it expires, so the
        request goes to the activator at once (503 lease_held there), not into a wait."""
        mesh = self.mesh_of(SELF, C)
        host = host_owned_by(SELF, SELF, C)
        self.hold_lease(host, C)
        target = self.assertForwardedTo(self.routed(mesh, host), C, host)
        reads = self.disk.calls
        self.assertIs(self.successResultOf(self.reroute(mesh, target, "unreachable")), SERVED_HERE)
        self.assertEqual(self.disk.calls, reads + 1)  # the cached holder was dropped: re-read
        self.assertEqual(self.clock.getDelayedCalls(), [])
        # A fresh request does not try C again while it is left out.
        self.assertIs(self.routed(mesh, host), SERVED_HERE)


class DrainTests(_Base):
    """A draining peer's leases are about to be released: requests for its spaces wait for that
    (reading lock.json every RELEASE_POLL, at most RELEASE_WAIT) instead of waking here into a
    held lease."""

    def refused_by_stopping_peer(self, mesh: MeshRouter, host: str) -> Deferred[Target]:
        target = self.assertForwardedTo(self.routed(mesh, host), B, host)
        return self.reroute(mesh, target, "stopping")

    def test_a_refused_request_waits_for_the_stopping_peers_release(self) -> None:
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(B, SELF, B)
        key = self.hold_lease(host, B)
        stopping, released = (
            forwards("peer_stopping"),
            sample("lchat_mesh_release_waits_total", outcome="released"),
        )
        rerouted = self.refused_by_stopping_peer(mesh, host)
        self.assertEqual(forwards("peer_stopping"), stopping + 1)
        self.advance(0.5)
        fresh = self.route(mesh, host)  # arriving meanwhile: waits the same way
        reads = self.disk.calls
        self.advance(1.0, step=0.01)  # fine steps: each poll fires within 10 ms of its time
        # A wake here now would only meet the held lease: both wait, reading lock.json once per
        # RELEASE_POLL between them (not once per request).
        self.assertEqual((rerouted.called, fresh.called), (False, False))
        self.assertEqual(self.served, [])
        polls = 1.0 / routing.RELEASE_POLL
        self.assertGreaterEqual(self.disk.calls - reads, polls - 1)
        self.assertLessEqual(self.disk.calls - reads, polls + 1)
        self.release_lease(key)  # B's drain releases it
        let_go = self.clock.seconds()
        for waiting in (rerouted, fresh):
            fired = self.advance_until(waiting, let_go + 1.0, step=0.01)
            self.assertLessEqual(fired - let_go, 2 * routing.RELEASE_POLL + 1e-6)
        self.assertIs(self.successResultOf(rerouted), SERVED_HERE)
        self.assertIs(self.successResultOf(fresh), SERVED_HERE)
        self.assertEqual(self.served, [host, host])
        self.assertEqual(sample("lchat_mesh_release_waits_total", outcome="released"), released + 2)

    def test_the_wait_for_a_release_is_bounded_by_release_wait(self) -> None:
        mesh = self.mesh_of(SELF, B)
        host = host_owned_by(B, SELF, B)
        self.hold_lease(host, B)  # B never releases it (a slow final flush, say)
        timed_out = sample("lchat_mesh_release_waits_total", outcome="timed_out")
        start = self.clock.seconds()
        rerouted = self.refused_by_stopping_peer(mesh, host)
        fired = self.advance_until(rerouted, start + routing.RELEASE_WAIT + 1.0) - start
        self.assertGreaterEqual(fired, routing.RELEASE_WAIT)
        self.assertLessEqual(fired, routing.RELEASE_WAIT + 2 * routing.RELEASE_POLL + 1e-6)
        self.assertIs(self.successResultOf(rerouted), SERVED_HERE)  # lease_held from there
        self.assertEqual(
            sample("lchat_mesh_release_waits_total", outcome="timed_out"), timed_out + 1
        )
        # The drain's grace is over: later requests go to the activator at once.
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_member_whose_heartbeat_says_draining_is_awaited(self) -> None:
        """No request reached the draining peer to be refused, but the view dropped it because
        its heartbeat says "draining": its leases are about to be released."""
        view = View(Peer(SELF), Peer(B))
        mesh = self.mesh(view)
        host = host_owned_by(SELF, SELF, B)
        key = self.hold_lease(host, B)
        view.read(Peer(SELF), draining=(B,))
        waiting = self.route(mesh, host)
        self.advance(1.0)
        self.assertFalse(waiting.called)
        self.release_lease(key)
        self.advance_until(waiting, self.clock.seconds() + 1.0)
        self.assertIs(self.successResultOf(waiting), SERVED_HERE)

    def test_a_member_whose_fresh_heartbeat_vanished_is_not_awaited(self) -> None:
        """Gone while its heartbeat was fresh, but not announced as draining: a drain deletes
        its heartbeat only after releasing every lease, so this one is dead (the janitor, a
        person), and the request goes to the activator at once (which judges the holder)."""
        view = View(Peer(SELF), Peer(B, age=0.5))
        mesh = self.mesh(view)
        host = host_owned_by(SELF, SELF, B)
        self.hold_lease(host, B)
        view.read(Peer(SELF))
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_member_that_aged_out_is_not_awaited(self) -> None:
        """Gone because its heartbeat aged out: dead or cut off, its leases last until they
        expire, and the request goes to the activator at once (503 lease_held there)."""
        view = View(Peer(SELF), Peer(B, age=30.0))  # 30 s + one 15 s beat: it would be gone
        mesh = self.mesh(view)
        host = host_owned_by(SELF, SELF, B)
        self.hold_lease(host, B)
        view.read(Peer(SELF))
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_draining_member_that_rejoins_is_forwarded_to_again(self) -> None:
        view = View(Peer(SELF), Peer(B))
        mesh = self.mesh(view)
        host = host_owned_by(SELF, SELF, B)
        self.hold_lease(host, B)
        view.read(Peer(SELF), draining=(B,))  # B drains...
        waiting = self.route(mesh, host)
        self.advance(1.0)
        self.assertFalse(waiting.called)
        view.read(Peer(SELF), Peer(B))  # ...and restarts before releasing (a quick restart)
        self.advance_until(waiting, self.clock.seconds() + 1.0)
        self.assertForwardedTo(self.successResultOf(waiting), B, host)
        self.assertForwardedTo(self.routed(mesh, host), B, host)  # no wait for new requests
        # B leaving again later is a new drain: awaited again.
        view.read(Peer(SELF), draining=(B,))
        self.assertFalse(self.route(mesh, host).called)

    def test_this_box_leaving_its_own_view_is_not_a_drain_of_its_spaces(self) -> None:
        view = View(Peer(SELF), Peer(B))
        mesh = self.mesh(view)
        host = host_owned_by(SELF, SELF, B)
        self.hold_lease(host, SELF)  # an earlier process of this box; the activator decides
        view.read(Peer(B))  # our own heartbeat went (deleted at our drain)
        target = self.routed(mesh, host)
        self.assertForwardedTo(target, B, host)  # B owns it now: nothing awaited
        self.assertEqual(self.clock.getDelayedCalls(), [])


def _deferred(target: Target | Deferred[Target]) -> Deferred[Target]:
    return target if isinstance(target, Deferred) else succeed(target)


class AnsweringBoxTests(_Base):
    """``answering_box`` (lchat.spacestats asks it which box answers a space's stats): the live
    holder (a peer's word, else the lease), else the owner by the hash; never a wake."""

    def box(self, mesh: MeshRouter, host: str) -> str:
        d = Deferred.fromCoroutine(mesh.answering_box(hibernating(host)))
        result: str = self.successResultOf(d)
        return result

    def test_the_holder_while_it_is_live_else_the_owner(self) -> None:
        view = View(Peer(SELF), Peer(B), Peer(C))
        mesh = self.mesh(view)
        mine, bs = host_owned_by(SELF, SELF, B, C), host_owned_by(B, SELF, B, C)
        self.assertEqual((self.box(mesh, mine), self.box(mesh, bs)), (SELF, B))
        self.assertEqual(mesh.self_url, SELF)
        for host in (mine, bs):
            self.hold_lease(host, placement.normalise_member_url(C))
        self.clock.advance(2.0)  # (past the holder cache)
        self.assertEqual(self.box(mesh, mine), placement.normalise_member_url(C))
        # A holder that left the view names nobody to ask: the owner by the hash answers.
        view.read(Peer(SELF), Peer(B))
        self.clock.advance(2.0)
        self.assertEqual((self.box(mesh, mine), self.box(mesh, bs)), (SELF, B))
        self.assertEqual(self.served, [])  # nothing woken, nothing served

    def test_a_peers_word_needs_no_bucket_read(self) -> None:
        host = host_owned_by(SELF, SELF, B)

        class Told(View):
            def holding(self, asked: str) -> str | None:
                return B if asked == host else None

        mesh = self.mesh(Told(Peer(SELF), Peer(B)))
        reads = self.disk.calls
        self.assertEqual(self.box(mesh, host), B)
        self.assertEqual(self.disk.calls, reads)


class NotHoldingTests(_Base):
    """A peer that refused a forward because it does not hold the space (``not_holding``: a
    failed-over space it slept, its region back) is not taken for its holder again while its
    beats catch up: the request is routed as if nobody held it."""

    def test_rerouted_to_the_owner_despite_the_stale_word(self) -> None:
        host = host_owned_by(SELF, SELF, B, C)

        class Told(View):
            def holding(self, asked: str) -> str | None:
                return placement.normalise_member_url(C) if asked == host else None

        mesh = self.mesh(Told(Peer(SELF), Peer(B), Peer(C)))
        first = self.assertForwardedTo(self.routed(mesh, host), C, host)  # its stale word
        counted = forwards("peer_not_holding")
        self.assertIs(self.successResultOf(self.reroute(mesh, first, "not_holding")), SERVED_HERE)
        self.assertEqual(self.served, [host])
        self.assertEqual(forwards("peer_not_holding"), counted + 1)
        # C stays in placement (it answers): only its word about this host is set aside, and
        # only until its beats have said otherwise (two heartbeats).
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.clock.advance(2 * HEARTBEAT)
        self.assertForwardedTo(self.routed(mesh, host), C, host)


class IsolatedTests(_Base):
    """A box past its liveness deadline (cut off from its bucket and its peers: ``lapsed``)
    answers every request at once: its own spaces from their read-only copies (the activator),
    a space a peer in its reach holds by a forward there, anything else a 503 — never after a
    lease read (which would hang on the bucket it cannot reach) or a dial to a silent peer
    (tests.test_mesh_cuts, d: refusals that took 1.5-3.6 s, the lease read's timeout and a
    dial's)."""

    def isolated_mesh(
        self, holder: str, answering: set[str], refused: bool = False
    ) -> tuple[MeshRouter, str]:
        """A lapsed box SELF of {SELF, B}, ``holder`` holding a space B owns by the last beats
        (said within dead_after: Membership.holding; no lease is read); ``answering``: the peers whose
        beats are answered (the rest went unanswered: out of reach, or, ``refused``, their port
        refused them: not counted as out of reach by the witness)."""
        host = host_owned_by(B, SELF, B)

        class Lapsed(View):
            def lapsed(self) -> bool:
                return True

            def holding(self, asked: str) -> str | None:
                return holder if asked == host else None

            def peer_unreachable(self, url: str) -> bool:
                return url not in answering and not refused

            def answered_since(self, url: str, since: float) -> bool:
                return url in answering

        return self.mesh(Lapsed(Peer(SELF), Peer(B))), host

    def test_a_space_held_by_a_peer_out_of_reach_gets_a_503_at_once(self) -> None:
        for refused in (False, True):  # (its beats unanswered, or its port refused them)
            mesh, host = self.isolated_mesh(B, answering=set(), refused=refused)
            reads, counted = self.disk.calls, forwards("isolated")
            got = self.routed(mesh, host)
            assert isinstance(got, LocalResponse)
            self.assertEqual((got.status, got.label), (503, "isolated"))
            retry = (b"retry-after", str(routing.RETRY_AFTER_SECONDS).encode())
            self.assertIn(retry, got.headers)
            self.assertEqual(self.disk.calls, reads)  # no lease read
            self.assertEqual(self.clock.getDelayedCalls(), [])  # nothing waited for
            self.assertEqual(self.served, [])  # no wake here either
            self.assertEqual(forwards("isolated"), counted + 1)

    def test_a_space_held_by_a_peer_in_reach_is_forwarded_there(self) -> None:
        """Both boxes cut off from the bucket, not from each other: the holder's read-only copy
        answers as this box's would."""
        mesh, host = self.isolated_mesh(B, answering={B})
        reads = self.disk.calls
        self.assertForwardedTo(self.routed(mesh, host), B, host)
        self.assertEqual(self.disk.calls, reads)

    def test_a_space_held_here_is_answered_by_its_read_only_copy(self) -> None:
        """Fenced, its lease counted lost: the activator answers (reads from the copy, writes
        refused), without a lease read first."""
        mesh, host = self.isolated_mesh(SELF, answering=set())
        self.running.hosts.add(host)
        self.running.lost.add(host)
        reads, counted = self.disk.calls, forwards("local_isolated")
        self.assertIs(self.routed(mesh, host), SERVED_HERE)
        self.assertEqual((self.served, self.disk.calls), ([host], reads))
        self.assertEqual(forwards("local_isolated"), counted + 1)

    def test_a_peer_in_reach_that_took_our_space_over_gets_its_requests(self) -> None:
        """Our copy stands read-only (its lease counted lost), and B, in reach, says it holds
        the space now: B's copy is the newer one."""
        mesh, host = self.isolated_mesh(B, answering={B})
        self.running.hosts.add(host)
        self.running.lost.add(host)
        self.assertForwardedTo(self.routed(mesh, host), B, host)
        self.assertEqual(self.served, [])

    def test_a_peer_that_said_it_does_not_hold_the_space_is_not_asked_again(self) -> None:
        mesh, host = self.isolated_mesh(B, answering={B})
        target = self.assertForwardedTo(self.routed(mesh, host), B, host)
        got = self.successResultOf(self.reroute(mesh, target, "not_holding"))
        assert isinstance(got, LocalResponse)
        self.assertEqual((got.status, got.label), (503, "isolated"))

    def test_a_failed_forward_is_refused_at_once(self) -> None:
        """A forward to the holder dialed just before the lapse fails: routed again, at once."""
        answering = {B}
        mesh, host = self.isolated_mesh(B, answering=answering)
        target = self.assertForwardedTo(self.routed(mesh, host), B, host)
        answering.clear()  # (its beats go unanswered from now on)
        got = self.successResultOf(self.reroute(mesh, target, "unreachable"))
        assert isinstance(got, LocalResponse)
        self.assertEqual((got.status, got.label), (503, "isolated"))
        self.assertEqual(self.clock.getDelayedCalls(), [])


class RegionView(View):
    """A view that also says since when each region has had no live member (the membership's
    ``region_empty_since``, on the router's clock here): ``empty[region]``."""

    def __init__(self, *members: Peer) -> None:
        super().__init__(*members)
        self.empty: dict[str, float] = {}

    def region_empty_since(self, region: str) -> float | None:
        return self.empty.get(region)


class RegionFailoverTests(_Base):
    """A space homed in ``fi``, whose replicas live in a bucket of their own (a ``file:``
    bucket), placed on this ``ie`` box because ``fi`` has no live box: 503 ``region_down``
    without the operator's consent, and within the grace; after it, served here (the activator
    wakes it from fi's bucket: lchat.hibernation.lifecycle) once one read of its lease there
    answered; a bucket that does not answer is still a 503."""

    AFTER = 300.0

    def setUp(self) -> None:
        super().setUp()
        self.fi = os.path.join(self.dir, "fi-bucket")
        os.makedirs(self.fi)
        self.fi_disk = Disk()
        self.opened: list[str] = []
        self.open_error: Exception | None = None
        self.cfg = self.with_failover(self.AFTER)

    def with_failover(self, after: float | None) -> BoxConfig:
        assert self.cfg.mesh is not None
        return evolve(
            self.cfg,
            mesh=evolve(self.cfg.mesh, region="ie", region_failover_after=after),
            region_buckets={"fi": parse_bucket_url("fi", f"file:{self.fi}"), "ie": self.hib.where},
        )

    def failover_mesh(self, view: View) -> MeshRouter:
        async def opener(reactor: Any, cfg: Any, where: Where, what: str) -> FileStore:
            self.opened.append(what)
            if self.open_error is not None:
                raise self.open_error
            return FileStore(self.clock, where.directory, run_in_thread=self.fi_disk)

        regions = RegionBuckets(self.clock, self.cfg, opener)  # type: ignore[arg-type]
        return MeshRouter(
            self.cfg, self.store, view, self.running, reactor=self.clock, regions=regions
        )

    def fi_lease(self, host: str, owner: str) -> None:
        store = FileStore(self.clock, self.fi, run_in_thread=maybeDeferred)
        self.successResultOf(
            Deferred.fromCoroutine(
                acquire(
                    store,
                    f"{host}/lock.json",
                    owner,
                    900.0,
                    host=host,
                    monotonic=self.clock.seconds,
                )
            )
        )

    def region_down(self, target: Target) -> None:
        assert isinstance(target, LocalResponse), target
        self.assertEqual((target.status, target.label), (503, "region_down"))

    def test_without_consent_a_region_without_a_box_is_region_down_for_ever(self) -> None:
        self.cfg = self.with_failover(None)
        view = RegionView(Peer(SELF, "ie"))
        view.empty["fi"] = EPOCH - 86400.0
        mesh = self.failover_mesh(view)
        host = f"h.{DOMAIN}"
        self.region_down(self.routed(mesh, host, home_region="fi"))
        self.assertEqual((self.served, self.opened, self.fi_disk.calls), ([], [], 0))

    def test_after_the_grace_the_owner_serves_it_from_its_home_bucket(self) -> None:
        view = RegionView(Peer(SELF, "ie"))
        view.empty["fi"] = self.clock.seconds()  # fi's last box just left the view
        mesh = self.failover_mesh(view)
        host = f"h.{DOMAIN}"
        self.region_down(self.routed(mesh, host, home_region="fi"))  # within the grace
        self.clock.advance(self.AFTER - 1)
        self.region_down(self.routed(mesh, host, home_region="fi"))
        self.assertEqual((self.served, self.fi_disk.calls), ([], 0))
        self.clock.advance(1)
        counted = forwards("region_failover")
        self.assertIs(self.routed(mesh, host, home_region="fi"), SERVED_HERE)
        self.assertEqual(self.served, [host])
        self.assertEqual(forwards("region_failover"), counted + 1)
        self.assertEqual(self.opened, ["region fi"])  # its lease read there: the bucket answers
        self.assertGreater(self.fi_disk.calls, 0)
        # Its region back: placement is scoped to it again (forwarded there, no failover).
        view.read(Peer(SELF, "ie"), Peer(B, "fi"))
        view.empty.pop("fi")
        self.assertForwardedTo(self.routed(mesh, host, home_region="fi"), B, host)
        # Never a due wake here, failover or not.
        view.read(Peer(SELF, "ie"))
        view.empty["fi"] = EPOCH - 86400.0
        self.assertFalse(mesh.is_owner(hibernating(host, "fi")))

    def test_a_home_bucket_that_does_not_answer_is_region_down(self) -> None:
        view = RegionView(Peer(SELF, "ie"))
        view.empty["fi"] = EPOCH - 86400.0
        mesh = self.failover_mesh(view)
        host, other = f"h.{DOMAIN}", f"o.{DOMAIN}"
        # It hangs: the read gives up after HOLDER_READ_TIMEOUT.
        self.fi_disk.hold()
        d = self.route(mesh, host, home_region="fi")
        self.assertNoResult(d)
        self.clock.advance(routing.HOLDER_READ_TIMEOUT)
        self.region_down(self.successResultOf(d))
        self.fi_disk.release()
        # It fails (the directory is gone: StoreUnavailable).
        os.rename(self.fi, self.fi + ".away")
        self.region_down(self.routed(mesh, other, home_region="fi"))
        self.assertEqual(self.served, [])
        # Its store cannot be opened (a key variable unset).
        mesh = self.failover_mesh(view)
        self.open_error = ConfigError("region fi's keys are in FI_KEY, which is unset")
        self.region_down(self.routed(mesh, host, home_region="fi"))
        self.assertEqual(self.served, [])
        # Back: served after the cached answer (holder_ttl) ages.
        os.rename(self.fi + ".away", self.fi)
        self.open_error = None
        self.clock.advance(2.0)
        self.assertIs(self.routed(mesh, host, home_region="fi"), SERVED_HERE)

    def test_stats_are_asked_of_the_holder_the_home_buckets_lease_names(self) -> None:
        """``answering_box`` for a space homed in fi reads fi's bucket, not this box's, whose
        lease (of the copy before the space moved) names a box that no longer holds it."""
        view = RegionView(Peer(SELF, "ie"), Peer(B, "ie"), Peer(C, "ie"))
        view.empty["fi"] = EPOCH - 86400.0
        mesh = self.failover_mesh(view)
        host = f"h.{DOMAIN}"
        self.hold_lease(host, placement.normalise_member_url(C))  # this bucket's stale lease
        self.fi_lease(host, B)  # B failed it over: it answers
        d = Deferred.fromCoroutine(mesh.answering_box(hibernating(host, "fi")))
        self.assertEqual(self.successResultOf(d), placement.normalise_member_url(B))
        self.assertEqual(self.opened, ["region fi"])
        self.assertEqual(self.served, [])

    def test_a_home_lease_held_by_a_live_box_is_forwarded_there(self) -> None:
        view = RegionView(Peer(SELF, "ie"), Peer(B, "ie"))
        view.empty["fi"] = EPOCH - 86400.0
        mesh = self.failover_mesh(view)
        host = host_owned_by(SELF, SELF, B)
        self.fi_lease(host, B)  # B failed it over first (it owned it by a view of its own)
        self.assertForwardedTo(self.routed(mesh, host, home_region="fi"), B, host)
        self.assertEqual(self.served, [])

    def test_a_request_forwarded_here_once_its_region_is_back_is_refused_for_the_sender(
        self,
    ) -> None:
        """This ie box served a fi space while fi was empty and has slept it since; fi's box is
        back and still forwards here on this box's earlier word: refused unprocessed, marked so
        that the sender routes again (never a 503 for as long as the word is stale)."""
        view = RegionView(Peer(SELF, "ie"), Peer(B, "fi"))
        mesh = self.failover_mesh(view)
        host = f"h.{DOMAIN}"
        counted = forwards("not_holding")
        marker = forward.marker(TOKEN, host, self.clock.seconds, BOUND)
        got = self.routed(mesh, host, forwarded=marker, home_region="fi")
        assert isinstance(got, LocalResponse), got
        self.assertEqual((got.status, got.label, got.refusal), (503, "not_holding", "not_holding"))
        self.assertIn((REFUSED, b"not_holding"), got.headers)
        self.assertEqual(forwards("not_holding"), counted + 1)
        self.assertEqual((self.served, self.fi_disk.calls), ([], 0))
        # A client's own request (no marker) for it: fi has a live box, forwarded there.
        self.assertForwardedTo(self.routed(mesh, host, home_region="fi"), B, host)

    def test_a_request_forwarded_here_fails_over_only_after_the_grace(self) -> None:
        view = RegionView(Peer(SELF, "ie"), Peer(B, "ie"))
        view.empty["fi"] = self.clock.seconds()
        mesh = self.failover_mesh(view)
        host = f"h.{DOMAIN}"

        def forwarded() -> Target:
            marker = forward.marker(TOKEN, host, self.clock.seconds, BOUND)
            return self.routed(mesh, host, forwarded=marker, home_region="fi")

        self.region_down(forwarded())
        self.clock.advance(self.AFTER)
        self.fi_lease(host, B)  # (one hop only: served here, the activator meets the lease)
        self.assertIs(forwarded(), SERVED_HERE)
        self.assertEqual(self.served, [host])

"""In-memory seams for the hand-over commands (lchat.handover.seams), on one fake clock.

- :class:`InMemoryAdmin`: the admin API's real resource (lchat.admin) answering in memory, over
  a real RouteSource of a real Registry; only the activator behind it is scripted
  (:class:`ScriptedActivator`). A call that is not answered within its timeout is the
  ``ProtocolError`` the real client raises; a router that is down is ``Unreachable``.
- :class:`RecordingUnits` and :class:`RecordingPeers`: record every call (the peers' live
  members and answers scripted for ``lchat relocate``); :class:`RecordingRecords`: DNS.
- the bucket is a real FileStore in a temp directory (:func:`file_bucket`); so are the region
  buckets ``lchat relocate`` copies between (:func:`region_stores`).
- :class:`StubPeerHolds`: ``lchat relocate``'s calls to peers, the real mesh client to peers'
  real mesh APIs in memory, each over a :class:`PeerActivator` (the real operator holds).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from attrs import define, field
from treq.testing import StubTreq
from twisted.internet import task
from twisted.internet.defer import Deferred, fail, succeed
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from lchat import admin_client, systemd_units
from lchat.admin import AdminAPI, _Json
from lchat.admin_client import Response
from lchat.cli.move_dns import MovedDNS
from lchat.dns import AddressChange
from lchat.handover import HandoverError
from lchat.handover.seams import Clock, RegionStores, StoreBucket
from lchat.hibernation.capacity import Holds
from lchat.hibernation.space import WakeFailed
from lchat.mesh import client as mesh_client
from lchat.mesh.members import Member
from lchat.objstore.file import FileStore
from lchat.objstore.where import Where
from lchat.registry import Registry, Route
from lchat.routesource import RouteSource
from lchat.systemd_units import UnitError
from lchat.threads import RunInThread
from tests.fakes import inline


def clock_of(reactor: task.Clock) -> Clock:
    """The command's blocking clock as the fake reactor's: a sleep advances it."""
    return Clock(monotonic=reactor.seconds, sleep=reactor.advance)


def run_inline(reactor: task.Clock) -> Callable[..., Any]:
    """A runner (as ``lchat.cli.runner.run``) for coroutines that finish without waiting."""

    def run(main: Callable[[Any], Coroutine[Any, Any, Any]], budget: float) -> Any:
        out: list[Any] = []
        Deferred.fromCoroutine(main(reactor)).addBoth(out.append)
        assert out, "the coroutine waited on something: not an inline bucket"
        if isinstance(out[0], Exception) or hasattr(out[0], "raiseException"):
            out[0].raiseException()
        return out[0]

    return run


def file_bucket(reactor: task.Clock, root: str) -> StoreBucket:
    """The hibernation bucket as a real FileStore (must exist, as the router opens it)."""

    async def open_store(_: Any) -> FileStore:
        return FileStore(reactor, root, inline)

    return StoreBucket(open_store, run_inline(reactor))


@define
class ScriptedActivator:
    """What lchat.admin asks of the activator; each wake's outcome is scripted in ``wakes``:
    seconds until awake (float), a WakeFailed, or None (never answers). Default: 0.5 s."""

    reactor: task.Clock
    wakes: list[float | WakeFailed | None] = field(factory=list)
    states: dict[str, str] = field(factory=dict)
    calls: list[tuple[str, str]] = field(factory=list)
    after_sleep: Callable[[str], None] = lambda host: None  # once an awake space has slept
    sleep_hangs: bool = False
    holds: dict[str, float] = field(factory=dict)  # host -> seconds (lchat relocate's hold)
    sleep_fails: Exception | None = None  # what a sleep fails with

    def status(self) -> dict[str, dict[str, Any]]:
        return {h: {"state": s} for h, s in self.states.items() if s != "asleep"}

    def held_asleep(self) -> dict[str, float]:
        return dict(self.holds)

    def hold(self, host: str, seconds: float, why: str) -> None:
        self.calls.append(("hold", host))
        self.holds[host] = seconds

    def release_hold(self, host: str) -> bool:
        self.calls.append(("release", host))
        return self.holds.pop(host, None) is not None

    def slots_held(self) -> int:
        return len(self.status())

    def state(self, host: str) -> str:
        return self.states.get(host, "asleep")

    def wake(self, route: Route, why: str) -> Deferred[None]:
        self.calls.append(("wake", route.host))
        outcome = self.wakes.pop(0) if self.wakes else 0.5
        if isinstance(outcome, WakeFailed):
            return fail(outcome)
        if outcome is None:
            return Deferred()
        self.states[route.host] = "waking"

        def awake() -> None:
            self.states[route.host] = "awake"

        return task.deferLater(self.reactor, outcome, awake)

    def sleep(self, host: str, why: str) -> Deferred[None]:
        self.calls.append(("sleep", host))
        if self.sleep_hangs:
            return Deferred()
        if self.sleep_fails is not None:
            return fail(self.sleep_fails)
        if self.states.pop(host, "asleep") != "asleep":
            self.after_sleep(host)
        return succeed(None)


class InMemoryAdmin:
    """:class:`lchat.admin_client.RouterAdmin` answered by lchat.admin's real resource."""

    def __init__(
        self,
        reactor: task.Clock,
        registry: Registry,
        activator: ScriptedActivator | None,
        *,
        units: str = "builtin",
        children: Any = None,  # the supervisor's view of its children (lchat.admin)
        restart: Callable[[str], Deferred[int | None]] | None = None,
        mesh: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.reactor = reactor
        self.routes = RouteSource(reactor, registry, run_in_thread=inline)
        self.api = AdminAPI(
            reactor, self.routes, units, children, activator=activator, mesh=mesh, restart=restart
        )
        self.down: BaseException | None = None  # FileNotFoundError: no router runs
        self.calls: list[str] = []

    def call(self, method: str, path: str, timeout: float, **args: str) -> Response:
        self.calls.append(f"{method} {path}")
        if self.down is not None:
            raise admin_client.Unreachable(f"router.sock: {self.down}") from self.down
        request: Any = DummyRequest([path[1:].encode()])
        request.method, request.path = method.encode(), path.encode()
        request.args = {k.encode(): [v.encode()] for k, v in args.items()}
        body = _Json(self.api).render(request)
        if body is NOT_DONE_YET:
            deadline = self.reactor.seconds() + timeout
            while not request.finished and self.reactor.seconds() < deadline:
                due = [c.getTime() for c in self.reactor.getDelayedCalls()]
                self.reactor.advance(max(0.0, min([deadline, *due]) - self.reactor.seconds()))
            if not request.finished:
                raise admin_client.ProtocolError("router.sock: timed out")
            body = b"".join(request.written)
        assert isinstance(body, bytes)
        return Response(request.responseCode or 200, body)

    def status(self, timeout: float) -> Response:
        return self.call("GET", "/status", timeout)

    def reload(self) -> Response:
        return self.call("POST", "/reload", 5.0)

    def wake(self, host: str, timeout: float) -> Response:
        return self.call("POST", "/wake", timeout, host=host)

    def sleep(self, host: str, timeout: float) -> Response:
        return self.call("POST", "/sleep", timeout, host=host)

    def restart(self, host: str, timeout: float) -> Response:
        return self.call("POST", "/restart", timeout, host=host)

    def sleep_held(self, host: str, hold: float, timeout: float) -> Response:
        return self.call("POST", "/sleep", timeout, host=host, hold=f"{hold:g}")

    def release(self, host: str) -> Response:
        return self.call("POST", "/release", 5.0, host=host)


@define
class RecordingUnits:
    """:class:`lchat.handover.seams.Units`: ``held``: socket -> the time its listener goes (a
    squatter: forever); ``healthy``: whether a started space answers."""

    reactor: task.Clock
    systemd: bool = True
    healthy: bool = True
    held: dict[str, float] = field(factory=dict)
    failing: dict[str, UnitError] = field(factory=dict)  # unit name -> its systemctl failure
    calls: list[str] = field(factory=list)

    def name(self, host: str, *, sidecar: bool = False) -> str:
        return systemd_units.unit_name(host, sidecar=sidecar)

    def _run(self, verb: str, unit: str) -> None:
        self.calls.append(f"{verb} {unit}")
        if unit in self.failing:
            raise self.failing[unit]

    def stop(self, host: str, *, sidecar: bool = False) -> None:
        self._run("stop", self.name(host, sidecar=sidecar))

    def start(self, host: str, socket: str) -> None:
        self._run("start", self.name(host))

    def start_sidecar(self, host: str) -> None:
        self._run("start", self.name(host, sidecar=True))

    def restart(self, host: str) -> None:
        self._run("restart", self.name(host))

    def listening(self, socket: str) -> bool:
        return self.reactor.seconds() < self.held.get(socket, float("-inf"))

    def answers(self, socket: str, host: str, timeout: float) -> bool:
        self.calls.append(f"health {host}")
        if not self.healthy:
            self.reactor.advance(timeout)  # as long as the real poll waits
        return self.healthy


@define
class RecordingPeers:
    active: bool = True
    covers: bool = True  # the host is a mesh host
    pushed: list[Route] = field(factory=list)

    def push(self, route: Route) -> None:
        if self.active:
            self.pushed.append(route)

    def replicates(self, route: Route) -> bool:
        return self.active and self.covers

    # lchat relocate's (lchat.handover.seams.Mesh)
    live: list[Member] | Exception = field(factory=list)  # the members' read, or its failure
    answers: dict[str, str] = field(factory=dict)  # a peer's URL -> its answer ("updated")

    def members(self) -> list[Member]:
        if isinstance(self.live, Exception):
            raise self.live
        return self.live

    def push_reporting(self, route: Route, report: Callable[[str], None]) -> None:
        """As lchat.cli.mesh.fan_out_upsert reports: one line per live peer."""
        self.push(route)
        if not self.active:
            return
        if isinstance(self.live, Exception):
            report(f"mesh: {route.host}: not replicated to peers ({self.live})")
            return
        for peer in self.live:
            answer = self.answers.get(peer.url, "updated")
            report(f"mesh: {route.host}: pushed to {peer.url}: {answer}")


def member(url: str, region: str) -> Member:
    """A live mesh member as a read of the heartbeats gives it."""
    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    return Member(url, region, "1", 0.0, when, 0.0, f"mesh/members/{url}")


def region_stores(reactor: task.Clock, disk: RunInThread = inline) -> RegionStores:
    """The region buckets as real FileStores (a ``file:`` Where's directory, made on first use as
    the CLI's opener does); ``disk``: the stores' thread runner (a test's slow or failing disk)."""

    async def open_store(_: Any, where: Where, what: str) -> FileStore:
        os.makedirs(where.directory, exist_ok=True)
        return FileStore(reactor, where.directory, disk)

    return RegionStores(open_store, run_inline(reactor), threads=lambda _: inline)


@define
class RecordingRecords:
    """:class:`lchat.handover.seams.AddressRecords`: ``refusal``/``failure``, when set, are what
    its check / its move raise."""

    refusal: str = ""
    failure: str = ""
    pointed: list[tuple[str, list[str]]] = field(factory=list)

    def check(self, host: str) -> None:
        if self.refusal:
            raise HandoverError(self.refusal)

    def point(self, host: str, member_urls: list[str]) -> tuple[str, dict[str, Any]]:
        """As Route53 answers a first move: no records before, the boxes' addresses after."""
        self.pointed.append((host, member_urls))
        if self.failure:
            raise HandoverError(self.failure)
        after = tuple(sorted(urlsplit(u).hostname or "" for u in member_urls))
        moved = MovedDNS(AddressChange(host, "Z1", (), after, 60, "C1"))
        return moved.line, moved.as_json()


class PeerActivator:
    """A peer router's activator as ``POST /api/mesh/hold`` drives it: the real operator holds
    (:class:`lchat.hibernation.capacity.Holds`) on the fake clock; sleeping an awake space runs
    ``on_sleep`` (its stand-down: the flush and the lease's release); ``sleep_hangs``: a sleep
    that never ends."""

    def __init__(self, reactor: task.Clock) -> None:
        self.held = Holds(reactor)
        self.awake: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.on_sleep: Callable[[str], None] = lambda host: None
        self.sleep_hangs = False

    def hold(self, host: str, seconds: float, why: str) -> None:
        self.calls.append(("hold", host))
        self.held.hold(host, seconds, why)

    def release_hold(self, host: str) -> bool:
        self.calls.append(("release", host))
        return self.held.release(host)

    def sleep(self, host: str, reason: str) -> Deferred[None]:
        self.calls.append(("sleep", host))
        if self.sleep_hangs:
            return Deferred()
        if host in self.awake:
            self.awake.discard(host)
            self.on_sleep(host)
        return succeed(None)

    def state(self, host: str) -> str:
        return "awake" if host in self.awake else "asleep"


class StubPeerHolds:
    """:class:`lchat.handover.seams.PeerHolds` through the real mesh client
    (:mod:`lchat.mesh.client`) to peers' real mesh APIs (:mod:`lchat.mesh.api`) in memory
    (``treq.testing.StubTreq``), on the fake clock: a peer whose answer does not come at once
    makes the call's whole timeout pass; one in ``down`` is refused at once, as a closed port."""

    def __init__(self, reactor: task.Clock, token: str) -> None:
        self.reactor: Any = reactor  # the calls' clock (the stub does their I/O)
        self.token = token
        self.apis: dict[str, Any] = {}  # peer URL -> StubTreq over its MeshAPI
        self.down: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def add(self, url: str, resource: Any) -> None:
        self.apis[url] = StubTreq(resource)

    async def hold(
        self,
        reactor: Any,
        peer_url: str,
        host: str,
        seconds: float,
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, dict[str, Any]]:
        self.calls.append(("hold", peer_url))
        http = self._http(peer_url)
        call = mesh_client.hold_space(
            peer_url, self.token, host, seconds, reactor=self.reactor, http=http, timeout=timeout
        )
        return await self._answer(http, call, timeout)

    async def release(
        self,
        reactor: Any,
        peer_url: str,
        host: str,
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, dict[str, Any]]:
        self.calls.append(("release", peer_url))
        http = self._http(peer_url)
        call = mesh_client.release_space(
            peer_url, self.token, host, reactor=self.reactor, http=http, timeout=timeout
        )
        return await self._answer(http, call, timeout)

    def _http(self, peer_url: str) -> Any:
        if peer_url in self.down:
            raise mesh_client.MeshCallError(peer_url, "POST: Connection refused")
        return self.apis[peer_url]

    async def _answer(
        self,
        http: Any,
        call: Coroutine[Any, Any, tuple[int, dict[str, Any]]],
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[int, dict[str, Any]]:
        d = Deferred.fromCoroutine(call)
        http.flush()
        if not d.called:
            self.reactor.advance(timeout)  # the peer never answers: the client's timeout passes
        return await d

"""The routing decision and the simple proxy, over real sockets with a real unix-socket backend."""

from __future__ import annotations

from types import MappingProxyType

from attrs import define, evolve, field
from twisted.trial.unittest import TestCase

from lchat.registry import Route, RouteTable
from lchat.router import (
    LocalResponse,
    LocalSocket,
    RemotePeer,
    RequestHead,
    Router,
    Target,
    unavailable,
)


@define
class Table:
    table: RouteTable


def table_of(*routes: Route) -> Table:
    return Table(RouteTable(routes=MappingProxyType({r.host: r for r in routes})))


def head(host: str) -> RequestHead:
    return RequestHead(method=b"GET", target=b"/", host=host)


READY = Route(host="chat.example.com", kind="instance", socket="/run/x.sock", status="ready")


class RouterDecisionTests(TestCase):
    def test_ready_row_goes_to_its_socket(self) -> None:
        router = Router(table_of(READY))
        self.assertEqual(
            router.route(head("chat.example.com")), LocalSocket("chat.example.com", "/run/x.sock")
        )

    def test_a_ready_rows_target_is_made_once_and_follows_a_changed_row(self) -> None:
        """The target of a ready row is kept per row (not made per request), and a row that
        changed (a new socket, a new kind) or went away is never answered from the old one."""
        tables = table_of(READY)
        router = Router(tables)
        first = router.route(head("chat.example.com"))
        self.assertIs(router.route(head("chat.example.com")), first)
        moved = evolve(READY, socket="/run/y.sock")
        tables.table = table_of(moved).table
        self.assertEqual(
            router.route(head("chat.example.com")), LocalSocket("chat.example.com", "/run/y.sock")
        )
        service = evolve(moved, kind="service")
        tables.table = table_of(service).table
        target = router.route(head("chat.example.com"))
        self.assertIsInstance(target, LocalSocket)
        assert isinstance(target, LocalSocket)
        self.assertEqual(target.kind, "service")
        tables.table = table_of().table
        gone = router.route(head("chat.example.com"))
        self.assertIsInstance(gone, LocalResponse)
        assert isinstance(gone, LocalResponse)
        self.assertEqual(gone.status, 404)

    def test_service_row_is_labelled_as_a_service(self) -> None:
        row = Route("svc.example.com", "service", "/run/svc.sock", status="ready")
        self.assertEqual(
            Router(table_of(row)).route(head("svc.example.com")),
            LocalSocket("svc.example.com", "/run/svc.sock", kind="service"),
        )

    def test_unknown_host_is_404_or_fallback(self) -> None:
        target = Router(table_of(READY)).route(head("other.example.com"))
        assert isinstance(target, LocalResponse)
        self.assertEqual(target.status, 404)
        target = Router(table_of(READY), "https://example.com/").route(head("other.example.com"))
        assert isinstance(target, LocalResponse)
        self.assertEqual(target.status, 302)
        self.assertIn((b"location", b"https://example.com/"), target.headers)

    def test_ip_literal_and_localhost_are_unknown(self) -> None:
        for host in ("127.0.0.1", "[::1]", "localhost"):
            target = Router(table_of(READY)).route(head(host))
            assert isinstance(target, LocalResponse)
            self.assertEqual(target.status, 404, host)

    def test_rows_that_are_not_ready_are_503_with_retry_after(self) -> None:
        for status in ("creating", "failed"):
            router = Router(table_of(Route("a.example.com", "instance", "/s", status=status)))
            target = router.route(head("a.example.com"))
            assert isinstance(target, LocalResponse)
            self.assertEqual(target.status, 503)
            self.assertIn(b"retry-after", dict(target.headers))

    def test_hibernating_row_without_activator_is_503(self) -> None:
        row = Route("h.example.com", "instance", "/s", status="ready", hibernate=True)
        target = Router(table_of(row)).route(head("h.example.com"))
        assert isinstance(target, LocalResponse)
        self.assertEqual(target.status, 503)


@define
class _Activator:
    """The activator as the router sees it: records each call, answers ``answer``."""

    answer: Target
    calls: list[tuple[str, bool]] = field(factory=list)

    def route(self, route: Route, sidecar: bool = False, write: bool = False) -> Target:
        self.calls.append((route.host, sidecar))
        return self.answer


@define
class _Mesh:
    """The mesh as the router sees it: in scope for ``domain``; forwards, or serves here (by
    the activator it holds, as lchat.mesh.routing.MeshRouter does)."""

    domain: str
    activator: _Activator | None = None
    forward_to: Target | None = None  # None: "here", the activator's answer
    routed: list[str] = field(factory=list)
    rerouted: list[tuple[str, str, str]] = field(factory=list)

    def in_scope(self, host: str) -> bool:
        return host.endswith("." + self.domain)

    def route(self, route: Route, head: RequestHead) -> Target:
        self.routed.append(route.host)
        if self.forward_to is not None:
            return self.forward_to
        assert self.activator is not None
        return self.activator.route(route, head.sidecar)

    def forward_elsewhere(self, route: Route, head: RequestHead) -> Target:
        self.routed.append(route.host)
        assert self.forward_to is not None
        return self.forward_to

    def reroute(self, route: Route, head: RequestHead, peer: RemotePeer, why: str) -> Target:
        self.rerouted.append((route.host, peer.member, why))
        assert self.activator is not None
        return self.activator.route(route, head.sidecar)


HIBERNATING = Route("h.mesh.example", "instance", "/run/h.sock", status="ready", hibernate=True)
ELSEWHERE = RemotePeer(
    "h.mesh.example", "10.0.0.2", 443, "h.mesh.example", member="https://box-2.example.net"
)
AWAKE = LocalSocket("h.mesh.example", "/run/h.sock")


class BranchTests(TestCase):
    """Which part of the router decides: the activator, the mesh, ACME, the mesh API."""

    def test_a_hibernating_row_goes_to_the_activator(self) -> None:
        activator = _Activator(AWAKE)
        router = Router(table_of(HIBERNATING), activator=activator)
        self.assertIs(router.route(head("h.mesh.example")), AWAKE)
        sidecar = RequestHead(method=b"GET", target=b"/", host="h.mesh.example", sidecar=True)
        router.route(sidecar)
        self.assertEqual(activator.calls, [("h.mesh.example", False), ("h.mesh.example", True)])

    def test_a_hibernating_row_that_is_not_ready_never_reaches_the_activator(self) -> None:
        activator = _Activator(AWAKE)
        row = Route("h.mesh.example", "instance", "/s", status="failed", hibernate=True)
        target = Router(table_of(row), activator=activator).route(head("h.mesh.example"))
        assert isinstance(target, LocalResponse)
        self.assertEqual((target.status, activator.calls), (503, []))

    def test_a_mesh_host_is_the_meshs_to_place_and_here_means_the_activator(self) -> None:
        activator = _Activator(AWAKE)
        mesh = _Mesh("mesh.example", activator)
        router = Router(table_of(HIBERNATING), activator=activator, mesh=mesh)
        self.assertIs(router.route(head("h.mesh.example")), AWAKE)  # placed here
        self.assertEqual(
            (mesh.routed, activator.calls), (["h.mesh.example"], [("h.mesh.example", False)])
        )
        mesh.forward_to = ELSEWHERE
        self.assertIs(router.route(head("h.mesh.example")), ELSEWHERE)  # placed on a peer
        self.assertEqual(len(activator.calls), 1, "a forwarded request never wakes it here")

    def test_a_peer_that_could_not_take_it_is_the_meshs_to_route_around(self) -> None:
        """Router.reroute: the proxy's ask, with the row as it is now; a row removed since is
        routed like any unknown host."""
        activator = _Activator(AWAKE)
        mesh = _Mesh("mesh.example", activator, forward_to=ELSEWHERE)
        table = table_of(HIBERNATING)
        router = Router(table, activator=activator, mesh=mesh)
        peer = router.route(head("h.mesh.example"))
        assert isinstance(peer, RemotePeer)
        self.assertIs(router.reroute(head("h.mesh.example"), peer, "stopping"), AWAKE)
        self.assertEqual(mesh.rerouted, [("h.mesh.example", ELSEWHERE.member, "stopping")])
        table.table = RouteTable(routes=MappingProxyType({}))
        gone = router.reroute(head("h.mesh.example"), peer, "unreachable")
        assert isinstance(gone, LocalResponse)
        self.assertEqual((gone.status, len(mesh.rerouted)), (404, 1))

    def test_a_host_out_of_the_meshs_scope_goes_straight_to_the_activator(self) -> None:
        activator = _Activator(AWAKE)
        mesh = _Mesh("other.example")
        router = Router(table_of(HIBERNATING), activator=activator, mesh=mesh)
        self.assertIs(router.route(head("h.mesh.example")), AWAKE)
        self.assertEqual(mesh.routed, [])

    def test_a_non_hibernating_row_never_reaches_the_mesh_or_the_activator(self) -> None:
        activator, mesh = _Activator(AWAKE), _Mesh("example.com")
        router = Router(table_of(READY), activator=activator, mesh=mesh)
        self.assertEqual(
            router.route(head("chat.example.com")), LocalSocket("chat.example.com", "/run/x.sock")
        )
        self.assertEqual((activator.calls, mesh.routed), ([], []))

    def test_the_mesh_api_is_this_boxs_own_name(self) -> None:
        router = Router(table_of(READY), mesh_api=("box-1.example.net", "/run/mesh.sock"))
        self.assertEqual(
            router.route(head("box-1.example.net")),
            LocalSocket("box-1.example.net", "/run/mesh.sock", kind="service"),
        )

    def test_an_acme_challenge_over_plain_http_goes_to_the_responder_for_any_host(self) -> None:
        router = Router(table_of(READY), acme_challenge="/run/acme.sock")
        for host in ("chat.example.com", "unregistered.example.com"):
            challenge = RequestHead(
                method=b"GET", target=b"/.well-known/acme-challenge/tok", host=host
            )
            self.assertEqual(
                router.route(challenge), LocalSocket(host, "/run/acme.sock", kind="service")
            )
        over_tls = RequestHead(
            method=b"GET",
            target=b"/.well-known/acme-challenge/tok",
            host="chat.example.com",
            secure=True,
        )
        self.assertEqual(router.route(over_tls), LocalSocket("chat.example.com", "/run/x.sock"))


class UnavailableTests(TestCase):
    """The activator's 503s (lchat.router.unavailable): public words, Retry-After, the drain's
    mark."""

    def test_public_words_and_retry_after_bounds(self) -> None:
        answer = unavailable("h.example.com", "lease_held", 2.2)
        self.assertEqual(answer.status, 503)
        self.assertIn(b"h.example.com is being served elsewhere right now", answer.body)
        self.assertIn((b"retry-after", b"3"), answer.headers)
        self.assertIn((b"retry-after", b"5"), unavailable("h.example.com", "spawn").headers)
        self.assertIn((b"retry-after", b"3600"), unavailable("h", "backoff", 1e9).headers)
        self.assertIn(b"temporarily unavailable", unavailable("h.example.com", "odd").body)
        self.assertEqual(answer.label, "wake_lease_held")

    def test_only_the_drains_refusals_are_marked_and_only_while_stopping(self) -> None:
        for reason in ("shutdown", "stood_down", "cancelled"):
            self.assertEqual(unavailable("h", reason, stopping=True).refusal, "stopping")
            self.assertEqual(unavailable("h", reason).refusal, "")
        for reason in ("lease_held", "backoff", "bucket", "spawn", "not_ready", "queue_timeout"):
            self.assertEqual(unavailable("h", reason, stopping=True).refusal, "", reason)

"""The routing decision and the simple proxy, over real sockets with a real unix-socket backend."""

from __future__ import annotations

from types import MappingProxyType

from attrs import define
from twisted.trial.unittest import TestCase

from lchat.registry import Route, RouteTable
from lchat.router import LocalResponse, LocalSocket, RequestHead, Router


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

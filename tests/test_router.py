"""The routing decision and the simple proxy, over real sockets with a real unix-socket backend."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from types import MappingProxyType
from typing import Any

from attrs import define
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXServerEndpoint, serverFromString
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import Site

from lchat.proxy.simple import ProxyResource, forwardable
from lchat.registry import Route, RouteTable
from lchat.router import LocalResponse, LocalSocket, Router


@define
class Table:
    table: RouteTable


def table_of(*routes: Route) -> Table:
    return Table(RouteTable(routes=MappingProxyType({r.host: r for r in routes})))


READY = Route(host="chat.example.com", kind="instance", socket="/run/x.sock", status="ready")


class RouterDecisionTests(TestCase):
    def test_ready_row_goes_to_its_socket(self) -> None:
        router = Router(table_of(READY))
        self.assertEqual(
            router.route("Chat.Example.COM:443"), LocalSocket("chat.example.com", "/run/x.sock")
        )

    def test_unknown_host_is_404_or_fallback(self) -> None:
        target = Router(table_of(READY)).route("other.example.com")
        assert isinstance(target, LocalResponse)
        self.assertEqual(target.status, 404)
        target = Router(table_of(READY), "https://example.com/").route("other.example.com")
        assert isinstance(target, LocalResponse)
        self.assertEqual(target.status, 302)
        self.assertIn((b"location", b"https://example.com/"), target.headers)

    def test_ip_literal_and_localhost_are_unknown_not_malformed(self) -> None:
        for host in ("127.0.0.1:8080", "[::1]:80", "localhost"):
            target = Router(table_of(READY)).route(host)
            assert isinstance(target, LocalResponse)
            self.assertEqual(target.status, 404, host)

    def test_malformed_or_missing_host_is_400(self) -> None:
        router = Router(table_of(READY))
        for host in (
            None,
            "",
            "a b",
            "../x",
            "a/b",
            "x\x00y.com",
            "a:b:c",
            "x.com:99999",
            "a" * 300,
        ):
            target = router.route(host)
            assert isinstance(target, LocalResponse)
            self.assertEqual(target.status, 400, repr(host))

    def test_rows_that_are_not_ready_are_503_with_retry_after(self) -> None:
        for status in ("creating", "failed"):
            router = Router(table_of(Route("a.example.com", "instance", "/s", status=status)))
            target = router.route("a.example.com")
            assert isinstance(target, LocalResponse)
            self.assertEqual(target.status, 503)
            self.assertIn(b"retry-after", dict(target.headers))

    def test_hibernating_row_without_activator_is_503(self) -> None:
        row = Route("h.example.com", "instance", "/s", status="ready", hibernate=True)
        target = Router(table_of(row)).route("h.example.com")
        assert isinstance(target, LocalResponse)
        self.assertEqual(target.status, 503)


class ForwardableTests(TestCase):
    def test_hop_by_hop_connection_named_proxy_and_internal_headers_are_dropped(self) -> None:
        headers = Headers(
            {
                b"Connection": [b"keep-alive, X-Secret"],
                b"X-Secret": [b"1"],
                b"Keep-Alive": [b"timeout=5"],
                b"TE": [b"trailers"],
                b"Proxy-Authorization": [b"x"],
                b"X-Lchat-Sidecar": [b"1"],
                b"X-Lchat-Mesh-Forwarded": [b"1"],
                b"Accept": [b"*/*"],
            }
        )
        self.assertEqual([n.lower() for n, _ in forwardable(headers)], [b"accept"])


class Echo(Resource):
    """A backend that reports what it received."""

    isLeaf = True

    def render(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"connection", b"x-hop")
        request.setHeader(b"x-hop", b"must not pass")
        return json.dumps(
            {
                "method": request.method.decode(),
                "uri": request.uri.decode(),
                "headers": {
                    k.decode().lower(): [x.decode() for x in v]
                    for k, v in request.requestHeaders.getAllRawHeaders()
                },
                "body": request.content.read().decode(),
            }
        ).encode()


class ProxyTests(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="px", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.sock = os.path.join(self.dir, "a.sock")
        rows = [
            Route("a.example.com", "instance", self.sock, status="ready"),
            Route(
                "gone.example.com", "instance", os.path.join(self.dir, "no.sock"), status="ready"
            ),
        ]
        self.proxy = ProxyResource(reactor, Router(table_of(*rows)))
        self.addCleanup(self.proxy.close)

    @inlineCallbacks
    def listen(self):
        backend = yield UNIXServerEndpoint(reactor, self.sock).listen(Site(Echo()))
        self.addCleanup(backend.stopListening)
        front = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            Site(self.proxy)
        )
        self.addCleanup(front.stopListening)
        return front.getHost().port

    @inlineCallbacks
    def request(self, port: int, host: bytes, method: bytes = b"GET", **kw: Any):
        headers = Headers({b"host": [host], **kw.pop("headers", {})})
        agent = Agent(reactor)
        response = yield agent.request(
            method, f"http://127.0.0.1:{port}/p?q=1".encode(), headers, kw.pop("body", None)
        )
        body = yield readBody(response)
        return response, body

    @inlineCallbacks
    def test_forwards_to_the_socket_keeping_host_and_setting_forwarded_headers(self):
        port = yield self.listen()
        response, body = yield self.request(
            port,
            b"A.example.com",
            headers={
                b"x-lchat-sidecar": [b"1"],
                b"x-lchat-mesh-forwarded": [b"forged"],
                b"x-forwarded-for": [b"10.9.8.7"],
            },
        )
        self.assertEqual(response.code, 200)
        seen = json.loads(body)
        self.assertEqual(seen["uri"], "/p?q=1")
        self.assertEqual(seen["headers"]["host"], ["A.example.com"])
        self.assertEqual(seen["headers"]["x-forwarded-for"], ["10.9.8.7, 127.0.0.1"])
        self.assertEqual(seen["headers"]["x-forwarded-proto"], ["http"])
        self.assertNotIn("x-lchat-sidecar", seen["headers"])
        self.assertNotIn("x-lchat-mesh-forwarded", seen["headers"])
        # Response headers named by Connection are only dropped by the streaming front door:
        # twisted.web's client hides the response's Connection header from us.

    @inlineCallbacks
    def test_request_body_is_forwarded(self):
        from io import BytesIO

        from twisted.web.client import FileBodyProducer

        port = yield self.listen()
        _, body = yield self.request(
            port, b"a.example.com", b"POST", body=FileBodyProducer(BytesIO(b"x" * 100_000))
        )
        seen = json.loads(body)
        self.assertEqual(seen["method"], "POST")
        self.assertEqual(len(seen["body"]), 100_000)

    @inlineCallbacks
    def test_unknown_host_404_and_dead_socket_502(self):
        port = yield self.listen()
        response, _ = yield self.request(port, b"nobody.example.com")
        self.assertEqual(response.code, 404)
        response, body = yield self.request(port, b"gone.example.com")
        self.assertEqual(response.code, 502)
        self.assertIn(b"not answering", body)

    @inlineCallbacks
    def test_malformed_host_header_is_400(self):
        port = yield self.listen()
        received = []

        class Raw(Protocol):
            def connectionMade(self) -> None:
                assert self.transport is not None
                self.transport.write(b"GET / HTTP/1.1\r\nHost: ../etc\r\nConnection: close\r\n\r\n")

            def dataReceived(self, data: bytes) -> None:
                received.append(data)

        factory = ClientFactory.forProtocol(Raw)
        proto = yield TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(factory)
        from twisted.internet.task import deferLater

        for _ in range(50):
            if received:
                break
            yield deferLater(reactor, 0.02, lambda: None)
        proto.transport.loseConnection()
        self.assertTrue(b"".join(received).startswith(b"HTTP/1.1 400"))

"""The forwarded marker: only a peer holding the mesh token can make a box serve locally."""

from __future__ import annotations

import socket
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from lchat.config import ProxyConfig
from lchat.mesh import forward
from lchat.proxy.downstream import ProxyFactory
from lchat.router import LocalResponse, RemotePeer, RequestHead, Target

_tcp: Any = reactor  # listenTCP's stub wants a ServerFactory; ours are plain Factories

TOKEN = "s3cret-token"
HOST = "a.mesh.example"


class MarkerTests(TestCase):
    def test_a_fresh_marker_for_this_host_authenticates(self) -> None:
        value = forward.marker(TOKEN, HOST, now=lambda: 1_000_000.0)
        self.assertTrue(value.startswith(b"v1 1000000 "))
        self.assertTrue(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_030.0))

    def test_wrong_token_other_host_or_stale_is_refused(self) -> None:
        value = forward.marker(TOKEN, HOST, now=lambda: 1_000_000.0)
        at = lambda: 1_000_000.0  # noqa: E731
        self.assertFalse(forward.authentic(value, "other-token", HOST, now=at))
        self.assertFalse(forward.authentic(value, TOKEN, "b.mesh.example", now=at))
        self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0 + 121))
        self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0 - 121))
        self.assertFalse(forward.authentic(value, "", HOST, now=at))  # no token: never

    def test_garbage_is_refused(self) -> None:
        for value in (
            None,
            b"",
            b"1",
            b"v1",
            b"v2 1000000 " + b"0" * 64,
            b"v1 notanumber " + b"0" * 64,
            b"v1 1000000 " + b"0" * 64,
            b"v1 1000000 zz",
            b"\xff\xfe",
            b"v1 1000000 " + b"a" * 500,
        ):
            self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0))

    @given(st.binary(max_size=300))
    def test_no_random_value_authenticates(self, value: bytes) -> None:
        self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0))


class PeerTargetTests(TestCase):
    def test_https_peer_is_pinned_and_verified_against_the_space(self) -> None:
        target = forward.peer_target("https://box-b.example.net:8443", HOST, TOKEN)
        self.assertEqual(
            (target.address, target.port, target.server_name, target.tls),
            ("box-b.example.net", 8443, HOST, True),
        )
        ((name, value),) = target.add_headers
        self.assertEqual(name, forward.HEADER)
        self.assertTrue(forward.authentic(value, TOKEN, HOST))

    def test_default_ports_and_plain_http(self) -> None:
        self.assertEqual(forward.peer_target("https://10.0.0.5", HOST, TOKEN).port, 443)
        plain = forward.peer_target("http://10.0.0.5", HOST, TOKEN)
        self.assertEqual((plain.port, plain.tls), (80, False))


class _ClosesUnanswered(Protocol):
    """A peer that is stopping: it reads a request head and closes without an answer."""

    def __init__(self, peer: _StoppingPeer) -> None:
        self.peer = peer

    def dataReceived(self, data: bytes) -> None:
        self.peer.heads += 1
        if b"\r\n\r\n" in data:
            self.transport.loseConnection()  # type: ignore[union-attr]


class _StoppingPeer(Factory):
    def __init__(self) -> None:
        self.heads = 0

    def buildProtocol(self, addr: object) -> _ClosesUnanswered:
        return _ClosesUnanswered(self)


class _ToPeer:
    """Routes every request to one peer, with the mesh's fallback (answer here instead)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.fallbacks = 0

    def route(self, head: RequestHead) -> Target:
        def fallback() -> Target:
            self.fallbacks += 1
            return LocalResponse(200, b"served elsewhere\n")

        return RemotePeer(
            host=head.host,
            address="127.0.0.1",
            port=self.port,
            server_name=head.host,
            tls=False,
            fallback=fallback,
        )


class RerouteTests(TestCase):
    """The proxy routes around a peer that refuses, or that closes a safe request unanswered."""

    def _proxy(self, peer_port: int) -> tuple[int, _ToPeer]:
        router = _ToPeer(peer_port)
        factory = ProxyFactory(reactor, router, ProxyConfig())
        port = _tcp.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.addCleanup(factory.pool.close)
        return port.getHost().port, router

    def _peer(self) -> tuple[int, _StoppingPeer]:
        factory = _StoppingPeer()
        port = _tcp.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return port.getHost().port, factory

    @inlineCallbacks
    def _request(self, port: int, method: bytes) -> Any:
        pool = HTTPConnectionPool(reactor, persistent=False)
        response = yield Agent(reactor, pool=pool).request(
            method,
            f"http://127.0.0.1:{port}/api/version".encode(),
            Headers({b"host": [HOST.encode()]}),
        )
        body = yield readBody(response)
        return response.code, body

    @inlineCallbacks
    def test_a_refusing_peer_is_routed_around(self):
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        port, router = self._proxy(dead_port)
        code, body = yield self._request(port, b"GET")
        self.assertEqual((code, body, router.fallbacks), (200, b"served elsewhere\n", 1))

    @inlineCallbacks
    def test_a_safe_request_closed_unanswered_is_routed_again(self):
        peer_port, peer = self._peer()
        port, router = self._proxy(peer_port)
        code, body = yield self._request(port, b"GET")
        self.assertEqual((code, body), (200, b"served elsewhere\n"))
        self.assertEqual(router.fallbacks, 1)
        self.assertGreaterEqual(peer.heads, 1)  # it did reach the peer first

    @inlineCallbacks
    def test_an_unsafe_request_closed_unanswered_is_not_sent_again(self):
        peer_port, _ = self._peer()
        port, router = self._proxy(peer_port)
        code, _ = yield self._request(port, b"POST")
        self.assertEqual(code, 502)  # it may have been acted on: never resent elsewhere
        self.assertEqual(router.fallbacks, 0)

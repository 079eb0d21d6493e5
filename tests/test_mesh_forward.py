"""The forwarded marker: only a peer holding the mesh token can make a box serve locally."""

from __future__ import annotations

import http.client
import io
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import Site

from lchat.config import ProxyConfig
from lchat.mesh import forward
from lchat.proxy.downstream import ProxyFactory
from lchat.proxy.hot import REPLAY_LIMIT
from lchat.proxy.http import REFUSED, Header
from lchat.router import LocalResponse, LocalSocket, RemotePeer, RequestHead, Target
from tests.proxy_harness import listen_now

_tcp: Any = reactor  # listenTCP's stub wants a ServerFactory; ours are plain Factories

TOKEN = "s3cret-token"
HOST = "a.mesh.example"
PEER = "https://box-b.example.net:8443"
BOUND = forward.Bound(method=b"GET", target=b"/api/x?y=1", peer=PEER)


class MarkerTests(TestCase):
    def test_a_fresh_marker_for_this_host_authenticates(self) -> None:
        value = forward.marker(TOKEN, HOST, lambda: 1_000_000.0, BOUND)
        self.assertTrue(value.startswith(b"v2 1000000 "))
        self.assertTrue(forward.authentic(value, TOKEN, HOST, lambda: 1_000_030.0, bound=BOUND))

    def test_wrong_token_other_host_or_stale_is_refused(self) -> None:
        value = forward.marker(TOKEN, HOST, lambda: 1_000_000.0, BOUND)
        at = lambda: 1_000_000.0  # noqa: E731
        b = BOUND
        self.assertFalse(forward.authentic(value, "other-token", HOST, at, bound=b))
        self.assertFalse(forward.authentic(value, TOKEN, "b.mesh.example", at, bound=b))
        self.assertFalse(forward.authentic(value, TOKEN, HOST, lambda: 1_000_000.0 + 121, bound=b))
        self.assertFalse(forward.authentic(value, TOKEN, HOST, lambda: 1_000_000.0 - 121, bound=b))
        self.assertFalse(forward.authentic(value, "", HOST, at, bound=b))  # no token: never

    def test_a_marker_is_bound_to_its_request_and_its_peer(self) -> None:
        """Issue 29: a marker captured at the box it was sent to (a ``lives_at`` target, any
        peer) is refused for any other request — another path, query or method — and by any
        other box, within its freshness window too."""
        value = forward.marker(TOKEN, HOST, lambda: 1_000_000.0, BOUND)
        at = lambda: 1_000_000.0  # noqa: E731
        for other in (
            forward.Bound(b"GET", b"/api/x?y=2", PEER),  # another query
            forward.Bound(b"GET", b"/api/admin", PEER),  # another path
            forward.Bound(b"POST", b"/api/x?y=1", PEER),  # another method
            forward.Bound(b"GET", b"/api/x?y=1", "https://box-c.example.net"),  # another peer
        ):
            self.assertFalse(forward.authentic(value, TOKEN, HOST, at, bound=other), other)
        self.assertTrue(forward.authentic(value, TOKEN, HOST, at, bound=BOUND))

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
            self.assertFalse(forward.authentic(value, TOKEN, HOST, lambda: 1e6, bound=BOUND))

    @given(st.binary(max_size=300))
    def test_no_random_value_authenticates(self, value: bytes) -> None:
        self.assertFalse(forward.authentic(value, TOKEN, HOST, lambda: 1e6, bound=BOUND))


class PeerTargetTests(TestCase):
    def test_https_peer_is_pinned_and_verified_against_the_space(self) -> None:
        target = forward.peer_target(
            "HTTPS://Box-B.example.net:8443/", HOST, TOKEN, time.time, method=b"GET",
            target=b"/api/x?y=1",
        )  # fmt: skip
        self.assertEqual(
            (target.address, target.port, target.server_name, target.tls),
            ("box-b.example.net", 8443, HOST, True),
        )
        ((name, value),) = target.add_headers
        self.assertEqual(name, forward.HEADER)
        # Bound to the request and to the peer's normalised URL.
        self.assertTrue(forward.authentic(value, TOKEN, HOST, time.time, bound=BOUND))

    def test_default_ports_and_plain_http(self) -> None:
        get = {"method": b"GET", "target": b"/"}
        self.assertEqual(
            forward.peer_target("https://10.0.0.5", HOST, TOKEN, time.time, **get).port, 443
        )
        plain = forward.peer_target("http://10.0.0.5", HOST, TOKEN, time.time, **get)
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
    """Routes every request to one mesh peer; routed again, it answers here."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reroutes = 0

    def route(self, head: RequestHead) -> Target:
        return RemotePeer(
            host=head.host,
            address="127.0.0.1",
            port=self.port,
            server_name=head.host,
            tls=False,
            member=f"http://127.0.0.1:{self.port}",
        )

    def reroute(self, head: RequestHead, peer: RemotePeer, why: str) -> Target:
        self.reroutes += 1
        return LocalResponse(200, b"served elsewhere\n")


class RerouteTests(TestCase):
    """The proxy routes around a peer that refuses, or that closes a safe request unanswered."""

    def _proxy(self, peer_port: int) -> tuple[int, _ToPeer]:
        router = _ToPeer(peer_port)
        factory = ProxyFactory(reactor, router, ProxyConfig())
        port = listen_now(factory)
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
        self.assertEqual((code, body, router.reroutes), (200, b"served elsewhere\n", 1))

    @inlineCallbacks
    def test_a_safe_request_closed_unanswered_is_routed_again(self):
        peer_port, peer = self._peer()
        port, router = self._proxy(peer_port)
        code, body = yield self._request(port, b"GET")
        self.assertEqual((code, body), (200, b"served elsewhere\n"))
        self.assertEqual(router.reroutes, 1)
        self.assertGreaterEqual(peer.heads, 1)  # it did reach the peer first

    @inlineCallbacks
    def test_an_unsafe_request_closed_unanswered_is_not_sent_again(self):
        peer_port, _ = self._peer()
        port, router = self._proxy(peer_port)
        code, _ = yield self._request(port, b"POST")
        self.assertEqual(code, 502)  # it may have been acted on: never resent elsewhere
        self.assertEqual(router.reroutes, 0)


class _Answer(Resource):
    """A peer (or a space) that reads the whole request, records it and answers ``status`` with
    ``headers`` and ``body`` (None: the request's own body, echoed)."""

    isLeaf = True

    def __init__(
        self, status: int = 201, headers: tuple[Header, ...] = (), body: bytes | None = None
    ) -> None:
        super().__init__()
        self.status, self.headers, self.body = status, headers, body
        self.requests: list[tuple[bytes, bytes]] = []

    def render(self, request: Any) -> bytes:
        data = request.content.read()
        self.requests.append((request.method, data))
        request.setResponseCode(self.status)
        for name, value in self.headers:
            request.setHeader(name, value)
        return data if self.body is None else self.body


STOPPING = b"503 Service Unavailable: the router is stopping; try again in 5s\n"
MARKED = ((b"retry-after", b"5"), (REFUSED, b"stopping"))  # what a draining owner answers


class _RefusesAtHead(Protocol):
    """An owner that is draining, seen from the wire: it refuses a forwarded request as soon as
    its head is in (before the body), marked, and closes (as a router does that answers before
    the body is all there)."""

    def __init__(self, peer: _DrainingPeer) -> None:
        self.peer = peer
        self.seen = b""

    def dataReceived(self, data: bytes) -> None:
        self.seen += data
        if b"\r\n\r\n" in self.seen and self.transport is not None:
            self.peer.heads += 1
            self.transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\n"
                b"X-Lchat-Refused: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (self.peer.why, len(STOPPING), STOPPING)
            )
            self.transport.loseConnection()
            self.seen = b""


class _DrainingPeer(Factory):
    def __init__(self, why: bytes = b"stopping") -> None:
        self.heads = 0
        self.why = why

    def buildProtocol(self, addr: object) -> _RefusesAtHead:
        return _RefusesAtHead(self)


def _content_length(head: bytes) -> int:
    """A request or response head's ``Content-Length`` (0 without one)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class _ClosesSecondRequest(Protocol):
    """A peer that answers the first request on a connection (kept alive) and closes the
    connection on the second one unanswered: a kept-alive connection closed under a request."""

    def __init__(self) -> None:
        self.buffer = b""
        self.served = 0

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer and self.transport is not None:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            length = _content_length(head)
            if len(rest) < length:
                return
            body, self.buffer = rest[:length], rest[length:]
            self.served += 1
            if self.served == 2:
                self.transport.loseConnection()
                return
            self.transport.write(
                b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )


class _ClosesSecondHead(Protocol):
    """A peer that answers the first request on a connection (kept alive) and closes the
    connection as soon as the second one's head is in, before its body: an idle close crossing a
    request whose body the client had not sent yet. ``seen`` is set at that close."""

    def __init__(self, seen: threading.Event) -> None:
        self.buffer = b""
        self.heads = 0
        self.seen = seen

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer and self.transport is not None:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            self.heads += 1
            if self.heads == 2:
                self.transport.loseConnection()
                self.seen.set()
                return
            length = _content_length(head)
            if len(rest) < length:
                self.heads -= 1  # (counted again once the body is in)
                return
            body, self.buffer = rest[:length], rest[length:]
            self.transport.write(
                b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )


def _post_in_two_parts(port: int, seen: threading.Event) -> list[tuple[int, bytes]]:
    """Two POSTs on one client connection; the second's body is sent only after the peer has
    closed the proxy's pooled connection under its head (``seen``), and a moment more, so the
    proxy has met the close before the body arrives."""
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        reader = sock.makefile("rb")
        for body, wait in ((b'{"body": "one"}', False), (b'{"body": "two"}', True)):
            sock.sendall(
                b"POST /api/rooms/r/messages HTTP/1.1\r\nHost: %s\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % (HOST.encode(), len(body))
            )
            if wait:
                seen.wait(10)
                time.sleep(0.3)  # (ordering: the proxy reads the close first)
            sock.sendall(body)
            lines = []
            while (line := reader.readline()) not in (b"\r\n", b""):
                lines.append(line)
            head = b"".join(lines)
            status = int(head.split()[1])
            answers.append((status, reader.read(_content_length(head))))
    return answers


class _ToPeers:
    """Routes every request to the mesh peer on ``first``; routed again (``why`` recorded), to
    the one on ``then``, and from there (it must never happen: one re-route) to a 500.
    ``then=None``: ``first`` is outside the mesh, never routed again."""

    def __init__(self, first: int, then: int | None) -> None:
        self.first, self.then = first, then
        self.whys: list[str] = []

    def _peer(self, host: str, port: int, mesh: bool = True) -> RemotePeer:
        member = f"http://127.0.0.1:{port}" if mesh else ""
        return RemotePeer(
            host=host, address="127.0.0.1", port=port, server_name=host, tls=False, member=member
        )

    def route(self, head: RequestHead) -> Target:
        return self._peer(head.host, self.first, mesh=self.then is not None)

    def reroute(self, head: RequestHead, peer: RemotePeer, why: str) -> Target:
        self.whys.append(why)
        if peer.port != self.first or self.then is None:
            return LocalResponse(500, b"routed a second time\n")
        return self._peer(head.host, self.then)


class _ToSpace:
    """The owner box's router, reduced to serving one space on a unix socket."""

    def __init__(self, path: str) -> None:
        self.path = path

    def route(self, head: RequestHead) -> Target:
        return LocalSocket(host=head.host, path=self.path)


class DrainRerouteTests(TestCase):
    """A 503 a draining owner marks ``X-Lchat-Refused: stopping`` (it never processed the
    request) is sent elsewhere by the forwarding box, once, body and all; any other 503 reaches
    the client as it is; the marker never does."""

    timeout = 15

    def _listen(self, factory: Any) -> int:
        port = _tcp.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    def _site(self, resource: _Answer) -> int:
        return self._listen(Site(resource))

    def _proxy(self, router: Any) -> int:
        factory = ProxyFactory(reactor, router, ProxyConfig())
        self.addCleanup(factory.pool.close)
        port = listen_now(factory)
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    @inlineCallbacks
    def _post(self, port: int, body: bytes, pool: HTTPConnectionPool | None = None) -> Any:
        if pool is None:
            pool = HTTPConnectionPool(reactor, persistent=False)
        response = yield Agent(reactor, pool=pool).request(
            b"POST",
            f"http://127.0.0.1:{port}/api/rooms/r/messages".encode(),
            Headers({b"host": [HOST.encode()], b"content-type": [b"application/json"]}),
            FileBodyProducer(io.BytesIO(body)),
        )
        data = yield readBody(response)
        headers = {k.lower(): v for k, v in response.headers.getAllRawHeaders()}
        return response.code, headers, data

    @inlineCallbacks
    def test_a_post_a_stopping_owner_refused_is_sent_elsewhere_with_its_body(self):
        owner = _Answer(503, MARKED, STOPPING)
        survivor = _Answer(201)
        router = _ToPeers(self._site(owner), self._site(survivor))
        body = json.dumps({"body": "x" * 5000}).encode()
        code, headers, data = yield self._post(self._proxy(router), body)
        self.assertEqual((code, data), (201, body))
        self.assertEqual(router.whys, ["stopping"])
        self.assertEqual(owner.requests, [(b"POST", body)])  # it did reach the owner first
        self.assertEqual(survivor.requests, [(b"POST", body)])
        self.assertNotIn(REFUSED, headers)

    @inlineCallbacks
    def test_a_post_a_peer_not_holding_the_space_refused_is_routed_again_told_so(self):
        """A failover box that slept the space since the sender's word said it held it
        (lchat.mesh.routing, ``not_holding``): routed again, the mesh told why."""
        refuser = _Answer(503, ((b"retry-after", b"5"), (REFUSED, b"not_holding")), STOPPING)
        home = _Answer(201)
        router = _ToPeers(self._site(refuser), self._site(home))
        body = b'{"body": "hi"}'
        code, headers, data = yield self._post(self._proxy(router), body)
        self.assertEqual((code, data, router.whys), (201, body, ["not_holding"]))
        self.assertEqual(home.requests, [(b"POST", body)])
        self.assertNotIn(REFUSED, headers)

    @inlineCallbacks
    def test_a_marker_of_no_known_refusal_is_relayed_as_a_503(self):
        odd = _Answer(503, ((b"retry-after", b"5"), (REFUSED, b"bored")), STOPPING)
        other = _Answer(201)
        router = _ToPeers(self._site(odd), self._site(other))
        code, headers, data = yield self._post(self._proxy(router), b'{"body": "hi"}')
        self.assertEqual((code, data, router.whys, other.requests), (503, STOPPING, [], []))
        self.assertNotIn(REFUSED, headers)

    @inlineCallbacks
    def test_a_spaces_own_503_reaches_the_client_unchanged(self):
        owner = _Answer(503, ((b"retry-after", b"7"),), b"the space is busy\n")
        survivor = _Answer(201)
        router = _ToPeers(self._site(owner), self._site(survivor))
        code, headers, data = yield self._post(self._proxy(router), b'{"body": "hi"}')
        self.assertEqual(
            (code, data, headers[b"retry-after"]), (503, b"the space is busy\n", [b"7"])
        )
        self.assertEqual((router.whys, survivor.requests), ([], []))

    @inlineCallbacks
    def test_a_refused_request_is_sent_elsewhere_at_most_once(self):
        owner = _Answer(503, MARKED, STOPPING)
        other = _Answer(503, MARKED, b"503 the other one is stopping too\n")
        router = _ToPeers(self._site(owner), self._site(other))
        code, headers, data = yield self._post(self._proxy(router), b'{"body": "hi"}')
        self.assertEqual((code, data), (503, b"503 the other one is stopping too\n"))
        self.assertEqual(router.whys, ["stopping"])  # the second target's reroute: never
        self.assertEqual((len(owner.requests), len(other.requests)), (1, 1))
        self.assertNotIn(REFUSED, headers)
        self.assertEqual(headers[b"retry-after"], [b"5"])

    @inlineCallbacks
    def test_a_refusal_that_overtakes_the_body_waits_for_the_body(self):
        """The owner refuses at the head, before the client has sent the body (Python's
        http.client sends them apart): the request goes elsewhere once the body is all in."""
        yield self._refused_before_the_body(b"stopping")

    @inlineCallbacks
    def test_a_not_holding_refusal_that_overtakes_the_body_is_told_so_after_it(self):
        yield self._refused_before_the_body(b"not_holding")

    @inlineCallbacks
    def _refused_before_the_body(self, why: bytes) -> Any:
        peer = _DrainingPeer(why)
        survivor = _Answer(201)
        router = _ToPeers(self._listen(peer), self._site(survivor))
        port = self._proxy(router)
        body = b'{"body": "late body"}'

        def post() -> tuple[int, bytes, list[str]]:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            try:
                sock.sendall(
                    b"POST /api/rooms/r/messages HTTP/1.1\r\nHost: %s\r\n"
                    b"Content-Length: %d\r\n\r\n" % (HOST.encode(), len(body))
                )
                deadline = time.monotonic() + 5
                while peer.heads < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.2)  # the refusal reaches the proxy: the body is not there yet
                whys_before_body = list(router.whys)
                sock.sendall(body)
                response = http.client.HTTPResponse(sock)
                response.begin()
                return response.status, response.read(), whys_before_body
            finally:
                sock.close()

        code, data, whys_before_body = yield deferToThread(post)
        self.assertEqual(peer.heads, 1)
        self.assertEqual(whys_before_body, [])
        self.assertEqual((code, data), (201, body))
        self.assertEqual(survivor.requests, [(b"POST", body)])
        self.assertEqual(router.whys, [why.decode()])

    @inlineCallbacks
    def test_a_body_over_the_replay_limit_gets_the_503(self):
        owner = _Answer(503, MARKED, STOPPING)
        survivor = _Answer(201)
        router = _ToPeers(self._site(owner), self._site(survivor))
        body = b"x" * (REPLAY_LIMIT + 1)
        code, headers, data = yield self._post(self._proxy(router), body)
        self.assertEqual((code, data), (503, STOPPING))  # never sent twice: not all kept
        self.assertEqual((router.whys, survivor.requests), ([], []))
        self.assertNotIn(REFUSED, headers)

    @inlineCallbacks
    def test_a_space_cannot_forge_the_marker(self):
        """The owner's router drops X-Lchat-Refused from its space's answer: the forwarding box
        sees a plain 503 and relays it."""
        path = os.path.join(tempfile.mkdtemp(prefix="fwd", dir="/tmp"), "space.sock")
        self.addCleanup(shutil.rmtree, os.path.dirname(path), True)
        space = _Answer(503, MARKED, b"503 from the space itself\n")
        listening = _tcp.listenUNIX(path, Site(space))
        self.addCleanup(listening.stopListening)
        owner = self._proxy(_ToSpace(path))
        survivor = _Answer(201)
        router = _ToPeers(owner, self._site(survivor))
        code, headers, data = yield self._post(self._proxy(router), b'{"body": "hi"}')
        self.assertEqual((code, data), (503, b"503 from the space itself\n"))
        self.assertEqual((router.whys, survivor.requests), ([], []))
        self.assertNotIn(REFUSED, headers)
        self.assertEqual(len(space.requests), 1)

    @inlineCallbacks
    def test_a_post_whose_body_is_still_coming_is_sent_again_when_its_connection_closed(self):
        """The peer closes the pooled connection under the second POST's head, before the
        client sent its body (a drain's idle close crossing it): nothing of the body was lost,
        so one fresh connection gets the request, and the body follows it there."""
        seen = threading.Event()
        peer = self._listen(Factory.forProtocol(lambda: _ClosesSecondHead(seen)))
        port = self._proxy(_ToPeers(peer, None))
        answers = yield deferToThread(_post_in_two_parts, port, seen)
        self.assertEqual(answers, [(201, b'{"body": "one"}'), (201, b'{"body": "two"}')])

    @inlineCallbacks
    def test_a_post_on_a_kept_alive_connection_closed_unanswered_is_sent_again(self):
        """The peer closes the pooled connection under the second POST without reading it (an
        idle close crossing the request): one fresh connection gets it, body and all."""
        router = _ToPeers(self._listen(Factory.forProtocol(_ClosesSecondRequest)), None)
        port = self._proxy(router)
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        for text in (b'{"body": "one"}', b'{"body": "two"}'):
            code, _, data = yield self._post(port, text, pool)
            self.assertEqual((code, data), (201, text))

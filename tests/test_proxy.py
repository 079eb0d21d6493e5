"""The front door's proxy over real sockets: real unix-socket backends, real clients.

Functional behaviour: streaming with backpressure both ways, keep-alive reuse on both sides, chunked
both ways, 100-continue, HEAD, an upstream answering before the body, pipelining, WebSockets with a
real client library, dial retry, TLS to a peer with name verification, and the request observer.
(Malformed and adversarial input lives in test_proxy_adversarial.)
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from typing import Any, cast

from attrs import define, evolve, field
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import (
    TCP4ClientEndpoint,
    UNIXServerEndpoint,
    serverFromString,
    wrapClientTLS,
    wrapServerTLS,
)
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    PrivateCertificate,
    optionsForClientTLS,
)
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import ILogObserver, Logger, globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.websocket import WebSocketResource, WebSocketTransport
from zope.interface import implementer

from lchat import certfiles, tls, uvloop_reactor
from lchat.config import ProxyConfig
from lchat.proxy import tls_accept
from lchat.proxy.downstream import ProxyFactory
from lchat.proxy.upstream import client_tls_context
from lchat.reactors import installed
from lchat.router import LocalResponse, LocalSocket, RemotePeer, RequestHead, Target
from lchat.threads import thread_runner
from tests.proxy_harness import listen
from tests.test_tls import TestCA

reactor = installed()
HOST = "chat.example.com"
_log = Logger(namespace="tests.test_proxy")


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


@define
class Observer:
    """Hands out in-flight tickets (lchat.router.InFlight) that record each request's path."""

    events: list[tuple[str, str]] = field(factory=list)
    upgrades: list[bool] = field(factory=list)  # each start's and end's upgrade flag

    def ticket(self, path: str) -> _Ticket:
        return _Ticket(self, path)

    @property
    def in_flight(self) -> int:
        return sum(1 if kind == "start" else -1 for kind, _ in self.events)


@define
class _Ticket:
    observer: Observer
    path: str

    def request_started(self, upgrade: bool) -> None:
        self.observer.events.append(("start", self.path))
        self.observer.upgrades.append(upgrade)

    def request_ended(self, upgrade: bool) -> None:
        self.observer.events.append(("end", self.path))
        self.observer.upgrades.append(upgrade)


@define
class StaticRouter:
    """Routes by host to fixed targets; a socket target carries ``observer``'s ticket."""

    targets: dict[str, Target]
    observer: Observer | None = None
    heads: list[RequestHead] = field(factory=list)

    def route(self, head: RequestHead) -> Target:
        self.heads.append(head)
        target = self.targets.get(head.host) or LocalResponse(404, b"unknown\n", label="unknown")
        if isinstance(target, LocalSocket) and self.observer is not None:
            target = evolve(target, inflight=self.observer.ticket(head.target.decode()))
        return target

    def reroute(self, head: RequestHead, peer: RemotePeer, why: str) -> Target:
        raise AssertionError("no mesh peer is routed to here")


class RawClient(Protocol):
    """A client that sends exactly the bytes we say and keeps everything it receives."""

    transport: Any

    def __init__(self) -> None:
        self.received = bytearray()
        self.closed: Deferred[None] = Deferred()
        self.is_closed = False
        self.closed_at = 0.0

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Any = None) -> None:
        self.is_closed = True
        self.closed_at = time.monotonic()
        self.closed.callback(None)


class Backend(Protocol):
    """A scripted backend: records raw bytes; ``respond`` decides what to send back."""

    transport: Any

    def __init__(self, factory: BackendFactory) -> None:
        self.f = factory
        self.buffer = bytearray()
        self.switched = False  # answered 101: raw bytes from now on

    def connectionMade(self) -> None:
        self.f.connections += 1
        self.f.live.append(self)

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        self.f.received += data
        self.f.respond(self)

    def connectionLost(self, reason: Any = None) -> None:
        self.f.live.remove(self)


class BackendFactory(Factory):
    noisy = False

    def __init__(self, respond: Any) -> None:
        self.respond = respond
        self.connections = 0
        self.received = bytearray()
        self.live: list[Backend] = []

    def buildProtocol(self, addr: Any) -> Backend:
        return Backend(self)


def fixed_response(body: bytes = b"hello") -> Any:
    """Answer each complete (bodiless) request with ``body``; keep the connection."""

    def respond(conn: Backend) -> None:
        while b"\r\n\r\n" in conn.buffer:
            _, _, rest = bytes(conn.buffer).partition(b"\r\n\r\n")
            conn.buffer = bytearray(rest)
            assert conn.transport is not None
            conn.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )

    return respond


def take_request(conn: Backend) -> tuple[bytes, bytes] | None:
    """The next whole request (its head, its ``Content-Length`` body) off ``conn``'s buffer, or
    None while it is not all there."""
    head, sep, rest = bytes(conn.buffer).partition(b"\r\n\r\n")
    if not sep:
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if len(rest) < length:
        return None
    conn.buffer = bytearray(rest[length:])
    return head, rest[:length]


class Echo(Resource):
    """twisted.web backend: reports the request it saw."""

    isLeaf = True

    def render(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "method": request.method.decode(),
                "uri": request.uri.decode(),
                "headers": {
                    k.decode().lower(): [v.decode() for v in vs]
                    for k, vs in request.requestHeaders.getAllRawHeaders()
                },
                "body_length": len(request.content.read()),
            }
        ).encode()


@implementer(IPushProducer)
class Firehose:
    """Writes as fast as its consumer allows and counts what it wrote."""

    def __init__(self, transport: Any, total: int, chunk: int = 65536) -> None:
        self.transport = transport
        self.remaining = total
        self.chunk = b"x" * chunk
        self.paused = False
        self.pauses = 0
        self.written = 0
        transport.registerProducer(self, True)
        reactor.callLater(0, self._pump)

    def _pump(self) -> None:
        while not self.paused and self.remaining > 0:
            piece = self.chunk[: min(len(self.chunk), self.remaining)]
            self.remaining -= len(piece)
            self.written += len(piece)
            self.transport.write(piece)
        if self.remaining <= 0:
            self.transport.unregisterProducer()

    def pauseProducing(self) -> None:
        self.paused = True
        self.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False
        reactor.callLater(0, self._pump)

    def stopProducing(self) -> None:
        self.remaining = 0


class EchoSocket:
    """WebSocket echo for the upgrade tests (twisted.web.websocket on the backend)."""

    def negotiationStarted(self, transport: WebSocketTransport) -> None:
        self.transport = transport

    def negotiationFinished(self) -> None:
        pass

    def textMessageReceived(self, data: str) -> None:
        self.transport.sendTextMessage("echo:" + data)

    def bytesMessageReceived(self, data: bytes) -> None:
        self.transport.sendBytesMessage(data)

    def pongReceived(self, payload: bytes) -> None:
        pass

    def connectionLost(self, reason: Any) -> None:
        pass


class EchoFactory:
    def buildProtocol(self, request: Any) -> EchoSocket:
        return EchoSocket()


class ProxyTestCase(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pr", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.sock = os.path.join(self.dir, "s.sock")
        self.observer = Observer()
        self.router = StaticRouter({HOST: LocalSocket(HOST, self.sock)}, self.observer)

    @inlineCallbacks
    def backend(self, factory: Any, path: str | None = None):
        port = yield UNIXServerEndpoint(reactor, path or self.sock).listen(factory)
        self.addCleanup(port.stopListening)
        return port

    secure = False  # listen with TLS, as the HTTPS listener does (lchat.tls, SNI certificates)

    @inlineCallbacks
    def proxy(self, **cfg: Any):
        self.factory = ProxyFactory(reactor, self.router, ProxyConfig(**cfg), secure=self.secure)
        store = None
        if self.secure:
            self.ca = TestCA()
            certs = os.path.join(self.dir, "certs")
            os.makedirs(certs, mode=0o700)
            self.ca.write(certfiles.cert_path(certs, HOST), HOST)
            store = tls.CertStore(
                reactor, certs, {HOST}.__contains__, run_in_thread=thread_runner(reactor)
            )
            store.load_initial()
        port = yield listen(self.factory, store=store)
        self.addCleanup(port.stopListening)
        self.addCleanup(self.factory.close)
        self.addCleanup(self.proxy_side_closed)
        self.port = port.getHost().port
        return self.port

    @inlineCallbacks
    def proxy_side_closed(self):
        """Cleanups run last-added first: clients are aborted by now; wait for our side."""
        yield self.until(lambda: not self.factory.connections)

    @inlineCallbacks
    def connect(self):
        client = RawClient()
        endpoint: Any = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        if self.secure:
            trust = Certificate.loadPEM(self.ca.pem)
            endpoint = wrapClientTLS(optionsForClientTLS(HOST, trustRoot=trust), endpoint)
        yield endpoint.connect(ClientFactory.forProtocol(lambda: client))
        self.addCleanup(
            lambda: client.transport.abortConnection() if not client.is_closed else None
        )
        return client

    @inlineCallbacks
    def until(self, predicate: Any, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {predicate}")
            yield sleep(0.01)

    def responses(self, raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
        """Parse complete responses (Content-Length or chunked) out of a byte stream."""
        out = []
        data = bytes(raw)
        while data:
            head, sep, rest = data.partition(b"\r\n\r\n")
            if not sep:
                break
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.decode().lower()] = value.decode().strip()
            if 100 <= status < 200:
                out.append((status, headers, b""))
                data = rest
                continue
            if headers.get("transfer-encoding") == "chunked":
                body = bytearray()
                while True:
                    size_line, _, rest = rest.partition(b"\r\n")
                    size = int(size_line, 16)
                    if size == 0:
                        rest = rest[2:]
                        break
                    body += rest[:size]
                    rest = rest[size + 2 :]
                out.append((status, headers, bytes(body)))
                data = rest
            else:
                n = int(headers.get("content-length", len(rest)))
                out.append((status, headers, rest[:n]))
                data = rest[n:]
        return out


class KeepAliveTests(ProxyTestCase):
    @inlineCallbacks
    def test_keep_alive_on_both_sides(self):
        backend = BackendFactory(fixed_response(b"hi"))
        yield self.backend(backend)
        yield self.proxy()
        client = yield self.connect()
        for i in range(3):
            client.transport.write(b"GET /%d HTTP/1.1\r\nHost: %s\r\n\r\n" % (i, HOST.encode()))
            yield self.until(lambda i=i: len(self.responses(client.received)) == i + 1)
        self.assertEqual([r[2] for r in self.responses(client.received)], [b"hi"] * 3)
        self.assertEqual(backend.connections, 1)  # one upstream connection, reused
        self.assertFalse(client.is_closed)  # and one downstream connection
        # A second client reuses the same idle upstream connection too.
        other = yield self.connect()
        other.transport.write(b"GET /x HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(other.received)) == 1)
        self.assertEqual(backend.connections, 1)

    @inlineCallbacks
    def test_pipelined_requests_are_answered_in_order(self):
        yield self.backend(Site(Echo()))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(
            b"".join(
                b"GET /p%d HTTP/1.1\r\nHost: %s\r\n\r\n" % (i, HOST.encode()) for i in range(4)
            )
        )
        yield self.until(lambda: len(self.responses(client.received)) == 4)
        uris = [json.loads(r[2])["uri"] for r in self.responses(client.received)]
        self.assertEqual(uris, ["/p0", "/p1", "/p2", "/p3"])

    @inlineCallbacks
    def test_http10_client_gets_a_closed_connection(self):
        yield self.backend(Site(Echo()))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(b"GET /old HTTP/1.0\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield client.closed
        self.assertTrue(client.received.startswith(b"HTTP/1.1 200"))
        self.assertIn(b"/old", client.received)

    @inlineCallbacks
    def test_forwarding_headers_internal_headers_and_host(self):
        yield self.backend(Site(Echo()))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(
            b"GET /h HTTP/1.1\r\nHost: Chat.Example.com\r\nX-Forwarded-For: 10.1.2.3\r\n"
            b"X-Lchat-Sidecar: 1\r\nx-lchat-mesh-forwarded: forged\r\nConnection: keep-alive, X-Drop\r\n"
            b"X-Drop: secret\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Authorization: x\r\n\r\n"
        )
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        seen = json.loads(self.responses(client.received)[0][2])["headers"]
        self.assertEqual(seen["host"], ["Chat.Example.com"])
        self.assertEqual(seen["x-forwarded-for"], ["10.1.2.3, 127.0.0.1"])
        self.assertEqual(seen["x-forwarded-proto"], ["http"])
        for name in ("x-lchat-sidecar", "x-lchat-mesh-forwarded", "x-drop", "keep-alive", "te"):
            self.assertNotIn(name, seen)
        self.assertNotIn("proxy-authorization", seen)
        head = self.router.heads[0]
        self.assertTrue(head.sidecar)
        self.assertEqual(head.forwarded, b"forged")
        self.assertEqual(head.host, "chat.example.com")


class FramingTests(ProxyTestCase):
    @inlineCallbacks
    def test_chunked_request_and_response(self):
        def respond(conn: Backend) -> None:
            data = bytes(conn.buffer)
            if not data.endswith(b"0\r\n\r\n"):
                return
            conn.buffer.clear()
            assert conn.transport is not None
            conn.transport.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            )

        backend = BackendFactory(respond)
        yield self.backend(backend)
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(
            b"POST /c HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % HOST.encode()
        )
        client.transport.write(b"3\r\nabc\r\n")
        yield sleep(0.05)
        client.transport.write(b"2\r\nde\r\n0\r\n\r\n")
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        status, headers, body = self.responses(client.received)[0]
        self.assertEqual(
            (status, headers.get("transfer-encoding"), body), (200, "chunked", b"hello world")
        )
        sent = bytes(backend.received)
        self.assertIn(b"Transfer-Encoding: chunked\r\n", sent)
        self.assertNotIn(b"Content-Length", sent)
        body_part = sent.split(b"\r\n\r\n", 1)[1]
        self.assertEqual(body_part, b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")

    @inlineCallbacks
    def test_close_delimited_upstream_body_is_chunked_downstream(self):
        def respond(conn: Backend) -> None:
            if b"\r\n\r\n" in conn.buffer:
                assert conn.transport is not None
                conn.transport.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
                conn.transport.loseConnection()

        yield self.backend(BackendFactory(respond))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        status, headers, body = self.responses(client.received)[0]
        self.assertEqual(
            (status, headers["transfer-encoding"], body), (200, "chunked", b"until the end")
        )
        self.assertFalse(client.is_closed)  # our framing lets the client keep its connection

    @inlineCallbacks
    def test_head_response_has_no_body_and_the_connection_stays_usable(self):
        def respond(conn: Backend) -> None:
            if b"\r\n\r\n" in conn.buffer:
                conn.buffer.clear()
                assert conn.transport is not None
                conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")

        yield self.backend(BackendFactory(respond))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(b"HEAD / HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: b"\r\n\r\n" in client.received)
        yield sleep(0.05)
        self.assertTrue(client.received.endswith(b"Content-Length: 1000\r\n\r\n"))
        client.received.clear()
        client.transport.write(b"HEAD /again HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: b"\r\n\r\n" in client.received)
        self.assertTrue(client.received.startswith(b"HTTP/1.1 200"))

    @inlineCallbacks
    def test_expect_100_continue(self):
        yield self.backend(Site(Echo()))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(
            b"PUT /up HTTP/1.1\r\nHost: %s\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
            % HOST.encode()
        )
        yield self.until(lambda: b"100 Continue" in client.received)
        self.assertTrue(client.received.startswith(b"HTTP/1.1 100 Continue\r\n"))
        client.transport.write(b"12345")
        yield self.until(lambda: len(self.responses(client.received)) == 2)
        final = self.responses(client.received)[1]
        self.assertEqual(final[0], 200)
        self.assertEqual(json.loads(final[2])["body_length"], 5)

    @inlineCallbacks
    def test_informational_heads_lose_internal_headers_like_final_ones(self):
        # A space's 103 Early Hints (and a 100 Continue) carrying the router's internal markers:
        # none reaches the client, whether the final head comes in the same read or a later one.
        internal = (
            b"X-Lchat-Sidecar: 1\r\nX-Lchat-Mesh-Forwarded: forged\r\nX-Lchat-Refused: stopping\r\n"
            b"X_Lchat_Sidecar: 1\r\n"
        )

        def respond(conn: Backend) -> None:
            if b"\r\n\r\n" not in conn.buffer:
                return
            together = b"/together" in conn.buffer
            conn.buffer.clear()
            assert conn.transport is not None
            hints = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n%s\r\n" % internal
            cont = b"HTTP/1.1 100 Continue\r\n%s\r\n" % internal
            final = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n%s\r\nok" % internal
            if together:
                conn.transport.write(cont + hints + final)
            else:
                conn.transport.write(hints)
                reactor.callLater(0.05, conn.transport.write, final)

        yield self.backend(BackendFactory(respond))
        yield self.proxy()
        for path in (b"/together", b"/apart"):
            client = yield self.connect()
            client.transport.write(b"GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path, HOST.encode()))
            yield self.until(lambda c=client: c.received.endswith(b"\r\n\r\nok"))
            received = bytes(client.received)
            self.assertIn(b"HTTP/1.1 103 Early Hints\r\n", received)
            self.assertIn(b"Link: </a.css>; rel=preload\r\n", received)  # the hint itself stays
            self.assertNotIn(b"x-lchat", received.lower(), received)
            self.assertNotIn(b"x_lchat", received.lower(), received)

    @inlineCallbacks
    def test_upstream_answering_before_the_body_closes_the_client(self):
        def respond(conn: Backend) -> None:
            if b"\r\n\r\n" in conn.buffer and not conn.f.live[0].buffer.endswith(b"done"):
                conn.buffer.clear()
                assert conn.transport is not None
                conn.transport.write(
                    b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 3\r\n\r\nbig"
                )

        yield self.backend(BackendFactory(respond))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(
            b"POST /big HTTP/1.1\r\nHost: %s\r\nContent-Length: 100000000\r\n\r\n" % HOST.encode()
        )
        client.transport.write(b"x" * 1000)
        yield client.closed
        status, headers, body = self.responses(client.received)[0]
        self.assertEqual((status, body, headers.get("connection")), (413, b"big", "close"))


class BackpressureTests(ProxyTestCase):
    @inlineCallbacks
    def test_slow_client_pauses_the_upstream(self):
        total = 64 * 1024 * 1024
        hoses: list[Firehose] = []

        def respond(conn: Backend) -> None:
            if b"\r\n\r\n" in conn.buffer and not hoses:
                assert conn.transport is not None
                conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
                hoses.append(Firehose(conn.transport, total))

        yield self.backend(BackendFactory(respond))
        yield self.proxy()
        client = yield self.connect()
        client.transport.pauseProducing()  # a client that stops reading
        client.transport.write(b"GET /big HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: hoses and hoses[0].paused, timeout=10)
        yield sleep(0.5)
        written = hoses[0].written
        self.assertTrue(hoses[0].paused)
        # Socket buffers and one transport buffer at most, nowhere near the whole body.
        self.assertLess(written, 16 * 1024 * 1024)
        yield sleep(0.3)
        self.assertEqual(hoses[0].written, written)  # still stopped while the client is
        client.transport.resumeProducing()
        yield self.until(lambda: len(client.received) >= total, timeout=60)
        self.assertEqual(hoses[0].written, total)

    @inlineCallbacks
    def test_slow_upstream_pauses_the_client_upload(self):
        backends: list[Backend] = []

        def respond(conn: Backend) -> None:
            if not backends:
                backends.append(conn)
                assert conn.transport is not None
                conn.transport.pauseProducing()  # a space that stops reading the body

        yield self.backend(BackendFactory(respond))
        yield self.proxy()
        client = yield self.connect()
        total = 64 * 1024 * 1024
        client.transport.write(
            b"POST /up HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n" % (HOST.encode(), total)
        )
        hose = Firehose(client.transport, total)
        yield self.until(lambda: hose.paused, timeout=10)
        yield sleep(0.5)
        sent = hose.written
        self.assertTrue(hose.paused)
        self.assertLess(sent, 16 * 1024 * 1024)
        yield sleep(0.3)
        self.assertEqual(hose.written, sent)
        backends[0].transport.resumeProducing()
        yield self.until(lambda: len(backends[0].buffer) >= total, timeout=60)
        backends[0].transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        yield self.until(lambda: b"204" in client.received)


class DialRetryTests(ProxyTestCase):
    @inlineCallbacks
    def test_backend_appearing_late_is_reached(self):
        yield self.proxy(dial_retry=5.0)
        client = yield self.connect()
        started = time.monotonic()
        client.transport.write(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield sleep(2.0)
        self.assertEqual(client.received, b"")  # still waiting, not failed
        yield self.backend(BackendFactory(fixed_response(b"late")))
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        self.assertEqual(self.responses(client.received)[0][2], b"late")
        self.assertGreaterEqual(time.monotonic() - started, 2.0)

    @inlineCallbacks
    def test_502_after_the_window(self):
        yield self.proxy(dial_retry=1.0)
        client = yield self.connect()
        started = time.monotonic()
        client.transport.write(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(client.received)) == 1, timeout=5)
        elapsed = time.monotonic() - started
        self.assertEqual(self.responses(client.received)[0][0], 502)
        self.assertGreaterEqual(elapsed, 0.9)
        self.assertLess(elapsed, 3.0)


class UpgradeTests(ProxyTestCase):
    @inlineCallbacks
    def test_websocket_echo_through_the_proxy(self):
        root = Resource()
        root.putChild(b"ws", WebSocketResource(cast(Any, EchoFactory())))
        yield self.backend(Site(root))
        yield self.proxy()

        def talk() -> list[str]:
            from websockets.sync.client import connect

            sock = socket.create_connection(("127.0.0.1", self.port))
            with connect(f"ws://{HOST}/ws", sock=sock, open_timeout=5) as ws:
                replies = []
                for text in ("one", "two", "x" * 100_000):
                    ws.send(text)
                    replies.append(str(ws.recv(timeout=5)))
                return replies

        replies = yield deferToThread(talk)
        self.assertEqual(replies, ["echo:one", "echo:two", "echo:" + "x" * 100_000])
        yield self.until(lambda: ("end", "/ws") in self.observer.events)
        # In flight from the handshake until the socket closed, not just for the 101.
        self.assertEqual(self.observer.upgrades, [True, True], "a tunnel is an upgrade")
        self.assertEqual(self.observer.events, [("start", "/ws"), ("end", "/ws")])

    @inlineCallbacks
    def test_upgrade_refused_by_the_space_is_relayed_and_closed(self):
        yield self.backend(Site(Echo()))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(
            b"GET /no HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
            % HOST.encode()
        )
        yield client.closed
        self.assertTrue(client.received.startswith(b"HTTP/1.1 200"))


UPGRADE_REQUEST = (
    b"GET /ws HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    % HOST.encode()
)
SWITCHED = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"


def switch_then_echo(conn: Backend) -> None:
    """A space that answers an upgrade with 101 and then echoes raw bytes."""
    if not conn.switched:
        _, sep, rest = bytes(conn.buffer).partition(b"\r\n\r\n")
        if not sep:
            return
        conn.switched = True
        conn.buffer = bytearray(rest)
        conn.transport.write(SWITCHED)
    if conn.buffer:
        conn.transport.write(bytes(conn.buffer))
        conn.buffer.clear()


# The same, as a process of its own that a test can SIGKILL (argv[1]: the unix socket path).
KILLABLE_SPACE = """
import socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(8)
conn, _ = server.accept()
data = b""
while b"\\r\\n\\r\\n" not in data:
    data += conn.recv(65536)
conn.sendall(b"HTTP/1.1 101 Switching Protocols\\r\\nConnection: Upgrade\\r\\nUpgrade: websocket\\r\\n\\r\\n")
while True:
    piece = conn.recv(65536)
    if not piece:
        break
    conn.sendall(piece)
"""


class TunnelCloseTests(ProxyTestCase):
    """Either side of an upgraded (101) connection closing or dying closes the other side at once,
    and ends the request for the observer (a hibernating space must not stay in flight)."""

    @inlineCallbacks
    def tunnel(self):
        """A client with an upgraded connection through the proxy that has echoed once."""
        client = yield self.connect()
        client.transport.write(UPGRADE_REQUEST + b"ping")
        yield self.until(lambda: bytes(client.received) == SWITCHED + b"ping")
        self.assertEqual(self.observer.in_flight, 1)
        return client

    @inlineCallbacks
    def closed_within(self, client: RawClient, since: float, what: str):
        yield self.until(lambda: client.is_closed, timeout=5)
        elapsed = client.closed_at - since
        _log.info(
            "{what}: client closed after {ms:.1f} ms (tls={tls})",
            what=what,
            ms=elapsed * 1000,
            tls=self.secure,
        )
        # A browser saw nothing for 10 s+ over TLS; this is normally a few milliseconds.
        self.assertLess(elapsed, 1.0, f"{what}: the client saw the close after {elapsed:.2f}s")
        yield self.until(lambda: self.observer.in_flight == 0, timeout=1)
        yield self.until(lambda: not self.factory.connections, timeout=1)
        return elapsed

    @inlineCallbacks
    def test_space_closing_the_tunnel_closes_the_client(self):
        backend = BackendFactory(switch_then_echo)
        yield self.backend(backend)
        yield self.proxy()
        client = yield self.tunnel()
        (space,) = backend.live
        started = time.monotonic()
        space.transport.loseConnection()
        yield self.closed_within(client, started, "space closed")
        self.assertEqual(self.observer.events, [("start", "/ws"), ("end", "/ws")])

    @inlineCallbacks
    def test_space_killed_disconnects_the_client(self):
        space = subprocess.Popen([sys.executable, "-c", KILLABLE_SPACE, self.sock])
        self.addCleanup(space.wait)
        self.addCleanup(space.kill)  # (a no-op once it has been killed and reaped)
        yield self.until(lambda: os.path.exists(self.sock), timeout=10)
        yield self.proxy()
        client = yield self.tunnel()
        started = time.monotonic()
        space.send_signal(signal.SIGKILL)
        yield self.closed_within(client, started, "space killed")

    @inlineCallbacks
    def test_client_closing_the_tunnel_closes_the_space_side(self):
        backend = BackendFactory(switch_then_echo)
        yield self.backend(backend)
        yield self.proxy()
        client = yield self.tunnel()
        client.transport.loseConnection()
        yield self.until(lambda: not backend.live, timeout=1)
        yield self.until(lambda: self.observer.in_flight == 0, timeout=1)
        self.assertEqual(self.observer.events, [("start", "/ws"), ("end", "/ws")])

    @inlineCallbacks
    def test_websocket_client_sees_the_space_close(self):
        """What a browser does: a WebSocket client library, the space closing with a Close frame."""
        sockets: list[EchoSocket] = []

        class Recording(EchoFactory):
            def buildProtocol(self, request: Any) -> EchoSocket:
                sockets.append(EchoSocket())
                return sockets[-1]

        root = Resource()
        root.putChild(b"ws", WebSocketResource(cast(Any, Recording())))
        yield self.backend(Site(root))
        yield self.proxy()
        started: list[float] = []

        def close_space() -> None:
            started.append(time.monotonic())
            sockets[0].transport.loseConnection()

        def talk() -> float:
            import ssl

            from websockets.exceptions import ConnectionClosed
            from websockets.sync.client import connect

            sock = socket.create_connection(("127.0.0.1", self.port))
            scheme, context = "ws", None
            if self.secure:
                scheme, context = "wss", ssl.create_default_context(cadata=self.ca.pem.decode())
            with connect(
                f"{scheme}://{HOST}/ws", sock=sock, ssl=context, open_timeout=5, close_timeout=5
            ) as ws:
                ws.send("one")
                assert ws.recv(timeout=5) == "echo:one"
                reactor.callFromThread(close_space)
                try:
                    ws.recv(timeout=5)
                except ConnectionClosed:
                    return time.monotonic()
                except TimeoutError:
                    raise AssertionError("no close seen for 5 s") from None
            raise AssertionError("the space sent something instead of closing")

        closed = yield deferToThread(talk)
        elapsed = closed - started[0]
        _log.info("websocket client saw the close after {ms:.1f} ms", ms=elapsed * 1000)
        self.assertLess(elapsed, 1.0, f"the client saw the close after {elapsed:.2f}s")
        yield self.until(lambda: self.observer.in_flight == 0, timeout=1)


class TLSTunnelCloseTests(TunnelCloseTests):
    """The same through the HTTPS listener: Twisted's TLS layer postpones a close while a producer
    is registered on the transport, so the proxy must unregister before closing."""

    secure = True


def tls_exchange(ca_pem: str, port: int, request: bytes) -> tuple[bytes, str, ssl.SSLSocket]:
    """A blocking TLS client (run it in a thread): send ``request``, read until the server's
    close: (what was read, how it ended, the socket — still open, its own close_notify not sent:
    the caller closes it). "close_notify": the server closed cleanly; anything else names the
    error (a close without close_notify, a reset)."""
    context = ssl.create_default_context(cadata=ca_pem)
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock = context.wrap_socket(raw, server_hostname=HOST, suppress_ragged_eofs=False)
    sock.sendall(request)
    received = bytearray()
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return bytes(received), "close_notify", sock
            received += chunk
    except OSError as e:  # ssl.SSLEOFError: closed without close_notify; a reset
        return bytes(received), type(e).__name__, sock


class TLSCloseTests(ProxyTestCase):
    """A TLS client that said it closes (``Connection: close``, or HTTP/1.0) gets its answer and
    our close_notify, and the connection is closed at once, as nginx closes it: the router does
    not wait for the client's close_notify (ClientConnection._close_tls_now). A close the router
    decides on while the client may still be sending (its pipelining limit) is the graceful one,
    which reads on: closing with unread bytes would reset the connection."""

    secure = True
    # An answer beyond CLOSE_NOW_LIMIT, relayed the general way: written first, then closed at
    # once if it has all left both transports by the end, else by the SSL transport's own close.
    BIG = 200 * 1024

    def respond(self, conn: Backend) -> None:
        while (request := take_request(conn)) is not None:
            head, _ = request
            body = b"b" * self.BIG if head.startswith(b"GET /big") else b"hello"
            conn.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )

    def closed_at_once(self) -> float:
        """``lchat_tls_closed_at_once_total``, as the front door's collector reports it."""
        registry = CollectorRegistry()
        registry.register(self.factory.state.collector)
        return registry.get_sample_value("lchat_tls_closed_at_once_total") or 0.0

    @inlineCallbacks
    def serve(self, **cfg: Any) -> Any:
        yield self.backend(BackendFactory(self.respond))
        yield self.proxy(**cfg)
        # A request kept alive first: its space connection is pooled, so that the next request
        # takes the one-read path (recognised whole, answered whole: lchat.proxy.hot).
        client = yield self.connect()
        client.transport.write(b"GET /warm HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        client.transport.loseConnection()
        yield self.until(lambda: len(self.factory.connections) == 0)

    @inlineCallbacks
    def exchange(self, request: bytes) -> Any:
        got, ended, sock = yield deferToThread(
            tls_exchange, self.ca.pem.decode(), self.port, request
        )
        self.addCleanup(sock.close)
        return got, ended

    @inlineCallbacks
    def assertClosedAtOnce(self, request: bytes, body: bytes = b"hello") -> Any:
        before = self.closed_at_once()
        got, ended = yield self.exchange(request)
        ((status, headers, answer),) = self.responses(got)
        self.assertEqual((status, headers.get("connection"), answer), (200, "close", body))
        self.assertEqual(ended, "close_notify")
        # The client has neither answered our close_notify nor closed: the router is done
        # with the connection all the same (it used to wait for the client's close_notify).
        yield self.until(lambda: not self.factory.connections, timeout=2.0)
        self.assertEqual(self.closed_at_once(), before + 1)

    @inlineCallbacks
    def test_a_request_answered_whole(self):
        yield self.serve()
        request = b"GET /x HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % HOST.encode()
        one_read = self.factory.state.stats.one_read
        yield self.assertClosedAtOnce(request)
        self.assertEqual(self.factory.state.stats.one_read, one_read + 1)  # (the path taken)

    @inlineCallbacks
    def test_a_request_with_a_body(self):
        yield self.serve()
        request = (
            b"POST /x HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n"
            b"Content-Length: 5\r\n\r\nabcde" % HOST.encode()
        )
        yield self.assertClosedAtOnce(request)

    @inlineCallbacks
    def test_an_http10_request(self):
        yield self.serve()
        yield self.assertClosedAtOnce(b"GET /x HTTP/1.0\r\nHost: %s\r\n\r\n" % HOST.encode())

    @inlineCallbacks
    def test_clients_that_answer_the_close_at_once_leave_nothing_behind(self):
        """As wrk and browsers do: the client's close_notify (and its FIN) arrive as the router
        closes, or just after. Whichever comes first, nothing fails in the loop, and every
        connection is gone."""
        yield self.serve()
        loop = uvloop_reactor.loop_of(reactor)
        errors: list[dict[str, Any]] = []
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        self.addCleanup(loop.set_exception_handler, previous)
        before = self.closed_at_once()
        request = b"GET /x HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % HOST.encode()
        pem, port = self.ca.pem.decode(), self.port

        def twenty() -> list[tuple[bytes, str]]:
            results = []
            for _ in range(20):
                got, ended, sock = tls_exchange(pem, port, request)
                try:
                    sock.unwrap()  # our close_notify, at once
                except OSError:
                    pass  # (the router may have closed already: a reset)
                sock.close()
                results.append((got, ended))
            return results

        results = yield deferToThread(twenty)
        for got, ended in results:
            self.assertEqual([r[0] for r in self.responses(got)], [200])
            self.assertEqual(ended, "close_notify")
        yield self.until(lambda: not self.factory.connections)
        self.assertEqual(errors, [])
        self.assertEqual(self.closed_at_once(), before + 20)

    @inlineCallbacks
    def test_a_uvloop_whose_ssl_protocol_cannot_be_made_here_serves_as_before(self):
        """Should a uvloop's SSLProtocol take other arguments, TLS is handed to uvloop whole, as
        before this close existed: every connection served, the warning said once."""

        def other_arguments(*args: Any, **kw: Any) -> Any:
            raise TypeError("__init__() got an unexpected keyword argument 'server_side'")

        self.patch(tls_accept, "_SSLProtocol", other_arguments)
        said: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if "cannot be made here" in event.get("log_format", ""):
                said.append(str(event["e"]))

        observer = cast(ILogObserver, observe)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        yield self.serve()
        before = self.closed_at_once()
        request = b"GET /x HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % HOST.encode()
        for _ in range(2):
            got, ended = yield self.exchange(request)
            self.assertEqual([r[0] for r in self.responses(got)], [200])
            self.assertEqual(ended, "close_notify")
        self.assertEqual(self.closed_at_once(), before)
        self.assertEqual(len(said), 1, said)

    @inlineCallbacks
    def test_a_big_answer_arrives_whole_then_the_close_notify(self):
        # (Either close: which one depends on the kernel's buffers; the client sees the same.)
        yield self.serve()
        request = b"GET /big HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % HOST.encode()
        got, ended = yield self.exchange(request)
        ((status, _, answer),) = self.responses(got)
        self.assertEqual((status, len(answer), ended), (200, self.BIG, "close_notify"))

    @inlineCallbacks
    def test_a_close_the_router_decides_on_reads_on(self):
        """Past its pipelining limit the router answers the last request it takes with
        ``Connection: close``; the client's further requests are unread: the close waits for
        the client's close_notify (reading and dropping), so no reset destroys the answers."""
        yield self.serve(max_pipelined=2)
        before = self.closed_at_once()
        requests = b"".join(
            b"GET /p%d HTTP/1.1\r\nHost: %s\r\n\r\n" % (i, HOST.encode()) for i in range(5)
        )
        got, ended = yield self.exchange(requests)
        answers = self.responses(got)  # (the one served, and the two it queued)
        self.assertEqual([a[0] for a in answers], [200, 200, 200])
        self.assertEqual(answers[-1][1].get("connection"), "close")
        self.assertEqual(ended, "close_notify")
        self.assertEqual(self.closed_at_once(), before)


class StalledUploadCloseTests(ProxyTestCase):
    """The router closing a client connection while a response streams (the upload under it
    stalled): the close must happen, over TLS too (a producer was still registered there)."""

    @inlineCallbacks
    def test_stalled_upload_under_a_streaming_answer_is_closed(self):
        def answer_at_once(conn: Backend) -> None:
            if b"\r\n\r\n" in conn.buffer and not conn.switched:
                conn.switched = True  # (answered; a response that never ends)
                conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\npartial")

        backend = BackendFactory(answer_at_once)
        yield self.backend(backend)
        yield self.proxy(keepalive_timeout=0.5)  # also the longest pause inside a request body
        client = yield self.connect()
        client.transport.write(
            b"POST /up HTTP/1.1\r\nHost: %s\r\nContent-Length: 100\r\n\r\n0123456789"
            % HOST.encode()
        )
        yield self.until(lambda: b"partial" in client.received)
        started = time.monotonic()
        yield self.until(lambda: client.is_closed, timeout=5)
        elapsed = client.closed_at - started
        _log.info("stalled upload: closed after {s:.2f}s (tls={tls})", s=elapsed, tls=self.secure)
        self.assertLess(elapsed, 3.0)
        yield self.until(lambda: not backend.live, timeout=1)


class TLSStalledUploadCloseTests(StalledUploadCloseTests):
    secure = True


class PeerTests(ProxyTestCase):
    """RemotePeer: TLS to another box, verified against the space's name, pinned to an address."""

    def make_ca(self) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test ca")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def leaf(self, ca_key: Any, ca_cert: Any, name: str) -> PrivateCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return PrivateCertificate.loadPEM(pem)

    @inlineCallbacks
    def peer(self, cert_name: str):
        ca_key, ca_cert = self.make_ca()
        server_cert = self.leaf(ca_key, ca_cert, cert_name)
        options = CertificateOptions(
            privateKey=server_cert.privateKey.original,
            certificate=server_cert.original,
            acceptableProtocols=[b"http/1.1"],
        )
        endpoint = wrapServerTLS(options, serverFromString(reactor, "tcp:0:interface=127.0.0.1"))
        port = yield endpoint.listen(Site(Echo()))
        self.addCleanup(port.stopListening)
        trust = client_tls_context()
        trust.load_verify_locations(
            cadata=ca_cert.public_bytes(serialization.Encoding.PEM).decode("ascii")
        )
        return port.getHost().port, trust

    @inlineCallbacks
    def test_forward_to_a_peer_verifies_the_space_name(self):
        peer_port, trust = yield self.peer(HOST)
        self.router.targets[HOST] = RemotePeer(
            HOST, "127.0.0.1", peer_port, HOST, add_headers=((b"X-Lchat-Mesh-Forwarded", b"mac"),)
        )
        yield self.proxy()
        self.factory.pool._tls_context = trust
        client = yield self.connect()
        client.transport.write(b"GET /peer HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        status, _, body = self.responses(client.received)[0]
        self.assertEqual(status, 200)
        seen = json.loads(body)
        self.assertEqual(seen["headers"]["host"], [HOST])
        self.assertEqual(seen["headers"]["x-lchat-mesh-forwarded"], ["mac"])

    @inlineCallbacks
    def test_a_peer_with_the_wrong_certificate_gets_nothing(self):
        peer_port, trust = yield self.peer("other.example.com")
        self.router.targets[HOST] = RemotePeer(HOST, "127.0.0.1", peer_port, HOST)
        yield self.proxy()
        self.factory.pool._tls_context = trust
        client = yield self.connect()
        client.transport.write(b"GET /peer HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        self.assertEqual(self.responses(client.received)[0][0], 502)


class FailureTests(ProxyTestCase):
    @inlineCallbacks
    def test_upstream_dying_mid_response_aborts_the_client(self):
        def respond(conn: Backend) -> None:
            if b"\r\n\r\n" in conn.buffer:
                assert conn.transport is not None
                conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
                # (abortConnection would drop the unsent bytes: let them go out first)
                reactor.callLater(0.1, conn.transport.abortConnection)

        yield self.backend(BackendFactory(respond))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield client.closed
        self.assertIn(b"partial", client.received)  # what arrived, then the cut: never a lie

    @inlineCallbacks
    def test_the_ticket_sees_start_and_end_and_local_answers_take_none(self):
        yield self.backend(BackendFactory(fixed_response()))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(b"GET /a HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        client.transport.write(b"GET /b HTTP/1.1\r\nHost: nobody.example.com\r\n\r\n")
        yield self.until(lambda: len(self.responses(client.received)) == 2)
        self.assertEqual(self.observer.events, [("start", "/a"), ("end", "/a")])
        self.assertEqual(self.observer.upgrades, [False, False], "a plain request")
        self.assertEqual([r[0] for r in self.responses(client.received)], [200, 404])


class AccessLogTests(ProxyTestCase):
    @inlineCallbacks
    def test_one_structured_line_per_request_when_on(self):
        from twisted.logger import globalLogPublisher

        events: list[dict[str, Any]] = []

        def observe(event: dict[str, Any]) -> None:
            if str(event.get("log_format", "")).startswith("access "):
                events.append(event)

        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))
        yield self.backend(BackendFactory(fixed_response(b"hey")))
        yield self.proxy(access_log=True)
        client = yield self.connect()
        client.transport.write(b"GET /logged?q=1 HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(events) == 1)
        event = events[0]
        self.assertEqual(
            (event["host"], event["method"], event["target"], event["status"], event["bytes"]),
            (HOST, "GET", "/logged?q=1", 200, 3),
        )

    @inlineCallbacks
    def test_silent_when_off(self):
        from twisted.logger import globalLogPublisher

        events: list[dict[str, Any]] = []
        observe = events.append
        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))
        yield self.backend(BackendFactory(fixed_response()))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        self.assertFalse([e for e in events if str(e.get("log_format", "")).startswith("access ")])


class LocalAnswerTests(ProxyTestCase):
    @inlineCallbacks
    def test_a_local_answer_to_a_bodiless_request_keeps_the_connection(self):
        yield self.backend(BackendFactory(fixed_response(b"ok")))
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(b"GET /a HTTP/1.1\r\nHost: nobody.example.com\r\n\r\n")
        yield self.until(lambda: len(self.responses(client.received)) == 1)
        client.transport.write(b"GET /b HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: len(self.responses(client.received)) == 2)
        self.assertEqual([r[0] for r in self.responses(client.received)], [404, 200])
        self.assertNotIn("connection", self.responses(client.received)[0][1])
        self.assertFalse(client.is_closed)

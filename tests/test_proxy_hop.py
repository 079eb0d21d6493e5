"""The hop: a worker process's proxy hands a request to the control process's hop socket, where a
``ProxyFactory(trusted_hop=True)`` serves it (lchat.controlhop). Differential, in one process over
real sockets: whatever a request is, the space receives the very bytes, and the client the very
answer, it would through a single process's proxy; control routes the very head.

The matrix: the client's scheme (the listener's: X-Forwarded-Proto); with and without the
client's own X-Forwarded-For (one line, several); a Content-Length body, a chunked one, an upgrade
(a tunnel through both proxies), a sidecar's marker, a mesh peer's marker, a browser's head, an
nginx-style answer (item 1's spliced heads, through the hop). Then what only the hop does: control's
one-read path is never taken for a hop request, a request without the worker's forwarding headers
is refused, control's drain refusal reaches a forwarding peer through a worker (and a space's
never), the worker waits longer for control than for a space. And the front door's new figures.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, cast
from unittest.mock import patch

import httptools
from attrs import define, field
from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint, UNIXServerEndpoint
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import certfiles, tls
from lchat.config import ProxyConfig
from lchat.controlhop import HopActivator, HopMesh
from lchat.hibernation.space import Budgets
from lchat.proxy import oneread
from lchat.proxy.downstream import HopDownstream, ProxyFactory
from lchat.proxy.exchange import plain_upstream_head
from lchat.proxy.http import REFUSED
from lchat.proxy.relay import HOP_SLACK
from lchat.proxy.state import FrontDoorState
from lchat.reactors import installed
from lchat.registry import Route
from lchat.router import LocalResponse, LocalSocket, RemotePeer, RequestHead, Router, Target, plain
from lchat.threads import thread_runner
from tests.proxy_harness import listen
from tests.test_proxy_oneread import PATTERNS, Rig
from tests.test_router import table_of
from tests.test_tls import TestCA

reactor = installed()
HOST = "sleepy.example.com"
REFUSING = "refusing.example.com"  # control answers it with a drain refusal for a peer
MARKED = "marked.example.com"  # a space that sends X-Lchat-Refused itself
# The space's answer, as nginx heads it (a hop-by-hop line the proxies splice out).
ANSWER = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 3\r\nConnection: keep-alive\r\n\r\nok\n"
)
MARKED_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 3\r\nX-Lchat-Refused: stopping\r\n"
    b"\r\nno\n"
)
SWITCHED = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


# --- the space ----------------------------------------------------------------------------------


class SpaceConnection(Protocol):
    """Records every byte; answers each whole request (ANSWER, or MARKED_ANSWER for MARKED), an
    upgrade with 101 and then echoes what follows."""

    transport: Any

    def __init__(self, space: Space) -> None:
        self.space = space
        self.raw = bytearray()
        self.parser = httptools.HttpRequestParser(self)
        self.switched = False
        self.host = b""

    def connectionMade(self) -> None:
        self.space.connections.append(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"host":
            self.host = value

    def on_message_complete(self) -> None:
        if not self.parser.should_upgrade():
            self.transport.write(MARKED_ANSWER if self.host == MARKED.encode() else ANSWER)

    def dataReceived(self, data: bytes) -> None:
        self.raw += data
        if self.switched:
            self.transport.write(b"echo:" + data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self.switched = True
            self.transport.write(SWITCHED)
            tail = data[int(e.args[0]) :]
            if tail:
                self.transport.write(b"echo:" + tail)


class Space(Factory):
    noisy = False

    def __init__(self) -> None:
        self.connections: list[SpaceConnection] = []

    def buildProtocol(self, addr: Any) -> SpaceConnection:
        return SpaceConnection(self)

    def received(self) -> list[bytes]:
        return [bytes(c.raw) for c in self.connections]


# --- routers ------------------------------------------------------------------------------------


@define
class SpaceRoutes:
    """The router a single process (or control) has for these hosts: HOST and MARKED to the
    space; REFUSING answered with a drain refusal for the peer that forwarded it (as
    lchat.mesh.routing's _refusal_for_peer marks one). Records every head it routes."""

    space: str
    heads: list[RequestHead] = field(factory=list)

    def route(self, head: RequestHead) -> Target:
        self.heads.append(head)
        if head.host == REFUSING:
            response = plain(503, "503 Service Unavailable: the router is stopping")
            return LocalResponse(
                response.status,
                response.body,
                (*response.headers, (REFUSED, b"stopping")),
                refusal="stopping",
            )
        return LocalSocket(head.host, self.space)

    def reroute(self, head: RequestHead, peer: RemotePeer, why: str) -> Target:
        raise AssertionError("no mesh peer is routed to here")


def worker_router(hop: str) -> Router:
    """A worker's router: every host here hibernates, so every request hops to control."""
    rows = [
        Route(host, "instance", "/nonexistent.sock", status="ready", hibernate=True)
        for host in (HOST, REFUSING, MARKED)
    ]
    return Router(table_of(*rows), activator=HopActivator(hop), mesh=HopMesh(hop))


# --- clients ------------------------------------------------------------------------------------


class RawClient(Protocol):
    transport: Any

    def __init__(self) -> None:
        self.received = bytearray()
        self.closed = False

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Any = None) -> None:
        self.closed = True


def complete(data: bytes, method: bytes = b"GET", count: int = 1) -> bool:
    """``data`` holds ``count`` whole responses (or a 101's head)."""
    if data.startswith(b"HTTP/1.1 101 "):
        return b"\r\n\r\n" in data
    done: list[bool] = []

    class Collector:
        def on_message_complete(self) -> None:
            done.append(True)

    parser = httptools.HttpResponseParser(Collector())
    if method == b"HEAD":
        return b"\r\n\r\n" in data
    try:
        parser.feed_data(data)
    except httptools.HttpParserError:
        return False
    return len(done) >= count


GET = b"GET /room/general?x=1 HTTP/1.1\r\nHost: sleepy.example.com\r\nAccept: */*\r\n\r\n"


def with_lines(request: bytes, *lines: bytes) -> bytes:
    added = b"".join(line + b"\r\n" for line in lines)
    return request.replace(b"\r\n\r\n", b"\r\n" + added + b"\r\n", 1)


BROWSER = (
    b"GET /room/general HTTP/1.1\r\nHost: sleepy.example.com\r\nConnection: keep-alive\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) Chrome/131\r\nAccept: text/html\r\n"
    b"Accept-Encoding: gzip, deflate, br\r\nCookie: a=b; lchat_session=x.y.z\r\n\r\n"
)
CASES: dict[str, list[bytes]] = {
    # name: the client's reads (an upgrade's second read goes through the tunnel)
    "plain get": [GET],
    "browser": [BROWSER],
    "head": [GET.replace(b"GET ", b"HEAD ", 1)],
    # (the second on a pooled connection: the worker's one-read path, to the hop target)
    "kept alive": [GET, BROWSER, GET],
    "client xff": [with_lines(GET, b"X-Forwarded-For: 203.0.113.9")],
    "client xff lines": [
        with_lines(
            GET,
            b"X-Forwarded-For: 203.0.113.9",
            b"X-Forwarded-For: 198.51.100.1, 198.51.100.2",
            b"X-Forwarded-Proto: gopher",
            b"Forwarded: for=1.2.3.4",
        )
    ],
    "content-length body": [
        b"POST /api/send HTTP/1.1\r\nHost: sleepy.example.com\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 11\r\n\r\nhello world"
    ],
    "expect 100-continue": [
        b"PUT /api/file HTTP/1.1\r\nHost: sleepy.example.com\r\nExpect: 100-continue\r\n"
        b"Content-Length: 4\r\n\r\nfile"
    ],
    "chunked body": [
        b"POST /api/send HTTP/1.1\r\nHost: sleepy.example.com\r\nTransfer-Encoding: chunked\r\n"
        b"X-Forwarded-For: 203.0.113.9\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    ],
    "upgrade": [
        b"GET /ws HTTP/1.1\r\nHost: sleepy.example.com\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        b"through the tunnel",
    ],
    "sidecar": [with_lines(GET, b"X-Lchat-Sidecar: 1")],
    "mesh forwarded": [
        with_lines(GET, b"X-Lchat-Mesh-Forwarded: v1.token", b"X-Forwarded-For: 1.2.3.4")
    ],
    "sidecar and forwarded": [with_lines(GET, b"X-Lchat-Sidecar: 1", b"X-Lchat-Mesh-Forwarded: t")],
    "marked by the space": [GET.replace(b"Host: sleepy", b"Host: marked")],
}


@define
class Seen:
    """What one run observed: the space's bytes per connection, the client's bytes, the heads
    control (or the single process) routed."""

    space: list[bytes]
    client: bytes
    heads: list[RequestHead]


class HopTestCase(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="hop", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)

    @inlineCallbacks
    def until(self, predicate: Callable[[], bool], timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {predicate}")
            yield sleep(0.005)

    @inlineCallbacks
    def serve(self, factory: Any, address: str = "tcp:0:interface=127.0.0.1"):
        port = yield listen(factory, address)
        self.addCleanup(port.stopListening)
        self.addCleanup(factory.close)
        return port

    @inlineCallbacks
    def space(self, name: str):
        space = Space()
        path = os.path.join(self.dir, name)
        port = yield UNIXServerEndpoint(reactor, path).listen(space)
        self.addCleanup(port.stopListening)
        return space, path

    @inlineCallbacks
    def single(self, secure: bool):
        """A single process: client -> proxy -> space. Returns (port, space, routes)."""
        space, path = yield self.space(f"single-{len(os.listdir(self.dir))}.sock")
        routes = SpaceRoutes(path)
        factory = ProxyFactory(reactor, routes, ProxyConfig(), secure=secure)
        port = yield self.serve(factory)
        return port.getHost().port, space, routes, factory

    @inlineCallbacks
    def hopped(self, secure: bool):
        """A worker and control: client -> worker -> hop.sock -> control -> space."""
        n = len(os.listdir(self.dir))
        space, path = yield self.space(f"space-{n}.sock")
        routes = SpaceRoutes(path)
        hop = os.path.join(self.dir, f"hop-{n}.sock")
        control = ProxyFactory(
            reactor, routes, ProxyConfig(), state=FrontDoorState("requests"), trusted_hop=True
        )
        yield self.serve(control, f"unix:{hop}")
        worker = ProxyFactory(reactor, worker_router(hop), ProxyConfig(), secure=secure)
        port = yield self.serve(worker)
        return port.getHost().port, space, routes, control

    @inlineCallbacks
    def exchange(self, port: int, reads: list[bytes]):
        """Send ``reads`` on a fresh connection, each after the answer to the one before."""
        client = RawClient()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        yield endpoint.connect(ClientFactory.forProtocol(lambda: client))
        method = reads[0].split(b" ", 1)[0]
        tunnel = b"Upgrade: websocket" in reads[0]
        for i, data in enumerate(reads):
            client.transport.write(data)
            if i == 0 or not tunnel:
                answered = i + 1
                yield self.until(
                    lambda n=answered: complete(bytes(client.received), method, n)  # type: ignore[misc]
                )
            else:
                echoed = b"echo:" + data
                yield self.until(
                    lambda e=echoed: bytes(client.received).endswith(e)  # type: ignore[misc]
                )
        client.transport.loseConnection()
        yield self.until(lambda: client.closed)
        return bytes(client.received)

    @inlineCallbacks
    def observe(self, make: Callable[..., Any], secure: bool, reads: list[bytes]):
        port, space, routes, _ = yield make(secure)
        client = yield self.exchange(port, reads)
        yield self.until(lambda: all(c.transport is None or c.raw for c in space.connections))
        return Seen(space.received(), client, routes.heads)


class DifferentialTests(HopTestCase):
    @inlineCallbacks
    def test_the_space_and_the_client_see_what_a_single_process_gives_them(self):
        """Every case of the matrix, both schemes: the same bytes at the space, the same
        answer at the client, the same routed head at control (its client, scheme, markers)."""
        reads_seen: list[bytes] = []
        real = HopDownstream.data_received
        recognise = oneread.request
        recognised: list[bytes] = []

        def reading(conn: HopDownstream, data: bytes) -> None:
            reads_seen.append(data)
            real(conn, data)

        def request(data: bytes, *args: Any) -> Any:
            whole = recognise(data, *args)
            if whole is not None:
                recognised.append(data)
            return whole

        with (
            patch.object(HopDownstream, "data_received", reading),
            patch.object(oneread, "request", request),
        ):
            for name, reads in CASES.items():
                for secure in (False, True):
                    single = yield self.observe(self.single, secure, reads)
                    hopped = yield self.observe(self.hopped, secure, reads)
                    where = f"{name}, {'https' if secure else 'http'}"
                    self.assertEqual(hopped.space, single.space, where)
                    self.assertEqual(hopped.client, single.client, where)
                    self.assertEqual(hopped.heads, single.heads, where)
                    for head in single.heads:
                        self.assertEqual((head.client, head.secure), ("127.0.0.1", secure))
        # Not vacuous: every case reached the space through the hop, with its markers; the
        # worker's one-read path served requests to the hop target too (a pooled connection).
        self.assertTrue(reads_seen)
        self.assertIn(BROWSER, recognised)
        self.assertIn(b"X-Lchat-Sidecar: 1\r\n", b"".join(reads_seen))
        self.assertIn(b"X-Lchat-Mesh-Forwarded: v1.token\r\n", b"".join(reads_seen))
        # Control's one-read path is never taken for a hop request: the recognisers decline
        # every read the worker sent (it always carries X-Forwarded-For: lchat.proxy.http's
        # REQUEST_SPECIAL), and the hop door does not even ask them (HopDownstream).
        for data in reads_seen:
            self.assertIsNone(oneread.request(data, 65536, 100, None), data)
            if data.startswith((b"GET ", b"HEAD ", b"POST ")):  # (not the tunnel's bytes)
                self.assertIn(b"\r\nX-Forwarded-For: ", data.split(b"\r\n\r\n")[0] + b"\r\n")

    @inlineCallbacks
    def test_control_counts_the_hop_requests_with_their_labels(self):
        """Control's hop door reports only lchat_http_requests, by the target control chose;
        the worker counts the same requests as "hop" (the box's merged scrape keeps control's)."""
        port, _, _, control = yield self.hopped(False)
        yield self.exchange(port, [GET])
        registry = CollectorRegistry()
        registry.register(control.state.collector)
        text = generate_latest(registry).decode()
        self.assertIn('lchat_http_requests_total{code="200",host_class="instance"} 1.0', text)
        families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        self.assertEqual(families, {"lchat_http_requests_total"})


class HopOnlyTests(HopTestCase):
    @inlineCallbacks
    def raw_to_hop(self, data: bytes):
        """``data`` straight to a control hop socket, as something other than a worker would."""
        n = len(os.listdir(self.dir))
        space, path = yield self.space(f"space-{n}.sock")
        hop = os.path.join(self.dir, f"hop-{n}.sock")
        control = ProxyFactory(reactor, SpaceRoutes(path), ProxyConfig(), trusted_hop=True)
        yield self.serve(control, f"unix:{hop}")
        client = RawClient()
        yield UNIXClientEndpoint(reactor, hop).connect(ClientFactory.forProtocol(lambda: client))
        client.transport.write(data)
        yield self.until(lambda: complete(bytes(client.received)))
        client.transport.abortConnection()
        return bytes(client.received), space

    @inlineCallbacks
    def test_a_request_without_the_workers_forwarding_headers_is_refused(self):
        for data in (
            GET,  # (the one-read path's shape: not taken on the hop door)
            with_lines(GET, b"X-Forwarded-Proto: https"),
            with_lines(GET, b"X-Forwarded-For: 10.0.0.1"),
            with_lines(GET, b"X-Forwarded-For: 10.0.0.1", b"X-Forwarded-Proto: ftp"),
        ):
            received, space = yield self.raw_to_hop(data)
            self.assertTrue(received.startswith(b"HTTP/1.1 400 "), received)
            self.assertEqual(space.connections, [])

    @inlineCallbacks
    def test_controls_drain_refusal_reaches_the_peer_through_a_worker(self):
        """X-Lchat-Refused on control's own answer passes the worker (its client may be the
        mesh peer that forwarded the request); a space's own is dropped, through the hop as
        through a single process (the differential's "marked by the space" case) and by a
        worker for any target but the hop."""
        port, _, _, _ = yield self.hopped(False)
        forwarded = with_lines(
            GET.replace(b"Host: sleepy", b"Host: refusing"), b"X-Lchat-Mesh-Forwarded: t"
        )
        received = yield self.exchange(port, [forwarded])
        self.assertTrue(received.startswith(b"HTTP/1.1 503 "), received)
        self.assertIn(b"\r\nx-lchat-refused: stopping\r\n", received.lower())
        port, _, _, _ = yield self.single(False)
        received = yield self.exchange(port, [GET.replace(b"Host: sleepy", b"Host: marked")])
        self.assertTrue(received.startswith(b"HTTP/1.1 503 "), received)
        self.assertNotIn(b"x-lchat-refused", received.lower())

    @inlineCallbacks
    def test_a_worker_whose_control_is_gone_says_so(self):
        """The hop socket refusing (control restarting or gone): a 502 naming the router, not
        the space, and a log line naming the hop socket."""
        hop = os.path.join(self.dir, "gone.sock")
        worker = ProxyFactory(reactor, worker_router(hop), ProxyConfig(dial_retry=0.05))
        port = yield self.serve(worker)
        with capture_logs() as logged:
            received = yield self.exchange(port.getHost().port, [GET])
        self.assertTrue(received.startswith(b"HTTP/1.1 502 "), received)
        self.assertIn(b"the router is not answering", received)
        self.assertTrue(any(hop in line and "hop socket" in line for line in logged), logged)

    @inlineCallbacks
    def test_tls_handshakes_are_counted_full_or_resumed(self):
        """A TLS client's second connection with its saved session is counted resumed; every
        connection is counted accepted."""
        ca = TestCA()
        certs = os.path.join(self.dir, "certs")
        os.makedirs(certs, mode=0o700)
        ca.write(certfiles.cert_path(certs, HOST), HOST)
        store = tls.CertStore(
            reactor, certs, {HOST}.__contains__, run_in_thread=thread_runner(reactor)
        )
        store.load_initial()
        _, path = yield self.space("space.sock")
        factory = ProxyFactory(reactor, SpaceRoutes(path), ProxyConfig(), secure=True)
        port = yield listen(factory, store=store)
        self.addCleanup(port.stopListening)
        self.addCleanup(factory.close)
        number = port.getHost().port
        ca_file = os.path.join(self.dir, "ca.pem")
        with open(ca_file, "wb") as f:
            f.write(ca.pem)

        def two_connections() -> list[bool]:
            context = ssl.create_default_context(cafile=ca_file)
            session = None
            reused: list[bool] = []
            for _ in range(2):
                with socket.create_connection(("127.0.0.1", number), timeout=5) as raw:
                    with context.wrap_socket(raw, server_hostname=HOST, session=session) as s:
                        s.sendall(GET)
                        answer = b""
                        while not complete(answer):
                            answer += s.recv(65536)
                        reused.append(bool(s.session_reused))
                        session = s.session
            return reused

        reused = yield deferToThread(two_connections)
        self.assertEqual(reused, [False, True])
        stats = factory.state.stats
        yield self.until(lambda: stats.tls_full + stats.tls_resumed == 2)
        self.assertEqual((stats.accepted, stats.tls_full, stats.tls_resumed), (2, 1, 1))
        registry = CollectorRegistry()
        registry.register(factory.state.collector)
        text = generate_latest(registry).decode()
        self.assertIn('lchat_tls_handshakes_total{resumed="yes"} 1.0', text)
        self.assertIn('lchat_tls_handshakes_total{resumed="no"} 1.0', text)
        self.assertIn("lchat_http_connections_accepted_total 2.0", text)


class ControlsOneReadPathTests(SynchronousTestCase):
    def test_the_recognisers_decline_every_head_a_worker_writes(self):
        """The hop door's guarantee, pinned where the one-read recognisers are defined (item 1
        edits them): a worker's request always carries X-Forwarded-For and X-Forwarded-Proto,
        and both recognisers, the C scanner and the patterns, decline a request with either (it
        would be served as the hop socket's peer's: lchat.proxy.http.REQUEST_SPECIAL)."""
        lines = b"Host: sleepy.example.com\r\nAccept: */*\r\n"
        heads = [
            plain_upstream_head(b"GET", b"/", lines, b"192.0.2.7", b"https"),
            plain_upstream_head(b"HEAD", b"/x?y", lines, b"::1", b"http"),
            plain_upstream_head(b"GET", b"/", b"Host: a.test\r\n", b"unix", b"http"),
            b"GET / HTTP/1.1\r\nHost: a.test\r\nX-Forwarded-For: 1.2.3.4, 10.0.0.1\r\n"
            b"X-Forwarded-Proto: http\r\nX-Lchat-Sidecar: 1\r\n\r\n",
        ]
        for recognise in (oneread.request, PATTERNS.request):
            for head in heads:
                self.assertIsNone(recognise(head, 65536, 100, None), head)
                without = head.replace(b"X-Forwarded-For", b"X-Other-For").replace(
                    b"X-Forwarded-Proto", b"X-Other-Proto"
                )
                if b"X-Lchat" not in head:  # (not vacuous: the same head without them passes)
                    self.assertIsNotNone(recognise(without, 65536, 100, None), without)


class HopDeadlineTests(SynchronousTestCase):
    def test_the_worker_waits_for_control_as_long_as_for_a_wake_and_an_answer(self):
        """A hop target has upstream_timeout plus the activator's queue budget to answer (control
        may hold the request for a wake first, then its own upstream_timeout runs), on the
        one-read path and the general one, with a body or without; a space has upstream_timeout."""
        self.assertEqual(HOP_SLACK, Budgets().queue)
        timeout = ProxyConfig().upstream_timeout
        get = GET.replace(b"sleepy", b"chat")
        post = CASES["content-length body"][0].replace(b"sleepy", b"chat")
        kinds: list[tuple[Literal["instance", "hop"], float]] = [
            ("instance", 0.0),
            ("hop", HOP_SLACK),
        ]
        for kind, slack in kinds:
            for request, general_path in ((get, False), (get, True), (post, False)):
                with self.subTest(kind=kind, request=request[:4], general=general_path):
                    rig = Rig()
                    rig.routes.target = LocalSocket("chat.example.com", "/hop.sock", kind=kind)
                    with general(general_path):
                        rig.request(request, None)
                    rig.clock.advance(timeout - 0.1)
                    self.assertEqual(rig.client_transport.data(), b"")
                    for _ in range(int(slack)):
                        rig.clock.advance(1)
                    self.assertEqual(rig.client_transport.data(), b"")
                    rig.clock.advance(1)
                    self.assertTrue(rig.client_transport.data().startswith(b"HTTP/1.1 504 "))
                    rig.close()


@contextmanager
def capture_logs() -> Iterator[list[str]]:
    """The text of every event logged meanwhile."""
    from twisted.logger import ILogObserver, formatEvent, globalLogPublisher

    lines: list[str] = []

    def record(event: dict[str, Any]) -> None:
        lines.append(formatEvent(event))

    observer = cast(ILogObserver, record)

    globalLogPublisher.addObserver(observer)
    try:
        yield lines
    finally:
        globalLogPublisher.removeObserver(observer)


@contextmanager
def general(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with patch.object(oneread, "request", lambda *args, **kwargs: None):
        yield


class FrontDoorFiguresTests(SynchronousTestCase):
    def test_the_default_report_is_every_figure(self):
        state = FrontDoorState()
        state.stats.count("instance", 200)
        registry = CollectorRegistry()
        registry.register(state.collector)
        families = {
            line.split()[2]
            for line in generate_latest(registry).decode().splitlines()
            if line.startswith("# TYPE")
        }
        self.assertEqual(
            families,
            {
                "lchat_http_requests_total",
                "lchat_http_in_flight",
                "lchat_proxy_bytes_total",
                "lchat_proxy_one_read_responses_total",
                "lchat_upgraded_connections",
                "lchat_http_connections",
                "lchat_http_connections_accepted_total",
                "lchat_tls_handshakes_total",
                "lchat_tls_closed_at_once_total",
                "lchat_upstream_idle_connections",
            },
        )

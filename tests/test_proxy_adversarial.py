"""Adversarial input at the front door: every request the proxy must refuse, smuggling attempts,
internal and hop-by-hop headers, the timeouts, leaks, and a hypothesis fuzz of request heads.

Everything runs over real sockets on the real reactor, against real unix-socket backends that record
every raw byte they receive (tests/proxy_harness.py), so "nothing reached the backend" and "the
backend saw exactly one well-framed request" are checked on the bytes themselves, re-parsed with
httptools. The functional behaviour (streaming, keep-alive, chunked, upgrade...) is in test_proxy.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar, cast

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import (
    TCP4ClientEndpoint,
    UNIXServerEndpoint,
    wrapClientTLS,
)
from twisted.internet.ssl import Certificate, optionsForClientTLS
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.trial.unittest import TestCase

from lchat import certfiles, tls
from lchat.config import ProxyConfig
from lchat.proxy.downstream import Downstream, ProxyFactory
from lchat.router import Router
from lchat.threads import thread_runner
from tests.proxy_harness import (
    FUZZ_CONFIG,
    STATUS_LINE,
    BackendConnection,
    BodyBackend,
    RawClient,
    RawClientFactory,
    RecordingBackend,
    Reply,
    backend_problems,
    blocking_exchange,
    complete_responses,
    idle_connections,
    listen,
    parse_requests,
    response_statuses,
    route_table,
)
from tests.test_tls import TestCA

reactor: Any = _reactor
T = TypeVar("T")

KNOWN = "chat.example.com"  # a backend answering each complete request
EARLY = "early.example.com"  # a backend answering as soon as it has parsed the head
SILENT = "silent.example.com"  # a backend that accepts and never answers
MISSING = "missing.example.com"  # a socket path nobody listens on
MEDIUM = "medium.example.com"  # answers with a body just under Twisted's 64 KiB write buffer
LARGE = "large.example.com"  # answers with a body far larger than any socket buffer
MEDIUM_BODY = 60_000
LARGE_BODY = 64 * 1024 * 1024

HOST = b"Host: chat.example.com"

CFG = ProxyConfig(
    header_timeout=0.5,
    keepalive_timeout=1.0,
    upstream_timeout=0.6,
    dial_retry=0.3,
    max_header_bytes=4096,
    max_headers=20,
)
SLACK = 0.4  # scheduling slack on a loaded machine
GAUGES = ("in_flight", "connections", "upgraded")  # the front door's (lchat.proxy.state)
REFUSALS = frozenset({400, 405, 408, 413, 414, 417, 431, 501, 505})


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


async def until(predicate: Callable[[], bool], within: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await sleep(step)
    return True


def gauges(factory: ProxyFactory) -> dict[str, int]:
    return {name: getattr(factory.state.stats, name) for name in GAUGES}


def request(*headers: bytes, line: bytes = b"GET / HTTP/1.1", body: bytes = b"") -> bytes:
    return line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


class TrackingFactory(ProxyFactory):
    """The real factory; keeps its protocols so teardown can wait for every connection to end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.downstreams: list[Downstream] = []

    def buildProtocol(self, addr: Any) -> Downstream:
        protocol = super().buildProtocol(addr)
        self.downstreams.append(protocol)
        return protocol


def _gone(protocol: Downstream) -> bool:
    return protocol.transport is None or protocol.closed


def buffered_output(transport: Any) -> int:
    """The proxy's unsent output on one client connection."""
    return int(transport.get_write_buffer_size()) if transport is not None else 0


class ProxyCase(TestCase):
    """A proxy on 127.0.0.1:<random> in front of recording backends, torn down without leftovers."""

    cfg: ClassVar[ProxyConfig] = CFG
    secure: ClassVar[bool] = False  # listen with TLS, as the HTTPS listener does
    timeout = 30

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        return Deferred.fromCoroutine(self._set_up())

    def tearDown(self) -> Deferred[None]:  # type: ignore[override]
        return Deferred.fromCoroutine(self._tear_down())

    async def _set_up(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="advh-", dir="/tmp")
        self.backends = {
            KNOWN: RecordingBackend("complete"),
            EARLY: RecordingBackend("head"),
            SILENT: RecordingBackend("silent"),
            MEDIUM: BodyBackend(MEDIUM_BODY),
            LARGE: BodyBackend(LARGE_BODY),
        }
        self.listening: list[Any] = []
        rows = []
        for i, (host, backend) in enumerate(self.backends.items()):
            path = os.path.join(self.dir, f"b{i}.sock")
            self.listening.append(await UNIXServerEndpoint(reactor, path).listen(backend))
            rows.append((host, path))
        rows.append((MISSING, os.path.join(self.dir, "nobody.sock")))
        self.factory = TrackingFactory(
            reactor, Router(route_table(rows)), self.cfg, secure=self.secure
        )
        store = None
        if self.secure:
            self.ca = TestCA()
            certs = os.path.join(self.dir, "certs")
            os.makedirs(certs, mode=0o700)
            self.ca.write(certfiles.cert_path(certs, KNOWN), KNOWN)
            self.ca.write(certfiles.default_cert_path(certs), "default.invalid")
            store = tls.CertStore(
                reactor,
                certs,
                {h for h, _ in rows}.__contains__,
                run_in_thread=thread_runner(reactor),
            )
            store.load_initial()
        self.proxy_port = await listen(self.factory, store=store)
        self.port: int = self.proxy_port.getHost().port
        self.clients: list[RawClient] = []
        self.baseline = gauges(self.factory)

    async def _tear_down(self) -> None:
        for client in self.clients:
            client.abort()
        await self.factory.close()
        for port in [self.proxy_port, *self.listening]:
            await port.stopListening()
        await until(self._all_gone, 3.0)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _all_gone(self) -> bool:
        return (
            all(c.is_closed for c in self.clients)
            and all(_gone(p) for p in self.factory.downstreams)
            and all(c.is_lost for b in self.backends.values() for c in b.connections)
        )

    # -- clients ---------------------------------------------------------------------------------

    async def connect(self) -> RawClient:
        endpoint: Any = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        if self.secure:
            trust = Certificate.loadPEM(self.ca.pem)
            endpoint = wrapClientTLS(optionsForClientTLS(KNOWN, trustRoot=trust), endpoint)
        client = cast(RawClient, await endpoint.connect(RawClientFactory()))
        self.clients.append(client)
        return client

    async def converse(
        self,
        client: RawClient,
        data: bytes | Sequence[bytes],
        *,
        interval: float = 0.0,
        wait: float = 3.0,
        responses: int | None = None,
    ) -> Reply:
        """Send ``data`` (pieces ``interval`` apart); wait for the close, or for ``responses``
        complete responses, or ``wait`` seconds. ``elapsed`` runs to the close when there was one."""
        start = time.monotonic()
        already = len(client.received)
        pieces = [data] if isinstance(data, bytes) else list(data)
        for i, piece in enumerate(pieces):
            if client.is_closed:
                break
            assert client.transport is not None
            client.transport.write(piece)
            if interval and i + 1 < len(pieces):
                await sleep(interval)

        def done() -> bool:
            got = bytes(client.received[already:])
            return client.is_closed or (
                responses is not None and complete_responses(got) >= responses
            )

        await until(done, max(0.0, wait - (time.monotonic() - start)))
        end = client.closed_at if client.is_closed else time.monotonic()
        return Reply(bytes(client.received[already:]), client.is_closed, end - start)

    async def exchange(
        self,
        data: bytes | Sequence[bytes],
        *,
        interval: float = 0.0,
        wait: float = 3.0,
        responses: int | None = None,
    ) -> Reply:
        client = await self.connect()
        reply = await self.converse(client, data, interval=interval, wait=wait, responses=responses)
        if not client.is_closed and client.transport is not None:
            client.transport.loseConnection()
        return reply

    # -- checks ----------------------------------------------------------------------------------

    def all_backend_connections(self) -> list[BackendConnection]:
        return [c for b in self.backends.values() for c in b.connections]

    async def assert_backend_untouched(self) -> None:
        await sleep(0.05)  # a dial the proxy should not have started would have landed by now
        touched = {
            host: [bytes(c.raw) for c in b.connections]
            for host, b in self.backends.items()
            if b.connections
        }
        self.assertEqual(touched, {}, "nothing may reach a backend")

    def assert_backends_well_framed(self) -> None:
        self.assertEqual([p for b in self.backends.values() for p in b.problems()], [])

    def busy_upstream(self) -> int:
        pool = self.factory.pool
        return len(pool._connections) - len(idle_connections(pool))

    async def assert_clean(self) -> None:
        """No upstream connection out of the pool, and every gauge back where it started."""
        for client in self.clients:
            if not client.is_closed and client.transport is not None:
                client.transport.loseConnection()
        await until(lambda: self._all_client_sides_gone() and self.busy_upstream() == 0, 3.0)
        self.assertEqual(self.busy_upstream(), 0, "an upstream connection leaked")
        await until(lambda: gauges(self.factory) == self.baseline, 1.0)
        self.assertEqual(gauges(self.factory), self.baseline)
        idle = {id(c) for c in idle_connections(self.factory.pool)}
        live = [c for c in self.all_backend_connections() if not c.is_lost]
        self.assertLessEqual(len(live), len(idle), "backend connections held outside the pool")

    def _all_client_sides_gone(self) -> bool:
        return all(c.is_closed for c in self.clients) and all(
            _gone(p) for p in self.factory.downstreams
        )


# --- 1. bad heads: exact status, closed at once, nothing reaches a backend ------------------------

LONG_LABEL = b"a" * 300 + b".example.com"
BAD_HEADS: list[tuple[str, bytes, set[int]]] = [
    # the request line
    ("no_target_no_version", b"GET\r\n\r\n", {400}),
    ("no_version", b"GET /\r\n" + HOST + b"\r\n\r\n", {400}),
    ("version_9_9", request(HOST, line=b"GET / HTTP/9.9"), {400, 505}),
    ("version_1_2", request(HOST, line=b"GET / HTTP/1.2"), {400, 505}),
    ("version_2_0", request(HOST, line=b"GET / HTTP/2.0"), {400, 505}),
    ("version_0_9", request(HOST, line=b"GET / HTTP/0.9"), {400, 505}),
    ("lowercase_protocol", request(HOST, line=b"GET / http/1.1"), {400}),
    ("lowercase_method", request(HOST, line=b"get / HTTP/1.1"), {400}),
    ("unknown_method", request(HOST, line=b"FROB / HTTP/1.1"), {400, 501}),
    ("garbage", bytes(range(256)), {400}),
    ("tls_client_hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, {400}),
    ("nul_in_target", request(HOST, line=b"GET /a\x00b HTTP/1.1"), {400}),
    ("space_in_target", request(HOST, line=b"GET /a b HTTP/1.1"), {400}),
    ("high_byte_in_target", request(HOST, line=b"GET /\xff HTTP/1.1"), {400}),
    ("trailing_space_after_version", request(HOST, line=b"GET / HTTP/1.1 "), {400}),
    ("h2_preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", {400, 505}),
    ("absolute_form", request(HOST, line=b"GET http://chat.example.com/ HTTP/1.1"), {400}),
    ("authority_form", request(HOST, line=b"GET chat.example.com:80 HTTP/1.1"), {400}),
    ("asterisk_form_for_get", request(HOST, line=b"GET * HTTP/1.1"), {400}),
    (
        "connect",
        request(b"Host: chat.example.com:443", line=b"CONNECT chat.example.com:443 HTTP/1.1"),
        {405},
    ),
    ("url_too_long", request(HOST, line=b"GET /" + b"a" * 5000 + b" HTTP/1.1"), {414}),
    # Host
    ("missing_host", request(), {400}),
    ("missing_host_http_1_0", request(line=b"GET / HTTP/1.0"), {400}),
    ("empty_host", request(b"Host: "), {400}),
    ("two_hosts_same", request(HOST, HOST), {400}),
    ("two_hosts_different", request(HOST, b"Host: evil.example.com"), {400}),
    ("host_dot_dot_slash", request(b"Host: ../x"), {400}),
    ("host_slash", request(b"Host: a/b"), {400}),
    ("host_nul", request(b"Host: x\x00y"), {400}),
    ("host_300_char_label", request(b"Host: " + LONG_LABEL), {400}),
    ("host_space", request(b"Host: a b"), {400}),
    ("host_tab", request(b"Host: chat\texample.com"), {400}),
    ("host_userinfo", request(b"Host: evil@chat.example.com"), {400}),
    ("host_empty_label", request(b"Host: chat..example.com"), {400}),
    ("host_list", request(b"Host: chat.example.com, evil.example.com"), {400}),
    ("host_bad_port", request(b"Host: chat.example.com:99999"), {400}),
    ("host_too_long", request(b"Host: " + b"ab." * 200 + b"com"), {400}),
    # framing: Content-Length and Transfer-Encoding
    (
        "cl_and_te",
        request(
            HOST,
            b"Content-Length: 5",
            b"Transfer-Encoding: chunked",
            line=b"POST / HTTP/1.1",
            body=b"0\r\n\r\n",
        ),
        {400},
    ),
    (
        "te_and_cl",
        request(
            HOST,
            b"Transfer-Encoding: chunked",
            b"Content-Length: 5",
            line=b"POST / HTTP/1.1",
            body=b"0\r\n\r\n",
        ),
        {400},
    ),
    (
        "cl_twice_different",
        request(
            HOST,
            b"Content-Length: 5",
            b"Content-Length: 6",
            line=b"POST / HTTP/1.1",
            body=b"hello!",
        ),
        {400},
    ),
    (
        "cl_twice_same",
        request(
            HOST, b"Content-Length: 5", b"Content-Length: 5", line=b"POST / HTTP/1.1", body=b"hello"
        ),
        {400},
    ),
    (
        "cl_list",
        request(HOST, b"Content-Length: 5, 5", line=b"POST / HTTP/1.1", body=b"hello"),
        {400},
    ),
    ("cl_negative", request(HOST, b"Content-Length: -1", line=b"POST / HTTP/1.1"), {400}),
    (
        "cl_plus",
        request(HOST, b"Content-Length: +5", line=b"POST / HTTP/1.1", body=b"hello"),
        {400},
    ),
    ("cl_hex", request(HOST, b"Content-Length: 0x10", line=b"POST / HTTP/1.1"), {400}),
    (
        "cl_huge",
        request(HOST, b"Content-Length: 99999999999999999999", line=b"POST / HTTP/1.1"),
        {400},
    ),
    (
        "cl_19_digits",
        request(HOST, b"Content-Length: 9223372036854775807", line=b"POST / HTTP/1.1"),
        {400, 413},
    ),
    ("cl_empty", request(HOST, b"Content-Length: ", line=b"POST / HTTP/1.1"), {400}),
    ("cl_inner_space", request(HOST, b"Content-Length: 1 2", line=b"POST / HTTP/1.1"), {400}),
    (
        "te_gzip_chunked",
        request(
            HOST, b"Transfer-Encoding: gzip, chunked", line=b"POST / HTTP/1.1", body=b"0\r\n\r\n"
        ),
        {501},
    ),
    (
        "te_chunked_gzip",
        request(
            HOST, b"Transfer-Encoding: chunked, gzip", line=b"POST / HTTP/1.1", body=b"0\r\n\r\n"
        ),
        {400, 501},
    ),
    (
        "te_gzip",
        request(HOST, b"Transfer-Encoding: gzip", line=b"POST / HTTP/1.1", body=b"abc"),
        {400, 501},
    ),
    (
        "te_identity",
        request(HOST, b"Transfer-Encoding: identity", line=b"POST / HTTP/1.1"),
        {400, 501},
    ),
    (
        "te_twice",
        request(
            HOST,
            b"Transfer-Encoding: chunked",
            b"Transfer-Encoding: chunked",
            line=b"POST / HTTP/1.1",
            body=b"0\r\n\r\n",
        ),
        {400},
    ),
    (
        "te_chunked_then_gzip",
        request(
            HOST,
            b"Transfer-Encoding: chunked",
            b"Transfer-Encoding: gzip",
            line=b"POST / HTTP/1.1",
            body=b"0\r\n\r\n",
        ),
        {400, 501},
    ),
    ("te_empty", request(HOST, b"Transfer-Encoding: ", line=b"POST / HTTP/1.1"), {400, 501}),
    (
        "te_xchunked",
        request(HOST, b"Transfer-Encoding: xchunked", line=b"POST / HTTP/1.1", body=b"0\r\n\r\n"),
        {400, 501},
    ),
    # header syntax
    ("obs_fold", request(HOST, b"X-A: a", b" b"), {400}),
    (
        "obs_fold_hiding_te",
        request(
            HOST,
            b"X-A: a",
            b" Transfer-Encoding: chunked",
            line=b"POST / HTTP/1.1",
            body=b"0\r\n\r\n",
        ),
        {400},
    ),
    ("obs_fold_tab", request(HOST, b"X-A: a", b"\tb"), {400}),
    ("space_before_colon", request(b"Host : chat.example.com"), {400}),
    (
        "space_before_colon_te",
        request(HOST, b"Transfer-Encoding : chunked", line=b"POST / HTTP/1.1", body=b"0\r\n\r\n"),
        {400},
    ),
    ("bare_lf", b"GET / HTTP/1.1\nHost: chat.example.com\n\n", {400}),
    ("bare_lf_in_headers", b"GET / HTTP/1.1\r\nHost: chat.example.com\nX-A: b\r\n\r\n", {400}),
    ("bare_cr", b"GET / HTTP/1.1\r\nHost: chat.example.com\rX-A: b\r\n\r\n", {400}),
    ("control_char_in_value", request(HOST, b"X-A: a\x01b"), {400}),
    ("nul_in_value", request(HOST, b"X-A: a\x00b"), {400}),
    ("empty_header_name", request(HOST, b": x"), {400}),
    ("header_without_colon", request(HOST, b"X-A"), {400}),
    ("space_in_header_name", request(HOST, b"X A: b"), {400}),
    # semantics
    ("expect_something_else", request(HOST, b"Expect: something-else"), {417}),
    # limits
    (
        "header_block_too_large",
        request(HOST, *(b"X-Pad-%02d: " % i + b"p" * 300 for i in range(15))),
        {431},
    ),
    ("one_header_too_large", request(HOST, b"X-Big: " + b"b" * 5000), {431}),
    ("too_many_headers", request(HOST, *(b"X-N-%02d: 1" % i for i in range(25))), {431}),
]


class BadHeadTests(ProxyCase):
    """Each bad head: the exact status, ``Connection: close``, closed at once, backends untouched."""

    async def check_refused(self, raw: bytes, expected: set[int]) -> None:
        reply = await self.exchange(raw, wait=2.0)
        self.assertIn(reply.status, expected, reply.data[:300])
        self.assertTrue(reply.closed, "the proxy must close after refusing a request")
        self.assertLess(reply.elapsed, self.cfg.header_timeout, "refused at once, not timed out")
        self.assertEqual(reply.header(b"connection"), b"close")
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_header_line_that_never_ends_is_refused_without_buffering_it(self) -> None:
        """One header line past max_header_bytes with no line end yet: the limit must apply to what
        is buffered, not only to completed lines (httptools keeps a partial header in memory)."""
        raw = request(HOST)[:-2] + b"X-Big: " + b"b" * 300_000  # no CRLF, ever
        reply = await self.exchange(raw, wait=2.0)
        self.assertEqual(reply.status, 431, reply.data[:200])
        self.assertTrue(reply.closed)
        self.assertLess(reply.elapsed, self.cfg.header_timeout, "refused at once, not timed out")
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_trailer_line_that_never_ends_is_refused(self) -> None:
        """The same for a chunked body's trailer section: httptools holds a partial trailer line
        in memory, and no timeout runs while a body is read. Expect a refusal, promptly."""
        head = request(HOST, b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.1")
        client = await self.connect()
        await self.converse(client, head + b"1\r\nx\r\n0\r\n", wait=0.0)
        reply = await self.converse(client, b"X-Trailer: " + b"t" * 300_000, wait=2.0)
        self.assertIn(reply.status, {400, 431}, reply.data[:200])
        self.assertTrue(reply.closed)
        await self.assert_clean()

    async def test_header_name_that_never_ends_is_refused(self) -> None:
        raw = request(HOST)[:-2] + b"X-" + b"n" * 300_000  # a name, no colon, no CRLF
        reply = await self.exchange(raw, wait=2.0)
        self.assertIn(reply.status, {400, 431}, reply.data[:200])
        self.assertTrue(reply.closed)
        self.assertLess(reply.elapsed, self.cfg.header_timeout, "refused at once, not timed out")
        await self.assert_backend_untouched()

    async def test_burst_of_bad_heads_at_once_leaks_nothing(self) -> None:
        replies = await gatherResults(
            [Deferred.fromCoroutine(self.exchange(raw, wait=3.0)) for _, raw, _ in BAD_HEADS]
        )
        for (name, _, expected), reply in zip(BAD_HEADS, replies, strict=True):
            self.assertIn(reply.status, expected, name)
            self.assertTrue(reply.closed, name)
        await self.assert_backend_untouched()
        await self.assert_clean()


def _bad_head_test(
    raw: bytes, expected: set[int]
) -> Callable[[BadHeadTests], Coroutine[Any, Any, None]]:
    async def test(self: BadHeadTests) -> None:
        await self.check_refused(raw, expected)

    return test


for _name, _raw, _expected in BAD_HEADS:
    setattr(BadHeadTests, f"test_{_name}", _bad_head_test(_raw, _expected))


# Well-formed names that are no space's are merely unknown: 404, not 400.
UNKNOWN_HOSTS = [
    b"localhost",
    b"127.0.0.1",
    b"[::1]",
    b"unknown.example.com",
    b"xn--9ca.example.com",
]


class UnknownHostTests(ProxyCase):
    async def test_unknown_but_well_formed_hosts_are_404(self) -> None:
        for host in UNKNOWN_HOSTS:
            reply = await self.exchange(request(b"Host: " + host), responses=1)
            self.assertEqual(reply.status, 404, host)
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_host_is_matched_normalised_and_forwarded_as_sent(self) -> None:
        reply = await self.exchange(request(b"Host: CHAT.Example.com.:8080"), responses=1)
        self.assertEqual(reply.status, 200)
        (msg,) = self.backends[KNOWN].requests()
        self.assertEqual(msg.values("host"), [b"CHAT.Example.com.:8080"])
        await self.assert_clean()


# --- 2. smuggling -----------------------------------------------------------------------------

SMUGGLED = b"GET /admin HTTP/1.1\r\nHost: chat.example.com\r\nX-Smuggled: 1\r\n\r\n"


class SmugglingTests(ProxyCase):
    """The backend sees exactly the requests the proxy parsed and validated, each framed once."""

    def assert_no_smuggled(self) -> None:
        for backend in self.backends.values():
            for conn in backend.connections:
                parsed = parse_requests(bytes(conn.raw))
                for msg in parsed.messages:
                    self.assertNotIn(b"/admin", msg.target, "a smuggled request reached a backend")
                    self.assertEqual(msg.values("x-smuggled"), [])

    async def test_request_inside_a_chunked_body_stays_body(self) -> None:
        raw = request(
            HOST, b"Transfer-Encoding: chunked", line=b"POST /up HTTP/1.1", body=chunked(SMUGGLED)
        )
        reply = await self.exchange(raw, responses=1)
        self.assertEqual(reply.status, 200)
        (msg,) = self.backends[KNOWN].requests()
        self.assertTrue(msg.complete)
        self.assertEqual((msg.method, msg.target, msg.body), (b"POST", b"/up", SMUGGLED))
        self.assertEqual(msg.values("transfer-encoding"), [b"chunked"])
        self.assertEqual(msg.values("content-length"), [])
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_request_after_a_content_length_body_is_parsed_and_validated(self) -> None:
        second = b"GET /second HTTP/1.1\r\nHost: chat.example.com\r\nX-Lchat-Sidecar: 1\r\n\r\n"
        raw = request(HOST, b"Content-Length: 5", line=b"POST /first HTTP/1.1", body=b"hello")
        reply = await self.exchange(raw + second, responses=2)
        self.assertEqual(reply.statuses(), [200, 200])
        msgs = self.backends[KNOWN].requests()
        self.assertEqual(
            [(m.method, m.target, m.body) for m in msgs],
            [
                (b"POST", b"/first", b"hello"),
                (b"GET", b"/second", b""),
            ],
        )
        self.assert_backends_well_framed()  # the second one's internal header was taken out too
        await self.assert_clean()

    async def test_invalid_pipelined_request_never_reaches_the_backend(self) -> None:
        bad = (
            b"POST /admin HTTP/1.1\r\nHost: chat.example.com\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        raw = request(HOST, b"Content-Length: 5", line=b"POST /first HTTP/1.1", body=b"hello")
        reply = await self.exchange(raw + bad, wait=2.0)
        self.assertEqual(reply.statuses()[:1], [200])
        self.assertTrue(reply.closed, "after a bad pipelined request the connection closes")
        self.assertEqual([m.target for m in self.backends[KNOWN].requests()], [b"/first"])
        self.assert_no_smuggled()
        await self.assert_clean()

    async def test_bytes_after_a_close_request_do_not_turn_its_answer_into_400(self) -> None:
        """RFC 9112 §9.6: answer the request carrying ``Connection: close``, ignore what follows.
        llhttp raises "Data after Connection: close" on the following bytes; that must not replace
        the answer to a request the space has already received (and perhaps acted on)."""
        warm = await self.exchange(request(HOST), responses=1)  # leaves a pooled upstream
        self.assertEqual(warm.status, 200)
        raw = request(
            HOST,
            b"Connection: close",
            b"Content-Length: 2",
            line=b"POST /once HTTP/1.1",
            body=b"hi",
        )
        reply = await self.exchange(raw + SMUGGLED, wait=2.0)
        self.assertTrue(reply.closed)
        self.assert_no_smuggled()
        once = [m for m in self.backends[KNOWN].requests() if m.target == b"/once"]
        self.assertEqual((reply.statuses(), len(once)), ([200], 1), reply.data[:200])
        await self.assert_clean()

    async def test_nothing_is_parsed_or_answered_after_the_proxy_decided_to_close(self) -> None:
        """A local answer that closes the connection ends it: the bytes behind it in the same read
        are neither routed nor answered (no second response after ``Connection: close``)."""
        first = request(b"Host: unknown.example.com", b"Content-Length: 2", line=b"POST / HTTP/1.1")
        for tail in (b"\x00\x01garbage\r\n\r\n", request(HOST, line=b"GET /after HTTP/1.1")):
            reply = await self.exchange(first + b"hi" + tail, wait=2.0)
            self.assertEqual(reply.statuses(), [404], reply.data)
            self.assertTrue(reply.closed)
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_cl_te_and_te_cl_desync_payloads_are_refused(self) -> None:
        payloads = [
            # CL.TE: a front end honouring CL would pass "0\r\n\r\nG" as the body
            request(
                HOST,
                b"Content-Length: 6",
                b"Transfer-Encoding: chunked",
                line=b"POST / HTTP/1.1",
                body=b"0\r\n\r\nG",
            ),
            # TE.CL: a back end honouring CL would read "8\r\n" and then a request
            request(
                HOST,
                b"Transfer-Encoding: chunked",
                b"Content-Length: 3",
                line=b"POST / HTTP/1.1",
                body=b"8\r\nSMUGGLED\r\n0\r\n\r\n" + SMUGGLED,
            ),
            # TE obfuscations
            request(
                HOST,
                b"Content-Length: 4",
                b"Transfer-Encoding: xchunked",
                line=b"POST / HTTP/1.1",
                body=b"5c\r\n" + SMUGGLED,
            ),
            request(
                HOST,
                b"Content-Length: 4",
                b"Transfer-Encoding : chunked",
                line=b"POST / HTTP/1.1",
                body=b"5c\r\n" + SMUGGLED,
            ),
            request(
                HOST,
                b"Content-Length: 4",
                b"Transfer-Encoding:\tchunked",
                line=b"POST / HTTP/1.1",
                body=b"5c\r\n" + SMUGGLED,
            ),
            request(
                HOST,
                b"Content-Length: 4",
                b"X: x",
                b" Transfer-Encoding: chunked",
                line=b"POST / HTTP/1.1",
                body=b"5c\r\n" + SMUGGLED,
            ),
            request(
                HOST,
                b"Content-Length: 4",
                b"Transfer-Encoding: chunked",
                b"Transfer-encoding: cow",
                line=b"POST / HTTP/1.1",
                body=b"5c\r\n" + SMUGGLED,
            ),
        ]
        for raw in payloads:
            reply = await self.exchange(raw, wait=2.0)
            self.assertIn(reply.status, {400, 501}, raw)
            self.assertTrue(reply.closed)
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_chunk_extension_is_not_forwarded(self) -> None:
        raw = request(
            HOST,
            b"Transfer-Encoding: chunked",
            line=b"POST / HTTP/1.1",
            body=b'1;ext=1\r\nx\r\n2;a="b"\r\nyz\r\n0;last\r\n\r\n',
        )
        reply = await self.exchange(raw, responses=1)
        self.assertEqual(reply.status, 200)
        (msg,) = self.backends[KNOWN].requests()
        self.assertEqual(msg.body, b"xyz")
        self.assertNotIn(b"ext", self.backends[KNOWN].received)
        self.assertNotIn(b"last", self.backends[KNOWN].received)
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_trailers_are_dropped(self) -> None:
        body = (
            b"1\r\nx\r\n0\r\nX-Lchat-Sidecar: 1\r\nX-Lchat-Mesh-Forwarded: t\r\nX-Other: 2\r\n\r\n"
        )
        raw = request(HOST, b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.1", body=body)
        reply = await self.exchange(raw, responses=1)
        self.assertEqual(reply.status, 200)
        (msg,) = self.backends[KNOWN].requests()
        self.assertEqual((msg.body, msg.trailers), (b"x", []))
        self.assertTrue(self.backends[KNOWN].received.endswith(b"\r\n0\r\n\r\n"))
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_framing_headers_in_trailers_are_refused_or_dropped(self) -> None:
        for trailer in (
            b"Content-Length: 5",
            b"Transfer-Encoding: chunked",
            b"Host: evil.example.com",
        ):
            body = b"1\r\nx\r\n0\r\n" + trailer + b"\r\n\r\n" + SMUGGLED
            raw = request(HOST, b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.1", body=body)
            reply = await self.exchange(raw, wait=2.0, responses=2)
            self.assertIn(reply.status, {200, 400}, trailer)
        for msg in self.backends[KNOWN].requests():
            self.assertEqual(msg.trailers, [])
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_bad_chunk_framing_is_refused(self) -> None:
        bodies = {
            "negative": b"-1\r\nx\r\n0\r\n\r\n",
            "hex_overflow": b"10000000000000001\r\nx\r\n0\r\n\r\n",
            "0x_prefix": b"0x1\r\nx\r\n0\r\n\r\n",
            "space_after_size": b"1 \r\nx\r\n0\r\n\r\n",
            "missing_crlf_after_data": b"1\r\nxy0\r\n\r\n" + SMUGGLED,
            "bare_lf": b"1\nx\n0\n\n",
            "size_swallows_next_size": b"5\r\nab\r\n0\r\n\r\n" + SMUGGLED,
            "nul_in_extension": b"1;\x00\r\nx\r\n0\r\n\r\n",
        }
        for name, body in bodies.items():
            raw = request(HOST, b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.1", body=body)
            reply = await self.exchange(raw, wait=2.0)
            self.assertEqual(reply.status, 400, name)
            self.assertTrue(reply.closed, name)
        await sleep(0.1)
        for conn in self.all_backend_connections():
            # At most the head of the refused request, never completed, never a second request.
            self.assertEqual(parse_requests(bytes(conn.raw)).complete, [])
        self.assert_no_smuggled()
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_bad_chunk_after_streaming_began_aborts_the_upstream(self) -> None:
        client = await self.connect()
        head = request(HOST, b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.1")
        await self.converse(client, head + b"3\r\nabc\r\n", wait=0.0)
        backend = self.backends[KNOWN]
        self.assertTrue(await until(lambda: b"abc" in backend.received, 2.0))
        reply = await self.converse(client, b"zz\r\n" + SMUGGLED, wait=2.0)
        self.assertEqual(reply.status, 400)
        self.assertTrue(reply.closed)
        (conn,) = backend.connections
        self.assertTrue(await until(lambda: conn.is_lost, 1.0), "the upstream must be aborted")
        self.assertEqual(parse_requests(bytes(conn.raw)).complete, [])
        self.assert_no_smuggled()
        await self.assert_clean()

    async def test_refused_upgrade_never_forwards_the_bytes_after_the_head(self) -> None:
        raw = request(HOST, b"Connection: Upgrade", b"Upgrade: websocket", line=b"GET /ws HTTP/1.1")
        reply = await self.exchange(raw + SMUGGLED, wait=2.0)
        self.assertEqual(reply.statuses(), [200])  # the backend declined to switch
        self.assertTrue(reply.closed)
        self.assertEqual([m.target for m in self.backends[KNOWN].requests()], [b"/ws"])
        self.assert_no_smuggled()
        await self.assert_clean()

    async def test_upgrade_request_with_a_body_is_refused(self) -> None:
        """llhttp treats everything after an upgrade request's head as the new protocol, so the body
        the head announces is never forwarded: the forwarded head would promise bytes that do not
        follow (ambiguous framing). Such a request must be refused."""
        for framing, body in (
            (b"Content-Length: 3", b"abc"),
            (b"Transfer-Encoding: chunked", b"3\r\nabc\r\n0\r\n\r\n"),
        ):
            raw = request(
                HOST,
                b"Connection: Upgrade",
                b"Upgrade: websocket",
                framing,
                line=b"POST /ws HTTP/1.1",
                body=body,
            )
            reply = await self.exchange(raw + SMUGGLED, wait=2.0)
            self.assertEqual(reply.status, 400, framing)
            self.assertTrue(reply.closed)
        await self.assert_backend_untouched()
        await self.assert_clean()


# --- 3. internal and hop-by-hop headers ---------------------------------------------------------


class HeaderHygieneTests(ProxyCase):
    async def test_internal_and_hop_by_hop_headers_never_reach_the_backend(self) -> None:
        raw = request(
            b"Host: Chat.Example.COM",
            b"X-Lchat-Sidecar: 1",
            b"x-lchat-sidecar: 2",
            b"X-LCHAT-MESH-FORWARDED: forged",
            b"x-Lchat-Mesh-Forwarded: forged-again",
            b"Connection: keep-alive, X-Lchat-Sidecar, X-Hop-One, x-hop-two",
            b"Connection: X-Lchat-Mesh-Forwarded",
            b"X-Hop-One: a",
            b"X-Hop-Two: b",
            b"Keep-Alive: timeout=5",
            b"TE: trailers",
            b"Trailer: X-T",
            b"Proxy-Authorization: Basic Zm9vOmJhcg==",
            b"Proxy-Connection: keep-alive",
            b"Upgrade: h2c",
            b"X-Forwarded-Proto: https",
            b"X-Kept: yes",
            line=b"GET /x HTTP/1.1",
        )
        reply = await self.exchange(raw, responses=1)
        self.assertEqual(reply.status, 200)
        self.assertNotIn(
            b"x-lchat", reply.data.lower(), "internal headers from a space stay inside"
        )
        backend = self.backends[KNOWN]
        (msg,) = backend.requests()
        self.assertNotIn(b"x-lchat", backend.received.lower())
        names = {n.lower() for n, _ in msg.headers}
        for hop in (
            b"connection",
            b"x-hop-one",
            b"x-hop-two",
            b"keep-alive",
            b"te",
            b"trailer",
            b"proxy-authorization",
            b"proxy-connection",
            b"upgrade",
        ):
            self.assertNotIn(hop, names)
        self.assertEqual(msg.values("host"), [b"Chat.Example.COM"])
        self.assertEqual(msg.values("x-forwarded-for"), [b"127.0.0.1"])
        self.assertEqual(msg.values("x-forwarded-proto"), [b"http"])
        self.assertEqual(msg.values("x-kept"), [b"yes"])
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_x_forwarded_for_is_appended_once(self) -> None:
        raw = request(HOST, b"X-Forwarded-For: 1.2.3.4", b"x-forwarded-for: 5.6.7.8")
        reply = await self.exchange(raw, responses=1)
        self.assertEqual(reply.status, 200)
        (msg,) = self.backends[KNOWN].requests()
        self.assertEqual(msg.values("x-forwarded-for"), [b"1.2.3.4, 5.6.7.8, 127.0.0.1"])
        await self.assert_clean()

    async def test_connection_option_cannot_strip_host(self) -> None:
        """``Connection: host`` must not make the proxy forward a request with no Host at all."""
        for option in (b"host", b"Host, close", b"keep-alive, HOST"):
            raw = request(HOST, b"Connection: " + option)
            reply = await self.exchange(raw, wait=2.0)
            self.assertIn(reply.status, {200, 400}, option)
        for msg in self.backends[KNOWN].requests():
            self.assertEqual(msg.values("host"), [b"chat.example.com"])
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_underscore_spelling_of_an_internal_header_does_not_reach_the_backend(
        self,
    ) -> None:
        """CGI/WSGI-style servers fold ``X_Lchat_Sidecar`` and ``X-Lchat-Sidecar`` into the same
        ``HTTP_X_LCHAT_SIDECAR``: a client could forge the marker past a name-exact filter."""
        raw = request(HOST, b"X_Lchat_Sidecar: 1", b"X-Lchat_Mesh-Forwarded: forged")
        reply = await self.exchange(raw, wait=2.0)
        self.assertIn(reply.status, {200, 400})
        for msg in self.backends[KNOWN].requests():
            folded = {n.lower().replace(b"_", b"-") for n, _ in msg.headers}
            self.assertFalse(folded & {b"x-lchat-sidecar", b"x-lchat-mesh-forwarded"}, msg.headers)
        await self.assert_clean()


# --- 4. timeouts --------------------------------------------------------------------------------


class TimeoutTests(ProxyCase):
    async def test_slowloris_head_is_cut_off_at_the_header_timeout(self) -> None:
        raw = request(HOST, b"X-Slow: 1")
        reply = await self.exchange([raw[i : i + 1] for i in range(len(raw))], interval=0.2)
        self.assertTrue(reply.closed)
        self.assertIn(reply.status, {408, None})
        self.assertLess(reply.elapsed, self.cfg.header_timeout + SLACK)
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_header_deadline_counts_from_the_connection(self) -> None:
        """Waiting just under the timeout before the first byte must not buy a second timeout."""
        client = await self.connect()
        connected = time.monotonic()
        await sleep(self.cfg.header_timeout * 0.9)
        raw = request(HOST)
        await self.converse(client, [raw[i : i + 1] for i in range(len(raw))], interval=0.1)
        self.assertTrue(client.is_closed)
        # from the connection: header_timeout; re-armed by the first byte it would be ~1.9x that
        self.assertLess(client.closed_at - connected, self.cfg.header_timeout * 1.6)
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_silent_connection_is_closed_at_the_header_timeout(self) -> None:
        reply = await self.exchange(b"")
        self.assertTrue(reply.closed)
        self.assertIn(reply.status, {408, None})
        self.assertLess(reply.elapsed, self.cfg.header_timeout + SLACK)
        await self.assert_clean()

    async def test_blank_lines_do_not_keep_a_connection_alive(self) -> None:
        reply = await self.exchange([b"\r\n"] * 20, interval=0.1)
        self.assertTrue(reply.closed)
        self.assertLess(reply.elapsed, self.cfg.header_timeout + SLACK)
        await self.assert_clean()

    async def test_slowloris_on_a_kept_alive_connection(self) -> None:
        client = await self.connect()
        first = await self.converse(client, request(HOST), responses=1)
        self.assertEqual(first.status, 200)
        raw = request(HOST)
        reply = await self.converse(client, [raw[i : i + 1] for i in range(len(raw))], interval=0.2)
        self.assertTrue(reply.closed)
        self.assertIn(reply.status, {408, None})
        self.assertLess(reply.elapsed, self.cfg.header_timeout + SLACK)
        self.assertEqual(len(self.backends[KNOWN].requests()), 1)
        await self.assert_clean()

    async def test_idle_keep_alive_connection_is_closed_after_keepalive_timeout(self) -> None:
        client = await self.connect()
        reply = await self.converse(client, request(HOST), responses=1)
        self.assertEqual(reply.status, 200)
        answered = time.monotonic()
        # Not the header timeout: an idle kept-alive connection gets keepalive_timeout.
        await sleep(self.cfg.header_timeout + 0.2)
        self.assertFalse(client.is_closed, "closed at the header timeout, not keepalive_timeout")
        self.assertTrue(await until(lambda: client.is_closed, self.cfg.keepalive_timeout + SLACK))
        self.assertGreater(client.closed_at - answered, self.cfg.keepalive_timeout - 0.1)
        self.assertEqual(client.received.count(b"HTTP/1.1 "), 1, "closed silently")
        await self.assert_clean()

    async def test_silent_upstream_is_504_after_upstream_timeout_and_its_connection_closed(
        self,
    ) -> None:
        for raw in (
            request(b"Host: silent.example.com"),
            request(
                b"Host: silent.example.com",
                b"Content-Length: 3",
                line=b"POST / HTTP/1.1",
                body=b"abc",
            ),
            request(
                b"Host: silent.example.com",
                b"Transfer-Encoding: chunked",
                line=b"POST / HTTP/1.1",
                body=chunked(b"abc"),
            ),
        ):
            reply = await self.exchange(raw, responses=1, wait=3.0)
            self.assertEqual(reply.status, 504)
            self.assertGreater(reply.elapsed, self.cfg.upstream_timeout - 0.05)
            self.assertLess(reply.elapsed, self.cfg.upstream_timeout + SLACK)
        conns = self.backends[SILENT].connections
        self.assertEqual(len(conns), 3)
        self.assertTrue(await until(lambda: all(c.is_lost for c in conns), 1.0))
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_unreachable_upstream_is_502_after_the_dial_window(self) -> None:
        reply = await self.exchange(request(b"Host: missing.example.com"), responses=1)
        self.assertEqual(reply.status, 502)
        self.assertLess(reply.elapsed, self.cfg.dial_retry + SLACK)
        await self.assert_clean()

    async def test_client_gone_while_upstream_is_silent_closes_the_upstream(self) -> None:
        client = await self.connect()
        await self.converse(client, request(b"Host: silent.example.com"), wait=0.0)
        backend = self.backends[SILENT]
        self.assertTrue(await until(lambda: bool(backend.connections), 1.0))
        client.abort()
        (conn,) = backend.connections
        self.assertTrue(await until(lambda: conn.is_lost, 0.3), "the upstream connection leaked")
        await self.assert_clean()

    async def test_client_gone_while_dialing_leaks_nothing(self) -> None:
        client = await self.connect()
        await self.converse(client, request(b"Host: missing.example.com"), wait=0.05)
        client.abort()
        await sleep(self.cfg.dial_retry + 0.1)  # let the dial window run out
        await self.assert_clean()

    async def test_client_gone_mid_body_closes_the_upstream(self) -> None:
        client = await self.connect()
        head = request(HOST, b"Content-Length: 100", line=b"POST / HTTP/1.1")
        await self.converse(client, head + b"0123456789", wait=0.0)
        backend = self.backends[KNOWN]
        self.assertTrue(await until(lambda: b"0123456789" in backend.received, 1.0))
        client.abort()
        (conn,) = backend.connections
        self.assertTrue(await until(lambda: conn.is_lost, 0.3), "the upstream connection leaked")
        self.assertEqual(parse_requests(bytes(conn.raw)).complete, [])
        await self.assert_clean()

    async def test_stalled_request_body_does_not_hold_connections_forever(self) -> None:
        """A client that announces a body and stops sending it: the body-idle timeout
        (keepalive_timeout between reads) ends the exchange, or both the client connection and the
        upstream connection would be held for as long as the client likes."""
        client = await self.connect()
        head = request(HOST, b"Content-Length: 100", line=b"POST / HTTP/1.1")
        await self.converse(client, head + b"0123456789", wait=0.0)
        bound = 2 * max(
            self.cfg.header_timeout, self.cfg.keepalive_timeout, self.cfg.upstream_timeout
        )
        closed = await until(lambda: client.is_closed, bound + SLACK)
        self.assertTrue(closed, f"still open {bound + SLACK:.1f}s after the body stalled")
        (conn,) = self.backends[KNOWN].connections
        self.assertTrue(await until(lambda: conn.is_lost, 0.5))
        await self.assert_clean()


# --- 5. clients that stop reading ----------------------------------------------------------------

_log = Logger(namespace="tests.test_proxy_adversarial")


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def blocking_client(port: int, ca_pem: bytes | None, rcvbuf: int | None = None) -> socket.socket:
    """A plain socket (TLS when ``ca_pem`` is given), its receive buffer shrunk before connecting
    (a client on a slow link, or one that reads nothing): what it does not read stays with us."""
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.settimeout(5)
    raw.connect(("127.0.0.1", port))
    if ca_pem is None:
        return raw
    context = ssl.create_default_context(cadata=ca_pem.decode())
    return context.wrap_socket(raw, server_hostname=KNOWN)


def flood(sock: socket.socket, payload: bytes, seconds: float) -> tuple[int, str]:
    """Send ``payload`` again and again for ``seconds``, reading nothing: (bytes sent, how it
    ended: "time", "blocked" for a second, or the error that cut it off)."""
    sock.settimeout(1.0)
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sock.sendall(payload)
        except TimeoutError:
            return sent, "blocked"
        except OSError as e:
            return sent, type(e).__name__
        sent += len(payload)
    return sent, "time"


class DrainModeTests(ProxyCase):
    """ProxyFactory.close() at shutdown: keep-alive ends, idle connections go, and a connection
    that has not sent its first request yet is answered rather than cut (its request may be on the
    wire: a peer that dialled a moment before the drain)."""

    async def test_idle_connections_close_a_fresh_one_is_answered_then_closed(self) -> None:
        used = await self.connect()
        reply = await self.converse(used, request(HOST), responses=1)
        self.assertEqual(response_statuses(reply.data), [200])
        self.assertFalse(used.is_closed, "kept alive before the drain")
        fresh = await self.connect()
        await sleep(0.05)  # accepted, nothing sent yet
        self.factory.close()
        self.assertTrue(await until(lambda: used.is_closed, 2.0), "an idle used connection")
        await sleep(0.1)
        self.assertFalse(fresh.is_closed, "a connection that has not sent its request yet")
        reply = await self.converse(fresh, request(HOST), responses=1)
        self.assertEqual(response_statuses(reply.data), [200])
        self.assertIn(b"\r\nconnection: close\r\n", reply.data.lower())
        self.assertTrue(await until(lambda: fresh.is_closed, 2.0))

    async def test_a_request_in_flight_at_the_drain_is_answered_with_close(self) -> None:
        client = await self.connect()
        assert client.transport is not None
        client.transport.write(request(b"Host: " + SILENT.encode()))
        await until(lambda: bool(self.backends[SILENT].connections), 2.0)
        self.factory.close()
        await sleep(0.1)
        self.assertFalse(client.is_closed, "a request being served is not cut")
        # Its answer (here the upstream timeout's 504) ends the connection: no keep-alive now.
        reply = await self.converse(client, b"", responses=1)
        self.assertEqual(response_statuses(reply.data), [504])
        self.assertIn(b"\r\nconnection: close\r\n", reply.data.lower())
        self.assertTrue(await until(lambda: client.is_closed, 2.0))


class SlowReaderTests(ProxyCase):
    """Clients that stop reading must cost the router a bounded amount, and not forever: the
    client is not read (nor answered) while its unsent output is over the high-water mark, at most
    ``max_pipelined`` requests queue, and a connection whose unsent output does not move for
    ``send_timeout`` is aborted, with its space connection (nginx: send_timeout)."""

    cfg = attrs.evolve(CFG, send_timeout=0.5)

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        self.socks: list[socket.socket] = []
        self.addCleanup(self.close_socks)
        return super().setUp()

    def close_socks(self) -> None:
        for sock in self.socks:
            sock.close()

    def ca_pem(self) -> bytes | None:
        return self.ca.pem if self.secure else None

    async def open_blocking(self, rcvbuf: int | None = None) -> tuple[socket.socket, Downstream]:
        """A blocking client (see blocking_client) and the proxy's side of its connection."""
        before = len(self.factory.downstreams)
        sock = await deferToThread(blocking_client, self.port, self.ca_pem(), rcvbuf)
        self.socks.append(sock)
        self.assertTrue(await until(lambda: len(self.factory.downstreams) > before, 2.0))
        return sock, self.factory.downstreams[-1]

    def shrink_send_buffer(self, downstream: Downstream) -> None:
        """The kernel's send buffer on the proxy's side, shrunk: what the client does not read
        stays in the router's own buffer instead of megabytes of loopback socket buffers."""
        transport: Any = downstream.transport
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1024)

    async def flood_and_watch(self, payload: bytes, seconds: float = 2.5) -> int:
        """A client pipelines ``payload`` for ``seconds`` and reads nothing. Returns the peak of
        the router's unsent output for it (the longest request queue is logged)."""
        # Isolate the high-water mark from the pipelining cap (tested on its own below).
        self.factory.cfg = attrs.evolve(self.cfg, max_pipelined=10**6)
        rss_before = rss_bytes()
        sock, downstream = await self.open_blocking(rcvbuf=4096)
        flooding = deferToThread(flood, sock, payload, seconds)
        peak = queued = 0
        while not flooding.called:
            peak = max(peak, buffered_output(downstream.transport) or 0)
            queued = max(queued, len(downstream._waiting))
            await sleep(0.01)
        sent, ended = await flooding
        _log.info(
            "pipelining flood (tls={tls}): {sent} bytes sent, ended by {ended}; router peak "
            "{peak} bytes unsent, {queued} requests queued; RSS {rss:+.1f} MB",
            tls=self.secure,
            sent=sent,
            ended=ended,
            peak=peak,
            queued=queued,
            rss=(rss_bytes() - rss_before) / 1e6,
        )
        return peak

    async def assert_aborted_by_send_timeout(self, downstream: Downstream, aborts: float) -> None:
        bound = self.cfg.send_timeout + 2.0  # the sweep runs every tenth of it; a loaded machine
        self.assertTrue(await until(lambda: _gone(downstream), bound), "still connected")
        self.assertEqual(sample("lchat_http_send_timeouts_total"), aborts + 1)

    async def test_pipelining_client_that_reads_nothing_gets_local_answers_bounded(self) -> None:
        aborts = sample("lchat_http_send_timeouts_total")
        pauses = sample("lchat_http_output_pauses_total")
        peak = await self.flood_and_watch(request(b"Host: nobody.example.com") * 100)
        # Twisted's 64 KiB mark, plus what one read of requests can add; without the mark this
        # grew by ~15 MB a second.
        self.assertLess(peak, 1_000_000, f"{peak} bytes held for a client that reads nothing")
        self.assertGreater(sample("lchat_http_output_pauses_total"), pauses)
        await self.assert_aborted_by_send_timeout(self.factory.downstreams[-1], aborts)
        await self.assert_clean()

    async def test_pipelining_client_that_reads_nothing_gets_proxied_answers_bounded(
        self,
    ) -> None:
        aborts = sample("lchat_http_send_timeouts_total")
        peak = await self.flood_and_watch(request(f"Host: {MEDIUM}".encode()) * 20)
        self.assertLess(peak, 1_000_000, f"{peak} bytes held for a client that reads nothing")
        await self.assert_aborted_by_send_timeout(self.factory.downstreams[-1], aborts)
        await self.assert_clean()

    async def test_client_that_stops_reading_a_large_response_is_aborted(self) -> None:
        aborts = sample("lchat_http_send_timeouts_total")
        client = await self.connect()
        await self.converse(client, request(f"Host: {LARGE}".encode()), wait=0.0)
        self.assertTrue(await until(lambda: len(client.received) > 0, 3.0))
        transport: Any = client.transport
        transport.pauseProducing()  # reads nothing more
        downstream = self.factory.downstreams[-1]
        # Over the high-water mark: the space is no longer read until the client reads.
        over = await until(lambda: (buffered_output(downstream.transport) or 0) > 65536, 5.0)
        self.assertTrue(over, "the client's output never filled")
        await self.assert_aborted_by_send_timeout(downstream, aborts)
        transport.resumeProducing()  # it finds the connection reset
        self.assertTrue(await until(lambda: client.is_closed, 5.0))
        (space,) = self.backends[LARGE].connections
        self.assertTrue(await until(lambda: space.is_lost, 1.0), "the space connection is held")
        self.assertLess(len(client.received), LARGE_BODY)
        await self.assert_clean()

    async def test_closing_connection_whose_client_reads_nothing_is_aborted(self) -> None:
        """The router decided to close (``Connection: close``) with the answer still unsent:
        the close waits for the client, but not longer than the send timeout."""
        aborts = sample("lchat_http_send_timeouts_total")
        sock, downstream = await self.open_blocking(rcvbuf=1024)
        self.shrink_send_buffer(downstream)
        raw = request(f"Host: {MEDIUM}".encode(), b"Connection: close")
        await deferToThread(sock.sendall, raw)
        # The whole answer came from the space (under the mark: never paused); it is unsent.
        self.assertTrue(await until(lambda: downstream._closed, 3.0))
        if not self.secure:
            # (Under TLS what waits is in the TCP layer below the TLS transport, which counts
            # only its own: the abort below is the proof there.)
            self.assertGreater(buffered_output(downstream.transport) or 0, MEDIUM_BODY // 2)
        await self.assert_aborted_by_send_timeout(downstream, aborts)
        await self.assert_clean()

    async def test_slow_reader_that_keeps_reading_is_not_aborted(self) -> None:
        """Output that drains slower than the send timeout but keeps moving is not a stall."""
        aborts = sample("lchat_http_send_timeouts_total")
        pauses = sample("lchat_http_output_pauses_total")
        sock, downstream = await self.open_blocking(rcvbuf=16384)
        self.shrink_send_buffer(downstream)
        count = 4
        await deferToThread(sock.sendall, request(f"Host: {MEDIUM}".encode()) * count)

        def sip() -> bytes:
            # At most ~100 KB/s: a full 64 KiB buffer takes longer than the send timeout to
            # drain, so only its steady movement keeps the connection.
            received = bytearray()
            deadline = time.monotonic() + 20
            while complete_responses(bytes(received)) < count and time.monotonic() < deadline:
                piece = sock.recv(2048)
                if not piece:
                    break
                received += piece
                time.sleep(0.02)
            return bytes(received)

        started = time.monotonic()
        received = await deferToThread(sip)
        _log.info(
            "slow reader (tls={tls}): {n} bytes, {r} responses in {s:.1f}s",
            tls=self.secure,
            n=len(received),
            r=complete_responses(received),
            s=time.monotonic() - started,
        )
        self.assertEqual(response_statuses(received), [200] * count)
        self.assertGreater(sample("lchat_http_output_pauses_total"), pauses)
        self.assertEqual(sample("lchat_http_send_timeouts_total"), aborts)
        await self.assert_clean()

    async def test_pipelined_requests_beyond_the_cap_close_the_connection(self) -> None:
        self.factory.cfg = attrs.evolve(self.cfg, max_pipelined=8)
        limited = sample("lchat_http_pipeline_limit_total")
        reply = await self.exchange(request(HOST) * 20, wait=3.0)
        # one served and eight queued; the last of those is answered with "Connection: close"
        self.assertEqual(reply.statuses(), [200] * 9)
        self.assertTrue(reply.closed)
        self.assertEqual(reply.data.lower().count(b"connection: close"), 1)
        self.assertEqual(len(self.backends[KNOWN].requests()), 9)
        self.assertEqual(sample("lchat_http_pipeline_limit_total"), limited + 1)
        await self.assert_clean()

    async def test_close_after_an_answer_that_was_routed_asynchronously_completes(self) -> None:
        """While routing or dialing, the client is not read; a close decided then (here a 502
        with "Connection: close") must still read the client's answer to a TLS close, or the
        router's side of the connection stays until the send timeout."""
        self.factory.cfg = attrs.evolve(self.cfg, send_timeout=30.0)
        client = await self.connect()
        reply = await self.converse(
            client, request(f"Host: {MISSING}".encode(), b"Connection: close"), wait=3.0
        )
        self.assertEqual((reply.status, reply.closed), (502, True))
        downstream = self.factory.downstreams[-1]
        self.assertTrue(await until(lambda: _gone(downstream), 2.0), "the router's side stayed")
        await self.assert_clean()


class SlowReaderTLSTests(SlowReaderTests):
    secure = True


# --- 6. leaks after a mixed burst ---------------------------------------------------------------


class LeakTests(ProxyCase):
    async def test_mixed_burst_leaves_no_stray_upstream_connections(self) -> None:
        good = request(HOST, b"Content-Length: 2", line=b"POST / HTTP/1.1", body=b"hi")
        jobs = [Deferred.fromCoroutine(self.exchange(raw, wait=3.0)) for _, raw, _ in BAD_HEADS]
        jobs += [Deferred.fromCoroutine(self.exchange(good, responses=1)) for _ in range(10)]
        # answered before the body is complete: the upstream connection cannot be reused
        early = request(b"Host: early.example.com", b"Content-Length: 100", line=b"POST / HTTP/1.1")
        jobs += [Deferred.fromCoroutine(self.exchange(early + b"x" * 10)) for _ in range(4)]
        jobs += [
            Deferred.fromCoroutine(self.exchange(request(b"Host: silent.example.com"), responses=1))
            for _ in range(3)
        ]
        jobs += [
            Deferred.fromCoroutine(
                self.exchange(
                    request(
                        HOST,
                        b"Transfer-Encoding: chunked",
                        line=b"POST / HTTP/1.1",
                        body=b"1\r\nx\r\n-1\r\n",
                    ),
                    wait=2.0,
                )
            )
            for _ in range(5)
        ]
        replies = await gatherResults(jobs)
        statuses = sorted(r.status or 0 for r in replies)
        self.assertEqual(statuses.count(504), 3)
        self.assertEqual(statuses.count(200), 14)
        self.assert_backends_well_framed()
        await self.assert_clean()
        self.assertLessEqual(sum(len(v) for v in self.factory.pool._idle.values()), 10)


# --- the oracle: backend_problems must see what it is there to see -----------------------------


class OracleTests(TestCase):
    """The fuzz test is only as good as its checker: make sure it flags each kind of problem."""

    def test_clean_stream_has_no_problems(self) -> None:
        ok = (
            b"POST / HTTP/1.1\r\nHost: a.example.com\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"1\r\nx\r\n0\r\n\r\nGET / HTTP/1.1\r\nHost: a.example.com\r\nContent-Length: 1\r\n\r\n"
            b"y"
        )
        self.assertEqual(backend_problems(ok), [])
        self.assertEqual(backend_problems(ok[:-1]), [], "only the last request may be cut short")

    def test_each_problem_is_flagged(self) -> None:
        host = b"Host: a.example.com\r\n"
        cases = {
            "cl and te": b"POST / HTTP/1.1\r\n"
            + host
            + b"Content-Length: 5\r\n"
            + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "te twice": b"POST / HTTP/1.1\r\n"
            + host
            + b"Transfer-Encoding: chunked\r\n"
            + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "second request cut short": b"GET / HTTP/1.1\r\n"
            + host
            + b"Content-Length: 9\r\n\r\nx"
            + b"GET / HTTP/1.1\r\n"
            + host
            + b"\r\n",
            "no host": b"GET / HTTP/1.1\r\n\r\n",
            "two hosts": b"GET / HTTP/1.1\r\n" + host + host + b"\r\n",
            "internal": b"GET / HTTP/1.1\r\n" + host + b"x-LCHAT-sidecar: 1\r\n\r\n",
            "hop": b"GET / HTTP/1.1\r\n" + host + b"Proxy-Authorization: x\r\n\r\n",
            "garbage": b"GET / HTTP/1.1\r\n" + host + b"\r\n\x00\x01",
            "version": b"GET / HTTP/1.0\r\n" + host + b"\r\n",
            "trailers": b"POST / HTTP/1.1\r\n"
            + host
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + b"0\r\nX-T: 1\r\n\r\n",
            "absolute": b"GET http://a.example.com/ HTTP/1.1\r\n" + host + b"\r\n",
        }
        for name, data in cases.items():
            self.assertNotEqual(backend_problems(data), [], name)


# --- 5. hypothesis: adversarial heads against a proxy in its own process --------------------------


def mostly(
    common: st.SearchStrategy[T], rare: st.SearchStrategy[T], one_in: int
) -> st.SearchStrategy[T]:
    """``rare`` about once in ``one_in`` draws: most requests stay close enough to valid to be routed."""
    # hypothesis favours small integers: the rare branch sits at the top of the range
    return st.integers(0, one_in - 1).flatmap(lambda i: rare if i == one_in - 1 else common)


METHODS = mostly(
    st.sampled_from([b"GET", b"GET", b"POST", b"PUT", b"HEAD", b"OPTIONS", b"DELETE", b"PATCH"]),
    st.sampled_from([b"CONNECT", b"PRI", b"SOURCE", b"get", b"G ET", b"", b"GET\x00", b"M-SEARCH"])
    | st.binary(min_size=1, max_size=8),
    8,
)
TARGETS = mostly(
    st.sampled_from([b"/", b"/a?b=c", b"/x/y", b"//x"]),
    st.sampled_from(
        [
            b"*",
            b"http://chat.example.com/",
            b"/%00",
            b"/\x00",
            b"/a b",
            b"",
            b"/" + b"a" * 5000,
            b"chat.example.com:443",
            b"/\xff",
            b"/#frag",
            b"/a\tb",
        ]
    ),
    8,
)
VERSIONS = mostly(
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]),
    st.sampled_from(
        [
            b"HTTP/2.0",
            b"HTTP/0.9",
            b"HTTP/9.9",
            b"http/1.1",
            b"HTTP/1.1 ",
            b"",
            b"HTTP/1.1\x00",
            b"RTSP/1.0",
            b"ICE/1.0",
            b"HTTP/1.01",
            b"HTTP/11",
        ]
    ),
    10,
)
EOLS = mostly(st.just(b"\r\n"), st.sampled_from([b"\n", b"\r", b"\r\n ", b"\n\r", b"\r\r\n"]), 25)
HOST_VALUES = mostly(
    st.sampled_from(
        [b"chat.example.com", b"chat.example.com", b"CHAT.example.com:80", b"chat.example.com."]
    ),
    st.sampled_from(
        [
            b"unknown.example.com",
            b"../x",
            b"a/b",
            b"x\x00y",
            b"a" * 300,
            b"a b",
            b"",
            b"127.0.0.1",
            b"[::1]",
            b"localhost",
            b"chat.example.com, x.example.com",
            b"chat.example.com\xff",
        ]
    ),
    6,
)
TOKEN = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_!#$%&'*+.^`|~",
    min_size=1,
    max_size=12,
).map(str.encode)
PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=16).map(
    str.encode
)
Pair = tuple[bytes, bytes]
# Each of these is acceptable on its own; together they make framing conflicts, Connection
# games, internal and hop-by-hop headers, upgrades and expectations.
TRICKY: st.SearchStrategy[Pair] = st.one_of(
    st.tuples(
        st.sampled_from([b"Connection", b"connection"]),
        st.sampled_from(
            [
                b"close",
                b"keep-alive",
                b"Upgrade",
                b"X-Lchat-Sidecar",
                b"close, TE",
                b"content-length",
                b"transfer-encoding",
                b"x-forwarded-for",
                b"host",
                b"X-Other",
                b"keep-alive, Upgrade",
            ]
        ),
    ),
    st.tuples(
        st.sampled_from(
            [
                b"X-Lchat-Sidecar",
                b"x-lchat-mesh-forwarded",
                b"X-LCHAT-SIDECAR",
                b"Keep-Alive",
                b"TE",
                b"Trailer",
                b"Proxy-Authorization",
                b"Proxy-Connection",
                b"X-Forwarded-For",
                b"X-Forwarded-Proto",
                b"X-Other",
                b"Upgrade",
            ]
        ),
        st.sampled_from([b"1", b"trailers", b"secret", b"127.0.0.2", b"websocket", b"https"]),
    ),
    st.tuples(
        st.sampled_from([b"Content-Length", b"content-length"]),
        st.sampled_from([b"0", b"5", b"05", b"3", b"100"]),
    ),
    st.tuples(
        st.sampled_from([b"Transfer-Encoding", b"transfer-encoding"]),
        st.sampled_from([b"chunked", b"CHUNKED", b"chunked "]),
    ),
    st.tuples(st.just(b"Expect"), st.sampled_from([b"100-continue", b"100-Continue"])),
    st.tuples(TOKEN, PRINTABLE),
)
# Each of these is wrong on its own (or at least suspicious).
INVALID: st.SearchStrategy[Pair] = st.one_of(
    st.tuples(st.sampled_from([b"Host", b"host"]), HOST_VALUES),
    st.tuples(
        st.just(b"Content-Length"),
        st.sampled_from(
            [
                b"-1",
                b"+5",
                b"0x10",
                b"99999999999999999999",
                b"5, 5",
                b"",
                b"9223372036854775807",
                b"5\x00",
            ]
        ),
    ),
    st.tuples(
        st.just(b"Transfer-Encoding"),
        st.sampled_from(
            [
                b"gzip, chunked",
                b"chunked, gzip",
                b"identity",
                b"chunked\x00",
                b"",
                b"chunked;q=1",
                b"gzip",
            ]
        ),
    ),
    st.tuples(st.just(b"Expect"), st.just(b"foo")),
    st.tuples(
        st.sampled_from([b"Host ", b" Host", b"Content_Length", b"Transfer_Encoding", b"X A", b""]),
        st.sampled_from([b"chat.example.com", b"5", b"chunked"]),
    ),
    st.tuples(TOKEN, st.binary(max_size=24)),
    st.tuples(st.binary(max_size=12), st.binary(max_size=24)),
)
SEPARATORS = mostly(st.just(b": "), st.sampled_from([b":", b" : ", b":\t", b"::", b""]), 12)
BODIES = mostly(
    st.sampled_from(
        [
            b"",
            b"",
            b"hello",
            b"5\r\nhello\r\n0\r\n\r\n",
            b"1;ext\r\nx\r\n0\r\n\r\n",
            b"0\r\n\r\n",
            b"0\r\nX-Lchat-Sidecar: 1\r\n\r\n",
            b"5c\r\n" + SMUGGLED + b"\r\n0\r\n\r\n",
            SMUGGLED,
            b"0\r\n\r\n" + SMUGGLED,
        ]
    ),
    st.sampled_from([b"-1\r\nx\r\n", b"fffffffffffffffffff\r\n", b"3\r\nabc0\r\n\r\n"])
    | st.binary(max_size=40),
    6,
)


@st.composite
def request_heads(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 14)) == 14:
        return draw(st.binary(min_size=1, max_size=200))
    eol = b"\r\n"
    line = draw(METHODS) + b" " + draw(TARGETS) + b" " + draw(VERSIONS)
    headers = draw(st.lists(TRICKY, max_size=5))
    if draw(st.integers(0, 9)) < 8:
        headers.insert(draw(st.integers(0, len(headers))), (b"Host", draw(HOST_VALUES)))
    if draw(st.integers(0, 2)) == 2:
        headers.insert(draw(st.integers(0, len(headers))), draw(INVALID))
    if draw(st.integers(0, 7)) == 7:
        headers += [(b"X-Pad-%d" % i, b"p" * 200) for i in range(draw(st.integers(10, 30)))]
    parts = [line, draw(EOLS)]
    for name, value in headers:
        parts += [name, draw(SEPARATORS), value, draw(EOLS)]
    parts.append(eol)
    parts.append(draw(BODIES))
    data = b"".join(parts)
    if draw(st.integers(0, 4)) == 4:  # something pipelined behind it
        data += draw(st.sampled_from([request(HOST, line=b"GET /second HTTP/1.1"), SMUGGLED]))
    return data


class FuzzServer:
    """The proxy and a recording backend in a child process (tests/proxy_harness.py main)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="advh-fuzz-", dir="/tmp")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.proxy_harness", self.dir],
            stdout=subprocess.PIPE,
            env=env,
            cwd=root,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fuzz proxy did not start")
        self.port: int = json.loads(line)["port"]
        self.sizes: dict[str, int] = {}
        self.checked: dict[str, int] = {}  # complete requests already checked, per stream

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def new_backend_problems(self) -> list[str]:
        """Problems in the requests backends received since the last call (a pooled backend
        connection carries requests of many examples: each is blamed on the one that sent it)."""
        out = []
        for name, stream in self.changed_backend_streams().items():
            first = self.checked.get(name, 0)
            out += [f"{name}: {p}" for p in backend_problems(stream, first=first)]
            self.checked[name] = len(parse_requests(stream).complete)
        return out

    def changed_backend_streams(self) -> dict[str, bytes]:
        """Every backend connection that received bytes since the last call: its whole stream."""
        out = {}
        for name in sorted(os.listdir(self.dir)):
            if not name.startswith("conn-"):
                continue
            path = os.path.join(self.dir, name)
            size = os.path.getsize(path)
            if size != self.sizes.get(name, 0):
                self.sizes[name] = size
                with open(path, "rb") as f:
                    out[name] = f.read()
        return out

    def errors(self) -> str:
        with open(os.path.join(self.dir, "errors.log")) as f:
            return f.read()

    def stats(self) -> dict[str, float]:
        raw = request(b"Host: stats.example.com", b"Connection: close")
        data, _, _ = blocking(self.port, raw, deadline=2.0)
        stats: dict[str, float] = json.loads(data.split(b"\r\n\r\n", 1)[1])
        return stats


def blocking(
    port: int, data: bytes | Sequence[bytes], deadline: float
) -> tuple[bytes, bool, float]:
    return blocking_exchange(port, data, deadline=deadline)


class FuzzTests(TestCase):
    timeout = 120

    def test_adversarial_heads_never_crash_hang_or_reach_the_backend_ambiguously(self) -> None:
        server = FuzzServer()
        self.addCleanup(server.stop)
        cfg = FUZZ_CONFIG
        deadline = cfg.header_timeout + 1.0
        normal = request(HOST, b"Connection: close", line=b"GET /health HTTP/1.1")

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(raw=request_heads(), cuts=st.lists(st.floats(0.0, 1.0), max_size=3))
        def check(raw: bytes, cuts: list[float]) -> None:
            # the same bytes, arriving in up to four reads
            at = sorted({int(c * len(raw)) for c in cuts} - {0, len(raw)})
            pieces = [raw[i:j] for i, j in zip([0, *at], [*at, len(raw)], strict=True)]
            data, closed, elapsed = blocking(server.port, pieces, deadline)
            # answered, or closed, within header_timeout + slack: never hung
            assert closed or data, f"no answer and not closed after {elapsed:.2f}s"
            if data:
                assert STATUS_LINE.match(data), f"not an HTTP/1.1 status line: {data[:80]!r}"
                statuses = Reply(data, closed, elapsed).statuses()
                if statuses and statuses[-1] in REFUSALS:
                    assert closed, f"{statuses[-1]} without closing the connection"
            problems = server.new_backend_problems()
            assert not problems, problems
            # The same process keeps serving a normal request.
            data, _, _ = blocking(server.port, normal, deadline)
            assert data.startswith(b"HTTP/1.1 200 "), f"the proxy stopped serving: {data[:80]!r}"

        check()
        self.assertEqual(server.errors(), "", "the proxy logged errors")
        stats: dict[str, float] = {}

        def settled() -> bool:
            stats.update(server.stats())
            # the stats request itself is in flight and holds one client connection
            return (
                stats["in_flight"] == 1
                and stats["connections"] == 1
                and stats["upstream_total"] == stats["upstream_idle"]
            )

        for _ in range(40):
            if settled():
                break
            time.sleep(0.05)
        self.assertEqual(stats["in_flight"], 1, stats)
        self.assertEqual(stats["connections"], 1, stats)
        self.assertEqual(stats["upstream_total"], stats["upstream_idle"], stats)

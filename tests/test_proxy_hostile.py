"""Hostile clients at the front door (issue 15, "Hostile clients"): each case an outside probe of the
router found, checked the way tests/test_proxy_adversarial.py checks everything: real sockets, the
real proxy listening on 127.0.0.1, real unix-socket backends recording every raw byte they receive.

Only what a client sees (status, bytes, when the connection closes), what a backend received
(re-parsed with httptools) and Prometheus samples are asserted, never the proxy's internals, so the
same tests hold for any implementation of the data plane behind :class:`ProxyCase`.

Covered elsewhere, not repeated here: the client that pipelines and never reads, and
``LCHAT_SEND_TIMEOUT`` (``SlowReaderTests`` and ``SlowReaderTLSTests`` in test_proxy_adversarial).

nginx 1.22 was asked the same questions (a throwaway config in front of a recording backend); what it
answered is noted on each test, and is the expected answer unless said otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any, ClassVar

import attrs
from prometheus_client import REGISTRY
from twisted.trial.unittest import SkipTest

from lchat.config import ProxyConfig
from tests.proxy_harness import (
    BackendConnection,
    RawClient,
    RecordingBackend,
    Reply,
    parse_requests,
    response_statuses,
)
from tests.test_proxy_adversarial import (
    CFG,
    EARLY,
    HOST,
    KNOWN,
    MEDIUM,
    MEDIUM_BODY,
    REFUSALS,
    SILENT,
    ProxyCase,
    chunked,
    request,
    sample,
    sleep,
    until,
)

# Timeouts far longer than any test waits: a close or an answer that comes within a second or two
# is the proxy's decision, never one of these running out.
PATIENT = attrs.evolve(CFG, header_timeout=10.0, keepalive_timeout=10.0)
PROMPTLY = 1.0  # "at once", with room for a loaded 2-core machine (normally a few milliseconds)


def rejected(status: int) -> float:
    return sample_labelled("lchat_http_rejected_total", reason=str(status))


def sample_labelled(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def body_received(backend: RecordingBackend) -> int:
    """Body bytes (de-chunked) the backend received, over all its requests."""
    return sum(len(m.body) for m in backend.requests())


class HostileCase(ProxyCase):
    cfg: ClassVar[ProxyConfig] = PATIENT

    def assert_refused_at_once(self, reply: Reply, status: int, what: object = "") -> None:
        """``status`` with ``Connection: close``, and the connection closed, promptly."""
        self.assertEqual(reply.status, status, (what, reply.data[:300]))
        self.assertEqual(reply.header(b"connection"), b"close", what)
        self.assertTrue(reply.closed, f"{what}: the proxy must close after refusing")
        self.assertLess(reply.elapsed, PROMPTLY, f"{what}: refused at once, not timed out")

    async def assert_backend_connections_closed(self) -> None:
        """Every connection the proxy opened to a backend is closed, none carried a whole request."""
        conns = self.all_backend_connections()
        self.assertTrue(
            await until(lambda: all(c.is_lost for c in conns), PROMPTLY),
            "a backend connection was left open",
        )
        for conn in conns:
            self.assertEqual(parse_requests(bytes(conn.raw)).complete, [], conn.raw[:200])


# --- upgraded tunnels: LCHAT_TUNNEL_IDLE_TIMEOUT -------------------------------------------------

UPGRADE = request(
    HOST,
    b"Connection: Upgrade",
    b"Upgrade: websocket",
    b"Sec-WebSocket-Version: 13",
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
    line=b"GET /ws HTTP/1.1",
)
SWITCHED = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
TUNNEL = SILENT  # the backend that never answers, made to switch (TunnelIdleTests._set_up)


class TunnelConnection(BackendConnection):
    """A backend connection that answers an upgrade request with 101 and then echoes raw bytes
    (when its backend's ``echo`` is on), keeping every raw byte like any recording backend."""

    backend: TunnelBackend

    def __init__(self, backend: TunnelBackend, number: int) -> None:
        super().__init__(backend, number)
        self.switched = False
        self.tunnelled = bytearray()  # what came through the tunnel, after the upgrade head

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.collector.current.values("upgrade"):
            assert self.transport is not None
            self.transport.write(SWITCHED)
            self.switched = True

    def dataReceived(self, data: bytes) -> None:
        if self.switched:
            self.raw += data
            self.tunnelled += data
            if self.backend.echo and self.transport is not None:
                self.transport.write(data)
            return
        super().dataReceived(data)


class TunnelBackend(RecordingBackend):
    """A recording backend whose connections switch protocols (see :class:`TunnelConnection`)."""

    echo = True

    def buildProtocol(self, addr: Any) -> BackendConnection:
        self._count += 1
        return TunnelConnection(self, self._count)


class TunnelIdleTests(HostileCase):
    """An upgraded (101) tunnel that carries no byte either way for ``tunnel_idle_timeout`` is
    closed, both sides, and counted in ``lchat_http_tunnel_idle_closes_total``; a byte either way
    starts the wait again. (nginx closes a quiet tunnel after ``proxy_read_timeout``, 60 s by
    default; 10 minutes here leaves room for a chat WebSocket's pings.)"""

    IDLE = 0.8  # the keep-open tests send a byte every IDLE/4: a 0.6 s stall would not break them
    cfg = attrs.evolve(PATIENT, tunnel_idle_timeout=IDLE)

    async def _set_up(self) -> None:
        await super()._set_up()
        # The backend that never answers becomes one that switches (only test objects change:
        # the proxy still routes silent.example.com to the same socket).
        self.backends[TUNNEL].__class__ = TunnelBackend

    @property
    def tunnel_backend(self) -> TunnelBackend:
        backend = self.backends[TUNNEL]
        assert isinstance(backend, TunnelBackend)
        return backend

    async def open_tunnel(self) -> tuple[RawClient, TunnelConnection]:
        """A client whose upgrade was switched and whose first bytes came back (or, without echo,
        reached the space)."""
        client = await self.connect()
        assert client.transport is not None
        client.transport.write(UPGRADE.replace(HOST, f"Host: {TUNNEL}".encode()))
        self.assertTrue(await until(lambda: bytes(client.received).startswith(SWITCHED), 3.0))
        (space,) = self.backends[TUNNEL].connections
        assert isinstance(space, TunnelConnection)
        client.transport.write(b"ping")
        self.assertTrue(await until(lambda: bytes(space.tunnelled) == b"ping", 3.0))
        if self.tunnel_backend.echo:
            self.assertTrue(await until(lambda: bytes(client.received) == SWITCHED + b"ping", 3.0))
        return client, space

    async def assert_idle_close(self, client: RawClient, space: TunnelConnection) -> None:
        """Nothing more moves: both sides are closed after IDLE (not before), and it is counted."""
        closes = sample("lchat_http_tunnel_idle_closes_total")
        quiet_since = time.monotonic()
        closed = await until(lambda: client.is_closed, self.IDLE + 3.0)
        self.assertTrue(closed, f"a tunnel quiet for {self.IDLE + 3.0:.1f}s is still open")
        self.assertGreater(client.closed_at - quiet_since, self.IDLE * 0.8, "closed too early")
        self.assertTrue(await until(lambda: space.is_lost, PROMPTLY), "the space side stayed open")
        self.assertEqual(sample("lchat_http_tunnel_idle_closes_total"), closes + 1)
        await self.assert_clean()

    async def test_idle_tunnel_is_closed_on_both_sides(self) -> None:
        client, space = await self.open_tunnel()
        await self.assert_idle_close(client, space)

    async def test_bytes_from_the_client_keep_the_tunnel_open(self) -> None:
        self.tunnel_backend.echo = False  # nothing comes back: only the client's bytes move
        client, space = await self.open_tunnel()
        assert client.transport is not None
        for _ in range(8):  # 8 * IDLE/4: twice the timeout, never IDLE without a byte
            await sleep(self.IDLE / 4)
            self.assertFalse(client.is_closed, "closed while the client was sending")
            client.transport.write(b".")
        self.assertTrue(await until(lambda: bytes(space.tunnelled) == b"ping" + b"." * 8, 2.0))
        self.assertEqual(bytes(client.received), SWITCHED)
        await self.assert_idle_close(client, space)

    async def test_bytes_from_the_space_keep_the_tunnel_open(self) -> None:
        client, space = await self.open_tunnel()
        assert space.transport is not None
        for _ in range(8):
            await sleep(self.IDLE / 4)
            self.assertFalse(client.is_closed, "closed while the space was sending")
            space.transport.write(b"!")
        self.assertTrue(
            await until(lambda: bytes(client.received) == SWITCHED + b"ping" + b"!" * 8, 2.0)
        )
        self.assertEqual(bytes(space.tunnelled), b"ping")
        await self.assert_idle_close(client, space)


class TunnelIdleTLSTests(TunnelIdleTests):
    secure = True


# --- request bodies: LCHAT_MAX_BODY ---------------------------------------------------------------

LIMIT = 1000
STREAMING = EARLY  # answers at the head and never ends its answer (MaxBodyTests._set_up)
OPEN_ANSWER = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"


class OpenAnswerConnection(BackendConnection):
    """Answers a request as soon as its head is parsed with the start of a chunked response that
    never ends (the proxy relays it as it comes)."""

    def _answer(self) -> None:
        assert self.transport is not None
        self.answered += 1
        self.transport.write(OPEN_ANSWER)


class OpenAnswerBackend(RecordingBackend):
    def buildProtocol(self, addr: Any) -> BackendConnection:
        self._count += 1
        return OpenAnswerConnection(self, self._count)


class MaxBodyTests(HostileCase):
    """At most ``max_body`` bytes of request body. A larger ``Content-Length`` is answered 413 (with
    ``Connection: close``, the connection closed) before anything is dialled; a chunked body that
    grows past it is answered 413 if its response has not started, else the client connection is
    aborted; either way the space's connection is aborted and the space never receives more than
    ``max_body`` body bytes. Exactly ``max_body`` passes. Each 413 counts in
    ``lchat_http_rejected_total{reason="413"}``. (nginx, client_max_body_size: the same statuses,
    413 with ``Connection: close``, nothing sent upstream, with request buffering on or off. For an
    announced length it then kept the connection open a few seconds, reading to discard the body
    that never came; here the client must see the close at once: a half-close, so that a client
    still uploading reads the 413 before a reset, is fine.)"""

    cfg = attrs.evolve(PATIENT, max_body=LIMIT)

    async def _set_up(self) -> None:
        await super()._set_up()
        # The backend that answers at the head now leaves its answer open (test objects only:
        # the proxy routes early.example.com to the same socket).
        self.backends[STREAMING].__class__ = OpenAnswerBackend

    def post(self, *headers: bytes, host: bytes = HOST, body: bytes = b"") -> bytes:
        return request(host, *headers, line=b"POST /up HTTP/1.1", body=body)

    async def test_content_length_over_the_limit_is_413_and_nothing_is_dialled(self) -> None:
        for length in (LIMIT + 1, 10**12):
            before = rejected(413)
            reply = await self.exchange(self.post(b"Content-Length: %d" % length), wait=3.0)
            self.assert_refused_at_once(reply, 413, length)
            self.assertEqual(rejected(413), before + 1)
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_bodies_of_exactly_the_limit_pass(self) -> None:
        body = bytes(range(256)) * 3 + b"x" * (LIMIT - 768)
        for raw in (
            self.post(b"Content-Length: %d" % LIMIT, body=body),
            self.post(b"Transfer-Encoding: chunked", body=chunked(body[:600], body[600:])),
        ):
            reply = await self.exchange(raw, responses=1)
            self.assertEqual(reply.status, 200, reply.data[:200])
        self.assertEqual([m.body for m in self.backends[KNOWN].requests()], [body, body])
        self.assert_backends_well_framed()
        await self.assert_clean()

    async def test_chunked_body_growing_past_the_limit_is_413(self) -> None:
        """The first 600 bytes are streamed to the space; the next 600 would pass the limit."""
        before = rejected(413)
        backend = self.backends[KNOWN]
        client = await self.connect()
        head = self.post(b"Transfer-Encoding: chunked")
        await self.converse(client, head + b"258\r\n" + b"a" * 600 + b"\r\n", wait=0.0)
        self.assertTrue(await until(lambda: body_received(backend) == 600, 3.0))
        started = time.monotonic()
        reply = await self.converse(client, b"258\r\n" + b"b" * 600 + b"\r\n", wait=3.0)
        reply.elapsed = (client.closed_at if client.is_closed else time.monotonic()) - started
        self.assert_refused_at_once(reply, 413)
        self.assertEqual(rejected(413), before + 1)
        await self.assert_backend_connections_closed()
        self.assertLessEqual(body_received(backend), LIMIT)
        await self.assert_clean()

    async def test_chunked_body_past_the_limit_in_one_read_is_413(self) -> None:
        bodies = [
            chunked(b"a" * 400, b"b" * 400, b"c" * 400),  # three chunks, the third one too many
            b"%x\r\n" % (1 << 20) + b"d" * (LIMIT + 500),  # one chunk announced far larger
        ]
        for body in bodies:
            reply = await self.exchange(self.post(b"Transfer-Encoding: chunked", body=body))
            self.assert_refused_at_once(reply, 413, body[:8])
        await self.assert_backend_connections_closed()
        for conn in self.backends[KNOWN].connections:
            received = sum(len(m.body) for m in parse_requests(bytes(conn.raw)).messages)
            self.assertLessEqual(received, LIMIT)
        await self.assert_clean()

    async def test_body_past_the_limit_after_the_response_started_aborts(self) -> None:
        """The space answers at the head and streams its answer (never finishing it, as a long
        poll or an echo would): the client already has a 200 head, so no 413 can follow; at the
        limit its connection is cut, and so is the space's."""
        backend = self.backends[STREAMING]
        client = await self.connect()
        head = self.post(b"Transfer-Encoding: chunked", host=f"Host: {STREAMING}".encode())
        await self.converse(client, head + b"258\r\n" + b"a" * 600 + b"\r\n", wait=0.0)
        self.assertTrue(await until(lambda: b"hello" in client.received, 3.0))
        self.assertTrue(client.received.startswith(b"HTTP/1.1 200 "), client.received)
        self.assertTrue(await until(lambda: body_received(backend) == 600, 3.0))
        self.assertFalse(client.is_closed)
        answer = bytes(client.received)
        started = time.monotonic()
        await self.converse(client, b"258\r\n" + b"b" * 600 + b"\r\n", wait=3.0)
        self.assertTrue(client.is_closed, "the connection must end at the limit")
        self.assertLess(client.closed_at - started, PROMPTLY)
        self.assertEqual(bytes(client.received), answer, "nothing after the open answer")
        await self.assert_backend_connections_closed()
        self.assertLessEqual(body_received(backend), LIMIT)
        await self.assert_clean()


class UnlimitedBodyTests(HostileCase):
    """``max_body = 0``: no limit (as nginx's ``client_max_body_size 0``)."""

    cfg = attrs.evolve(PATIENT, max_body=0)

    async def test_zero_means_no_limit(self) -> None:
        body = b"z" * 150_000
        for raw in (
            request(HOST, b"Content-Length: %d" % len(body), line=b"POST / HTTP/1.1", body=body),
            request(
                HOST, b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.1", body=chunked(body)
            ),
        ):
            reply = await self.exchange(raw, responses=1)
            self.assertEqual(reply.status, 200, reply.data[:200])
        self.assertEqual([m.body for m in self.backends[KNOWN].requests()], [body, body])
        await self.assert_clean()


# --- the listen backlog --------------------------------------------------------------------------


class BacklogTests(HostileCase):
    """The listening socket's backlog is the system's ``somaxconn`` (Twisted's default is 50: a
    burst of connects beyond it is dropped by the kernel). ``ss -ltn`` shows a listening socket's
    backlog in its Send-Q column. This checks the socket ProxyCase listens on, so it checks the
    router only as long as ProxyCase listens the way the router does."""

    def test_listen_backlog_is_somaxconn(self) -> None:
        ss = shutil.which("ss")
        if ss is None or not os.path.exists("/proc/sys/net/core/somaxconn"):
            raise SkipTest("needs ss (iproute2) and /proc/sys/net/core/somaxconn")
        with open("/proc/sys/net/core/somaxconn") as f:
            somaxconn = int(f.read())
        out = subprocess.run(
            [ss, "-ltnH", f"sport = :{self.port}"], capture_output=True, text=True, check=True
        ).stdout
        rows = [line.split() for line in out.splitlines() if line.strip()]
        self.assertEqual(len(rows), 1, out)
        state, _recv_q, send_q = rows[0][:3]
        self.assertEqual(state, "LISTEN", out)
        self.assertEqual(int(send_q), somaxconn, f"listen backlog {send_q}, somaxconn {somaxconn}")


# --- Host: nothing but printable ASCII ------------------------------------------------------------

# Each of these reached chat.example.com: the proxy read the bytes as Latin-1 and IDNA mapped them
# (ª -> a, a soft hyphen -> nothing). nginx does not fold them either: it treats a byte >= 0x80 as
# part of a name no server_name matches (its default server answers; 404 in the probe), and
# answers 400 to a control character. The router refuses all of them: 400.
BAD_HOSTS = [
    b"ch\xaat.example.com",  # ª, NFKC "a": the probe's "Host: \xaa.test" reaching a.test
    b"\xaa.test",
    b"chat\xad.example.com",  # soft hyphen, mapped to nothing
    b"CHAT.EXAMPLE.COM\xad",
    b"ch\xc2\xaat.example.com",  # ª in UTF-8
    b"chat.example.com\xff",
    b"chat.example.com\x85",  # NEL
    b"chat.example.com\xa0",  # no-break space
    b"chat\x01.example.com",
    b"chat\x1b.example.com",
    b"chat.example.com\x7f",
]


class HostHeaderTests(HostileCase):
    async def test_non_ascii_and_control_bytes_in_host_are_400(self) -> None:
        before = rejected(400)
        for host in BAD_HOSTS:
            reply = await self.exchange(request(b"Host: " + host), wait=3.0)
            self.assert_refused_at_once(reply, 400, host)
        self.assertEqual(rejected(400), before + len(BAD_HOSTS))
        await self.assert_backend_untouched()
        await self.assert_clean()

    async def test_the_a_label_of_an_idn_is_a_name_like_any_other(self) -> None:
        reply = await self.exchange(request(b"Host: xn--bcher-kva.example"), responses=1)
        self.assertEqual(reply.status, 404)  # well-formed, merely unknown
        await self.assert_clean()


# --- header names with underscores ----------------------------------------------------------------


class UnderscoreHeaderTests(HostileCase):
    """Header names with an underscore are dropped on the way to the space, silently, and the
    request is served (nginx's ``underscores_in_headers off``: it forwarded ``X-Bar`` and dropped
    ``X_Foo``, answering 200). A CGI/WSGI-style space reads ``X_Foo`` and ``X-Foo`` as the same
    ``HTTP_X_FOO``: a client could otherwise forge a header a front proxy set or vetted."""

    async def test_underscored_names_never_reach_the_backend(self) -> None:
        raw = request(
            HOST,
            b"X_Foo: forged",
            b"X-Foo: 1",
            b"x_foo: forged-again",
            b"Accept_Language: xx",
            b"_: 1",
            b"Content_Length: 99",
            b"Content-Length: 2",
            line=b"POST /u HTTP/1.1",
            body=b"hi",
        )
        reply = await self.exchange(raw, responses=1)
        self.assertEqual(reply.status, 200, reply.data[:200])
        (msg,) = self.backends[KNOWN].requests()
        self.assertEqual([n for n, _ in msg.headers if b"_" in n], [])
        self.assertEqual(msg.values("x-foo"), [b"1"])
        self.assertEqual(msg.body, b"hi")
        self.assert_backends_well_framed()
        await self.assert_clean()


# --- HTTP/1.0 with Transfer-Encoding --------------------------------------------------------------


class Http10ChunkedTests(HostileCase):
    """HTTP/1.0 has no transfer codings (RFC 9112 §6.1: a server MAY treat it as faulty framing;
    nginx answers 400 and closes): 400, nothing forwarded."""

    async def test_http_1_0_with_transfer_encoding_is_400(self) -> None:
        for raw in (
            request(
                HOST,
                b"Transfer-Encoding: chunked",
                line=b"POST / HTTP/1.0",
                body=chunked(b"abc"),
            ),
            request(
                HOST,
                b"Transfer-Encoding: chunked",
                b"Connection: keep-alive",
                line=b"POST / HTTP/1.0",
                body=chunked(b"abc"),
            ),
            request(HOST, b"Transfer-Encoding: chunked", line=b"GET / HTTP/1.0", body=b"0\r\n\r\n"),
        ):
            reply = await self.exchange(raw, wait=3.0)
            self.assert_refused_at_once(reply, 400, raw[:40])
        await self.assert_backend_untouched()
        await self.assert_clean()


# --- chunk sizes past 64 bits ---------------------------------------------------------------------

OVERFLOWING_SIZES = [
    b"fffffffffffffffff",  # 17 hex digits
    b"10000000000000000",  # 2**64
    b"ffffffffffffffffffffffffffffffff",
    b"10000000000000001",
]


class ChunkSizeOverflowTests(HostileCase):
    """A chunk size that does not fit in 64 bits: 400 at once (nginx: 400, immediately), with the
    space's connection (opened for the head) closed and never a whole request on it; never an
    answer only when a timeout runs out (here 10 s away)."""

    async def test_overflowing_chunk_size_is_400_at_once(self) -> None:
        for size in OVERFLOWING_SIZES:
            raw = request(
                HOST,
                b"Transfer-Encoding: chunked",
                line=b"POST / HTTP/1.1",
                body=size + b"\r\nabc",
            )
            reply = await self.exchange(raw, wait=3.0)
            self.assert_refused_at_once(reply, 400, size)
        await self.assert_backend_connections_closed()
        await self.assert_clean()

    async def test_overflowing_chunk_size_after_streaming_began_is_400_at_once(self) -> None:
        backend = self.backends[KNOWN]
        for size in OVERFLOWING_SIZES[:2]:
            had = body_received(backend)
            client = await self.connect()
            head = request(HOST, b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.1")
            await self.converse(client, head + b"3\r\nabc\r\n", wait=0.0)

            def arrived(expected: int = had + 3) -> bool:
                return body_received(backend) == expected

            self.assertTrue(await until(arrived, 3.0))
            started = time.monotonic()
            reply = await self.converse(client, size + b"\r\nabc", wait=3.0)
            reply.elapsed = (client.closed_at if client.is_closed else time.monotonic()) - started
            self.assert_refused_at_once(reply, 400, size)
        await self.assert_backend_connections_closed()
        await self.assert_clean()


# --- a bad request pipelined behind a good one ----------------------------------------------------

GOOD = request(HOST, line=b"GET /good HTTP/1.1")
BAD_TAILS = {
    "garbage": b"\x00\x01garbage\r\n\r\n",
    "tls_hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
    "header_syntax": request(HOST, b"X A: b", line=b"GET /bad HTTP/1.1"),
    "cl_and_te": request(
        HOST,
        b"Content-Length: 3",
        b"Transfer-Encoding: chunked",
        line=b"POST /bad HTTP/1.1",
        body=b"0\r\n\r\n",
    ),
    "bad_host": request(b"Host: ch\xaat.example.com", line=b"GET /bad HTTP/1.1"),
    "http_1_0_chunked": request(
        HOST, b"Transfer-Encoding: chunked", line=b"POST /bad HTTP/1.0", body=b"0\r\n\r\n"
    ),
    "bad_version": request(HOST, line=b"GET /bad HTTP/2.0"),
    "bad_chunk": request(
        HOST, b"Transfer-Encoding: chunked", line=b"POST /bad HTTP/1.1", body=b"zz\r\n"
    ),
}


class PipelinedBadRequestTests(HostileCase):
    """A bad request pipelined behind a good one: the good one is answered in full, then, at
    most, a 400 (nginx: the 200, then a 400 with ``Connection: close``), and the connection closes
    at once; never a 408 when the header timeout (10 s here) runs out, and the bad one never
    reaches a space."""

    WAIT = 2.0  # per case: twice PROMPTLY, and far from the 10 s header timeout

    def problems(
        self, name: str, reply: Reply, good: int = 200, within: float = PROMPTLY
    ) -> list[str]:
        """What is wrong with ``reply``: it must hold the good answer, whole (a response parser
        finds it complete: its body came before anything else), then at most one refusal with
        ``Connection: close``, and end with the close, within ``within``; never a 408."""
        statuses = response_statuses(reply.data)
        out = []
        if statuses[:1] != [good] or len(statuses) > 2:
            out.append(f"{name}: responses {statuses}, expected [{good}] or [{good}, 400]")
        elif len(statuses) == 2:
            # nginx: 400; the bad request's own refusal (505 for HTTP/2.0, say) will do as well
            if statuses[1] not in REFUSALS - {408}:
                out.append(f"{name}: second response {statuses[1]}")
            if b"\r\nconnection: close\r\n" not in reply.data.lower():
                out.append(f"{name}: the refusal does not say Connection: close")
        if b"HTTP/1.1 408 " in reply.data:
            out.append(f"{name}: a 408")
        if not reply.closed:
            out.append(f"{name}: still open after {reply.elapsed:.1f}s")
        elif reply.elapsed >= within:
            out.append(f"{name}: closed after {reply.elapsed:.2f}s (a timeout?)")
        return out

    async def test_good_answer_then_close(self) -> None:
        problems = []
        for name, tail in BAD_TAILS.items():
            reply = await self.exchange(GOOD + tail, wait=self.WAIT)
            problems += self.problems(name, reply)
        self.assertEqual(problems, [])
        targets = [m.target for m in self.backends[KNOWN].requests()]
        self.assertEqual(targets, [b"/good"] * len(BAD_TAILS), "only the good ones reach a space")
        await self.assert_clean()

    async def test_large_good_answer_is_delivered_whole_then_close(self) -> None:
        good = request(f"Host: {MEDIUM}".encode(), line=b"GET /medium HTTP/1.1")
        problems = []
        for name in ("garbage", "header_syntax", "bad_host"):
            reply = await self.exchange(good + BAD_TAILS[name], wait=self.WAIT)
            problems += self.problems(name, reply)
            if b"b" * MEDIUM_BODY not in reply.data:
                problems.append(f"{name}: the {MEDIUM_BODY}-byte body is not all there")
        self.assertEqual(problems, [])
        self.assertEqual(len(self.backends[MEDIUM].requests()), 3)
        await self.assert_clean()

    async def test_bad_request_arriving_while_the_good_one_is_with_its_space(self) -> None:
        """The bad bytes come in a read of their own while the good request waits for its space
        (one that never answers: the good request's answer is the upstream timeout's 504)."""
        problems = []
        for name in ("garbage", "header_syntax", "cl_and_te"):
            client = await self.connect()
            await self.converse(client, request(f"Host: {SILENT}".encode()), wait=0.1)
            reply = await self.converse(
                client, BAD_TAILS[name], wait=self.cfg.upstream_timeout + self.WAIT
            )
            whole = Reply(bytes(client.received), reply.closed, reply.elapsed)
            problems += self.problems(
                name, whole, good=504, within=self.cfg.upstream_timeout + PROMPTLY
            )
        self.assertEqual(problems, [])
        self.assertEqual([m.target for m in self.backends[SILENT].requests()], [b"/"] * 3)
        await self.assert_clean()

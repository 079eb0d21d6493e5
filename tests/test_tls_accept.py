"""The asyncio TLS front door (:mod:`lchat.proxy.tls_accept`): real sockets on 127.0.0.1, real TLS
clients (Python's ``ssl`` in threads, Twisted's verifying client), a tiny asyncio application.

Everything :class:`tests.test_tls.FrontDoorCases` expects of a front door, twice: with nothing
obtaining certificates on demand (connections go to TLS at once) and with an issuer listening (each
ClientHello is peeked for its name first). Then first contact: a host whose certificate is being
issued gets it in its very first handshake; nothing else ever waits.

Runs on the reactor's own asyncio loop, as the router does: ``trial --reactor=uvloop`` (how
``python -m tests.parallel`` and ``make test`` run it). On another reactor every test that serves
fails, naming that fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from cryptography import x509
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import task, threads
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import certfiles, tls, uvloop_reactor
from lchat.proxy import tls_accept
from lchat.proxy.tls_accept import Incomplete, TLSAcceptor, client_hello_server_name
from tests.test_tls import (
    FrontDoorCases,
    TestCA,
    captured_logs,
    client_hello,
    handshake,
    reactor,
    sample,
)

ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 15\r\n"
    b"connection: close\r\n\r\nhello over tls\n"
)


class HelloApp(asyncio.Protocol):
    """The application behind the front door: answers the first request head, then closes."""

    def __init__(self, open_connections: set[HelloApp]) -> None:
        self.open = open_connections
        self.buffer = b""
        self.transport: Any = None  # uvloop's SSL transport (not an asyncio.Transport subclass)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.open.add(self)
        ssl_object = transport.get_extra_info("ssl_object")
        assert ssl_object is not None  # only ever reached over TLS

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if b"\r\n\r\n" in self.buffer and self.transport is not None:
            self.transport.write(ANSWER)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open.discard(self)


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class AcceptorHarness(TestCase):
    """Serves with a :class:`TLSAcceptor` on the reactor's own asyncio loop."""

    def serve(self, store: tls.CertStore, **kw: Any) -> Deferred[int]:
        loop = uvloop_reactor.loop_of(reactor)  # on another reactor: an error naming the fix
        sock = listening_socket()
        self.app_connections: set[HelloApp] = set()
        self.acceptor = TLSAcceptor(
            loop,
            sock,
            lambda: HelloApp(self.app_connections),
            store,
            clock=reactor,
            **kw,
        )
        self.acceptor.start()
        self.addCleanup(self.drain)
        self.addCleanup(self.acceptor.close)
        return succeed(sock.getsockname()[1])

    @inlineCallbacks
    def drain(self) -> Any:
        for _ in range(500):
            if self.acceptor.pending == 0 and not self.app_connections:
                return
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.fail(
            f"server connections still open: {self.acceptor.pending} in their handshake, "
            f"{len(self.app_connections)} served"
        )


class AcceptorSNITests(FrontDoorCases, AcceptorHarness):
    """Nothing obtains certificates on demand: every connection goes to TLS at once."""


class AcceptorPeekingSNITests(AcceptorSNITests):
    """An issuer listens (it declines every host, so nothing is held): every connection's
    ClientHello is peeked for its name before TLS gets it, and everything else is the same."""

    def make_store(self, **kw: Any) -> tls.CertStore:
        wanted = tls.CertificateWanted()
        wanted.connect(lambda host: False)
        return super().make_store(wanted=wanted, **kw)

    def count_peeks(self) -> tuple[list[str | None], list[object]]:
        """(the names read from ClientHellos, the connections watched for the rest of one)."""
        names: list[str | None] = []
        watched: list[object] = []
        peeked, start = TLSAcceptor._peeked, tls_accept._Peek.start

        def reading(acceptor: TLSAcceptor, conn: Any, peer: str, name: str | None) -> None:
            names.append(name)
            peeked(acceptor, conn, peer, name)

        def watching(peek: tls_accept._Peek) -> None:
            watched.append(peek)
            start(peek)

        self.patch(TLSAcceptor, "_peeked", reading)
        self.patch(tls_accept._Peek, "start", watching)
        return names, watched

    @inlineCallbacks
    def test_every_connection_is_peeked(self) -> Any:
        store = self.make_store()
        port = yield self.serve(store)
        names, _ = self.count_peeks()
        got = yield threads.deferToThread(handshake, port, "a.example.com")
        self.assertEqual(got.serial, self.serial["a"])
        self.assertEqual(names, ["a.example.com"])

    @inlineCallbacks
    def test_a_client_hello_queued_at_accept_is_read_without_watching(self) -> Any:
        store = self.make_store()
        port = yield self.serve(store)
        self.acceptor._stop_listening()  # connections queue in the kernel, ClientHello and all
        names, watched = self.count_peeks()
        got = threads.deferToThread(handshake, port, "a.example.com")
        yield task.deferLater(reactor, 0.3, lambda: None)
        self.acceptor.start()
        got = yield got
        self.assertEqual(got.serial, self.serial["a"])
        self.assertEqual(names, ["a.example.com"])
        self.assertEqual(watched, [])


# --- first contact --------------------------------------------------------------------------------

NEW = "new.example.com"  # registered, no certificate yet
OTHER = "other.example.com"  # registered, no certificate yet


class FirstContactTests(AcceptorHarness):
    """A known host with no certificate, while the ACME issuer listens: its first handshake waits
    for the certificate (the issuer here is a listener that writes one, signed by the test CA,
    after a while, and rescans)."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.ca = TestCA()
        self.known = {"a.example.com", "x.wild.example.com", NEW, OTHER}
        self.serial = {
            "a": self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com"),
            "wild": self.ca.write(
                certfiles.wildcard_cert_path(self.dir, "wild.example.com"), "*.wild.example.com"
            ),
            "default": self.ca.write(certfiles.default_cert_path(self.dir), "fallback.invalid"),
        }
        self.logs = captured_logs(self)
        self.asked: list[str] = []
        self.issued: dict[str, int] = {}
        self.held_when_issued: list[float] = []
        self.wanted = tls.CertificateWanted()
        self.store = tls.CertStore(
            reactor,
            self.dir,
            self.known.__contains__,
            run_in_thread=threads.deferToThread,
            wanted=self.wanted,
        )
        self.store.load_initial()
        self.holds = {
            o: sample("lchat_tls_holds_total", outcome=o) for o in ("issued", "timeout", "declined")
        }

    def issue_after(self, delay: float, *hosts: str) -> None:
        """Connect an issuer that, asked for one of ``hosts``, writes its certificate ``delay``
        seconds later and rescans; asked for anything else, it does nothing."""

        def want(host: str) -> None:
            self.asked.append(host)
            if host in hosts and host not in self.issued:
                self.issued[host] = 0
                reactor.callLater(delay, issue, host)

        def issue(host: str) -> None:
            self.held_when_issued.append(sample("lchat_tls_held_handshakes"))
            self.issued[host] = self.ca.write(certfiles.cert_path(self.dir, host), host)
            self.store.rescan()

        self.wanted.connect(want)

    def holds_ended(self, outcome: str) -> float:
        return sample("lchat_tls_holds_total", outcome=outcome) - self.holds[outcome]

    def timed(self, f: Callable[..., Any], *args: Any, **kw: Any) -> Deferred[tuple[float, Any]]:
        """Run blocking ``f`` in a thread; fires with (seconds it took, its result)."""

        def run() -> tuple[float, Any]:
            start = time.monotonic()
            result = f(*args, **kw)
            return time.monotonic() - start, result

        return threads.deferToThread(run)

    @inlineCallbacks
    def test_first_handshake_gets_the_certificate_issued_meanwhile(self) -> Any:
        self.issue_after(0.5, NEW)
        port = yield self.serve(self.store)
        took, got = yield self.timed(handshake, port, NEW, verify_with=self.ca.pem)
        self.assertEqual((got.serial, got.names), (self.issued[NEW], (NEW,)))
        self.assertGreaterEqual(took, 0.4)
        self.assertEqual(self.asked, [NEW])
        self.assertEqual(self.held_when_issued, [1.0])
        self.assertEqual(sample("lchat_tls_held_handshakes"), 0)
        self.assertEqual((self.holds_ended("issued"), self.holds_ended("timeout")), (1, 0))
        self.assertTrue(
            any(
                f"tls: holding the first handshake for {NEW} while its certificate is issued" in e
                for e in self.logs
            ),
            self.logs,
        )
        self.assertTrue(
            any(f"tls: certificate for {NEW} arrived after 0." in e for e in self.logs), self.logs
        )
        self.assertEqual(self.store.handshake_failures, {})

    @inlineCallbacks
    def test_a_certificate_that_never_comes_gets_the_default_after_the_hold(self) -> Any:
        self.issue_after(0.1)  # asked, never issues
        port = yield self.serve(self.store, hold=1.0)
        took, got = yield self.timed(handshake, port, NEW)
        self.assertEqual(got.serial, self.serial["default"])
        self.assertGreaterEqual(took, 0.9)
        self.assertEqual((self.holds_ended("issued"), self.holds_ended("timeout")), (0, 1))
        self.assertTrue(
            any(
                f"tls: no certificate for {NEW} within 1.0s: serving the default certificate" in e
                for e in self.logs
            ),
            self.logs,
        )
        # Its issuance is failing: the next visitor is not held again (for a while).
        took, got = yield self.timed(handshake, port, NEW)
        self.assertEqual(got.serial, self.serial["default"])
        self.assertEqual(self.holds_ended("timeout"), 1)
        self.assertEqual(sum("tls: holding the first handshake" in e for e in self.logs), 1)

    @inlineCallbacks
    def test_without_a_default_the_held_handshake_fails_after_the_hold(self) -> Any:
        os.unlink(certfiles.default_cert_path(self.dir))
        self.store.load_initial()
        self.issue_after(0.1)
        port = yield self.serve(self.store, hold=1.0)
        yield self.assertFailure(self.timed(handshake, port, NEW), ssl.SSLError)
        yield self.drain()
        self.assertEqual(self.store.handshake_failures, {"no_certificate": 1})
        self.assertEqual(self.holds_ended("timeout"), 1)
        self.assertTrue(
            any("serving no certificate (no default.pem" in e for e in self.logs), self.logs
        )

    @inlineCallbacks
    def test_hosts_not_eligible_never_wait(self) -> Any:
        """Unknown hosts, hosts with their own certificate or a wildcard, and no SNI at all:
        served at once, although a hold would last 30 s."""
        self.issue_after(0.1, NEW)
        port = yield self.serve(self.store, hold=30.0)
        cases = [
            ("unknown.example.com", self.serial["default"]),
            ("x.wild.example.com", self.serial["wild"]),
            ("y.wild.example.com", self.serial["wild"]),  # unregistered, under the wildcard
            ("a.example.com", self.serial["a"]),
            (None, self.serial["default"]),
        ]
        for name, serial in cases:
            took, got = yield self.timed(handshake, port, name)
            self.assertEqual(got.serial, serial, name)
            self.assertLess(took, 10.0, name)  # a few ms normally; held, it would take 30 s
        self.assertEqual(self.asked, [])
        self.assertEqual((self.holds_ended("issued"), self.holds_ended("timeout")), (0, 0))
        self.assertFalse([e for e in self.logs if "holding" in e])

    @inlineCallbacks
    def test_no_hold_for_a_host_the_issuer_declines(self) -> Any:

        def decline(host: str) -> bool:
            self.asked.append(host)
            return False

        self.wanted.connect(decline)
        port = yield self.serve(self.store, hold=30.0)
        took, got = yield self.timed(handshake, port, NEW)
        self.assertEqual(got.serial, self.serial["default"])
        self.assertLess(took, 10.0)
        self.assertEqual(self.asked[:1], [NEW])
        self.assertFalse([e for e in self.logs if "holding" in e])

    @inlineCallbacks
    def test_a_hold_the_issuer_gives_up_on_is_released_at_once(self) -> Any:
        """A worker's issuer link says "maybe" first (the hold starts), then the control
        process's issuer declines: ``give_up`` releases the hold long before it would end."""

        def maybe(host: str) -> None:
            if not self.asked:  # (the SNI callback cues it again as the default is chosen)
                reactor.callLater(0.2, self.store.give_up, host)
            self.asked.append(host)

        self.wanted.connect(maybe)
        port = yield self.serve(self.store, hold=30.0)
        took, got = yield self.timed(handshake, port, NEW)
        self.assertEqual(got.serial, self.serial["default"])
        self.assertLess(took, 10.0)  # held, it would take 30 s
        self.assertEqual(self.holds_ended("declined"), 1)
        self.assertEqual(self.holds_ended("timeout"), 0)
        self.assertTrue(
            any(
                f"tls: the issuer will not obtain a certificate for {NEW} now: serving the "
                "default certificate" in e
                for e in self.logs
            ),
            self.logs,
        )
        # Not held again for a while, as after a timeout.
        took, got = yield self.timed(handshake, port, NEW)
        self.assertLess(took, 10.0)
        self.assertEqual(self.holds_ended("declined"), 1)
        self.assertEqual(sum("tls: holding the first handshake" in e for e in self.logs), 1)

    @inlineCallbacks
    def test_held_connections_are_bounded(self) -> Any:
        """With one hold allowed, a second eligible host is served at once while the first
        waits; the first still gets its certificate."""
        self.issue_after(1.0, NEW)
        port = yield self.serve(self.store, hold=30.0, max_held=1)
        first = self.timed(handshake, port, NEW, verify_with=self.ca.pem)
        for _ in range(500):
            if self.acceptor._held:
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(self.acceptor._held, 1)
        took, got = yield self.timed(handshake, port, OTHER)
        self.assertEqual(got.serial, self.serial["default"])
        self.assertLess(took, 10.0)
        self.assertTrue(any("handshakes are held already" in e for e in self.logs), self.logs)
        _, got = yield first
        self.assertEqual(got.serial, self.issued[NEW])

    @inlineCallbacks
    def test_a_client_hello_dribbled_byte_by_byte_is_read(self) -> Any:
        self.issue_after(0.3, NEW)
        port = yield self.serve(self.store, hold=30.0)
        wakes: list[None] = []
        real = tls_accept._Peek._readable

        def counting(peek: tls_accept._Peek) -> None:
            wakes.append(None)
            real(peek)

        self.patch(tls_accept._Peek, "_readable", counting)
        serial = yield threads.deferToThread(dribbled_handshake, port, NEW, self.ca.pem)
        self.assertEqual(serial, self.issued[NEW])
        self.assertEqual(self.asked[:1], [NEW])  # the name came from the peeked bytes
        self.assertEqual(self.holds_ended("issued"), 1)
        # Woken when the record header is in, then when the whole record is: not per byte, and
        # never spinning on bytes a peek left queued.
        self.assertLessEqual(len(wakes), 6)

    @inlineCallbacks
    def test_a_client_that_sends_nothing_is_closed_after_the_peek_timeout(self) -> Any:
        self.issue_after(0.1, NEW)
        silent = sample("lchat_tls_silent_connections_total")
        port = yield self.serve(self.store, peek_timeout=0.5)
        took, data = yield self.timed(wait_for_close, port)
        self.assertEqual(data, b"")
        self.assertGreaterEqual(took, 0.4)
        self.assertLess(took, 9.0)
        self.assertEqual(sample("lchat_tls_silent_connections_total") - silent, 1)
        yield self.drain()
        self.assertEqual(self.store.handshake_failures, {})

    @inlineCallbacks
    def test_unpeeked_a_client_that_sends_nothing_is_closed_after_the_handshake_timeout(
        self,
    ) -> Any:
        port = yield self.serve(self.store, handshake_timeout=0.5)  # no issuer: no peek
        took, data = yield self.timed(wait_for_close, port)
        self.assertEqual(data, b"")
        self.assertLess(took, 9.0)
        yield self.drain()
        self.assertEqual(self.store.handshake_failures, {})

    @inlineCallbacks
    def test_a_partial_client_hello_then_silence_is_a_closed_handshake(self) -> Any:
        self.issue_after(0.1, NEW)
        port = yield self.serve(self.store, peek_timeout=0.5)
        hello = client_hello(NEW)
        took, data = yield self.timed(wait_for_close, port, hello[: len(hello) // 2])
        self.assertEqual(data, b"")
        self.assertLess(took, 9.0)
        yield self.drain()
        self.assertEqual(self.store.handshake_failures, {"closed": 1})


class BacklogTests(AcceptorHarness):
    """A drain: accept what the kernel has queued, close the listener, serve those."""

    @inlineCallbacks
    def test_queued_connections_are_served_after_close(self) -> Any:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        ca = TestCA()
        serial = ca.write(certfiles.cert_path(directory, "a.example.com"), "a.example.com")
        store = tls.CertStore(
            reactor, directory, {"a.example.com"}.__contains__, run_in_thread=threads.deferToThread
        )
        store.load_initial()
        loop = uvloop_reactor.loop_of(reactor)
        sock = listening_socket()
        port = sock.getsockname()[1]
        self.app_connections = set()
        acceptor = self.acceptor = TLSAcceptor(
            loop, sock, lambda: HelloApp(self.app_connections), store, clock=reactor
        )
        self.addCleanup(self.drain)
        self.addCleanup(acceptor.close)
        queued = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        for raw in queued:
            self.addCleanup(raw.close)
        acceptor.accept_backlog()  # never started: only what is queued
        acceptor.close()
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        for raw in queued:
            got = yield threads.deferToThread(handshake_on, raw, "a.example.com")
            self.assertEqual(got, serial)


# --- blocking clients -----------------------------------------------------------------------------


def handshake_on(raw: socket.socket, server_name: str) -> int:
    """Blocking: a handshake on a connected socket; the serial of the certificate presented."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with context.wrap_socket(raw, server_hostname=server_name) as conn:
        der = conn.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number


def dribbled_handshake(port: int, server_name: str, ca: bytes) -> int:
    """Blocking: a verifying handshake whose ClientHello goes out one byte per TCP segment;
    the serial of the certificate presented."""
    context = ssl.create_default_context(cadata=ca.decode("ascii"))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(ssl.SSLWantReadError):
            client.do_handshake()
        for byte in outgoing.read():
            raw.sendall(bytes([byte]))
            time.sleep(0.001)
        while True:
            try:
                client.do_handshake()
                break
            except ssl.SSLWantReadError:
                if out := outgoing.read():
                    raw.sendall(out)
                data = raw.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection") from None
                incoming.write(data)
        if out := outgoing.read():
            raw.sendall(out)
        der = client.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number


def wait_for_close(port: int, send: bytes = b"") -> bytes:
    """Blocking: connect, send ``send`` (without closing), and read until the server closes (or
    20 s pass: then the socket timeout raises)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as raw:
        if send:
            raw.sendall(send)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := raw.recv(65536):
                data += chunk
        return data


# --- the ClientHello parser -----------------------------------------------------------------------


def hello_without_sni() -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    client = context.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def as_records(hello: bytes, sizes: list[int]) -> bytes:
    """The handshake message inside ``hello`` (one record) re-framed into records of ``sizes``
    bytes each (the rest in a last one)."""
    message = hello[5:]
    out = b""
    for size in [*sizes, len(message)]:
        if not message:
            break
        chunk, message = message[:size], message[size:]
        out += hello[:3] + len(chunk).to_bytes(2, "big") + chunk
    return out


class ClientHelloTests(SynchronousTestCase):
    def test_real_client_hellos(self) -> None:
        for name in ("a.example.com", "xn--bcher-kva.example", "under_score.example.com", "x"):
            self.assertEqual(client_hello_server_name(client_hello(name)), name)
        self.assertIsNone(client_hello_server_name(hello_without_sni()))

    def test_every_prefix_asks_for_more_and_no_more_than_is_there(self) -> None:
        hello = client_hello("a.example.com")
        for cut in range(len(hello)):
            result = client_hello_server_name(hello[:cut])
            assert isinstance(result, Incomplete), (cut, result)
            self.assertGreater(result.needed, cut)
            self.assertLessEqual(result.needed, len(hello))

    def test_split_over_several_records(self) -> None:
        hello = client_hello("a.example.com")
        for sizes in ([1], [3], [4, 1], [50, 50, 50], [1] * 20):
            framed = as_records(hello, sizes)
            self.assertEqual(client_hello_server_name(framed), "a.example.com", sizes)
            result = client_hello_server_name(framed[:-1])
            self.assertIsInstance(result, Incomplete)

    def test_not_tls_is_said_at_once(self) -> None:
        for data in (b"G", b"GET / HTTP/1.1\r\n", b"\x16\x02", b"\x80\x2e\x01\x03\x01", b"\x15"):
            self.assertIsNone(client_hello_server_name(data), data)
        # A handshake record that is not a ClientHello, an empty record, an oversized one.
        self.assertIsNone(client_hello_server_name(b"\x16\x03\x01\x00\x04\x02\x00\x00\x00"))
        self.assertIsNone(client_hello_server_name(b"\x16\x03\x01\x00\x00"))
        self.assertIsNone(client_hello_server_name(b"\x16\x03\x01\x40\x01"))

    @settings(max_examples=500, deadline=None)
    @given(st.binary(max_size=600))
    def test_garbage_never_raises(self, data: bytes) -> None:
        result = client_hello_server_name(data)
        self.assertTrue(result is None or isinstance(result, str | Incomplete))

    @settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def test_a_damaged_client_hello_never_raises(self, data: st.DataObject) -> None:
        hello = bytearray(client_hello_server_name_sample())
        for _ in range(data.draw(st.integers(1, 8))):
            at = data.draw(st.integers(0, len(hello) - 1))
            hello[at] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(hello)))
        result = client_hello_server_name(bytes(hello[:cut]))
        if isinstance(result, Incomplete):
            self.assertGreater(result.needed, cut)
        else:
            self.assertTrue(result is None or isinstance(result, str))

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(1, 300), max_size=10))
    def test_any_record_framing_gives_the_name(self, sizes: list[int]) -> None:
        framed = as_records(client_hello_server_name_sample(), sizes)
        self.assertEqual(client_hello_server_name(framed), "a.example.com")


_SAMPLE: list[bytes] = []


def client_hello_server_name_sample() -> bytes:
    """One ClientHello for a.example.com, made once."""
    if not _SAMPLE:
        _SAMPLE.append(client_hello("a.example.com"))
    return _SAMPLE[0]

"""The certificate store and SNI selection, with real handshakes on 127.0.0.1.

:class:`FrontDoorCases` is what the TLS front door must do with the store's certificates;
``tests.test_tls_accept`` runs it on the front door (:mod:`lchat.proxy.tls_accept`).

A test CA is made here with ``cryptography``; clients are Python's ``ssl`` (in a thread, so any
certificate can be inspected) and Twisted's own verifying client.
"""

from __future__ import annotations

import _ssl  # the ENCODING_DER constant of its Certificate objects (public from 3.13)
import contextlib
import ctypes
import datetime
import io
import os
import socket
import ssl
import stat
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from attrs import frozen
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client import REGISTRY
from twisted.internet import defer, task, threads
from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol, wrapClientTLS
from twisted.internet.protocol import Protocol
from twisted.internet.ssl import Certificate, optionsForClientTLS
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import certfiles, hosts, ticketkeys, tls
from lchat.cli.main import main
from lchat.reactors import installed
from lchat.threads import thread_runner
from tests.fakes import inline

reactor = installed()
NOW = datetime.datetime.now(datetime.UTC)


# --- a test CA ----------------------------------------------------------------------------------


class TestCA:
    """A CA with one intermediate-free chain: leaf certificates signed directly by the root."""

    def __init__(self, name: str = "lchat test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - datetime.timedelta(days=1))
            .not_valid_after(NOW + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        *names: str,
        not_after: datetime.datetime | None = None,
        key: ec.EllipticCurvePrivateKey | None = None,
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = key or ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - datetime.timedelta(days=1))
            .not_valid_after(not_after or NOW + datetime.timedelta(days=10))
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        return key, cert

    def write(self, path: str, *names: str, mode: int = 0o600, **kw: Any) -> int:
        """Issue a certificate for ``names`` into ``path`` (key + leaf + CA); returns its serial."""
        key, cert = self.issue(*names, **kw)
        write_pem(path, key, [cert, self.cert], mode)
        return cert.serial_number


def write_pem(
    path: str, key: ec.EllipticCurvePrivateKey, chain: Iterable[x509.Certificate], mode: int
) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ) + b"".join(c.public_bytes(serialization.Encoding.PEM) for c in chain)
    write_bytes(path, data, mode)


def write_bytes(path: str, data: bytes, mode: int = 0o600) -> None:
    """Temp file + rename, as an ACME client does."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


# --- a TLS client -------------------------------------------------------------------------------


@frozen
class Hello:
    serial: int
    names: tuple[str, ...]
    alpn: str | None
    version: str | None


def handshake(
    port: int,
    server_name: str | None,
    alpn: tuple[str, ...] = ("http/1.1",),
    tls_version: ssl.TLSVersion | None = None,
    verify_with: bytes | None = None,
) -> Hello:
    """Blocking: one handshake, whatever certificate the server presents (it is returned), or
    only one issued by the CA ``verify_with`` (PEM)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if verify_with is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=verify_with.decode("ascii"))
    if alpn:
        context.set_alpn_protocols(list(alpn))
    if tls_version is not None:
        context.minimum_version = context.maximum_version = tls_version
        context.set_ciphers("DEFAULT:@SECLEVEL=0")  # let the client at least offer it
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=server_name) as conn:
            der = conn.getpeercert(binary_form=True)
            assert der is not None
            cert = x509.load_der_x509_certificate(der)
            try:
                san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
                names = tuple(san.value.get_values_for_type(x509.DNSName))
            except x509.ExtensionNotFound:
                names = ()
            return Hello(cert.serial_number, names, conn.selected_alpn_protocol(), conn.version())


def send_and_close(port: int, data: bytes) -> None:
    """Blocking: connect, send ``data``, and close once the server has closed (or after 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(data)
        raw.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            while raw.recv(65536):
                pass


def client_hello(server_name: str) -> bytes:
    """The first bytes a TLS client sends (its ClientHello), for a server named ``server_name``."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=server_name)
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


class _Get(Protocol):
    def __init__(self, host: str) -> None:
        self.host = host
        self.data = b""
        self.alpn: bytes | None = None
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(
            b"GET / HTTP/1.1\r\nHost: " + self.host.encode() + b"\r\nConnection: close\r\n\r\n"
        )

    def dataReceived(self, data: bytes) -> None:
        self.alpn = getattr(self.transport, "negotiatedProtocol", None)
        self.data += data

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        self.done.callback(self.data)


def sample(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


def captured_logs(case: SynchronousTestCase) -> list[str]:
    events: list[str] = []

    def record(event: dict[str, Any]) -> None:
        if str(event.get("log_namespace", "")).startswith("lchat.tls"):
            events.append(formatEvent(event))

    observer: Any = record

    globalLogPublisher.addObserver(observer)
    case.addCleanup(globalLogPublisher.removeObserver, observer)
    return events


# --- the listener -------------------------------------------------------------------------------


if TYPE_CHECKING:
    _Case = TestCase
else:
    _Case = object


class FrontDoorCases(_Case):
    """What the TLS front door does with the store's certificates, with real handshakes (run by
    ``tests.test_tls_accept``, with and without names peeked first).

    A subclass says how to listen (:meth:`serve`, answering each HTTP request head with
    ``hello over tls``) and how to wait until every server connection has closed (:meth:`drain`).
    """

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.ca = TestCA()
        self.known = {"a.example.com", "b.example.com", "x.wild.example.com"}
        self.serial = {
            "a": self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com"),
            "b": self.ca.write(certfiles.cert_path(self.dir, "b.example.com"), "b.example.com"),
            "wild": self.ca.write(
                certfiles.wildcard_cert_path(self.dir, "wild.example.com"), "*.wild.example.com"
            ),
            # On disk, but the host is not in the registry.
            "stranger": self.ca.write(
                certfiles.cert_path(self.dir, "stranger.example.com"), "stranger.example.com"
            ),
            "default": self.ca.write(certfiles.default_cert_path(self.dir), "fallback.invalid"),
        }
        self.logs = captured_logs(self)

    def make_store(self, **kw: Any) -> tls.CertStore:
        kw.setdefault("run_in_thread", thread_runner(reactor))
        store = tls.CertStore(reactor, self.dir, self.known.__contains__, **kw)
        store.load_initial()
        return store

    if TYPE_CHECKING:  # provided by the subclass (after this class in its bases)

        def serve(self, store: tls.CertStore, **kw: Any) -> Deferred[int]:
            """Listen on 127.0.0.1 with ``store``'s certificates; fires with the port. Cleanup
            stops listening, then drains."""

        def drain(self) -> Deferred[None]:
            """Fires once every server connection has closed (fails the test after ~5 s)."""

    def hello(self, port: int, name: str | None, **kw: Any) -> Deferred[Hello]:
        return threads.deferToThread(handshake, port, name, **kw)

    @inlineCallbacks
    def test_sni_picks_each_hosts_certificate(self) -> Any:
        port = yield self.serve(self.make_store())
        a = yield self.hello(port, "a.example.com")
        b = yield self.hello(port, "b.example.com")
        self.assertEqual((a.serial, a.names), (self.serial["a"], ("a.example.com",)))
        self.assertEqual((b.serial, b.names), (self.serial["b"], ("b.example.com",)))
        upper = yield self.hello(port, "A.Example.COM")
        self.assertEqual(upper.serial, self.serial["a"])

    @inlineCallbacks
    def test_wildcard_covers_direct_subdomains_only(self) -> Any:
        port = yield self.serve(self.make_store())
        for name in ("x.wild.example.com", "unregistered.wild.example.com"):
            got = yield self.hello(port, name)
            self.assertEqual(got.serial, self.serial["wild"], name)
        for name in ("a.b.wild.example.com", "wild.example.com"):
            got = yield self.hello(port, name)
            self.assertEqual(got.serial, self.serial["default"], name)

    @inlineCallbacks
    def test_host_certificate_beats_the_wildcard(self) -> Any:
        own = self.ca.write(
            certfiles.cert_path(self.dir, "x.wild.example.com"), "x.wild.example.com"
        )
        port = yield self.serve(self.make_store())
        got = yield self.hello(port, "x.wild.example.com")
        self.assertEqual(got.serial, own)

    @inlineCallbacks
    def test_host_not_in_registry_never_gets_its_own_certificate(self) -> Any:
        port = yield self.serve(self.make_store())
        got = yield self.hello(port, "stranger.example.com")
        self.assertEqual(got.serial, self.serial["default"])
        # Registered later: the very next handshake gets it (no rescan needed).
        self.known.add("stranger.example.com")
        got = yield self.hello(port, "stranger.example.com")
        self.assertEqual(got.serial, self.serial["stranger"])

    @inlineCallbacks
    def test_no_sni_and_garbage_names_get_the_default(self) -> Any:
        port = yield self.serve(self.make_store())
        for name in (None, "localhost", "under_score.example.com"):
            got = yield self.hello(port, name)
            self.assertEqual(got.serial, self.serial["default"], name)

    @inlineCallbacks
    def test_without_default_an_unmatched_handshake_fails_and_is_counted(self) -> Any:
        os.unlink(certfiles.default_cert_path(self.dir))
        store = self.make_store()
        port = yield self.serve(store)
        before = sample("lchat_tls_handshake_failures_total", reason="no_certificate")
        for name in ("stranger.example.com", None):
            yield self.assertFailure(self.hello(port, name), ssl.SSLError)
        yield self.drain()  # the server notices after the client gave up
        self.assertEqual(store.handshake_failures, {"no_certificate": 2})
        after = sample("lchat_tls_handshake_failures_total", reason="no_certificate")
        self.assertEqual(after - before, 2)
        got = yield self.hello(port, "a.example.com")  # the others are unaffected
        self.assertEqual(got.serial, self.serial["a"])

    def test_the_dispatch_context_keeps_no_session_cache(self) -> None:
        """OpenSSL's server-side session cache is off on the listener's context (TLS 1.3
        resumes from tickets); where lchat cannot reach it, a line says so and TLS still
        serves."""
        store = self.make_store()
        pointer = ticketkeys._ssl_ctx(store.server_ssl_context)
        self.assertEqual(ticketkeys._libssl().ctrl(pointer, 45, 0, None), 0)  # OFF

        def refused(ctx: Any) -> None:
            raise ticketkeys.TicketKeyError("layout unknown here")

        self.patch(ticketkeys, "no_session_cache", refused)
        other = self.make_store()
        self.assertIsNotNone(other.server_ssl_context)
        self.assertTrue(
            any("session cache stays on (layout unknown here)" in line for line in self.logs),
            self.logs,
        )

    @inlineCallbacks
    def test_alpn_is_http11_on_the_per_name_context(self) -> Any:
        port = yield self.serve(self.make_store())
        for name in ("a.example.com", "x.wild.example.com", None):
            got = yield self.hello(port, name, alpn=("h2", "http/1.1"))
            self.assertEqual(got.alpn, "http/1.1", name)
        got = yield self.hello(port, "a.example.com", alpn=("h2",))
        self.assertIsNone(got.alpn)  # no overlap: no ALPN, as for a client that offers none

    @inlineCallbacks
    def test_tls_below_12_is_refused(self) -> Any:
        store = self.make_store()
        port = yield self.serve(store)
        yield self.assertFailure(
            self.hello(port, "a.example.com", tls_version=ssl.TLSVersion.TLSv1_1), ssl.SSLError
        )
        yield self.drain()
        self.assertEqual(store.handshake_failures, {"version": 1})
        got = yield self.hello(port, "a.example.com", tls_version=ssl.TLSVersion.TLSv1_2)
        self.assertEqual((got.serial, got.version), (self.serial["a"], "TLSv1.2"))

    @inlineCallbacks
    def test_what_counts_as_a_failed_handshake(self) -> Any:
        """A TCP probe and a completed handshake are not failures; plain HTTP on the HTTPS port, a
        client that refuses our certificate and one that leaves mid-handshake are, each under its
        reason, logged with the peer and the name it asked for."""
        store = self.make_store()
        port = yield self.serve(store)
        yield threads.deferToThread(send_and_close, port, b"")  # a TCP probe: not a byte
        got = yield self.hello(port, "a.example.com")
        self.assertEqual(got.serial, self.serial["a"])
        yield self.drain()
        self.assertEqual(store.handshake_failures, {})

        yield threads.deferToThread(send_and_close, port, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        stranger = TestCA("another CA").pem
        yield self.assertFailure(
            threads.deferToThread(handshake, port, "a.example.com", verify_with=stranger),
            ssl.SSLError,
        )
        hello = client_hello("b.example.com")
        yield threads.deferToThread(send_and_close, port, hello[: len(hello) // 2])
        yield self.drain()
        self.assertEqual(store.handshake_failures, {"plain_http": 1, "peer_alert": 1, "closed": 1})
        refused = [line for line in self.logs if "(peer_alert)" in line]
        self.assertEqual(len(refused), 1, self.logs)
        self.assertIn("from 127.0.0.1:", refused[0])
        self.assertIn("for a.example.com:", refused[0])

    @inlineCallbacks
    def test_verifying_client_gets_an_http_answer(self) -> Any:
        port = yield self.serve(self.make_store())
        for name in ("a.example.com", "x.wild.example.com"):
            options = optionsForClientTLS(
                name, trustRoot=Certificate.loadPEM(self.ca.pem), acceptableProtocols=[b"http/1.1"]
            )
            endpoint = wrapClientTLS(options, TCP4ClientEndpoint(reactor, "127.0.0.1", port))
            client = _Get(name)
            yield connectProtocol(endpoint, client)
            data = yield client.done
            self.assertTrue(data.startswith(b"HTTP/1.1 200 "), data[:100])
            self.assertTrue(data.endswith(b"hello over tls\n"))
            self.assertEqual(client.alpn, b"http/1.1")

    @inlineCallbacks
    def test_certificate_replaced_on_disk_is_served_to_the_next_handshake(self) -> Any:
        store = self.make_store()
        port = yield self.serve(store)
        got = yield self.hello(port, "a.example.com")
        self.assertEqual(got.serial, self.serial["a"])
        renewed = self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com")
        yield store.rescan()
        got = yield self.hello(port, "a.example.com")
        self.assertEqual(got.serial, renewed)
        self.assertTrue(any("tls: a.example.com certificate replaced" in e for e in self.logs))

    @inlineCallbacks
    def test_world_readable_key_is_refused_loudly_until_fixed(self) -> Any:
        path = certfiles.cert_path(self.dir, "c.example.com")
        serial = self.ca.write(path, "c.example.com", mode=0o644)
        self.known.add("c.example.com")
        store = self.make_store()
        port = yield self.serve(store)
        got = yield self.hello(port, "c.example.com")
        self.assertEqual(got.serial, self.serial["default"])
        self.assertIn(f"chmod 600 {path}", store.refused()[path])
        self.assertTrue(any(e.startswith(f"tls: refusing {path}: mode 0644") for e in self.logs))
        self.assertEqual(sample("lchat_tls_refused_files"), 1)
        os.chmod(path, 0o600)  # a chmod alone is noticed
        yield store.rescan()
        got = yield self.hello(port, "c.example.com")
        self.assertEqual(got.serial, serial)
        self.assertEqual(store.refused(), {})

    @inlineCallbacks
    def test_garbage_file_is_refused_without_breaking_the_others(self) -> Any:
        path = certfiles.cert_path(self.dir, "d.example.com")
        write_bytes(path, b"-----BEGIN CERTIFICATE-----\nnonsense\n-----END CERTIFICATE-----\n")
        write_bytes(certfiles.cert_path(self.dir, "e.example.com"), os.urandom(300))
        self.known.update({"d.example.com", "e.example.com"})
        store = self.make_store()
        port = yield self.serve(store)
        self.assertEqual(
            sorted(store.refused()),
            sorted([path, certfiles.cert_path(self.dir, "e.example.com")]),
        )
        got = yield self.hello(port, "d.example.com")
        self.assertEqual(got.serial, self.serial["default"])
        got = yield self.hello(port, "a.example.com")
        self.assertEqual(got.serial, self.serial["a"])

    @inlineCallbacks
    def test_a_refused_replacement_keeps_the_certificate_loaded_before(self) -> Any:
        store = self.make_store()
        port = yield self.serve(store)
        write_bytes(certfiles.cert_path(self.dir, "a.example.com"), b"half-written")
        yield store.rescan()
        got = yield self.hello(port, "a.example.com")
        self.assertEqual(got.serial, self.serial["a"])
        self.assertIn(certfiles.cert_path(self.dir, "a.example.com"), store.refused())

    @inlineCallbacks
    def test_removed_certificate_is_no_longer_served(self) -> Any:
        store = self.make_store()
        port = yield self.serve(store)
        os.unlink(certfiles.cert_path(self.dir, "b.example.com"))
        yield store.rescan()
        got = yield self.hello(port, "b.example.com")
        self.assertEqual(got.serial, self.serial["default"])
        self.assertNotIn("b.example.com", store.certificates())


# --- the store without sockets -------------------------------------------------------------------


def synchronous(f: Callable[[], Any]) -> Deferred[Any]:
    return maybeDeferred(f)


class StoreTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.ca = TestCA()
        self.logs = captured_logs(self)

    def test_file_names_come_from_validated_hostnames(self) -> None:
        self.assertEqual(certfiles.cert_path("/c", "a.example.com"), "/c/a.example.com.pem")
        self.assertEqual(
            certfiles.wildcard_cert_path("/c", "example.com"), "/c/wildcard-example.com.pem"
        )
        self.assertEqual(certfiles.default_cert_path("/c"), "/c/default.pem")
        for bad in ("A.example.com", "../x.example.com", "x", "wildcard-x.example.com", ""):
            self.assertRaises(hosts.InvalidHost, certfiles.cert_path, "/c", bad)
        self.assertRaises(hosts.InvalidHost, certfiles.wildcard_cert_path, "/c", "com")

    def test_what_counts_as_a_certificate_file(self) -> None:
        self.assertEqual(certfiles.role_of("a.example.com.pem"), ("host", "a.example.com"))
        self.assertEqual(certfiles.role_of("wildcard-example.com.pem"), ("wildcard", "example.com"))
        self.assertEqual(certfiles.role_of("default.pem"), ("default", "default"))
        for ignored in (
            "dev-ca.pem",
            "dev-ca.key",
            "account.key",
            "a.example.com.pem.tmp",
            "A.example.com.pem",
            "wildcard-com.pem",
            "notes.txt",
        ):
            self.assertIsNone(certfiles.role_of(ignored), ignored)

    def test_misnamed_file_is_ignored_with_a_hint(self) -> None:
        self.ca.write(os.path.join(self.dir, "A.Example.com.pem"), "a.example.com")
        store = tls.CertStore(
            reactor, self.dir, lambda h: True, run_in_thread=thread_runner(reactor)
        )
        store.load_initial()
        self.assertEqual(store.certificates(), {})
        self.assertTrue(any("rename it a.example.com.pem" in e for e in self.logs), self.logs)

    def test_checks_on_load(self) -> None:
        now = NOW.timestamp()

        def load(name: str, kind: certfiles.Kind = "host") -> certfiles.Loaded | certfiles.Refused:
            path = (
                certfiles.cert_path(self.dir, name)
                if kind == "host"
                else os.path.join(self.dir, "w")
            )
            return certfiles.load_file(path, kind, name, now)

        self.ca.write(certfiles.cert_path(self.dir, "ok.example.com"), "ok.example.com")
        self.assertIsInstance(load("ok.example.com"), certfiles.Loaded)

        _, cert = self.ca.issue("mismatch.example.com")
        other = ec.generate_private_key(ec.SECP256R1())
        write_pem(certfiles.cert_path(self.dir, "mismatch.example.com"), other, [cert], 0o600)
        self.assertIn("does not match", self.why(load("mismatch.example.com")))

        self.ca.write(certfiles.cert_path(self.dir, "wrong.example.com"), "other.example.com")
        self.assertIn("not wrong.example.com", self.why(load("wrong.example.com")))

        self.ca.write(
            certfiles.cert_path(self.dir, "old.example.com"),
            "old.example.com",
            not_after=NOW - datetime.timedelta(hours=1),
        )
        self.assertIn("expired", self.why(load("old.example.com")))

        # A host file may hold a wildcard that covers it; a wildcard file must be the wildcard.
        self.ca.write(certfiles.cert_path(self.dir, "w1.example.com"), "*.example.com")
        self.assertIsInstance(load("w1.example.com"), certfiles.Loaded)
        self.ca.write(os.path.join(self.dir, "w"), "x.example.com")
        self.assertIn("not *.example.com", self.why(load("example.com", "wildcard")))

        self.ca.write(
            certfiles.cert_path(self.dir, "loose.example.com"), "loose.example.com", mode=0o640
        )
        self.assertIn("mode 0640", self.why(load("loose.example.com")))

        data = open(certfiles.cert_path(self.dir, "ok.example.com"), "rb").read()
        write_bytes(certfiles.cert_path(self.dir, "two.example.com"), data + data)
        self.assertIn("2 private keys", self.why(load("two.example.com")))

    def why(self, outcome: certfiles.Loaded | certfiles.Refused) -> str:
        assert isinstance(outcome, certfiles.Refused), outcome
        return outcome.why

    def test_certificate_that_expires_while_loaded_stops_being_served(self) -> None:
        clock = task.Clock()
        clock.advance(NOW.timestamp())
        path = certfiles.cert_path(self.dir, "soon.example.com")
        self.ca.write(path, "soon.example.com", not_after=NOW + datetime.timedelta(hours=1))
        store = tls.CertStore(clock, self.dir, lambda h: True, run_in_thread=synchronous)
        store.load_initial()
        self.assertIsNotNone(store.select(b"soon.example.com"))
        self.assertGreater(
            sample("lchat_tls_certificate_expiry_seconds", name="soon.example.com"),
            clock.seconds(),
        )
        clock.advance(7200)
        self.successResultOf(store.rescan())
        self.assertIsNone(store.select(b"soon.example.com"))
        self.assertTrue(any("expired" in e and "no longer served" in e for e in self.logs))
        self.assertIn("expired", store.refused()[path])
        self.assertIsNone(
            REGISTRY.get_sample_value(
                "lchat_tls_certificate_expiry_seconds", {"name": "soon.example.com"}
            )
        )

    def test_registered_host_without_a_certificate_is_logged_once(self) -> None:
        store = tls.CertStore(
            task.Clock(), self.dir, {"a.example.com"}.__contains__, run_in_thread=synchronous
        )
        store.load_initial()
        for _ in range(3):
            self.assertIsNone(store.select(b"a.example.com"))
            self.assertIsNone(store.select(b"unregistered.example.com"))
            self.successResultOf(store.rescan())
        self.assertEqual(
            [e for e in self.logs if "no certificate" in e],
            [
                f"tls: no certificate for a.example.com (expected {self.dir}/a.example.com.pem or a wildcard)"
            ],
        )

    def test_a_registered_host_without_a_certificate_cues_the_issuer(self) -> None:
        """The cue reaches whoever connected to it (the issuer), for known hosts only; a second
        listener is refused (one issuer per box)."""
        wanted = tls.CertificateWanted()
        store = tls.CertStore(
            task.Clock(),
            self.dir,
            {"a.example.com"}.__contains__,
            run_in_thread=synchronous,
            wanted=wanted,
        )
        store.load_initial()
        self.assertIsNone(store.select(b"a.example.com"))  # not connected yet
        asked: list[str] = []
        wanted.connect(asked.append)
        with self.assertRaises(RuntimeError):
            wanted.connect(asked.append)
        self.assertIsNone(store.select(b"a.example.com"))
        self.assertIsNone(store.select(b"unregistered.example.com"))
        self.assertEqual(asked, ["a.example.com"])

    def test_missing_directory_is_logged_once_and_picked_up_when_it_appears(self) -> None:
        directory = os.path.join(self.dir, "acme")
        store = tls.CertStore(task.Clock(), directory, lambda h: True, run_in_thread=synchronous)
        store.load_initial()
        self.successResultOf(store.rescan())
        self.assertEqual(sum("does not exist" in e for e in self.logs), 1)
        os.makedirs(directory)
        self.ca.write(certfiles.cert_path(directory, "a.example.com"), "a.example.com")
        self.successResultOf(store.rescan())
        self.assertEqual(list(store.certificates()), ["a.example.com"])

    def test_service_scans_at_start_and_every_interval(self) -> None:
        clock = task.Clock()
        store = tls.CertStore(
            clock, self.dir, lambda h: True, run_in_thread=synchronous, interval=10
        )
        store.startService()
        self.addCleanup(store.stopService)
        self.assertEqual(store.certificates(), {})
        self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com")
        self.ca.write(certfiles.wildcard_cert_path(self.dir, "example.com"), "*.example.com")
        clock.advance(9)
        self.assertEqual(store.certificates(), {})
        clock.advance(1)
        self.assertEqual(sorted(store.certificates()), ["*.example.com", "a.example.com"])
        self.assertEqual(sample("lchat_tls_certificates", kind="host"), 1)
        self.assertEqual(sample("lchat_tls_certificates", kind="wildcard"), 1)
        self.assertEqual(sample("lchat_tls_certificates", kind="default"), 0)
        self.assertTrue(
            any("tls: loaded certificate for a.example.com (expires" in e for e in self.logs)
        )

    def test_unchanged_files_are_not_reread(self) -> None:
        loads: list[str] = []
        real = certfiles.load_file

        def counting(path: str, *args: Any) -> Any:
            loads.append(os.path.basename(path))
            return real(path, *args)

        self.patch(certfiles, "load_file", counting)
        self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com")
        self.ca.write(certfiles.cert_path(self.dir, "b.example.com"), "b.example.com")
        store = tls.CertStore(task.Clock(), self.dir, lambda h: True, run_in_thread=synchronous)
        store.load_initial()
        self.ca.write(certfiles.cert_path(self.dir, "b.example.com"), "b.example.com")
        self.successResultOf(store.rescan())
        self.successResultOf(store.rescan())
        self.assertEqual(loads, ["a.example.com.pem", "b.example.com.pem", "b.example.com.pem"])

    def test_sni_lookup_order(self) -> None:
        for name in ("a.example.com", "x.example.com"):
            self.ca.write(certfiles.cert_path(self.dir, name), name)
        self.ca.write(certfiles.wildcard_cert_path(self.dir, "example.com"), "*.example.com")
        known = {"a.example.com"}
        store = tls.CertStore(task.Clock(), self.dir, known.__contains__, run_in_thread=inline)
        store.load_initial()
        contexts = {c.label: c.ssl_context for c in store.certificates().values()}

        def lookup(server_name: bytes | None) -> ssl.SSLContext | None:
            loaded = store.select(server_name)
            return loaded.ssl_context if loaded is not None else None

        self.assertIs(lookup(b"a.example.com"), contexts["a.example.com"])
        self.assertIs(lookup(b"x.example.com"), contexts["*.example.com"])  # not registered
        self.assertIs(lookup(b"new.example.com"), contexts["*.example.com"])
        self.assertIsNone(lookup(b"example.com"))
        self.assertIsNone(lookup(b"a.b.example.com"))
        self.assertIsNone(lookup(b"\xff\xfe.example.com"))
        self.assertIsNone(lookup(None))


class SNICallbackTests(SynchronousTestCase):
    """The SNI callback on real (in-memory) handshakes: each name is normalised once, and what a
    host is served still follows the registry from one handshake to the next."""

    def test_names_normalised_once_and_the_registry_still_decides(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        ca = TestCA()
        ca.write(certfiles.cert_path(directory, "a.example.com"), "a.example.com")
        ca.write(certfiles.wildcard_cert_path(directory, "example.com"), "*.example.com")
        known = {"a.example.com"}
        store = tls.CertStore(task.Clock(), directory, known.__contains__, run_in_thread=inline)
        store.load_initial()
        normalised: list[str] = []
        real = hosts.normalise

        def counting(name: str) -> str:
            normalised.append(name)
            return real(name)

        self.patch(hosts, "normalise", counting)
        client = ssl.create_default_context(cadata=ca.pem.decode("ascii"))

        def served(name: str) -> list[str]:
            end = memory_connect(store.server_ssl_context, client, name, None)
            cert = end.getpeercert()
            assert cert is not None
            names: Any = cert["subjectAltName"]
            return [v for k, v in names if k == "DNS"]

        for _ in range(3):
            self.assertEqual(served("a.example.com"), ["a.example.com"])
        self.assertEqual(normalised, ["a.example.com"])
        known.clear()  # its row is gone: no rebuild, yet the next handshake gets the wildcard
        self.assertEqual(served("a.example.com"), ["*.example.com"])
        self.assertEqual(normalised, ["a.example.com"])


class OnDemandStoreTests(SynchronousTestCase):
    """What the front door asks the store while it holds a first handshake: is this host worth
    holding (:meth:`CertStore.holds_for`), cue the issuer (:meth:`CertStore.want`), tell me when
    its certificate is in (:meth:`CertStore.wait_for`). On a fake clock, scans inline."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.ca = TestCA()
        self.clock = task.Clock()
        self.clock.advance(NOW.timestamp())
        self.known = {"a.example.com", "new.example.com", "x.wild.example.com"}
        self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com")
        self.wanted = tls.CertificateWanted()
        self.store = tls.CertStore(
            self.clock,
            self.dir,
            self.known.__contains__,
            run_in_thread=synchronous,
            wanted=self.wanted,
        )
        self.store.load_initial()

    def test_holds_only_known_hosts_without_any_certificate_while_an_issuer_listens(self) -> None:
        store = self.store
        self.assertFalse(store.on_demand)
        self.assertFalse(store.holds_for("new.example.com"))  # nobody would issue it
        asked: list[str] = []
        self.wanted.connect(asked.append)
        self.assertTrue(store.on_demand)
        self.assertTrue(store.holds_for("new.example.com"))
        self.assertTrue(store.holds_for("x.wild.example.com"))
        self.assertFalse(store.holds_for("a.example.com"))  # has its own
        self.assertFalse(store.holds_for("unknown.example.com"))  # not in the registry
        self.ca.write(
            certfiles.wildcard_cert_path(self.dir, "wild.example.com"), "*.wild.example.com"
        )
        self.successResultOf(store.rescan())
        self.assertFalse(store.holds_for("x.wild.example.com"))  # the wildcard serves it
        self.assertEqual(asked, [])  # asking is want()'s job
        self.assertTrue(store.want("new.example.com"))
        self.assertEqual(asked, ["new.example.com"])

    def test_want_reports_an_issuer_that_declines(self) -> None:
        self.assertFalse(self.store.want("new.example.com"))  # nobody listens
        self.wanted.connect(lambda host: host != "new.example.com")
        self.assertFalse(self.store.want("new.example.com"))
        self.assertTrue(self.store.want("x.wild.example.com"))

    def test_wait_for_fires_when_a_rescan_brings_the_certificate(self) -> None:
        self.assertIs(self.successResultOf(self.store.wait_for("a.example.com", 10)), True)
        waits = [self.store.wait_for("new.example.com", 10) for _ in range(2)]
        other = self.store.wait_for("x.wild.example.com", 10)
        self.clock.advance(5)
        self.successResultOf(self.store.rescan())  # nothing new
        for d in (*waits, other):
            self.assertNoResult(d)
        self.ca.write(certfiles.cert_path(self.dir, "new.example.com"), "new.example.com")
        self.successResultOf(self.store.rescan())
        for d in waits:
            self.assertIs(self.successResultOf(d), True)
        self.assertNoResult(other)  # another host's certificate is not this one's
        self.clock.advance(5)
        self.assertIs(self.successResultOf(other), False)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_wait_for_a_host_a_new_wildcard_covers(self) -> None:
        d = self.store.wait_for("x.wild.example.com", 10)
        self.ca.write(
            certfiles.wildcard_cert_path(self.dir, "wild.example.com"), "*.wild.example.com"
        )
        self.successResultOf(self.store.rescan())
        self.assertIs(self.successResultOf(d), True)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_wait_for_times_out_on_the_store_clock(self) -> None:
        d = self.store.wait_for("new.example.com", 10)
        self.clock.advance(9.9)
        self.assertNoResult(d)
        self.clock.advance(0.1)
        self.assertIs(self.successResultOf(d), False)
        # A certificate arriving later fires nothing twice.
        self.ca.write(certfiles.cert_path(self.dir, "new.example.com"), "new.example.com")
        self.successResultOf(self.store.rescan())

    def test_a_cancelled_wait_is_forgotten(self) -> None:
        d = self.store.wait_for("new.example.com", 10)
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.ca.write(certfiles.cert_path(self.dir, "new.example.com"), "new.example.com")
        self.successResultOf(self.store.rescan())  # does not fire the cancelled one again


class StdlibContextTests(SynchronousTestCase):
    """The stdlib context each certificate gets: the checked bytes, the whole chain, the same
    protocol settings as the listener's."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.ca = TestCA()

    def test_built_from_the_checked_bytes_not_the_path(self) -> None:
        paths: list[str] = []
        real = ssl.SSLContext.load_cert_chain

        def spy(context: ssl.SSLContext, certfile: Any, *args: Any, **kw: Any) -> None:
            paths.append(str(certfile))
            real(context, certfile, *args, **kw)

        self.patch(ssl.SSLContext, "load_cert_chain", spy)
        path = certfiles.cert_path(self.dir, "a.example.com")
        serial = self.ca.write(path, "a.example.com")
        loaded = certfiles.load_file(path, "host", "a.example.com", NOW.timestamp())
        assert isinstance(loaded, certfiles.Loaded)
        self.assertEqual(len(paths), 1)
        self.assertRegex(paths[0], r"^/proc/self/fd/\d+$")
        # Replaced on disk afterwards: the context still serves what was checked.
        self.ca.write(path, "a.example.com")
        chain = memory_handshake(loaded.ssl_context, "a.example.com", self.ca.pem)
        self.assertEqual(chain[0].serial_number, serial)
        self.assertEqual(chain[-1], self.ca.cert)  # the chain after the leaf is sent too

    def test_a_key_that_the_stdlib_refuses_is_refused(self) -> None:
        def refuse(*args: Any, **kw: Any) -> None:
            raise ssl.SSLError(1, "[SSL] nope")

        self.patch(ssl.SSLContext, "load_cert_chain", refuse)
        path = certfiles.cert_path(self.dir, "a.example.com")
        self.ca.write(path, "a.example.com")
        outcome = certfiles.load_file(path, "host", "a.example.com", NOW.timestamp())
        assert isinstance(outcome, certfiles.Refused)
        self.assertIn("OpenSSL will not use it", outcome.why)


def memory_handshake(server: ssl.SSLContext, name: str, ca: bytes) -> list[x509.Certificate]:
    """One handshake between ``server`` and a verifying client in memory: the chain it sent."""
    client_context = ssl.create_default_context(cadata=ca.decode("ascii"))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_context.wrap_bio(c_in, c_out, server_hostname=name)
    peer = server.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    for _ in range(10):
        for i, (end, outgoing, other) in enumerate(((client, c_out, s_in), (peer, s_out, c_in))):
            if not done[i]:
                with contextlib.suppress(ssl.SSLWantReadError):
                    end.do_handshake()
                    done[i] = True
            other.write(outgoing.read())
        if all(done):
            break
    assert all(done), "the in-memory handshake did not finish"
    # Public as SSLObject.get_unverified_chain from Python 3.13; the same method underneath.
    chain = client._sslobj.get_unverified_chain()  # type: ignore[attr-defined]
    return [x509.load_der_x509_certificate(c.public_bytes(_ssl.ENCODING_DER)) for c in chain]


def memory_connect(
    dispatch: ssl.SSLContext, client: ssl.SSLContext, name: str, session: ssl.SSLSession | None
) -> ssl.SSLObject:
    """One TLS 1.3 connection in memory to a listener's ``dispatch`` context, offering
    ``session``; returns the client's end once it has read the server's first bytes (and with
    them the session tickets sent after the handshake)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    end = client.wrap_bio(c_in, c_out, server_hostname=name, session=session)
    peer = dispatch.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    for _ in range(10):
        for i, (side, outgoing, other) in enumerate(((end, c_out, s_in), (peer, s_out, c_in))):
            if not done[i]:
                with contextlib.suppress(ssl.SSLWantReadError):
                    side.do_handshake()
                    done[i] = True
            other.write(outgoing.read())
        if all(done):
            break
    assert all(done), "the in-memory handshake did not finish"
    peer.write(b"hello")
    c_in.write(s_out.read())
    assert end.read(5) == b"hello"
    assert end.version() == "TLSv1.3", end.version()
    return end


class TicketKeyTests(SynchronousTestCase):
    """``ticket_key_file``: the shared session-ticket key, read by the scan in its thread and
    installed on the reactor thread; a bad key is logged once and never fatal. Without it the
    store keeps OpenSSL's own key."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.ca = TestCA()
        self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com")
        self.key_file = os.path.join(self.mktemp() + "-run", "tls-ticket.key")
        os.makedirs(os.path.dirname(self.key_file))
        self.logs = captured_logs(self)
        self.client = ssl.create_default_context(cadata=self.ca.pem.decode("ascii"))
        self.threads: list[str] = []

    def in_a_thread(self, f: Callable[[], Any]) -> Deferred[Any]:
        """A real thread, joined: the store's callbacks then run on this (the reactor's) one."""
        out: list[Any] = []
        worker = threading.Thread(target=lambda: out.append(f()), name="scan")
        worker.start()
        worker.join()
        return defer.succeed(out[0])

    def store(self, **kw: Any) -> tls.CertStore:
        store = tls.CertStore(
            task.Clock(), self.dir, lambda h: True, run_in_thread=self.in_a_thread, **kw
        )
        store.load_initial()
        return store

    def resumes(self, a: tls.CertStore, b: tls.CertStore) -> bool:
        """A session from ``a``'s listener, offered to ``b``'s: resumed?"""
        first = memory_connect(a.server_ssl_context, self.client, "a.example.com", None)
        session = first.session
        assert session is not None and session.has_ticket
        again = memory_connect(b.server_ssl_context, self.client, "a.example.com", session)
        return again.session_reused

    def test_without_a_key_file_each_store_keeps_its_own_key(self) -> None:
        a, b = self.store(), self.store()
        self.assertTrue(self.resumes(a, a))
        self.assertFalse(self.resumes(a, b))

    def test_stores_sharing_the_key_file_resume_each_others_sessions(self) -> None:
        ticketkeys.write(self.key_file, ticketkeys.new_key())
        a = self.store(ticket_key_file=self.key_file)
        b = self.store(ticket_key_file=self.key_file)
        self.assertTrue(self.resumes(a, b))
        self.assertTrue(self.resumes(b, a))
        self.assertEqual(sample("lchat_tls_ticket_key_shared"), 1)
        self.assertIn(
            f"tls: session tickets are shared across workers (key {self.key_file})", self.logs
        )
        # A rotation reaches a store at its next rescan; until then the two keys differ.
        ticketkeys.write(self.key_file, ticketkeys.new_key())
        self.successResultOf(a.rescan())
        self.assertFalse(self.resumes(a, b))
        self.successResultOf(b.rescan())
        self.assertTrue(self.resumes(a, b))

    def test_a_changed_key_is_read_in_the_scan_thread_and_installed_on_the_reactor(self) -> None:
        seen: list[tuple[str, str]] = []
        real_read, real_install = ticketkeys.read, ticketkeys.install

        def read(path: str) -> bytes:
            seen.append(("read", threading.current_thread().name))
            return real_read(path)

        def install(ctx: ssl.SSLContext, key: bytes) -> None:
            seen.append(("install", threading.current_thread().name))
            real_install(ctx, key)

        self.patch(ticketkeys, "read", read)
        self.patch(ticketkeys, "install", install)
        ticketkeys.write(self.key_file, ticketkeys.new_key())
        store = self.store(ticket_key_file=self.key_file)
        main = threading.current_thread().name
        self.assertEqual(seen, [("read", main), ("install", main)])  # load_initial: blocking
        seen.clear()
        self.successResultOf(store.rescan())
        self.assertEqual(seen, [])  # unchanged: not read again
        key = ticketkeys.new_key()
        ticketkeys.write(self.key_file, key)
        self.successResultOf(store.rescan())
        self.assertEqual(seen, [("read", "scan"), ("install", main)])
        self.assertEqual(read_ticket_key(store.server_ssl_context), key)

    def test_a_bad_key_file_is_logged_once_and_never_fatal(self) -> None:
        failed = sample("lchat_tls_ticket_key_installs_total", outcome="failed")
        store = self.store(ticket_key_file=self.key_file)  # no file yet
        ticketkeys.write(self.key_file, ticketkeys.new_key())
        os.chmod(self.key_file, 0o644)
        for _ in range(3):
            self.successResultOf(store.rescan())
        self.assertEqual(list(store.certificates()), ["a.example.com"])  # served all along
        warnings = [e for e in self.logs if "not shared across workers" in e]
        self.assertEqual(
            warnings,
            [
                f"tls: session tickets are not shared across workers: {self.key_file} does not "
                "exist (a reconnect through another worker makes a full handshake)",
                f"tls: session tickets are not shared across workers: {self.key_file} is "
                "readable by other users (mode 0644; want 0600) (a reconnect through another "
                "worker makes a full handshake)",
            ],
        )
        self.assertEqual(sample("lchat_tls_ticket_key_shared"), 0)
        self.assertEqual(
            sample("lchat_tls_ticket_key_installs_total", outcome="failed"), failed + 2
        )
        os.chmod(self.key_file, 0o600)
        self.successResultOf(store.rescan())
        self.assertEqual(sample("lchat_tls_ticket_key_shared"), 1)
        installed = read_ticket_key(store.server_ssl_context)
        # Once a key is in, a later failure keeps it (tickets still resume) and says so.
        self.patch(ticketkeys, "PYTHON", (3, 99))
        ticketkeys.write(self.key_file, ticketkeys.new_key())
        self.successResultOf(store.rescan())
        self.assertEqual(read_ticket_key(store.server_ssl_context), installed)
        self.assertEqual(sample("lchat_tls_ticket_key_shared"), 1)
        self.assertTrue(
            any(
                "keeping the session ticket key installed before: Python 3.99" in e
                for e in self.logs
            )
        )


def read_ticket_key(ctx: ssl.SSLContext) -> bytes:
    """The ticket key OpenSSL holds for ``ctx`` (SSL_CTRL_GET_TLSEXT_TICKET_KEYS)."""
    lib = ticketkeys._libssl()
    pointer = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    out = ctypes.create_string_buffer(ticketkeys.KEY_BYTES)
    assert (
        lib.ctrl(pointer, ticketkeys._SSL_CTRL_GET_TLSEXT_TICKET_KEYS, ticketkeys.KEY_BYTES, out)
        == 1
    )
    return out.raw


class ListenerAndGiveUpTests(SynchronousTestCase):
    """What the control process and a worker's link ask of a store: ``subscribe`` (told after a
    rebuild that changed what is served) and ``give_up`` (the issuer declined a held host)."""

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.ca = TestCA()
        self.clock = task.Clock()
        self.clock.advance(NOW.timestamp())
        self.logs = captured_logs(self)
        self.store = tls.CertStore(self.clock, self.dir, lambda h: True, run_in_thread=synchronous)

    def test_listeners_are_told_once_per_rebuild_that_changed_something(self) -> None:
        told: list[list[str]] = []
        self.store.subscribe(lambda: 1 / 0)  # a broken listener is logged; the others still run
        self.store.subscribe(lambda: told.append(sorted(self.store.certificates())))
        self.store.load_initial()
        self.assertEqual(told, [[]])  # the first scan builds the (empty) set
        self.successResultOf(self.store.rescan())
        self.assertEqual(told, [[]])
        self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com")
        self.successResultOf(self.store.rescan())
        self.successResultOf(self.store.rescan())
        self.assertEqual(told, [[], ["a.example.com"]])
        os.remove(certfiles.cert_path(self.dir, "a.example.com"))
        self.successResultOf(self.store.rescan())
        self.assertEqual(told, [[], ["a.example.com"], []])
        self.assertEqual(
            len([e for e in self.logs if "a certificate-change listener failed" in e]), 3
        )
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 3)

    def test_listeners_run_after_the_waiters_the_rebuild_serves(self) -> None:
        order: list[str] = []
        self.store.load_initial()
        self.store.subscribe(lambda: order.append("listener"))
        self.store.wait_for("a.example.com", 10).addCallback(lambda _: order.append("waiter"))
        self.ca.write(certfiles.cert_path(self.dir, "a.example.com"), "a.example.com")
        self.successResultOf(self.store.rescan())
        self.assertEqual(order, ["waiter", "listener"])

    def test_give_up_fires_that_hosts_waiters_false_at_once(self) -> None:
        self.store.load_initial()
        waits = [self.store.wait_for("new.example.com", 10) for _ in range(2)]
        other = self.store.wait_for("other.example.com", 10)
        self.store.give_up("new.example.com")
        for d in waits:
            self.assertIs(self.successResultOf(d), False)
        self.assertNoResult(other)
        self.store.give_up("nobody.example.com")  # nothing waits: nothing happens
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)  # only the other's timeout
        self.clock.advance(10)
        self.assertIs(self.successResultOf(other), False)


# --- lchat dev-cert -------------------------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


class DevCertTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.join(os.path.abspath(self.mktemp()), "acme")

    def load(self, name: str) -> x509.Certificate:
        with open(os.path.join(self.dir, name), "rb") as f:
            return x509.load_pem_x509_certificates(f.read())[0]

    def test_makes_a_ca_and_leaf_certificates_the_store_serves(self) -> None:
        code, out, err = run_cli("dev-cert", "--out", self.dir, "demo.localhost", "*.example.com")
        self.assertEqual(code, 0, err)
        self.assertIn(f"curl --cacert {self.dir}/dev-ca.pem https://demo.localhost/", out)
        self.assertIn("curl -k", out)
        ca = self.load("dev-ca.pem")
        for filename in ("demo.localhost.pem", "wildcard-example.com.pem", "dev-ca.key"):
            mode = stat.S_IMODE(os.stat(os.path.join(self.dir, filename)).st_mode)
            self.assertEqual(mode, 0o600, filename)
        leaf = self.load("demo.localhost.pem")
        leaf.verify_directly_issued_by(ca)
        self.assertEqual(
            leaf.not_valid_after_utc - leaf.not_valid_before_utc,
            datetime.timedelta(days=365, hours=1),
        )
        store = tls.CertStore(
            reactor, self.dir, lambda h: True, run_in_thread=thread_runner(reactor)
        )
        store.load_initial()
        self.assertEqual(sorted(store.certificates()), ["*.example.com", "demo.localhost"])
        self.assertEqual(store.refused(), {})

    def test_rerun_keeps_the_ca_and_valid_certificates(self) -> None:
        self.assertEqual(run_cli("dev-cert", "--out", self.dir, "demo.localhost")[0], 0)
        ca, leaf = self.load("dev-ca.pem"), self.load("demo.localhost.pem")
        code, out, _ = run_cli("dev-cert", "--out", self.dir, "demo.localhost", "two.localhost")
        self.assertEqual(code, 0)
        self.assertIn("dev-ca.pem (kept)", out)
        self.assertIn("demo.localhost.pem (kept", out)
        self.assertIn("two.localhost.pem (created", out)
        self.assertEqual(self.load("dev-ca.pem"), ca)
        self.assertEqual(self.load("demo.localhost.pem"), leaf)
        self.load("two.localhost.pem").verify_directly_issued_by(ca)

    def test_never_overwrites_a_certificate_it_did_not_issue(self) -> None:
        os.makedirs(self.dir)
        path = certfiles.cert_path(self.dir, "real.example.com")
        TestCA("someone else").write(path, "real.example.com")
        before = open(path, "rb").read()
        code, _, err = run_cli("dev-cert", "--out", self.dir, "real.example.com")
        self.assertEqual(code, 1)
        self.assertIn("not issued by the dev CA", err)
        self.assertEqual(open(path, "rb").read(), before)

    def test_default_directory_is_the_acme_cache(self) -> None:
        data = os.path.abspath(self.mktemp())
        os.makedirs(data)
        env = os.path.join(data, "router.env")
        with open(env, "w") as f:
            f.write(f"LCHAT_DATA_DIR={data}\nLCHAT_HTTPS_ADDR=127.0.0.1:8443\n")
        code, out, err = run_cli("dev-cert", "--env-file", env, "demo.localhost")
        self.assertEqual(code, 0, err)
        self.assertTrue(os.path.exists(os.path.join(data, "acme", "demo.localhost.pem")))
        self.assertIn("https://demo.localhost:8443/api/version", out)

    def test_bad_names_are_refused_before_anything_is_written(self) -> None:
        code, _, err = run_cli("dev-cert", "--out", self.dir, "ok.localhost", "bad_name")
        self.assertEqual(code, 1)
        self.assertIn("lchat: error:", err)
        self.assertFalse(os.path.exists(self.dir))

    def test_listed_in_help(self) -> None:
        code, out, _ = run_cli("--help")
        self.assertEqual(code, 0)
        self.assertIn("    dev-cert ", out)

"""lchat/twisted_internals.py against the installed Twisted, over real loopback TCP and TLS.

Every test here exists to fail loudly, naming the Twisted internal, when a Twisted release changes
one of the private names lchat relies on (setup.cfg pins Twisted to the releases these passed on).
Each check is functional (what lchat needs from the internal, on real connections) and, where the
internal is a plain attribute, structural too, so that the message says exactly what moved.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives import serialization
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol, serverFromString
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IHandshakeListener, IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import PrivateCertificate, optionsForClientTLS, platformTrust
from twisted.internet.task import Clock, deferLater
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web import _newclient
from twisted.web.client import Agent, HTTPConnectionPool, RequestGenerationFailed, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from twisted.web.resource import Resource
from twisted.web.server import Site
from zope.interface import implementer

from lchat import twisted_internals
from lchat.objstore.s3 import exchange
from lchat.reactors import installed
from lchat.twisted_internals import platform_trust_plus, quiet_pool, treq_reactor
from tests.test_tls import TestCA

reactor = installed()
NAME = "internals.lchat.test"


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


async def until(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        await sleep(0.01)


def moved(name: str, why: str) -> str:
    """The failure message: which internal, and what in lchat breaks."""
    return (
        f"Twisted internal {name} changed in this Twisted: {why} "
        "(see lchat/twisted_internals.py; setup.cfg pins the tested Twisted)"
    )


@implementer(IHandshakeListener)
class _Held(Protocol):
    """A connection's far end: keeps its protocol so the test can reach the transport."""

    def __init__(self, into: list[_Held], greeting: bytes = b"") -> None:
        self.into = into
        self.greeting = greeting
        self.received = b""
        self.lost: Failure | None = None
        self.completed = False

    def connectionMade(self) -> None:
        self.into.append(self)
        if self.greeting:
            self.transport.write(self.greeting)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def handshakeCompleted(self) -> None:
        self.completed = True

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.lost = reason


def _factory(into: list[_Held], greeting: bytes = b"") -> Factory:
    return Factory.forProtocol(lambda: _Held(into, greeting))


class _Base(TestCase):
    timeout = 30

    async def listen(self, factory: Any) -> int:
        port: IListeningPort = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            factory
        )
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)  # type: ignore[attr-defined]

    async def connect(self, port: int, protocol: Protocol) -> Protocol:
        connected: Protocol = await connectProtocol(
            TCP4ClientEndpoint(reactor, "127.0.0.1", port), protocol
        )
        self.addCleanup(lambda: connected.transport.abortConnection())  # type: ignore[union-attr]
        return connected

    def server_tls(self, ca: TestCA) -> Any:
        key, cert = ca.issue(NAME)
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ) + cert.public_bytes(serialization.Encoding.PEM)
        return PrivateCertificate.loadPEM(pem).options()


def _write_file(path: str, data: bytes) -> str:
    path = os.path.abspath(path)
    with open(path, "wb") as f:
        f.write(data)
    return path


# --- quiet_pool -------------------------------------------------------------------------------


class _Hello(Resource):
    isLeaf = True

    def render_GET(self, request: Any) -> bytes:
        return b"hello"


class QuietPoolTests(_Base):
    """HTTPConnectionPool._factory and twisted.web.client._HTTP11ClientFactory."""

    async def fetch_logging(self, pool: HTTPConnectionPool) -> list[dict[str, Any]]:
        """One GET through ``pool``; the "Starting factory" events of its connection factory."""
        site = Site(_Hello())
        site.noisy = False
        port = await self.listen(site)
        events: list[dict[str, Any]] = []
        observer: ILogObserver = events.append  # type: ignore[assignment]
        globalLogPublisher.addObserver(observer)
        try:
            response = await Agent(reactor, pool=pool).request(
                b"GET", f"http://127.0.0.1:{port}/".encode()
            )
            self.assertEqual(await readBody(response), b"hello")
        finally:
            globalLogPublisher.removeObserver(observer)
            await pool.closeCachedConnections()
        return [
            e
            for e in events
            if isinstance(e.get("factory"), twisted_internals._HTTP11ClientFactory)
            and "Starting factory" in str(e.get("log_format", ""))
        ]

    async def test_the_pool_uses_the_factory_it_is_given(self) -> None:
        self.assertIs(
            getattr(HTTPConnectionPool, "_factory", None),
            twisted_internals._HTTP11ClientFactory,
            moved(
                "twisted.web.client.HTTPConnectionPool._factory",
                "quiet_pool can no longer choose the pool's connection factory",
            ),
        )
        self.assertEqual(
            await self.fetch_logging(quiet_pool(reactor, persistent=False)),
            [],
            moved(
                "HTTPConnectionPool._factory",
                "the pool ignored it: every connection logs 'Starting factory' again",
            ),
        )

    async def test_without_it_every_connection_logs(self) -> None:
        """The control: what quiet_pool silences is really there (else it can go)."""
        noisy = await self.fetch_logging(HTTPConnectionPool(reactor, persistent=False))
        self.assertEqual(
            len(noisy),
            1,
            "Twisted's _HTTP11ClientFactory no longer logs each connection: "
            "lchat.twisted_internals.quiet_pool is not needed any more",
        )


# --- platform_trust_plus ----------------------------------------------------------------------


class PlatformTrustPlusTests(_Base):
    """twisted.internet._sslverify.IOpenSSLTrustRoot._addCACertsToContext."""

    def test_the_interface_is_what_it_implements(self) -> None:
        self.assertEqual(
            sorted(twisted_internals.TrustRoot.names()),
            ["_addCACertsToContext"],
            moved(
                "twisted.internet._sslverify.IOpenSSLTrustRoot",
                "its methods changed; platform_trust_plus implements _addCACertsToContext only",
            ),
        )

    async def handshake(self, trust: Any) -> _Held:
        ca = TestCA()
        trust = trust(_write_file(self.mktemp(), ca.pem))
        held: list[_Held] = []
        port = await self.listen(TLSMemoryBIOFactory(self.server_tls(ca), False, _factory(held)))
        client_side: list[_Held] = []
        client = TLSMemoryBIOFactory(
            optionsForClientTLS(NAME, trustRoot=trust), True, _factory(client_side, b"ping")
        )
        connecting = TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(client)
        try:
            tcp: Any = await connecting.addTimeout(5, reactor)
        except Exception as e:
            self.flushLoggedErrors()
            raise AssertionError(
                moved(
                    "twisted.internet._sslverify.IOpenSSLTrustRoot._addCACertsToContext",
                    f"a client TLS connection with platform_trust_plus failed: {e!r}",
                )
            ) from e
        self.addCleanup(tcp.transport.abortConnection)
        await until(
            lambda: (
                bool(client_side) and (client_side[0].completed or client_side[0].lost is not None)
            ),
            5,
            "the handshake's outcome",
        )
        return client_side[0]

    async def test_a_private_ca_in_a_file_is_trusted(self) -> None:
        client = await self.handshake(platform_trust_plus)
        self.assertTrue(
            client.completed,
            moved(
                "twisted.internet._sslverify.IOpenSSLTrustRoot._addCACertsToContext",
                "optionsForClientTLS no longer loads LCHAT_MESH_CA_FILE's CAs through it, so "
                f"mesh peers with a private CA fail verification ({client.lost})",
            ),
        )

    async def test_the_platform_alone_does_not_trust_it(self) -> None:
        """The control: the handshake above succeeds because of the file's CA."""
        client = await self.handshake(lambda _ca_file: platformTrust())
        self.assertFalse(client.completed)


# --- the S3 client's error types ---------------------------------------------------------------


@implementer(IBodyProducer)
class _Short:
    """Declares 10 bytes and writes 5."""

    length = 10

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(b"12345")
        d: Deferred[None] = Deferred()
        reactor.callLater(0, d.callback, None)
        return d

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _LostClient(_newclient.HTTP11ClientProtocol):
    lost = False

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.lost = True
        super().connectionLost(reason)


class HTTPClientErrorTests(_Base):
    """RequestNotSent, WrongBodyLength and the _WrapperException family (lchat.objstore.s3)."""

    def test_the_s3_client_knows_every_wrapped_error(self) -> None:
        wrapper = getattr(_newclient, "_WrapperException", None)
        self.assertIsNotNone(wrapper, moved("twisted.web._newclient._WrapperException", "gone"))
        assert wrapper is not None
        unknown = [
            cls.__name__
            for cls in _all_subclasses(wrapper)
            if not issubclass(cls, exchange.WRAPPERS)
        ]
        self.assertEqual(
            unknown,
            [],
            moved(
                "twisted.web._newclient._WrapperException",
                "it has new subclasses lchat.objstore.s3.exchange.WRAPPERS does not list, whose "
                "causes the S3 client would neither describe nor check for cancellation",
            ),
        )

    async def test_request_not_sent_is_what_a_lost_connection_refuses_with(self) -> None:
        held: list[_Held] = []
        port = await self.listen(_factory(held))
        protocol = _LostClient()
        await self.connect(port, protocol)
        await until(lambda: bool(held), 5, "the server side of the connection")
        held[0].transport.loseConnection()  # type: ignore[union-attr]
        await until(lambda: protocol.lost, 5, "the client seeing it")
        request = _newclient.Request(b"GET", b"/", Headers({b"host": [b"x"]}), None)
        failure: Failure | None = None
        try:
            await protocol.request(request)
        except Exception:
            failure = Failure()
        self.assertTrue(
            failure is not None and failure.check(twisted_internals.RequestNotSent),
            moved(
                "twisted.web._newclient.RequestNotSent",
                f"a request on a lost connection failed with {failure!r}: the S3 client no "
                "longer knows it was never sent",
            ),
        )

    async def test_wrong_body_length_is_what_a_short_body_fails_with(self) -> None:
        site = Site(_Hello())
        site.noisy = False
        port = await self.listen(site)
        agent = Agent(reactor, pool=quiet_pool(reactor, persistent=False))
        producer = _Short()
        failure: Failure | None = None
        try:
            await agent.request(b"POST", f"http://127.0.0.1:{port}/".encode(), None, producer)
        except RequestGenerationFailed as e:
            failure = e.reasons[0] if e.reasons else None
        self.assertTrue(
            failure is not None and failure.check(twisted_internals.WrongBodyLength),
            moved(
                "twisted.web._newclient.WrongBodyLength",
                f"a body shorter than its length failed with {failure!r}",
            ),
        )


# --- treq_reactor ---------------------------------------------------------------------------------


@implementer(IAgent)
class _Silent:
    """An agent whose requests are never answered."""

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred[IResponse]:
        return Deferred()


class TreqReactorTests(SynchronousTestCase):
    """treq._types._ITreqReactor: all treq asks of the reactor it is given is callLater."""

    def test_a_request_times_out_on_the_reactor_it_is_given(self) -> None:
        clock = Clock()
        d = HTTPClient(_Silent()).request(
            "GET", "http://x.invalid/", reactor=treq_reactor(clock), timeout=5
        )
        self.assertEqual(
            len(clock.getDelayedCalls()),
            1,
            moved("treq's reactor= argument", "treq no longer times a request out on it"),
        )
        clock.advance(5)
        self.failureResultOf(d, CancelledError)


def _all_subclasses(cls: type) -> list[type]:
    out: list[type] = []
    sub: type
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out

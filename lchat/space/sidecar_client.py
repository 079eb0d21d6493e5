"""How the reference bot sidecar (lchat.space.sidecar) talks to its space: HTTP over the space's
unix socket, or over an http(s) base URL with ``Host: $LCHAT_HOST`` (the router); the WebSocket
listener (wsproto: twisted's client cannot add our marker header). Every request and upgrade is
marked ``X-Lchat-Sidecar: 1``; each is bounded by :data:`REQUEST_TIMEOUT`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

from attrs import define, field, frozen
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    UNIXClientEndpoint,
    connectProtocol,
    wrapClientTLS,
)
from twisted.internet.error import ConnectingCancelledError
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.internet.protocol import connectionDone
from twisted.internet.ssl import optionsForClientTLS
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgentEndpointFactory
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    TextMessage,
)
from wsproto.events import Request as WSRequest
from wsproto.utilities import LocalProtocolError, RemoteProtocolError
from zope.interface import implementer

from lchat import unixhttp
from lchat.reactors import Reactor, TCPReactor, TimeReactor
from lchat.space.sidecar_config import BaseURL, SidecarConfig
from lchat.twisted_internals import quiet_pool
from lchat.unixhttp import Response
from lchat.webutil import BytesProducer

log = Logger(namespace="lchat.space.sidecar")

SIDECAR_HEADER = "X-Lchat-Sidecar"
REQUEST_TIMEOUT = 10.0  # one request, connect to last byte
MAX_RESPONSE = 1 << 20


class RequestFailed(Exception):
    """No usable answer from the space (nothing listening, timeout, cut off...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# -- talking to the space ----------------------------------------------------------------------


def marked(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` plus the sidecar marker (whatever the caller passed under that name)."""
    out = {k: v for k, v in headers.items() if k.lower() != SIDECAR_HEADER.lower()}
    out[SIDECAR_HEADER] = "1"
    return out


class Client(Protocol):
    """How the sidecar reaches its space. Every request it sends carries the sidecar marker."""

    host: str  # the Host header

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        timeout: float = REQUEST_TIMEOUT,  # noqa: ASYNC109 -- Twisted: enforced via addTimeout
    ) -> Response: ...

    def endpoint(self) -> IStreamClientEndpoint: ...

    def target(self, path: str) -> str: ...


@define
class UnixClient:
    """Straight to the space's unix socket (the default)."""

    reactor: TimeReactor
    socket: str
    host: str

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        timeout: float = REQUEST_TIMEOUT,  # noqa: ASYNC109 -- Twisted: enforced via addTimeout
    ) -> Response:
        try:
            return await unixhttp.request(
                self.reactor,
                self.socket,
                method,
                path,
                host=self.host,
                headers=marked(headers),
                body=body,
                timeout=timeout,
                max_body=MAX_RESPONSE,
            )
        except unixhttp.UnixHTTPError as e:
            raise RequestFailed(str(e)) from None

    def endpoint(self) -> IStreamClientEndpoint:
        return UNIXClientEndpoint(self.reactor, self.socket, timeout=int(REQUEST_TIMEOUT))

    def target(self, path: str) -> str:
        return path


@implementer(IAgentEndpointFactory)
@frozen
class _Fixed:
    """Every URI goes to one endpoint (the base URL's address)."""

    endpoint: IStreamClientEndpoint

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return self.endpoint


def _cancelled(e: BaseException) -> bool:
    kinds = (CancelledError, ConnectingCancelledError)
    return isinstance(e, kinds) or any(
        isinstance(r, Failure) and r.check(*kinds) for r in getattr(e, "reasons", None) or []
    )


def _describe(e: BaseException) -> str:
    reasons = getattr(e, "reasons", None) or []
    if reasons:
        return "; ".join(r.getErrorMessage() if isinstance(r, Failure) else str(r) for r in reasons)
    return str(e) or type(e).__name__


@define
class URLClient:
    """Through an http(s) base URL (e.g. the router), with ``Host: <the space>``.

    Over https the certificate is verified against the space's name (the router picks the
    certificate by SNI), while the connection goes to the URL's address.
    """

    reactor: TCPReactor
    base: BaseURL
    host: str
    _agent: Agent = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._agent = Agent.usingEndpointFactory(
            self.reactor,
            _Fixed(self.endpoint()),
            pool=quiet_pool(IReactorTime(self.reactor), persistent=False),
        )

    def endpoint(self) -> IStreamClientEndpoint:
        tcp = HostnameEndpoint(
            self.reactor, self.base.hostname, self.base.port, timeout=int(REQUEST_TIMEOUT)
        )
        if self.base.scheme == "https":
            return wrapClientTLS(optionsForClientTLS(self.host), tcp)
        return tcp

    def target(self, path: str) -> str:
        return self.base.prefix + path

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        timeout: float = REQUEST_TIMEOUT,  # noqa: ASYNC109 -- Twisted: enforced via addTimeout
    ) -> Response:
        attempt = Deferred.fromCoroutine(self._exchange(method, path, headers, body))
        attempt.addTimeout(timeout, IReactorTime(self.reactor))
        try:
            return await attempt
        except defer.TimeoutError:
            raise RequestFailed(f"{self.base}: no response within {timeout:g}s") from None

    async def _exchange(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        # The URL names the space (so the Agent sends Host: <space>); _Fixed picks the address.
        url = f"http://{self.host}{self.target(path)}".encode("ascii")
        hdrs = Headers({k: [v] for k, v in marked(headers).items()})
        producer = BytesProducer(body) if body or method in ("POST", "PUT") else None
        try:
            resp = await self._agent.request(method.encode(), url, hdrs, producer)
            if resp.length is not UNKNOWN_LENGTH and resp.length > MAX_RESPONSE:
                raise RequestFailed(f"{self.base}: response of {resp.length} bytes is too large")
            data = await readBody(resp)
        except RequestFailed:
            raise
        except Exception as e:
            if _cancelled(e):
                raise CancelledError() from None
            raise RequestFailed(f"{self.base}: {_describe(e)}") from None
        out = {
            name.decode("latin-1").lower(): ", ".join(v.decode("latin-1") for v in values)
            for name, values in resp.headers.getAllRawHeaders()
        }
        return Response(status=resp.code, headers=out, body=data)


def client_for(reactor: Reactor, config: SidecarConfig) -> Client:
    if config.url is not None:
        return URLClient(reactor, config.url, config.host)
    assert config.socket is not None
    return UnixClient(reactor, config.socket, config.host)


# -- the WebSocket listener (wsproto: twisted's client cannot add our marker header) -----------


class WSHandle(Protocol):
    closed: Deferred[None]

    def close(self) -> None: ...


class _WSClient(TwistedProtocol):
    def __init__(self, host: str, target: str, on_text: Callable[[str], None]) -> None:
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._host = host
        self._target = target
        self._on_text = on_text
        self._text: list[str] = []
        self.opened: Deferred[None] = Deferred(lambda _: self._abort())
        self.closed: Deferred[None] = Deferred()

    def _abort(self) -> None:
        if self.transport is not None:
            cast(Any, self.transport).abortConnection()

    def _send(self, event: Event) -> None:
        try:
            data = self._ws.send(event)
        except LocalProtocolError:
            return
        if self.transport is not None:
            self.transport.write(data)

    def connectionMade(self) -> None:
        marker = (SIDECAR_HEADER.lower().encode(), b"1")
        self._send(WSRequest(host=self._host, target=self._target, extra_headers=[marker]))

    def dataReceived(self, data: bytes) -> None:
        try:
            self._ws.receive_data(data)
            for event in self._ws.events():
                self._handle(event)
        except RemoteProtocolError as e:
            log.warn("websocket protocol error: {error}", error=e)
            self._abort()

    def _handle(self, event: Event) -> None:
        if isinstance(event, AcceptConnection):
            if not self.opened.called:
                self.opened.callback(None)
        elif isinstance(event, RejectConnection):
            if not self.opened.called:
                self.opened.errback(RequestFailed(f"websocket refused: HTTP {event.status_code}"))
            assert self.transport is not None
            self.transport.loseConnection()
        elif isinstance(event, TextMessage):
            self._text.append(event.data)
            if event.message_finished:
                text, self._text = "".join(self._text), []
                try:
                    self._on_text(text)
                except Exception:
                    log.failure("handling a websocket message failed")
        elif isinstance(event, Ping):
            self._send(event.response())
        elif isinstance(event, CloseConnection):
            if self._ws.state is ConnectionState.REMOTE_CLOSING:
                self._send(event.response())
            assert self.transport is not None
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self.opened.called:
            self.opened.errback(
                RequestFailed(f"websocket closed before opening: {reason.getErrorMessage()}")
            )
        if not self.closed.called:
            self.closed.callback(None)

    def close(self) -> None:
        if self._ws.state is ConnectionState.OPEN:
            self._send(CloseConnection(code=1000))
        if self.transport is not None:
            self.transport.loseConnection()


async def ws_connect(
    reactor: IReactorTime, client: Client, path: str, on_text: Callable[[str], None]
) -> WSHandle:
    """Open a WebSocket to ``path`` on the space (marker header included); RequestFailed if not."""
    proto = _WSClient(client.host, client.target(path), on_text)
    connecting = connectProtocol(client.endpoint(), proto)
    connecting.addTimeout(REQUEST_TIMEOUT, reactor)
    try:
        await connecting
    except defer.TimeoutError:
        raise RequestFailed(f"websocket: no connection within {REQUEST_TIMEOUT:g}s") from None
    except CancelledError:
        raise
    except Exception as e:
        raise RequestFailed(f"websocket: cannot connect: {_describe(e)}") from None
    opened = proto.opened.addTimeout(REQUEST_TIMEOUT, reactor)
    try:
        await opened
    except defer.TimeoutError:
        raise RequestFailed(f"websocket: no handshake within {REQUEST_TIMEOUT:g}s") from None
    return proto


Connector = Callable[[str, Callable[[str], None]], Awaitable[WSHandle]]

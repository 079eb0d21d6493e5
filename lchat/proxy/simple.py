"""A simple, correct HTTP/1.1 reverse proxy on twisted.web, good enough for the foundation.

It routes by Host through :class:`lchat.router.Router`, forwards to the space's unix socket with a
pooled client, strips hop-by-hop and internal headers, sets ``X-Forwarded-*``, and streams the
response back. It buffers request bodies (twisted.web does) and does not splice upgrades: the
streaming front door replaces it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectError, ConnectionDone
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, FileBodyProducer, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from lchat.router import LocalResponse, LocalSocket, Router
from lchat.webutil import quiet_pool

_log = Logger(namespace="lchat.proxy")

# RFC 9110 §7.6.1 hop-by-hop headers, plus the proxy-* family handled below.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
)
# Read to classify the request, never passed on to a space (DESIGN.md §4).
INTERNAL = frozenset({b"x-lchat-sidecar", b"x-lchat-mesh-forwarded"})

_requests = Counter("lchat_proxy_requests_total", "Proxied requests by status class", ["code"])
_in_flight = Gauge("lchat_proxy_in_flight", "Requests being proxied right now")
_upstream_errors = Counter("lchat_proxy_upstream_errors_total", "Upstream failures", ["kind"])


def forwardable(headers: Headers) -> list[tuple[bytes, bytes]]:
    """The request or response headers a proxy may pass on."""
    named: set[bytes] = set()
    for value in headers.getRawHeaders(b"connection", []):
        named.update(token.strip().lower() for token in value.split(b","))
    out: list[tuple[bytes, bytes]] = []
    for name, values in headers.getAllRawHeaders():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in INTERNAL or lower in named:
            continue
        if lower.startswith(b"proxy-"):
            continue
        out.extend((name, v) for v in values)
    return out


@implementer(IAgentEndpointFactory)
class _FixedUnixEndpoint:
    def __init__(self, reactor: Any, path: str) -> None:
        self._reactor = reactor
        self._path = path

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return UNIXClientEndpoint(self._reactor, self._path, timeout=5)


class _Relay(Protocol):
    """Copies an upstream response body into the downstream request."""

    def __init__(self, request: Request, done: Deferred[None]) -> None:
        self._request = request
        self._done = done

    def dataReceived(self, data: bytes) -> None:
        if not self._request.finished and not self._request._disconnected:
            self._request.write(data)

    def connectionLost(self, reason: Failure = ConnectionDone) -> None:  # type: ignore[assignment]
        if reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback(None)
        else:
            self._done.errback(reason)


class ProxyResource(Resource):
    isLeaf = True

    def __init__(self, reactor: Any, router: Router) -> None:
        super().__init__()
        self._reactor = reactor
        self._router = router
        self._pool = quiet_pool(reactor)
        self._pool.maxPersistentPerHost = 16
        self._pool.cachedConnectionTimeout = 60

    def close(self) -> Deferred[None]:
        return self._pool.closeCachedConnections()

    def render(self, request: Request) -> bytes | int:
        host = request.getHeader(b"host")
        target = self._router.route(host.decode("latin-1") if host is not None else None)
        if isinstance(target, LocalResponse):
            return _local(request, target)
        if not request.uri.startswith(b"/"):
            return _local(request, LocalResponse(400, b"400 Bad Request: origin-form only\n"))
        self._forward(request, target)
        return NOT_DONE_YET

    def _forward(self, request: Request, target: LocalSocket) -> None:
        headers = Headers()
        for name, value in forwardable(request.requestHeaders):
            # The body producer states its own length; ours would duplicate it.
            if name.lower() in (b"x-forwarded-for", b"x-forwarded-proto", b"content-length"):
                continue
            headers.addRawHeader(name, value)
        peer = request.getClientAddress()
        client_ip = getattr(peer, "host", None) or "unix"
        prior = request.getHeader(b"x-forwarded-for")
        forwarded_for = client_ip.encode() if prior is None else prior + b", " + client_ip.encode()
        headers.setRawHeaders(b"x-forwarded-for", [forwarded_for])
        headers.setRawHeaders(b"x-forwarded-proto", [b"https" if request.isSecure() else b"http"])

        length = request.getHeader(b"content-length")
        has_body = length not in (None, b"0") or request.getHeader(b"transfer-encoding")
        content = request.content
        body = None
        if has_body and content is not None:
            content.seek(0)
            body = FileBodyProducer(content)
        agent = Agent.usingEndpointFactory(
            self._reactor, _FixedUnixEndpoint(self._reactor, target.path), pool=self._pool
        )
        uri = b"http://" + target.host.encode("ascii") + request.uri
        _in_flight.inc()
        d = agent.request(request.method, uri, headers, body)
        d.addCallback(self._respond, request)
        d.addErrback(self._fail, request, target)
        d.addBoth(lambda _: _in_flight.dec())

    def _respond(self, response: IResponse, request: Request) -> Deferred[None]:
        request.setResponseCode(response.code, response.phrase)
        for name, value in forwardable(response.headers):
            request.responseHeaders.addRawHeader(name, value)
        _requests.labels(f"{response.code // 100}xx").inc()
        done: Deferred[None] = Deferred()
        response.deliverBody(_Relay(request, done))

        def finish(_: object) -> None:
            if not request.finished and not request._disconnected:
                request.finish()

        def broken(failure: Failure) -> None:
            _upstream_errors.labels("body").inc()
            _log.warn("upstream body broke off: {e}", e=failure.getErrorMessage())
            if not request._disconnected and request.channel is not None:
                request.channel.loseConnection()

        done.addCallbacks(finish, broken)
        return done

    def _fail(self, failure: Failure, request: Request, target: LocalSocket) -> None:
        kind = "connect" if failure.check(ConnectError) else "request"
        _upstream_errors.labels(kind).inc()
        _requests.labels("5xx").inc()
        _log.warn(
            "upstream {path} for {host} failed: {e}",
            path=target.path,
            host=target.host,
            e=failure.getErrorMessage(),
        )
        if request.finished or request._disconnected or request.startedWriting:
            if not request.finished and request.channel is not None:
                request.channel.loseConnection()
            return
        _write_local(request, LocalResponse(502, b"502 Bad Gateway: the space is not answering\n"))


def _local(request: Request, response: LocalResponse) -> bytes:
    _requests.labels(f"{response.status // 100}xx").inc()
    request.setResponseCode(response.status)
    for name, value in response.headers:
        request.responseHeaders.setRawHeaders(name, [value])
    if not request.responseHeaders.hasHeader(b"content-type"):
        request.responseHeaders.setRawHeaders(b"content-type", [b"text/plain; charset=utf-8"])
    return response.body


def _write_local(request: Request, response: LocalResponse) -> None:
    request.write(_local(request, response))
    request.finish()

"""A tiny async HTTP/1.1 client over a unix socket.

Used for readiness probes (``GET /api/version``) and by the activator for ``GET /api/next-due``.
One request per connection (``Connection: close``): these are rare, small control-plane calls,
so pooling would only add state to get wrong. Every failure a caller can meet — nothing listening,
no socket file, no answer in time, a cut-off or oversized response — surfaces as one typed
:class:`UnixHTTPError` that names the socket, so log lines can say what went wrong.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any, cast

from attrs import frozen
from twisted.internet import defer, error
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import (
    IReactorTime,
    IReactorUNIX,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.client import (
    URI,
    Agent,
    ResponseDone,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgentEndpointFactory, IResponse
from zope.interface import implementer

from lchat.reactors import TimeReactor
from lchat.twisted_internals import quiet_pool
from lchat.webutil import BytesProducer

MAX_BODY = 1 << 20  # probes and next-due answers are tiny; anything bigger is a misbehaving peer


class UnixHTTPError(Exception):
    """A request over a unix socket got no usable response. ``reason`` is for humans."""

    def __init__(self, socket_path: str, reason: str) -> None:
        super().__init__(f"{socket_path}: {reason}")
        self.socket_path = socket_path
        self.reason = reason


class ResponseTooLarge(UnixHTTPError):
    """The response body was larger than the cap."""


@frozen
class Response:
    status: int
    headers: Mapping[str, str]  # names lowercased; repeated headers joined with ", "
    body: bytes


async def request(
    reactor: TimeReactor,  # and IReactorUNIX, adapted to where it connects
    socket_path: str,
    method: str,
    path: str,
    *,
    host: str = "localhost",
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    timeout: float = 5.0,  # noqa: ASYNC109 -- Twisted, not asyncio: enforced via addTimeout
    max_body: int = MAX_BODY,
) -> Response:
    """Send one request to the HTTP server listening on ``socket_path`` and read the whole answer.

    ``timeout`` bounds everything: connecting, sending, waiting and reading the body.
    Raises :class:`UnixHTTPError` (or :class:`ResponseTooLarge`) on any failure.
    """
    if not path.startswith("/"):
        raise ValueError(f"request path must start with '/': {path!r}")
    attempt = Deferred.fromCoroutine(
        _exchange(reactor, socket_path, method, path, host, headers or {}, body, timeout, max_body)
    )
    # Cancelling the coroutine's Deferred cancels whatever it awaits (connect, response, body),
    # which aborts the connection; addTimeout turns that cancellation into TimeoutError.
    attempt.addTimeout(timeout, IReactorTime(reactor))
    try:
        return await attempt
    except defer.TimeoutError:
        raise UnixHTTPError(socket_path, f"no response within {timeout:g}s") from None


async def _exchange(
    reactor: TimeReactor,
    socket_path: str,
    method: str,
    path: str,
    host: str,
    headers: Mapping[str, str],
    body: bytes,
    connect_timeout: float,
    max_body: int,
) -> Response:
    agent = Agent.usingEndpointFactory(
        reactor,
        _UnixEndpointFactory(reactor, socket_path, connect_timeout),
        pool=quiet_pool(IReactorTime(reactor), persistent=False),
    )
    hdrs = Headers({k: [v] for k, v in headers.items()})
    producer = BytesProducer(body) if body or method.upper() in ("POST", "PUT", "PATCH") else None
    url = f"http://{host}{path}".encode("ascii")
    try:
        resp = cast(
            IResponse, await agent.request(method.upper().encode("ascii"), url, hdrs, producer)
        )
    except Exception as e:
        raise _translate(socket_path, e) from None

    if resp.length is not UNKNOWN_LENGTH and resp.length > max_body:
        _abort(resp)
        raise ResponseTooLarge(
            socket_path, f"response body of {resp.length} bytes exceeds {max_body} bytes"
        )
    collector = _CappedBody(max_body, socket_path)
    resp.deliverBody(collector)
    try:
        data = await collector.done
    except UnixHTTPError:
        raise
    except Exception as e:
        raise _translate(socket_path, e, "response cut off") from None

    out: dict[str, str] = {}
    for name, values in resp.headers.getAllRawHeaders():
        out[name.decode("latin-1").lower()] = ", ".join(v.decode("latin-1") for v in values)
    return Response(status=resp.code, headers=out, body=data)


def _translate(socket_path: str, e: Exception, what: str = "request failed") -> Exception:
    """Map Twisted's connection/response failures onto UnixHTTPError; keep cancellation."""
    cancelled = (defer.CancelledError, error.ConnectingCancelledError)
    if isinstance(e, cancelled) or any(
        isinstance(r, Failure) and r.check(*cancelled) for r in _reason_list(e)
    ):
        # A cancelled connect surfaces as ConnectingCancelledError, a cancelled exchange as
        # ResponseNeverReceived([CancelledError]): report both as cancellation, so addTimeout
        # recognises its own work and callers' cancels propagate.
        return defer.CancelledError()
    if isinstance(e, error.ConnectionRefusedError):
        return UnixHTTPError(socket_path, "connection refused (nothing is listening)")
    if isinstance(e, error.ConnectError):
        if getattr(e, "osError", None) == errno.ENOENT or not os.path.exists(socket_path):
            return UnixHTTPError(socket_path, "socket does not exist")
        return UnixHTTPError(socket_path, f"cannot connect: {e}")
    if isinstance(e, ResponseNeverReceived):
        return UnixHTTPError(socket_path, f"connection closed without a response ({_reasons(e)})")
    return UnixHTTPError(socket_path, f"{what}: {_reasons(e)}")


def _reason_list(e: BaseException) -> list[object]:
    return list(getattr(e, "reasons", None) or [])


def _reasons(e: BaseException) -> str:
    # ResponseFailed & co. wrap a list of Failures; show the underlying causes.
    reasons = _reason_list(e)
    if reasons:
        return (
            "; ".join(str(r.value) if isinstance(r, Failure) else str(r) for r in reasons)
            or type(e).__name__
        )
    return str(e) or type(e).__name__


def _abort(resp: IResponse) -> None:
    # Deliver to a protocol that immediately stops the producer: the only public way to
    # drop a response's connection without reading it.
    class _Drop(Protocol):
        def connectionMade(self) -> None:
            cast(Any, self.transport).stopProducing()

        def connectionLost(self, reason: Failure = connectionDone) -> None:
            pass

    resp.deliverBody(_Drop())


@implementer(IAgentEndpointFactory)
class _UnixEndpointFactory:
    def __init__(self, reactor: TimeReactor, socket_path: str, timeout: float) -> None:
        self._reactor = reactor
        self._path = socket_path
        self._timeout = timeout

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        return UNIXClientEndpoint(
            IReactorUNIX(self._reactor), self._path, timeout=max(1, int(self._timeout + 0.999))
        )


class _CappedBody(Protocol):
    """Collects a response body, aborting the connection once it passes ``cap`` bytes."""

    def __init__(self, cap: int, socket_path: str) -> None:
        self.done: Deferred[bytes] = Deferred(lambda _d: self.abort())
        self._cap = cap
        self._path = socket_path
        self._buf = bytearray()

    def abort(self) -> None:
        if self.transport is not None:
            cast(Any, self.transport).stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        if len(self._buf) + len(data) > self._cap:
            self.abort()
            self.done.errback(
                ResponseTooLarge(self._path, f"response body exceeds {self._cap} bytes")
            )
            return
        self._buf += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.done.called:
            return
        # PotentialDataLoss: no Content-Length and the server closed — normal for HTTP/1.0.
        if reason.check(ResponseDone, http.PotentialDataLoss):
            self.done.callback(bytes(self._buf))
        else:
            self.done.errback(reason)

"""The per-request decision: which target serves a request for a given Host.

The router knows hostnames and registry rows; it knows nothing of HTTP parsing (the proxy's job) or of
processes (the supervisor's). Later issues add the mesh (forward to the owner) and the activator (wake
a hibernating space) as further branches of :meth:`Router.route`.
"""

from __future__ import annotations

from typing import Protocol

from attrs import frozen
from prometheus_client import Counter

from lchat import hosts
from lchat.registry import RouteTable

RETRY_AFTER_SECONDS = 5

_decisions = Counter("lchat_route_decisions_total", "Routing decisions by outcome", ["outcome"])


@frozen
class LocalSocket:
    """Proxy the request to this space or service's unix socket."""

    host: str
    path: str


@frozen
class LocalResponse:
    """Answer the request here, without any upstream."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


Target = LocalSocket | LocalResponse


class TableSource(Protocol):
    """Anything holding the current route table (the registry's RouteSource does)."""

    @property
    def table(self) -> RouteTable: ...


def _plain(status: int, text: str, *extra: tuple[bytes, bytes]) -> LocalResponse:
    return LocalResponse(
        status=status,
        body=(text + "\n").encode(),
        headers=((b"content-type", b"text/plain; charset=utf-8"), *extra),
    )


class Router:
    """Maps a request's Host header to a :data:`Target` using the current route table."""

    def __init__(self, table: TableSource, fallback_url: str = "") -> None:
        self._table = table
        self._fallback = fallback_url.encode("ascii", "strict") if fallback_url else b""

    def route(self, host_header: str | None) -> Target:
        if host_header is None:
            _decisions.labels("bad_host").inc()
            return _plain(400, "400 Bad Request: missing Host header")
        try:
            host = hosts.parse_host_header(host_header)
        except hosts.InvalidHost:
            _decisions.labels("bad_host").inc()
            return _plain(400, "400 Bad Request: malformed Host header")
        route = self._table.table.get(host)
        if route is None:
            _decisions.labels("unknown").inc()
            if self._fallback:
                return LocalResponse(302, b"", ((b"location", self._fallback),))
            return _plain(404, "404 Not Found: unknown host")
        if route.hibernate:
            # Hibernating rows belong to the activator, which needs LCHAT_HIBERNATE_BUCKET and
            # arrives in its own issue; until then they are honestly unavailable, not misrouted.
            _decisions.labels("hibernating").inc()
            return _plain(
                503,
                f"503 Service Unavailable: {host} is hibernating and this router has no activator",
                (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
            )
        if not route.serveable:
            _decisions.labels(route.status).inc()
            return _plain(
                503,
                f"503 Service Unavailable: {host} is {route.status}",
                (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
            )
        _decisions.labels("local").inc()
        return LocalSocket(host=host, path=route.socket)

"""The per-request decision: which target serves a request.

The router knows hostnames and registry rows; it knows nothing of HTTP parsing (the proxy's job) or of
processes (the supervisor's). The proxy hands it a parsed :class:`RequestHead` and gets back a
:data:`Target`, now or later (a Deferred: the activator may have to wake a space first).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

from attrs import evolve, field, frozen
from prometheus_client import Counter
from twisted.internet.defer import Deferred

from lchat.registry import Route, RouteTable

RETRY_AFTER_SECONDS = 5
_RETRY_AFTER = (b"retry-after", str(RETRY_AFTER_SECONDS).encode())  # on 503s of ours
ACME_CHALLENGE_PATH = b"/.well-known/acme-challenge/"

Header = tuple[bytes, bytes]


class RequestHead(NamedTuple):
    """What the routing decision may look at. Internal headers are already taken out.

    Immutable, like every value here; a NamedTuple rather than a frozen attrs class because one is
    made per request, and it costs a tenth as much to make (docs/performance.md)."""

    method: bytes
    target: bytes  # origin-form: /path?query
    host: str  # normalised (lchat.hosts.parse_host_header)
    client: str = ""  # the peer's address
    secure: bool = False  # arrived over TLS
    sidecar: bool = False  # carried X-Lchat-Sidecar: a bot sidecar's own traffic
    forwarded: bytes | None = None  # the raw X-Lchat-Mesh-Forwarded value, unauthenticated
    # Asks to switch protocols (a WebSocket): once switched, in flight until the tunnel closes.
    upgrade: bool = False


class InFlight(Protocol):
    """Counts the requests a target is serving (a hibernating space: what keeps it awake and
    what its sleep waits for). The proxy calls ``request_started`` once the request is routed to
    the target and ``request_ended`` exactly once after, when its response is complete or its
    connection gone (an upgraded one: when the tunnel closes)."""

    def request_started(self, upgrade: bool) -> None: ...
    def request_ended(self, upgrade: bool) -> None: ...


@frozen
class LocalSocket:
    """Proxy to this space's or service's unix socket; or, ``kind="hop"``, to the control
    process's hop socket (a worker process handing over a request only control can serve: a
    hibernating host's, a mesh forward; lchat.controlhop)."""

    host: str
    path: str
    kind: Literal["instance", "service", "hop"] = "instance"
    # Added to the response head (e.g. X-Lchat-Wake on a request that waited for a wake).
    response_headers: tuple[Header, ...] = ()
    # Told when a request to it starts and ends (the activator's awake space), or None.
    inflight: InFlight | None = field(default=None, eq=False, repr=False)
    # Added to the request head, after the forwarding headers (a hop's X-Lchat-Sidecar and
    # X-Lchat-Mesh-Forwarded: what control reads to route the request as this process would).
    add_headers: tuple[Header, ...] = ()


@frozen
class RemotePeer:
    """Proxy to another box over TLS, verifying ``server_name``, connecting to ``address`` only.

    ``tls=False`` only for a mesh whose ``LCHAT_MESH_SELF`` URLs are ``http://`` (a private
    network the operator chose to trust); never a verification bypass."""

    host: str
    address: str
    port: int
    server_name: str
    add_headers: tuple[Header, ...] = ()
    tls: bool = True
    # The mesh box it forwards to (its normalised URL), or "" for an upstream outside the mesh.
    # A mesh forward the peer could not take, nothing of it acted on, is routed again once
    # (Routes.reroute), told why: "unreachable" or "refused" (the dial failed), "closed" (a safe
    # request closed unanswered), "stopping" (refused unprocessed: the peer is draining) or
    # "not_holding" (refused unprocessed: the peer does not hold the space its word said it held).
    member: str = ""


@frozen
class LocalResponse:
    """Answer here, without any upstream. ``label`` names the outcome in metrics.

    ``refusal`` is set only on an answer made *instead of* processing the request: to
    ``"stopping"`` because this box is stopping, to ``"not_holding"`` because a forward reached it
    for a space it does not hold (lchat.mesh.routing). Nothing of it was acted on and another box
    may serve it (lchat.mesh.routing tells the peer that forwarded it, and only that peer)."""

    status: int
    body: bytes
    headers: tuple[Header, ...] = ()
    label: str = field(default="local", kw_only=True)
    refusal: str = field(default="", kw_only=True)


Target = LocalSocket | RemotePeer | LocalResponse


class TableSource(Protocol):
    """Anything holding the current route table (the registry's RouteSource does)."""

    @property
    def table(self) -> RouteTable: ...


class Routes(Protocol):
    """What the proxy needs from a router."""

    def route(self, head: RequestHead) -> Target | Deferred[Target]: ...

    def reroute(
        self, head: RequestHead, peer: RemotePeer, why: str
    ) -> Target | Deferred[Target]: ...


def plain(status: int, text: str, *extra: Header, label: str = "local") -> LocalResponse:
    return LocalResponse(
        status,
        (text + "\n").encode(),
        ((b"content-type", b"text/plain; charset=utf-8"), *extra),
        label=label,
    )


_unavailable = Counter(
    "lchat_activator_unavailable_total", "503s answered by the activator, by reason", ["reason"]
)

# What a hibernating space's 503 tells the world, by reason (details go to the log, never to a
# client: paths, owners and store errors are for the operator).
_PUBLIC = {
    "lease_held": "{host} is being served elsewhere right now",
    "queue_timeout": "{host} is still waking",
    "sidecar": "{host} is asleep (sidecar requests never wake it)",
    "shutdown": "the router is stopping",
    "backoff": "{host} failed to wake a moment ago",
    "spawn": "{host} could not start",
    "not_ready": "{host} could not start",
    "bucket": "{host} cannot wake while storage is unreachable",
    "diverged": "{host} cannot wake until an operator checks its storage",
    "capacity": "{host} cannot wake right now: this server is at capacity",
    "held": "{host} is being moved",
    "not_alive": "{host} cannot wake on this server right now",
    "build_behind": "{host} cannot wake on this server until it is updated",
    "moved": "{host} has moved to another region; retry in a moment",
    "not_witnessed": "{host} cannot save changes right now (its storage is out of reach); "
    "reads still work",
}
# 503s that mean "this box is stopping, and the request was never acted on": while the router
# drains, a request refused for one of these is marked (LocalResponse.refusal) so that a mesh peer
# that forwarded it sends it elsewhere. Never lease_held, backoff, bucket, spawn, not_ready or
# queue_timeout: those say nothing about this box going away (another box would meet the same
# lease, or start a second wake racing this one), and never a space's own 503 (a space's answer is
# not a LocalResponse at all).
DRAIN_REFUSALS = frozenset(
    {
        "shutdown",  # the router is stopping: no new wake here
        "stood_down",  # queued on a space that went to sleep as the drain began
        "cancelled",  # waiting for a wake the drain called off
    }
)


def unavailable(
    host: str, reason: str, retry_after: float = 0.0, *, stopping: bool = False
) -> LocalResponse:
    """A hibernating space's 503 with ``Retry-After`` (``retry_after`` rounded up, 1 s to 1 h;
    0: the default). The body says what kind of trouble in public words only. ``stopping``: the
    router is draining, and a refusal of :data:`DRAIN_REFUSALS` is marked as such."""
    _unavailable.labels(reason).inc()
    seconds = max(1, min(int(retry_after + 0.999) or RETRY_AFTER_SECONDS, 3600))
    public = _PUBLIC.get(reason, "{host} is temporarily unavailable").format(host=host)
    response = plain(
        503,
        f"503 Service Unavailable: {public}; try again in {seconds}s",
        (b"retry-after", str(seconds).encode()),
        label=f"wake_{reason}",
    )
    if stopping and reason in DRAIN_REFUSALS:
        response = evolve(response, refusal="stopping")
    return response


class Hibernation(Protocol):
    """The activator, as the router sees it."""

    def route(
        self, route: Route, sidecar: bool = False, write: bool = False
    ) -> Target | Deferred[Target]: ...


# Methods that change nothing (RFC 9110 9.2.1): every other one may be a write. The one list:
# the activator's write gate and the proxy's resend of a forwarded request elsewhere both read it.
SAFE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})


class Mesh(Protocol):
    """The mesh's routing, as the router sees it (lchat.mesh.routing.MeshRouter)."""

    def in_scope(self, host: str) -> bool: ...

    def route(self, route: Route, head: RequestHead) -> Target | Deferred[Target]:
        """Served here (by the activator the mesh holds) or forwarded to a peer."""

    def forward_elsewhere(self, route: Route, head: RequestHead) -> Target: ...

    def reroute(
        self, route: Route, head: RequestHead, peer: RemotePeer, why: str
    ) -> Target | Deferred[Target]:
        """Routed again without ``peer``, or answered here (a lives-elsewhere row)."""


class Router:
    """Maps a request to a :data:`Target` using the current route table."""

    def __init__(
        self,
        table: TableSource,
        fallback_url: str = "",
        activator: Hibernation | None = None,
        mesh: Mesh | None = None,
        mesh_api: tuple[str, str] | None = None,  # (this box's mesh-self host, API socket)
        acme_challenge: str | None = None,  # the HTTP-01 responder's socket, for plain HTTP
    ) -> None:
        self._table = table
        self._fallback = fallback_url.encode("ascii", "strict") if fallback_url else b""
        self._activator = activator
        self._mesh = mesh
        self._mesh_api = mesh_api
        self._acme_challenge = acme_challenge
        # The target of each ready row, made once per row (a row is a frozen value: a changed
        # one is a new object), not once per request.
        self._sockets: dict[str, tuple[Route, LocalSocket]] = {}

    def route(self, head: RequestHead) -> Target | Deferred[Target]:
        host = head.host
        if (
            self._acme_challenge is not None
            and not head.secure
            and head.target.startswith(ACME_CHALLENGE_PATH)
        ):
            # A CA validating HTTP-01, for any host: only tokens we published are answered.
            return LocalSocket(host=host, path=self._acme_challenge, kind="service")
        if self._mesh_api is not None and host == self._mesh_api[0]:
            # Addressed to this box itself: the route-replication API (bearer token inside).
            return LocalSocket(host=host, path=self._mesh_api[1], kind="service")
        route = self._table.table.routes.get(host)  # (RouteTable.get, without the call)
        cached = self._sockets.get(host)
        if cached is not None and cached[0] is route:
            return cached[1]  # the same ready row as before (rows are frozen: a change is new)
        if route is None:
            if self._fallback:
                return LocalResponse(302, b"", ((b"location", self._fallback),), label="unknown")
            return plain(404, "404 Not Found: unknown host", label="unknown")
        retry = _RETRY_AFTER
        if route.elsewhere:
            # A peer's "lives elsewhere" row: the space runs always-on on the box at lives_at.
            # Forwarded there, never woken, run or answered here (docs/mesh.md, Hibernate flips).
            if self._mesh is None:
                return plain(
                    503,
                    f"503 Service Unavailable: {host} runs on another box, and this router is "
                    f"not in the mesh (LCHAT_MESH_SELF is not set)",
                    retry,
                    label="elsewhere",
                )
            return self._mesh.forward_elsewhere(route, head)
        if route.hibernate and self._activator is not None and route.serveable:
            if self._mesh is not None and self._mesh.in_scope(host):
                return self._mesh.route(route, head)
            return self._activator.route(route, head.sidecar, head.method not in SAFE_METHODS)
        if route.hibernate and self._activator is None:
            # Hibernating rows belong to the activator, which exists only with
            # LCHAT_HIBERNATE_BUCKET: without it they are honestly unavailable, not misrouted.
            return plain(
                503,
                f"503 Service Unavailable: {host} is hibernating and this router has no "
                f"activator (LCHAT_HIBERNATE_BUCKET is not set)",
                retry,
                label="hibernating",
            )
        if not route.serveable:
            return plain(
                503, f"503 Service Unavailable: {host} is {route.status}", retry, label=route.status
            )
        target = LocalSocket(host=host, path=route.socket, kind=route.kind)
        if len(self._sockets) > 2 * len(self._table.table) + 64:
            self._sockets.clear()  # rows removed since: forget them
        self._sockets[host] = (route, target)
        return target

    def reroute(self, head: RequestHead, peer: RemotePeer, why: str) -> Target | Deferred[Target]:
        """Route ``head`` again: the mesh box ``peer.member`` could not take it (``why``, as
        :class:`RemotePeer` says) and nothing of it was acted on. The proxy asks once per
        request. The mesh leaves the peer out a while; a row gone meanwhile is routed as such."""
        route = self._table.table.routes.get(head.host)
        if route is None or self._mesh is None:
            return self.route(head)
        return self._mesh.reroute(route, head, peer, why)

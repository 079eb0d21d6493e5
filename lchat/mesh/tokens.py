"""Which mesh token a peer proved it holds: ``LCHAT_MESH_TOKEN``, or the one extra value
``LCHAT_MESH_TOKEN_ACCEPT`` that a box accepts (never sends) while the fleet rotates the token
(docs/secrets.md, "Mesh token").

A box always *sends* ``LCHAT_MESH_TOKEN`` (the bearer on route-replication calls, the key of the
forwarded marker's HMAC) and *accepts* either value, so that a rotation (three rolling restarts)
never has a box send a token some other box does not yet accept.

Invariants: both values are compared on every check, each in constant time (how long a check takes
says nothing about which value matched, or whether one did); a use of the accepted value is counted
in :data:`ACCEPT_TOKEN_USES` (by ``use``) and logged the first time per process and use, naming
the metric an operator watches before dropping ``LCHAT_MESH_TOKEN_ACCEPT``.

Failed authentication on the mesh API is rate-limited per client address (:class:`AuthLimiter`): each 401
takes a token from the client's bucket (:data:`AUTH_FAILURES_BURST`, refilled one per
:data:`AUTH_FAILURE_EVERY` seconds); with none left, every request of that client — whatever
token it carries, so that guessing gains nothing — is answered 429 with ``Retry-After`` until one
is back, counted in ``lchat_mesh_auth_limited_total`` and logged once per episode. The client is
the last ``X-Forwarded-For`` entry, which this box's proxy appends (the API is reached only
through it, or on its unix socket: "local").
"""

from __future__ import annotations

import hmac
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from prometheus_client import Counter
from twisted.logger import Logger
from twisted.web.server import Request

ACCEPT_ENV = "LCHAT_MESH_TOKEN_ACCEPT"
# (A peer with a stale token during a botched rotation retries far less often than one 401 every
# AUTH_FAILURE_EVERY seconds; a guesser gets 10 guesses a minute at most.)
AUTH_FAILURES_BURST = 10
AUTH_FAILURE_EVERY = 6.0
AUTH_CLIENTS = 10_000  # client buckets kept (least recently failed dropped first)

Match = Literal["current", "accept"]
Use = Literal["api", "forwarded", "heartbeat"]

ACCEPT_TOKEN_USES = Counter(
    "lchat_mesh_accept_token_total",
    "Mesh requests authenticated by LCHAT_MESH_TOKEN_ACCEPT, not LCHAT_MESH_TOKEN, by use (api: "
    "a route-replication call's bearer; forwarded: a forwarded request's marker; heartbeat: a "
    "member's heartbeat MAC). Flat on every "
    "box: no peer still sends that value, so it can be dropped",
    ["use"],
)
for _use in ("api", "forwarded", "heartbeat"):
    ACCEPT_TOKEN_USES.labels(_use)

_log = Logger(namespace="lchat.mesh.tokens")
_logged: set[str] = set()  # uses already logged by this process (the counter keeps counting)


def match(given: bytes, current: bytes, accept: bytes) -> Match | None:
    """Which configured value ``given`` equals: both comparisons always run, in constant time. An
    empty value never matches (an unset ``accept`` accepts nothing)."""
    is_current = hmac.compare_digest(given, current)
    is_accept = hmac.compare_digest(given, accept)
    if is_current and current:
        return "current"
    if is_accept and accept:
        return "accept"
    return None


def note_accept_use(use: Use) -> None:
    """Count one request authenticated by the accepted value; log the first per use."""
    ACCEPT_TOKEN_USES.labels(use).inc()
    if use in _logged:
        return
    _logged.add(use)
    _log.info(
        "mesh: a peer authenticated with {env} ({use}), not LCHAT_MESH_TOKEN: some box still "
        "sends that value. Drop {env} only once lchat_mesh_accept_token_total stops growing on "
        "every box (logged once per process; counted in the metric)",
        env=ACCEPT_ENV,
        use=use,
    )


class AuthLimiter:
    """A token bucket per client address for failed mesh-API authentication (the module
    docstring). Invariants: a client with an empty bucket is refused before its token is
    looked at; at most :data:`AUTH_CLIENTS` buckets are kept (the least recently failing client
    is forgotten first: it starts again with a full bucket, which costs a guesser nothing it
    did not have)."""

    def __init__(
        self,
        clock: Callable[[], float],
        burst: int = AUTH_FAILURES_BURST,
        every: float = AUTH_FAILURE_EVERY,
        clients: int = AUTH_CLIENTS,
    ) -> None:
        self._clock = clock
        self.burst = burst
        self.every = every
        self._clients = clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at
        self._limited: set[str] = set()  # clients refused since their last refill (logged)

    def _tokens(self, client: str) -> float:
        got = self._buckets.get(client)
        if got is None:
            return float(self.burst)
        tokens, at = got
        return min(float(self.burst), tokens + (self._clock() - at) / self.every)

    def retry_after(self, client: str) -> int | None:
        """Seconds until ``client`` may try again (at least 1), or None: it may now."""
        tokens = self._tokens(client)
        if tokens >= 1.0:
            self._limited.discard(client)
            return None
        return max(1, math.ceil((1.0 - tokens) * self.every))

    def failed(self, client: str) -> None:
        """``client`` failed to authenticate: one token less."""
        tokens = max(0.0, self._tokens(client) - 1.0)
        self._buckets[client] = (tokens, self._clock())
        self._buckets.move_to_end(client)
        while len(self._buckets) > self._clients:
            gone, _ = self._buckets.popitem(last=False)
            self._limited.discard(gone)

    def first_refusal(self, client: str) -> bool:
        """True once per episode of refusals of ``client`` (for one log line)."""
        if client in self._limited:
            return False
        self._limited.add(client)
        return True


def client_of(request: Request) -> str:
    """A mesh API client's address (the module docstring): the last X-Forwarded-For entry, else "local"."""
    values = request.requestHeaders.getRawHeaders(b"x-forwarded-for") or []
    if not values:
        return "local"
    last = values[-1].rsplit(b",", 1)[-1].strip()
    return last.decode("ascii", "replace")[:64] or "local"

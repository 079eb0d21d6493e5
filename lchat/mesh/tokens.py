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
"""

from __future__ import annotations

import hmac
from typing import Literal

from prometheus_client import Counter
from twisted.logger import Logger

ACCEPT_ENV = "LCHAT_MESH_TOKEN_ACCEPT"

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

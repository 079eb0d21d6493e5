"""The body of a mesh box's heartbeat object (lchat.mesh.membership) and of its beats to its peers
(lchat.mesh.witness), and the MAC that proves a mesh box wrote it (:class:`HeartbeatKeys`).

Anyone who can write to the bucket can write an object under ``mesh/members/``; only a holder of
``LCHAT_MESH_TOKEN`` can make its ``mac``. A heartbeat is a member's only when its MAC verifies:
``hex HMAC-SHA256(K, "v1\n" + <the body without "mac">)`` where ``K = HMAC-SHA256(<token>,
"lchat mesh heartbeat v1")``, a key of its own derived from the token (the token itself is never
a MAC key here, so a heartbeat MAC can be no other message's, and the reverse). It covers every
field of the body — the URL, the epoch and the start time (``started_at``), the region, the
version, the process, ``draining`` — so none can be changed or moved to another key. A box signs
with ``LCHAT_MESH_TOKEN`` and verifies with it or, during a token rotation, with
``LCHAT_MESH_TOKEN_ACCEPT`` (counted in ``lchat_mesh_accept_token_total{use="heartbeat"}``).

A copy of a member's own heartbeat (the same bytes, replayed into its own key) is still its
heartbeat: it keeps that member looking alive in the bucket for as long as the copy is fresh,
which only the bucket's writer can do and which makes nobody else a member.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math

from attrs import asdict, evolve, field, frozen

from lchat.mesh import tokens

MAC_LABEL = b"lchat mesh heartbeat v1"
_MAC_HEX = 64
REQUIRED = ("url", "region", "version", "started_at")  # in every body; the others when set


@frozen
class Heartbeat:
    """The body of a heartbeat object."""

    url: str  # normalised LCHAT_MESH_SELF
    region: str  # LCHAT_MESH_REGION ("" = region-agnostic)
    version: str  # lchat.__version__ of the beating process
    started_at: float  # unix seconds (the box's clock, informational) of that process's start
    # Random per liveness period of a router process: the leases it takes name it (docs/lease.md),
    # and a lapse starts a new one, so nothing of the old one is written again. "" in older bodies.
    epoch: str = ""
    # The box is draining: out of placement at once, but alive (it still writes its last
    # flushes) until the drain deletes the heartbeat.
    draining: bool = False
    # Random per router process, kept across lapses: which process of the box a peer hears and
    # holds an answer of (lchat.mesh.witness). "" in the bodies of an older lchat, which takes
    # part in no witnessing (judged by the bucket alone).
    process: str = ""
    # hex HMAC of the rest of the body under the mesh's heartbeat key (HeartbeatKeys); "" in
    # the bodies of an older lchat, which are no member's.
    mac: str = ""

    def to_json(self) -> bytes:
        """Deterministic: the same heartbeat always gives the same bytes (and ETag). Only the
        :data:`REQUIRED` fields are written when empty."""
        data = {k: v for k, v in asdict(self).items() if v or k in REQUIRED}
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, body: bytes) -> Heartbeat:
        """Strict (ValueError says why): every field present with its type; extra fields ignored."""
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("body is not JSON") from None
        if not isinstance(data, dict):
            raise ValueError("body is not a JSON object")
        url, region, version, started = (data.get(k) for k in REQUIRED)
        if not (isinstance(url, str) and isinstance(region, str) and isinstance(version, str)):
            raise ValueError("url, region and version must be strings")
        if (
            not isinstance(started, int | float)
            or isinstance(started, bool)
            or not math.isfinite(started)
        ):
            raise ValueError("started_at must be a number")
        epoch, draining = data.get("epoch", ""), data.get("draining", False)
        process = data.get("process", "")
        if not isinstance(epoch, str) or not isinstance(draining, bool):
            raise ValueError("epoch must be a string and draining a boolean")
        if not isinstance(process, str):
            raise ValueError("process must be a string")
        mac = data.get("mac", "")
        if not isinstance(mac, str) or len(mac) > 2 * _MAC_HEX:
            raise ValueError("mac must be a string")
        return cls(url, region, version, float(started), epoch, draining, process, mac)


def heartbeat_key(token: str) -> bytes:
    """The key heartbeats are MACed with, derived from a mesh token (b"" for no token)."""
    if not token:
        return b""
    return hmac.new(token.encode("utf-8"), MAC_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, heartbeat: Heartbeat) -> str:
    body = evolve(heartbeat, mac="").to_json()
    return hmac.new(key, b"v1\n" + body, hashlib.sha256).hexdigest()


@frozen
class HeartbeatKeys:
    """Signs this box's heartbeats and checks everyone's (the module docstring).

    Invariants: a heartbeat is accepted only when its MAC verifies under the current key or the
    rotation's accepted one; both comparisons always run, in constant time; with no token
    (``current`` empty) nothing verifies."""

    current: bytes = field(repr=False)
    accept: bytes = field(default=b"", repr=False)

    @classmethod
    def of(cls, token: str, accept: str = "") -> HeartbeatKeys:
        """The keys of ``LCHAT_MESH_TOKEN`` and ``LCHAT_MESH_TOKEN_ACCEPT``."""
        return cls(heartbeat_key(token), heartbeat_key(accept) if accept != token else b"")

    def sign(self, heartbeat: Heartbeat) -> Heartbeat:
        """``heartbeat`` with its MAC under the current key."""
        if not self.current:
            raise ValueError("no mesh token to sign a heartbeat with")
        return evolve(heartbeat, mac=_mac(self.current, heartbeat))

    def check(self, heartbeat: Heartbeat) -> tokens.Match | None:
        """Which key made ``heartbeat``'s MAC ("current", "accept"), or None: not a member's.
        A use of the accepted key is counted (lchat.mesh.tokens)."""
        given = heartbeat.mac.encode("ascii", "replace")
        if not self.current or len(given) != _MAC_HEX:
            return None
        expected = _mac(self.current, heartbeat).encode("ascii")
        also = _mac(self.accept, heartbeat).encode("ascii") if self.accept else b""
        which = tokens.match(given, expected, also)
        if which == "accept":
            tokens.note_accept_use("heartbeat")
        return which

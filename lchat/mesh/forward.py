"""The one-hop marker on a forwarded request, and the target that forwards it (docs/design.md §9).

A box that forwards a request to the space's owner adds ``X-Lchat-Mesh-Forwarded``; the owner then
serves it locally whatever its own view of the membership says (the lease settles a disagreement),
so a request never bounces between two boxes. The marker is honoured only when it authenticates:

    X-Lchat-Mesh-Forwarded: v2 <unix seconds> <hex HMAC-SHA256(LCHAT_MESH_TOKEN,
        "v2\\n<seconds>\\n<host>\\n<peer>\\n<method>\\n<target>")>

bound to the space's hostname, to the request (its method and its whole target, path and query,
as the proxy sends them on unchanged), to the peer it was sent to (the target member's normalised
``LCHAT_MESH_SELF``; the receiver checks its own), and fresh within :data:`MAX_SKEW` seconds.
Anything else — no token, a wrong MAC, another host's, request's or peer's marker, a stale one, a
``v1`` marker of an older lchat — is ignored (the proxy strips the header from every request
before it reaches a space in any case). Comparison is constant-time. So a marker captured where
it was sent (a ``lives_at`` box, a peer) is good for nothing but that one request to that one
box, within the window.

A box signs with ``LCHAT_MESH_TOKEN`` only; it verifies with it and, during a token rotation, with
``LCHAT_MESH_TOKEN_ACCEPT`` too (both MACs are computed and compared every time; a marker that only
the accepted value verifies counts in ``lchat_mesh_accept_token_total{use="forwarded"}``, see
:mod:`lchat.mesh.tokens`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from urllib.parse import urlsplit

from attrs import frozen

from lchat.mesh import tokens
from lchat.mesh.placement import normalise_member_url
from lchat.router import Header, RemotePeer

HEADER = b"x-lchat-mesh-forwarded"
MAX_SKEW = 120.0  # seconds either way: boxes' clocks are NTP-close, not equal


@frozen
class Bound:
    """What a marker is bound to besides its host: the request's method and target (as sent on,
    unchanged) and the peer it goes to (a normalised member URL)."""

    method: bytes
    target: bytes
    peer: str


def _mac(token: str, stamp: str, host: str, bound: Bound) -> str:
    message = b"\n".join(
        (b"v2", stamp.encode(), host.encode(), bound.peer.encode(), bound.method, bound.target)
    )
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def marker(token: str, host: str, now: Callable[[], float], bound: Bound) -> bytes:
    """The header value a box adds when it forwards a request for ``host`` (``now``: unix
    seconds, the router's clock) as ``bound`` says."""
    stamp = str(int(now()))
    return f"v2 {stamp} {_mac(token, stamp, host, bound)}".encode("ascii")


def authentic(
    value: bytes | None,
    token: str,
    host: str,
    now: Callable[[], float],
    accept: str = "",
    *,
    bound: Bound,
) -> bool:
    """Does ``value`` (the raw header, or None) prove a mesh peer forwarded this request — the
    one ``bound`` describes (its method, target, and this box as the peer)? It does when its MAC
    is made with ``token`` or, in a rotation window, with ``accept`` (counted)."""
    if not value or not token or len(value) > 200:
        return False
    try:
        version, stamp, mac = value.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        return False
    if version != "v2" or not stamp.isdigit() or len(stamp) > 12:
        return False
    if abs(now() - int(stamp)) > MAX_SKEW:
        return False
    given = mac.encode("ascii")
    expected = _mac(token, stamp, host, bound).encode("ascii")
    also = _mac(accept, stamp, host, bound).encode("ascii") if accept else b""
    which = tokens.match(given, expected, also)
    if which == "accept":
        tokens.note_accept_use("forwarded")
    return which is not None


def peer_target(
    peer_url: str,
    host: str,
    token: str,
    now: Callable[[], float],
    *,
    method: bytes,
    target: bytes,
) -> RemotePeer:
    """Where to send ``host``'s request (``method`` ``target``) on the box ``peer_url``: connect
    to the peer's address, verify the certificate against the *space's* name (the shared
    wildcard), mark it forwarded (the marker bound to that request and that peer)."""
    bound = Bound(method=method, target=target, peer=normalise_member_url(peer_url))
    header: Header = (HEADER, marker(token, host, now, bound))
    address, port = peer_address(peer_url)
    return RemotePeer(
        host=host,
        address=address,
        port=port,
        server_name=host,
        add_headers=(header,),
        tls=urlsplit(peer_url).scheme == "https",
        member=bound.peer,
    )


def peer_address(peer_url: str) -> tuple[str, int]:
    """The address and port a forward to the box ``peer_url`` connects to."""
    parts = urlsplit(peer_url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)

"""HTTP/1.1 pieces shared by both sides of the proxy: header filtering, heads, chunking."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from http import HTTPStatus

Header = tuple[bytes, bytes]

# RFC 9110 §7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-connection",
    }
)
# On a 503 a box made itself, instead of processing a request a mesh peer forwarded, because it
# is stopping: the peer may send the request elsewhere (lchat.mesh.routing, docs/design.md §9).
REFUSED = b"x-lchat-refused"
# Read to classify a request, never passed to a space (docs/design.md §4); dropped from every space's
# and peer's response too, so that neither a space nor a client ever sees or forges one.
INTERNAL = frozenset({b"x-lchat-sidecar", b"x-lchat-mesh-forwarded", REFUSED})
# We set these ourselves on the way to a space (and a client's own Forwarded is not believed).
FORWARDING = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"forwarded"})
# Names a CGI/WSGI-style server would read as one of the above once '_' becomes '-' (as nginx
# and gunicorn do, we drop them rather than let a client forge a marker that way).
_GUARDED = INTERNAL | FORWARDING

# The header policy's names, in one place. The general path reads, checks, drops or sets each of
# these itself (request: lchat.proxy.exchange.validate; response: UpstreamConnection's head
# check). The one-read recognisers (lchat.proxy.oneread and its C twin) decline a message with
# any of them, with any name starting with one of SPECIAL_PREFIXES, or any underscored name: their
# declined-name lists are made from these sets (tests/test_proxy_oneread.py holds them to it).
REQUEST_SPECIAL = HOP_BY_HOP | FORWARDING | INTERNAL | {b"content-length", b"expect"}
RESPONSE_SPECIAL = HOP_BY_HOP | INTERNAL | {b"content-length"}
SPECIAL_PREFIXES = (b"proxy-", b"x-lchat-")

# The hop-by-hop lines servers send on an ordinary answer: nginx's and Node's
# ``Connection: keep-alive``, Node's ``Keep-Alive: timeout=5``, Apache's ``Upgrade: h2,h2c`` with
# ``Connection: Upgrade, Keep-Alive``. A response head whose only special lines are these (its
# Connection naming nothing but RESPONSE_SPLICED_TOKENS) goes to the client as it came with these
# lines taken out (:func:`without_lines`), not rebuilt: what they say concerns our connection to
# the space only (keep it open: we do; an upgrade is offered: not taken, as the status is not
# 101). The general path (UpstreamConnection) and the one-read recognisers both splice this way.
RESPONSE_SPLICED = frozenset({b"connection", b"keep-alive", b"upgrade"})
RESPONSE_SPLICED_TOKENS = frozenset({b"keep-alive", b"upgrade"})


def without_lines(head: bytes, names: frozenset[bytes]) -> bytes | None:
    """``head`` (a message head as it came: its first line, field lines, the empty line) without
    the field lines whose lowercased name is in ``names``, every other byte as it came; ``None``
    when a line is not one field of its own (a folded line, a bare CR or LF, space around the
    name): then which bytes belong to which parsed header is not plain, and the head must be
    built again from its parsed headers instead."""
    lines = head[:-4]
    crlf = lines.count(b"\r\n")
    if lines.count(b"\r") != crlf or lines.count(b"\n") != crlf:
        return None
    first, *fields = lines.split(b"\r\n")
    kept = [first]
    for line in fields:
        name, colon, _ = line.partition(b":")
        if not colon or not name or name.strip() != name:
            return None
        if name.lower() not in names:
            kept.append(line)
    kept.append(b"\r\n")
    return b"\r\n".join(kept)


def lookalike(name: bytes) -> bool:
    """An underscore spelling of a header we guard, e.g. ``X_Lchat_Sidecar``."""
    return b"_" in name and name.lower().replace(b"_", b"-") in _GUARDED


def connection_tokens(headers: Iterable[Header]) -> set[bytes]:
    """Lowercased tokens of every Connection header: the hop-by-hop names it adds."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return tokens


def end_to_end(headers: Iterable[Header], drop: frozenset[bytes] = frozenset()) -> list[Header]:
    """The headers a proxy passes on: no hop-by-hop ones, none the Connection header names,
    no ``Proxy-*``, no framing (we frame each hop ourselves), and none in ``drop``."""
    headers = list(headers)
    named = connection_tokens(headers)
    out = []
    for name, value in headers:
        lower = name.lower()
        if (
            lower in HOP_BY_HOP
            or lower in named
            or lower == b"content-length"
            or lower.startswith(b"proxy-")
            or lower in drop
            or lookalike(lower)
        ):
            continue
        out.append((name, value))
    return out


def head_bytes(first_line: bytes, headers: Iterable[Header]) -> bytes:
    parts = [first_line, b"\r\n"]
    for name, value in headers:
        parts += [name, b": ", value, b"\r\n"]
    parts.append(b"\r\n")
    return b"".join(parts)


def status_line(status: int, reason: bytes | None = None) -> bytes:
    if not reason:
        try:
            reason = HTTPStatus(status).phrase.encode("ascii")
        except ValueError:
            reason = b"Unknown"
    return b"HTTP/1.1 %d %s" % (status, reason)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def simple_response(
    status: int, body: bytes, headers: Iterable[Header] = (), close: bool = False
) -> bytes:
    """A complete response with a known length, for answers the proxy makes itself."""
    all_headers = [(n, v) for n, v in headers if n.lower() != b"content-length"]
    all_headers.append((b"content-length", str(len(body)).encode()))
    if close:
        all_headers.append((b"connection", b"close"))
    return head_bytes(status_line(status), all_headers) + body


class Valve:
    """Pauses one transport's reading for any number of independent reasons.

    asyncio's pause/resume is not counted: the second party to resume would undo the first one's
    pause. The valve keeps a set of reasons and reads only when it is empty. The other side's
    protocol closes it with :data:`PEER_FULL` while its transport's write buffer is over the
    high-water mark (``pause_writing``) and opens it at ``resume_writing``: the backpressure that
    keeps a slow reader from making us buffer a fast writer.

    ``reasons`` is the valve's own (read it, never change it): empty when open, so that a hot path
    can skip calls to ``open`` that would find nothing to do.
    """

    PEER_FULL = "peer-full"
    __slots__ = ("_transport", "reasons")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self.reasons: set[str] = set()  # why reading is paused

    @property
    def closed(self) -> bool:
        return bool(self.reasons)

    def close(self, reason: str) -> None:
        if not self.reasons and not self._transport.is_closing():
            self._transport.pause_reading()  # type: ignore[attr-defined]
        self.reasons.add(reason)

    def open(self, reason: str) -> None:
        if reason not in self.reasons:
            return
        self.reasons.discard(reason)
        if not self.reasons and not self._transport.is_closing():
            self._transport.resume_reading()  # type: ignore[attr-defined]

    def open_all(self) -> None:
        """Read again, whatever the reasons were."""
        if self.reasons:
            self.reasons.clear()
            if not self._transport.is_closing():
                self._transport.resume_reading()  # type: ignore[attr-defined]

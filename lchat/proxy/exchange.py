"""One request and its response (:class:`Exchange`), and the pure functions at its edges: a
parsed request head checked and read (:func:`validate`), the head written upstream
(:func:`upstream_head`) and the response head written to the client (:func:`client_head`).

None of them does I/O or reads a connection's state: each takes what it needs as arguments and
either returns a value or raises :class:`Reject`. ``validate`` and ``client_head`` also set the
fields of the exchange they read (its framing, what goes upstream, how the response is framed).
"""

from __future__ import annotations

from collections.abc import Callable

from attrs import frozen

from lchat.proxy.hot import Exchange
from lchat.proxy.http import (
    FORWARDING,
    HOP_BY_HOP,
    INTERNAL,
    Header,
    connection_tokens,
    end_to_end,
    head_bytes,
    status_line,
)
from lchat.router import LocalSocket, RemotePeer, RequestHead

# Request headers never passed on as they came (we frame each hop and set these ourselves).
_NOT_PASSED = HOP_BY_HOP | {b"content-length"}
_NO_TOKENS: frozenset[bytes] = frozenset()


@frozen
class Reject(Exception):
    """Raised inside a parser callback: answer ``status`` and close."""

    status: int
    reason: str


class StopReading(Exception):
    """Raised from a parser callback when nothing more on this connection may be parsed: after a
    request that closes it (RFC 9112 §9.6; llhttp would fail on what follows, turning the answer into
    a 400), or when we are already closing."""


def body_done(ex: Exchange) -> bool:
    """All of the request body has arrived (a request without one is done at its head)."""
    return ex.body_complete or (not ex.chunked and not ex.length)


def closes_after(ex: Exchange, draining: bool) -> bool:
    """The connection closes after ``ex``'s answer: asked to, marked so (a bad request pipelined
    behind it: nothing more is read), an upgrade's, the router ``draining``, or a body the client
    has not finished sending (it cannot be skipped in step)."""
    return ex.close_after or not ex.keep_alive or not body_done(ex) or ex.upgrade or draining


def validate(
    ex: Exchange,
    parse_host: Callable[[bytes], str],
    client: str,
    secure: bool,
    max_body: int,
) -> RequestHead:
    """The routing head of ``ex``, whose head httptools parsed (method, version, url, headers),
    having set its framing (``chunked``, ``length``, ``upgrade``), the client's own
    ``forwarded_for`` and the ``upstream_lines`` passed on as they came. Raises :class:`Reject`
    for anything two parsers could read differently: no ambiguity reaches a space.
    ``parse_host`` normalises a Host value (raising Reject); ``max_body`` 0 is no limit."""
    if ex.version not in ("1.0", "1.1"):
        # llhttp reads "GET /" (no version) as HTTP/0.9 and accepts "HTTP/2.0": not HTTP/1.x.
        raise Reject(400 if ex.version == "0.9" else 505, "unsupported HTTP version")
    if ex.method == b"CONNECT":
        raise Reject(405, "CONNECT is not supported")
    url = bytes(ex.url)
    if not url.startswith(b"/") and not (url == b"*" and ex.method == b"OPTIONS"):
        raise Reject(400, "request target must be origin-form")
    host_values: list[bytes] = []
    lengths: set[bytes] = set()
    internal: dict[bytes, bytes] = {}
    kept: list[Header] = []
    # What goes upstream as it came, one "name: value" line each (end_to_end, in one pass
    # with the checks: this is every request's path): no hop-by-hop or framing header, no
    # Proxy-*, none we set ourselves. Connection's own tokens are applied below.
    lines: list[bytes] = []
    connection = False
    for name, value in ex.headers:
        lower = name.lower()
        if lower == b"host":
            host_values.append(value)
        elif lower == b"content-length":
            lengths.add(value.strip())
        elif lower == b"transfer-encoding":
            if value.strip().lower() != b"chunked":
                raise Reject(501, "only chunked transfer coding is supported")
            ex.chunked = True
        elif lower == b"expect":
            if value.strip().lower() != b"100-continue":
                raise Reject(417, "unsupported expectation")
        elif lower == b"connection":
            connection = True
        elif lower == b"x-forwarded-for":
            ex.forwarded_for.append(value)
        if lower in INTERNAL:
            internal[lower] = value
        elif b"_" not in name:
            # A name with an underscore is dropped, as nginx does (underscores_in_headers
            # off): a CGI/WSGI-style server would fold it onto the dashed name.
            kept.append((name, value))
            if not (lower in _NOT_PASSED or lower in FORWARDING or lower.startswith(b"proxy-")):
                lines.append(b"%s: %s\r\n" % (name, value))
    if ex.chunked and ex.version == "1.0":
        # HTTP/1.0 has no chunked coding: a server reading it as 1.0 would take the chunks
        # for the body's bytes (RFC 9112 §6.1; nginx answers 400 too).
        raise Reject(400, "Transfer-Encoding in an HTTP/1.0 request")
    if len(host_values) != 1:
        raise Reject(400, "exactly one Host header is required")
    host = parse_host(host_values[0])
    if lengths:
        if len(lengths) > 1 or ex.chunked:
            raise Reject(400, "conflicting message framing")
        (text,) = lengths
        if not text.isdigit() or len(text) > 18:
            raise Reject(400, "malformed Content-Length")
        ex.length = int(text)
        if max_body and ex.length > max_body:
            raise Reject(413, f"request body over {max_body} bytes (LCHAT_MAX_BODY)")
    tokens = connection_tokens(ex.headers) if connection else _NO_TOKENS
    if tokens and not tokens <= HOP_BY_HOP:
        # Connection names headers of its own to drop (rare): filter the slow way.
        lines = [b"%s: %s\r\n" % h for h in end_to_end(kept, drop=FORWARDING)]
    ex.upstream_lines = b"".join(lines)
    if b"host" in tokens:
        raise Reject(400, "Connection may not name Host")  # it would strip Host upstream
    ex.upgrade = b"upgrade" in tokens and any(n.lower() == b"upgrade" for n, _ in ex.headers)
    if ex.upgrade and (ex.chunked or ex.length):
        # llhttp takes every byte after an upgrade request's head as the new protocol: the
        # body its head announces would never follow it upstream.
        raise Reject(400, "an upgrade request cannot carry a body")
    return RequestHead(
        method=ex.method,
        target=url,
        host=host,
        client=client,
        secure=secure,
        sidecar=b"x-lchat-sidecar" in internal,
        forwarded=internal.get(b"x-lchat-mesh-forwarded"),
        upgrade=ex.upgrade,
    )


def hop_origin(ex: Exchange, head: RequestHead) -> tuple[RequestHead, tuple[bytes, bytes]]:
    """On the control process's hop socket, where only a worker process connects: the request
    as the worker's client sent it. The last X-Forwarded-For element is the worker's client (the
    worker appended it, :func:`upstream_head`) and X-Forwarded-Proto its scheme; the element is
    taken out of ``ex.forwarded_for``, so that :func:`upstream_head`, given the returned origin,
    writes the very bytes the worker would have written to a space. Returns ``head`` with that
    client and ``secure``, and the origin ``(client, scheme)``. A head without them did not come
    from a worker: :class:`Reject` (400)."""
    if not ex.forwarded_for:
        raise Reject(
            400, "a hop request without X-Forwarded-For (only a worker process may connect)"
        )
    last = ex.forwarded_for[-1]
    prior, comma, client = last.rpartition(b", ")
    if comma:
        ex.forwarded_for[-1] = prior  # (what the worker's client sent itself, joined)
    else:
        ex.forwarded_for.pop()
    scheme = b""
    for name, value in ex.headers:
        if len(name) == 17 and name.lower() == b"x-forwarded-proto":
            scheme = value
    if not client or scheme not in (b"http", b"https"):
        raise Reject(
            400,
            "a hop request without its client or X-Forwarded-Proto (only a worker process may "
            "connect)",
        )
    origin = (client, scheme)
    return head._replace(client=client.decode("latin-1"), secure=scheme == b"https"), origin


def plain_upstream_head(
    method: bytes, target: bytes, lines: bytes, client: bytes, scheme: bytes
) -> bytes:
    """The common head written upstream: no body, no client-sent X-Forwarded-For."""
    return b"%s %s HTTP/1.1\r\n%sX-Forwarded-For: %s\r\nX-Forwarded-Proto: %s\r\n\r\n" % (
        method,
        target,
        lines,
        client,
        scheme,
    )


def upstream_head(ex: Exchange, client: bytes, scheme: bytes) -> bytes:
    """The head written upstream for ``ex`` (validated, routed): its passed lines, the
    forwarding headers (``client``'s address appended to the client's own X-Forwarded-For,
    ``scheme`` as X-Forwarded-Proto), a peer's added headers, and our own framing."""
    assert ex.head is not None and ex.target is not None
    if (
        not ex.forwarded_for
        and ex.length is None
        and not ex.chunked
        and not ex.upgrade
        and type(ex.target) is LocalSocket
        and not ex.target.add_headers
    ):
        # The common head: no body, no client-sent X-Forwarded-For, to this box's space.
        return plain_upstream_head(ex.method, ex.head.target, ex.upstream_lines, client, scheme)
    prior = ex.forwarded_for
    forwarded_for = b", ".join([*prior, client]) if prior else client
    headers: list[Header] = [(b"X-Forwarded-For", forwarded_for), (b"X-Forwarded-Proto", scheme)]
    if isinstance(ex.target, LocalSocket | RemotePeer):
        headers.extend(ex.target.add_headers)
    if ex.chunked:
        headers.append((b"Transfer-Encoding", b"chunked"))
    elif ex.length is not None and (ex.length > 0 or ex.method in (b"POST", b"PUT", b"PATCH")):
        headers.append((b"Content-Length", str(ex.length).encode()))
    if ex.upgrade:
        upgrade = [v for n, v in ex.headers if n.lower() == b"upgrade"]
        headers += [(b"Connection", b"Upgrade"), (b"Upgrade", upgrade[0])]
    parts = [b"%s %s HTTP/1.1\r\n" % (ex.method, ex.head.target), ex.upstream_lines]
    for name, value in headers:
        parts += [name, b": ", value, b"\r\n"]
    parts.append(b"\r\n")
    return b"".join(parts)


def client_head(
    ex: Exchange,
    status: int,
    reason: bytes,
    headers: list[Header],
    length: int | None,
    extra: tuple[Header, ...],
    keep: frozenset[bytes] = _NO_TOKENS,
) -> bytes:
    """The final response head written to the client for ``ex``: the space's end-to-end headers
    without internal ones (but those in ``keep``: a hop target's ``X-Lchat-Refused``, which only
    the control process's own answer can carry), ``extra`` added, framed for the client's
    version (setting ``response_chunked``, and ``close_after`` when the close is what delimits
    the body)."""
    out = end_to_end(headers, drop=INTERNAL - keep if keep else INTERNAL)
    out.extend(extra)
    no_body = ex.method == b"HEAD" or status in (204, 304)
    if length is not None:
        out.append((b"Content-Length", str(length).encode()))
    elif not no_body:
        if ex.version == "1.1":
            ex.response_chunked = True
            out.append((b"Transfer-Encoding", b"chunked"))
        else:
            ex.close_after = True  # HTTP/1.0: the close delimits the body
    if ex.close_after:
        out.append((b"Connection", b"close"))
    elif ex.version == "1.0":
        out.append((b"Connection", b"keep-alive"))
    return head_bytes(status_line(status, reason), out)

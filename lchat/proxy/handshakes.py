"""What the stdlib TLS layer saw of one front-door handshake, and a failed one's kind."""

from __future__ import annotations

import re
import ssl
from contextvars import ContextVar

from attrs import define


@define
class HandshakeNotes:
    """What the stdlib TLS layer saw of one server handshake, for telling a failure's kind.

    The front door (:mod:`lchat.proxy.tls_accept`) puts a fresh one in :data:`handshake_notes` (a
    context variable) before handing an accepted socket to TLS; uvloop runs the connection's
    callbacks, and so the certificate store's SNI callback and every ``do_handshake``
    (:class:`NotedSSLObject`), in a copy of that context, where they note what they see;
    :func:`classify_ssl_failure` reads it when the handshake fails.
    """

    server_name: str = ""  # the SNI name as the client sent it ("" for none)
    steps: int = 0  # do_handshake calls: the first comes with the connection, before any byte
    sni: bool = False  # the SNI callback ran (a whole ClientHello arrived and was accepted)
    certificate: bool = False  # ... and found a certificate to serve
    peeked: bool = False  # the front door already saw bytes from the peer (it peeked them)

    @property
    def received(self) -> bool:
        """The peer sent at least one byte: a connection that sent none is a TCP probe (or a
        client that gave up), not a failed handshake."""
        return self.peeked or self.steps > 1


handshake_notes: ContextVar[HandshakeNotes | None] = ContextVar(
    "lchat_tls_handshake_notes", default=None
)


class NotedSSLObject(ssl.SSLObject):
    """The listener context's ``sslobject_class`` (the stdlib's hook for it): counts handshake
    steps into the connection's :class:`HandshakeNotes`. uvloop (as asyncio's own SSL protocol)
    calls ``do_handshake`` once when the connection is made, then once per chunk received."""

    def do_handshake(self) -> None:
        notes = handshake_notes.get()
        if notes is not None:
            notes.steps += 1
        super().do_handshake()


def classify_ssl_failure(error: BaseException, notes: HandshakeNotes) -> tuple[str, str]:
    """A failed handshake (what uvloop raised) as ``(kind, detail)``: a metric label from a small,
    fixed set, and the reason for the log.

    ``closed``: the peer (or the handshake timeout) ended the connection mid-handshake;
    ``version``: below TLS 1.2; ``plain_http``: an HTTP request on the HTTPS port; ``peer_alert``:
    the client refused us, usually our certificate; ``no_certificate``: nothing to serve for the
    name asked (nor a default); ``protocol``: anything else.
    """
    if not isinstance(error, ssl.SSLError):
        # EOF or a reset mid-handshake, or the handshake timeout (ConnectionAbortedError).
        detail = str(error) or "the peer closed the connection"
        return "closed", detail
    detail = _SSL_C_LINE.sub("", str(error))  # "[SSL: HTTP_REQUEST] http request"
    text = detail.lower()
    if "unsupported protocol" in text or "version too low" in text:
        return "version", detail
    if "http request" in text:
        return "plain_http", detail
    if "alert" in text:
        return "peer_alert", detail
    if notes.sni and not notes.certificate:
        return "no_certificate", detail
    return "protocol", detail


_SSL_C_LINE = re.compile(r"\s*\(_ssl\.c:\d+\)$")

"""The port-80 listener (``LCHAT_HTTP_ADDR`` once TLS is served): everything goes to https.

``GET http://chat.example.com/a?b`` -> ``301 Location: https://chat.example.com/a?b``, for every host
(an unknown one then gets its 404 over https). The one exception is ``/.well-known/acme-challenge/…``,
which an ACME CA fetches over plain HTTP: it goes to the HTTP-01 responder
(:mod:`lchat.acme.http01`; a 404 when ACME is off), with ``request.postpath`` holding what follows
``acme-challenge/``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from twisted.web.http import BAD_REQUEST, MOVED_PERMANENTLY
from twisted.web.resource import IResource, NoResource, Resource
from twisted.web.server import Request

from lchat import hosts

ACME_CHALLENGE = (b".well-known", b"acme-challenge")


class RedirectToHTTPS(Resource):
    """The root resource of the plain-HTTP site.

    ``https_port``: the port clients should use for https, when it is not 443 (the public port, which
    may differ from the one the router binds behind a port forward).
    """

    def __init__(
        self, https_port: int | None = None, acme_challenge: IResource | None = None
    ) -> None:
        super().__init__()
        if https_port is not None and not 0 < https_port < 65536:
            raise ValueError(f"https_port {https_port} is not a TCP port")
        self._suffix = "" if https_port in (None, 443) else f":{https_port}"
        self._acme: IResource = acme_challenge if acme_challenge is not None else NoResource()
        self._redirect = _Redirect(self._suffix)

    def getChildWithDefault(self, path: bytes, request: Request) -> IResource:
        # Traversal has just consumed the first segment; the hook gets only what is under
        # acme-challenge/ (at least one more segment, possibly empty).
        rest, done = request.postpath or [], request.prepath or []
        if path == ACME_CHALLENGE[0] and rest[:1] == [ACME_CHALLENGE[1]] and len(rest) > 1:
            done.append(rest.pop(0))
            return self._acme
        return self._redirect

    def render(self, request: Request) -> bytes:
        return self._redirect.render(request)


class _Redirect(Resource):
    isLeaf = True

    def __init__(self, port_suffix: str) -> None:
        super().__init__()
        self._suffix = port_suffix

    def render(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        raw = request.getHeader(b"host")
        try:
            if raw is None:
                raise hosts.InvalidHost("no Host header")
            host = hosts.parse_host_header(raw.decode("utf-8"))
        except (UnicodeDecodeError, hosts.InvalidHost):
            request.setResponseCode(BAD_REQUEST)
            return b"missing or malformed Host header\n"
        location = f"https://{host}{self._suffix}".encode("ascii") + _target(request.uri)
        request.setResponseCode(MOVED_PERMANENTLY)
        request.setHeader(b"location", location)
        return b"moved to " + location + b"\n"


def _target(uri: bytes) -> bytes:
    """The request target as path + query, percent-encoding anything outside printable ASCII."""
    if not uri.startswith(b"/"):
        # absolute-form (http://host/path?q) keeps its path; ``*`` and junk become ``/``
        parts = urlsplit(uri)
        if parts.scheme not in (b"http", b"https") or not parts.netloc:
            return b"/"
        uri = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
    return b"".join(bytes([b]) if 0x21 <= b <= 0x7E else b"%%%02X" % b for b in uri)

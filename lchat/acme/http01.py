"""The HTTP-01 responder: ``GET /.well-known/acme-challenge/<token>`` on port 80.

Orders (in worker threads) :meth:`~ChallengeResponder.publish` a token's key authorisation before
telling the CA to look, and :meth:`~ChallengeResponder.withdraw` it afterwards. The CA then fetches
it over plain HTTP from whichever box the name's DNS points at; with the shared certificate cache
that may be another box than the one that placed the order, so a token not known here is looked up
in the bucket (``lookup``), where the ordering box put it.

Only tokens we published are ever answered; anything else is a 404, and a token that is not the
base64url the protocol uses is a 404 before any lookup.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request

from lchat import hosts
from lchat.webutil import answerable

_log = Logger(namespace="lchat.acme")

TOKEN = re.compile(r"[A-Za-z0-9_-]{1,256}")
MAX_LOOKUPS = 16  # bucket lookups in flight at once: a scanner's random tokens cost no more
Lookup = Callable[[str], Awaitable[str | None]]
MayLookup = Callable[[str], bool]


def valid_token(token: str) -> bool:
    return TOKEN.fullmatch(token) is not None


class ChallengeResponder:
    """Key authorisations by token. ``publish``/``withdraw`` may be called from any thread."""

    def __init__(self, lookup: Lookup | None = None, may_lookup: MayLookup | None = None) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}
        self.lookup = lookup
        # Which Host headers may cost a bucket lookup: names some box could be ordering for (the
        # registry's), not whatever a scanner sends.
        self.may_lookup = may_lookup or (lambda host: True)
        self.lookups = 0  # in flight

    def publish(self, token: str, key_authorization: str) -> None:
        if not valid_token(token):
            raise ValueError(f"not an ACME token: {token!r}")
        with self._lock:
            self._tokens[token] = key_authorization

    def withdraw(self, token: str) -> None:
        with self._lock:
            self._tokens.pop(token, None)

    def get(self, token: str) -> str | None:
        with self._lock:
            return self._tokens.get(token)

    def resource(self) -> IResource:
        """The resource for what follows ``acme-challenge/`` (:class:`lchat.redirect.RedirectToHTTPS`
        hands it ``request.postpath == [token]``)."""
        return _Challenge(self)

    def site_root(self) -> IResource:
        """A whole site answering only ``/.well-known/acme-challenge/<token>`` (behind the proxy,
        when plain HTTP proxies instead of redirecting)."""
        root = Resource()
        well_known = Resource()
        root.putChild(b".well-known", well_known)
        well_known.putChild(b"acme-challenge", _Challenge(self))
        return root


class _Challenge(Resource):
    isLeaf = True

    def __init__(self, responder: ChallengeResponder) -> None:
        super().__init__()
        self._responder = responder

    def render_GET(self, request: Request) -> bytes | int:
        request.setHeader(b"content-type", b"text/plain")
        request.setHeader(b"cache-control", b"no-store")
        segments = request.postpath or []
        token = segments[0].decode("ascii", "replace") if len(segments) == 1 else ""
        if not valid_token(token):
            return _not_found(request)
        answer = self._responder.get(token)
        if answer is not None:
            return self._answer(request, token, answer)
        responder = self._responder
        lookup = responder.lookup
        if lookup is None or responder.lookups >= MAX_LOOKUPS:
            return _not_found(request)
        try:
            host = hosts.parse_host_header((request.getHeader(b"host") or b"").decode("ascii"))
        except (UnicodeDecodeError, hosts.InvalidHost):
            return _not_found(request)
        if not responder.may_lookup(host):
            return _not_found(request)

        async def find() -> str | None:
            responder.lookups += 1
            try:
                return await lookup(token)
            finally:
                responder.lookups -= 1

        still = answerable(request)
        d = Deferred.fromCoroutine(find())

        def found(value: str | None) -> None:
            if not still():
                return
            if value is None:
                request.write(_not_found(request))
            else:
                request.write(self._answer(request, token, value))
            request.finish()

        def failed(failure: Failure) -> None:
            _log.warn(
                "acme: looking up challenge token in the shared cache failed: {error}",
                error=failure.getErrorMessage(),
            )
            if still():
                request.write(_not_found(request))
                request.finish()

        d.addCallbacks(found, failed)
        return NOT_DONE_YET

    def _answer(self, request: Request, token: str, answer: str) -> bytes:
        host = request.getHeader(b"host") or b"?"
        _log.info(
            "acme: answered the HTTP-01 challenge for {host}",
            host=host.decode("ascii", "replace")[:255],
            token=token,
        )
        return answer.encode("ascii")


def _not_found(request: Request) -> bytes:
    request.setResponseCode(404)
    return b"no such challenge\n"

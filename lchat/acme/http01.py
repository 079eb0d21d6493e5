"""The HTTP-01 responder: ``GET /.well-known/acme-challenge/<token>`` on port 80.

Orders (in worker threads) :meth:`~ChallengeResponder.publish` a token's key authorisation before
telling the CA to look, and :meth:`~ChallengeResponder.withdraw` it afterwards. The CA then fetches
it over plain HTTP from whichever box the name's DNS points at; with the shared certificate cache
that may be another box than the one that placed the order, so a token not known here is looked up
in the bucket (``lookup``), where the ordering box put it.

Invariants:

- Only tokens a box of this fleet published are ever answered: this box's own, or a bucket
  object whose MAC verifies under the certificate cache key (:func:`lchat.acme.cache.open_challenge`).
  An object someone else wrote into the bucket is a 404, logged as an error and counted
  (``lchat_acme_challenge_lookups_total{outcome="unauthenticated"}``): it is what a bucket writer
  opening their own order for a fleet name would plant.
- A token that is not the base64url an ACME CA issues (RFC 8555 §8.3: at least 128 bits, so 22
  characters or more) is a 404 before any lookup, and so is a Host no box could be ordering for.
- With a ``pending`` index, a token is read from the bucket only when a listing of
  ``certs/challenges/`` that *began after the request arrived* holds it (the ordering box writes
  the object before it tells the CA to look, so such a listing does): a scanner's random tokens
  cost no GET, and all waiting requests share one LIST, begun at most once per
  ``list_interval`` and never two at once.
- One client (its IP: the peer address, or behind this router's proxy the address the proxy
  appended to ``X-Forwarded-For``) has at most ``MAX_PER_CLIENT`` lookups waiting at once; more
  are a 404 at once. A flood from one address cannot crowd out the CA's requests.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable, Collection

from prometheus_client import Counter
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request

from lchat import hosts
from lchat.acme.cache import ChallengeRefused
from lchat.deferutil import fire
from lchat.webutil import answerable

_log = Logger(namespace="lchat.acme")

TOKEN = re.compile(r"[A-Za-z0-9_-]{1,256}")
# What a CA's token looks like (RFC 8555 §8.3: base64url, no padding, >= 128 bits of entropy;
# Let's Encrypt and Pebble send 43 characters): only these may cost a lookup.
ACME_TOKEN = re.compile(r"[A-Za-z0-9_-]{22,256}")
MAX_LOOKUPS = 16  # bucket GETs in flight at once (listed tokens only, with an index)
MAX_PER_CLIENT = 4  # lookups waiting at once for one client address
MAX_WAITING = 1024  # lookups waiting at once in all (each holds a request open)
LIST_INTERVAL = 0.5  # seconds between the starts of two listings of certs/challenges/
BUSY_LOG_EVERY = 60.0  # at most one "refused, busy" line per this many seconds (a flood is loud)

Lookup = Callable[[str], Awaitable[str | None]]
ListPending = Callable[[], Awaitable[Collection[str]]]

_lookups = Counter(
    "lchat_acme_challenge_lookups_total",
    "HTTP-01 tokens this box did not publish itself, by outcome: answered (from the bucket, MAC "
    "verified), unlisted (not in the bucket's listing: no GET), missing (listed, gone by the GET), "
    "unauthenticated (an object no box of this fleet wrote: refused), busy_client (that client "
    "already had MAX_PER_CLIENT waiting), busy (too many waiting in all), error (the bucket failed)",
    ["outcome"],
)
for _o in ("answered", "unlisted", "missing", "unauthenticated", "busy_client", "busy", "error"):
    _lookups.labels(_o)


class PendingIndex:
    """The tokens under ``certs/challenges/``, from listings shared by every waiting lookup (see
    the module docstring). :meth:`holds` may also answer from the last listing when that already
    holds the token: the GET that follows says whether it is still there."""

    def __init__(
        self, clock: IReactorTime, list_tokens: ListPending, interval: float = LIST_INTERVAL
    ):
        self._clock = clock
        self._list = list_tokens
        self.interval = interval
        self._tokens: frozenset[str] = frozenset()
        self._waiters: list[Deferred[frozenset[str]]] = []
        self._timer: IDelayedCall | None = None
        self._listing = False
        self._last_start = float("-inf")
        self.listings = 0  # begun so far

    def holds(self, token: str) -> Deferred[bool]:
        if token in self._tokens:
            return succeed(True)
        waiter: Deferred[frozenset[str]] = Deferred()
        self._waiters.append(waiter)
        self._schedule()
        return waiter.addCallback(lambda tokens: token in tokens)

    def _schedule(self) -> None:
        if self._listing or self._timer is not None or not self._waiters:
            return
        delay = max(0.0, self._last_start + self.interval - self._clock.seconds())
        self._timer = self._clock.callLater(delay, self._begin)

    def _begin(self) -> None:
        self._timer = None
        waiters, self._waiters = self._waiters, []
        self._listing = True
        self._last_start = self._clock.seconds()
        self.listings += 1
        d = Deferred.fromCoroutine(self._read())

        def done(result: frozenset[str] | Failure) -> None:
            self._listing = False
            fire(waiters, result)
            self._schedule()  # lookups that arrived while this listing ran

        d.addBoth(done)

    async def _read(self) -> frozenset[str]:
        tokens = frozenset(await self._list())
        self._tokens = tokens
        return tokens


class ChallengeResponder:
    """Key authorisations by token. ``publish``/``withdraw`` may be called from any thread.

    ``lookup``: the bucket's answer for a token (:meth:`lchat.acme.cache.SharedCache.get_challenge`,
    which raises :class:`~lchat.acme.cache.ChallengeRefused` for an object no box of the fleet
    wrote). ``pending``: the listing of tokens in the bucket, paced by ``clock``
    (:class:`PendingIndex`); without it every well-formed token costs a GET."""

    def __init__(
        self,
        lookup: Lookup | None = None,
        may_lookup: Callable[[str], bool] | None = None,
        *,
        pending: ListPending | None = None,
        clock: IReactorTime,
        list_interval: float = LIST_INTERVAL,
    ) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}
        self.lookup = lookup
        # Which Host headers may cost a bucket lookup: names some box could be ordering for (the
        # registry's), not whatever a scanner sends.
        self.may_lookup = may_lookup or (lambda host: True)
        self.index = None if pending is None else PendingIndex(clock, pending, list_interval)
        self._clock = clock
        self.lookups = 0  # bucket GETs in flight
        self.waiting = 0  # lookups not yet answered (index wait and GET)
        self._by_client: dict[str, int] = {}  # waiting lookups by client address
        self._busy_logged = float("-inf")
        self._busy_since_log = 0

    def publish(self, token: str, key_authorization: str) -> None:
        if not TOKEN.fullmatch(token):
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

    # -- lookups in the bucket

    def admit(self, client: str) -> str | None:
        """Take a waiting slot for ``client``; None when admitted, else the refusal's outcome."""
        if self._by_client.get(client, 0) >= MAX_PER_CLIENT:
            return "busy_client"
        if self.waiting >= MAX_WAITING:
            return "busy"
        self.waiting += 1
        self._by_client[client] = self._by_client.get(client, 0) + 1
        return None

    def release(self, client: str) -> None:
        self.waiting -= 1
        left = self._by_client[client] - 1
        if left:
            self._by_client[client] = left
        else:
            del self._by_client[client]

    async def find(self, token: str, host: str) -> str | None:
        """The bucket's answer for ``token`` (None: a 404), every outcome counted."""
        lookup = self.lookup
        assert lookup is not None
        if self.index is not None and not await self.index.holds(token):
            _lookups.labels("unlisted").inc()
            return None
        if self.lookups >= MAX_LOOKUPS:
            _lookups.labels("busy").inc()
            return None
        self.lookups += 1
        try:
            answer = await lookup(token)
        except ChallengeRefused as e:
            _lookups.labels("unauthenticated").inc()
            _log.error(
                "acme: refused the HTTP-01 answer the bucket holds for a token asked for {host}: "
                "no box of this fleet wrote it ({why}). Someone who can write to the bucket may "
                "be ordering a certificate for this name; answered 404",
                host=host,
                why=e,
                token=token,
            )
            return None
        finally:
            self.lookups -= 1
        _lookups.labels("answered" if answer is not None else "missing").inc()
        return answer

    def refused_busy(self, outcome: str, client: str) -> None:
        _lookups.labels(outcome).inc()
        self._busy_since_log += 1
        now = self._clock.seconds()
        if now - self._busy_logged >= BUSY_LOG_EVERY:
            _log.warn(
                "acme: refused {count} HTTP-01 lookups (404 without a lookup): too many waiting "
                "({why}; the latest from {client})",
                count=self._busy_since_log,
                why=f"{MAX_PER_CLIENT} from one client" if outcome == "busy_client" else "in all",
                client=client,
            )
            self._busy_logged = now
            self._busy_since_log = 0


def client_of(request: Request) -> str:
    """The address a lookup is counted against: the TCP peer, or behind this router's proxy (a
    UNIX socket only the router reaches) the last ``X-Forwarded-For`` entry, which the proxy
    appends itself (what a client sends comes before it)."""
    address = request.getClientAddress()
    host = getattr(address, "host", None)
    if isinstance(host, str):
        return host
    forwarded = request.requestHeaders.getRawHeaders(b"x-forwarded-for") or []
    if forwarded:
        return forwarded[-1].rsplit(b",", 1)[-1].strip().decode("ascii", "replace")[:64]
    return "?"


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
        if not TOKEN.fullmatch(token):
            return _not_found(request)
        answer = self._responder.get(token)
        if answer is not None:
            return self._answer(request, token, answer)
        responder = self._responder
        if responder.lookup is None or not ACME_TOKEN.fullmatch(token):
            return _not_found(request)
        try:
            host = hosts.parse_host_header((request.getHeader(b"host") or b"").decode("ascii"))
        except (UnicodeDecodeError, hosts.InvalidHost):
            return _not_found(request)
        if not responder.may_lookup(host):
            return _not_found(request)
        client = client_of(request)
        refused = responder.admit(client)
        if refused is not None:
            responder.refused_busy(refused, client)
            return _not_found(request)

        still = answerable(request)

        def done(value: str | Failure | None) -> None:
            responder.release(client)
            if isinstance(value, Failure):
                _lookups.labels("error").inc()
                _log.warn(
                    "acme: looking up challenge token in the shared cache failed: {error}",
                    error=value.getErrorMessage(),
                )
                value = None
            if still():
                request.write(
                    _not_found(request) if value is None else self._answer(request, token, value)
                )
                request.finish()

        Deferred.fromCoroutine(responder.find(token, host)).addBoth(done)
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

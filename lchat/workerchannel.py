"""The control channel of a box of many processes: HTTP/1.1 over unix sockets between the control
process and its data-plane workers (docs/performance.md "Many cores").

Each worker serves :func:`worker_site` on ``<run>/workers/worker-<k>.sock``:

- ``GET /api/version`` → ``{"version", "slot", "pid"}`` (the Supervisor's readiness probe, a ping);
- ``GET /status`` → the worker's figures (``status()``'s mapping, as JSON);
- ``GET /metrics`` → its Prometheus text (merged by control, lchat.metricsmerge);
- ``POST /reload?reason=`` → once its routes are reloaded, ``{"fingerprint", "routes"}``;
- ``POST /rescan`` → once its certificates are rescanned, ``{"certificates": n}``.

Control serves :func:`control_site` on ``<run>/workers/control.sock``:

- ``POST /cert-wanted?host=`` → ``{"coming": bool | null}``: a worker met a first-contact handshake
  for ``host`` (no certificate yet); control's issuer decides whether one is coming.

Calls go through :func:`ask` (one request per connection, every call with a timeout and a typed
failure). :class:`WorkerLink` is a worker's side of ``/cert-wanted``: what its certificate store's
cue calls, so first-contact handshakes are held in the worker that owns them while control issues.

Bad input (an unknown path, a wrong method, a malformed host, garbage instead of HTTP) gets a 4xx
with a one-line reason; a callable that fails gets a 500 and a log line, never a traceback on the
wire. Only the router's user can open these sockets (a 0700 directory): there is no other
authentication, and nothing here may be served on TCP.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, Counter
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

import lchat
from lchat import hosts, unixhttp
from lchat.reactors import TimeReactor
from lchat.webutil import QuietSite, answerable

_log = Logger(namespace="lchat.workers")

# What each side's callables answer: a JSON object, now or later.
Answer = Mapping[str, Any] | Deferred[Mapping[str, Any]]

REMEMBER = 60.0  # seconds a worker keeps control's answer about a host (or a failed call's "no")
MAX_HOSTS = 4096  # hosts a worker remembers answers for (and asks about at once), at most
ASK_TIMEOUT = 5.0  # seconds a worker waits for control's answer to /cert-wanted
MAX_REASON = 256  # characters of a reload's reason (it goes into log lines)

# The calls, by path: the ``call`` label of the failure counter (anything else is "other").
CALLS = {
    "/api/version": "version",
    "/status": "status",
    "/metrics": "metrics",
    "/reload": "reload",
    "/rescan": "rescan",
    "/cert-wanted": "cert-wanted",
}

_failures = Counter(
    "lchat_worker_channel_failures_total",
    "Calls between the control process and its workers that got no usable answer, by call "
    "(version, status, metrics, reload, rescan: control asking a worker; cert-wanted: a worker "
    "asking control) and why (timeout, refused: nothing listening, error: cut off or garbled)",
    ["call", "why"],
)
_cert_wanted = Counter(
    "lchat_worker_cert_wanted_total",
    "A worker's questions to the control process about a first-contact certificate, by answer "
    "(coming; declined; failed: counted as declined for 60 s; busy: too many questions in "
    "flight, not asked, not held)",
    ["answer"],
)
for _answer_kind in ("coming", "declined", "failed", "busy"):
    _cert_wanted.labels(_answer_kind)  # present at 0, so a rate() sees the first one


class ChannelError(Exception):
    """A call over the control channel got no usable answer. ``reason`` is for humans."""

    def __init__(self, socket_path: str, reason: str) -> None:
        super().__init__(f"{socket_path}: {reason}")
        self.socket_path = socket_path
        self.reason = reason


class ChannelTimeout(ChannelError):
    """No answer within the call's timeout (the process is busy, hung or stopped)."""


class ChannelRefused(ChannelError):
    """Nothing listens on the socket (no such file, or the process is gone)."""


def ask(
    reactor: TimeReactor,  # and IReactorUNIX, which unixhttp adapts to
    sock_path: str,
    method: str,
    path: str,
    timeout: float,
) -> Deferred[tuple[int, Any]]:
    """One call: ``method path`` on the HTTP server at ``sock_path``. Fires ``(status, body)``,
    the body decoded from JSON when the answer says ``application/json``, else its bytes.

    Fails with :class:`ChannelTimeout` when no whole answer came within ``timeout`` seconds,
    :class:`ChannelRefused` when nothing listens, :class:`ChannelError` on anything else (cut off,
    not the JSON it claims to be). Each failure counts in ``lchat_worker_channel_failures_total``.
    """
    return Deferred.fromCoroutine(_ask(reactor, sock_path, method, path, timeout))


async def _ask(
    reactor: TimeReactor,
    sock_path: str,
    method: str,
    path: str,
    timeout: float,  # noqa: ASYNC109 -- Twisted, not asyncio: enforced via addTimeout
) -> tuple[int, Any]:
    call = CALLS.get(urllib.parse.urlsplit(path).path, "other")
    # unixhttp's own deadline is a backstop: ours fires first and is told apart by its type.
    attempt = Deferred.fromCoroutine(
        unixhttp.request(reactor, sock_path, method, path, timeout=timeout + 1.0)
    )
    attempt.addTimeout(timeout, IReactorTime(reactor))
    try:
        response = await attempt
    except defer.TimeoutError:
        _failures.labels(call, "timeout").inc()
        raise ChannelTimeout(sock_path, f"{method} {path}: no answer within {timeout:g}s") from None
    except unixhttp.UnixHTTPError as e:
        # unixhttp's two reasons for "nothing listens" (pinned by tests/test_workerchannel.py).
        if e.reason.startswith(("connection refused", "socket does not exist")):
            _failures.labels(call, "refused").inc()
            raise ChannelRefused(sock_path, f"{method} {path}: {e.reason}") from None
        _failures.labels(call, "error").inc()
        raise ChannelError(sock_path, f"{method} {path}: {e.reason}") from None
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        return response.status, response.body
    try:
        return response.status, json.loads(response.body)
    except (ValueError, UnicodeDecodeError) as e:
        _failures.labels(call, "error").inc()
        raise ChannelError(sock_path, f"{method} {path}: the answer is not JSON ({e})") from None


# --- the sites -------------------------------------------------------------------------------


def worker_site(
    reload: Callable[[str], Answer],
    rescan: Callable[[], Answer],
    status: Callable[[], Mapping[str, Any]],
    metrics: Callable[[], bytes],
    *,
    slot: int | None = None,
) -> Site:
    """A worker's side of the channel (the module's first table).

    ``reload(reason)`` reloads the worker's routes and answers ``{"fingerprint", "routes"}``;
    ``rescan()`` rescans its certificates and answers ``{"certificates": n}`` (either may answer
    with a Deferred); ``status()`` is the worker's figures; ``metrics()`` its Prometheus text.
    ``/api/version``'s slot is ``slot``, or ``status()["slot"]`` when not given."""
    return QuietSite(_WorkerResource(reload, rescan, status, metrics, slot))


def control_site(cert_wanted: Callable[[str], bool | None] | None) -> Site:
    """The control process's side of the channel: ``POST /cert-wanted?host=H`` answers
    ``{"coming": cert_wanted(H)}`` (the issuer's ``want``); ``cert_wanted`` None (no ACME) answers
    ``{"coming": false}``, so workers hold no handshake for a certificate nobody issues."""
    return QuietSite(_ControlResource(cert_wanted))


class _Channel(Resource):
    """Routes by path and method; answers 404/405 (with Allow) for the rest."""

    isLeaf = True

    def routes(self) -> Mapping[bytes, tuple[bytes, Callable[[Request], bytes | int]]]:
        raise NotImplementedError

    def render(self, request: Request) -> bytes | int:
        found = self.routes().get(request.path or b"")
        if found is None:
            return _json(request, 404, {"error": "not found"})
        method, handler = found
        allowed = (method, b"HEAD") if method == b"GET" else (method,)
        if request.method not in allowed:
            request.setHeader(b"allow", b", ".join(allowed))
            return _json(request, 405, {"error": f"method not allowed (use {method.decode()})"})
        return handler(request)


class _WorkerResource(_Channel):
    def __init__(
        self,
        reload: Callable[[str], Answer],
        rescan: Callable[[], Answer],
        status: Callable[[], Mapping[str, Any]],
        metrics: Callable[[], bytes],
        slot: int | None,
    ) -> None:
        super().__init__()
        self._reload = reload
        self._rescan = rescan
        self._status = status
        self._metrics = metrics
        self._slot = slot
        self._routes = {
            b"/api/version": (b"GET", self._version),
            b"/status": (b"GET", self._status_answer),
            b"/metrics": (b"GET", self._metrics_answer),
            b"/reload": (b"POST", self._reload_answer),
            b"/rescan": (b"POST", self._rescan_answer),
        }

    def routes(self) -> Mapping[bytes, tuple[bytes, Callable[[Request], bytes | int]]]:
        return self._routes

    def _version(self, request: Request) -> bytes | int:
        def version() -> Mapping[str, Any]:
            slot = self._slot if self._slot is not None else self._status().get("slot")
            return {"version": lchat.__version__, "slot": slot, "pid": os.getpid()}

        return _answer(request, "version", version)

    def _status_answer(self, request: Request) -> bytes | int:
        return _answer(request, "status", self._status)

    def _metrics_answer(self, request: Request) -> bytes | int:
        try:
            text = self._metrics()
        except Exception:
            _log.failure("worker channel: rendering the metrics failed")
            return _json(request, 500, {"error": "rendering the metrics failed"})
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
        return text

    def _reload_answer(self, request: Request) -> bytes | int:
        raw = (request.args or {}).get(b"reason", [b"control"])[0]
        try:
            reason = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _json(request, 400, {"error": "bad reason: not UTF-8"})
        if len(reason) > MAX_REASON:
            return _json(request, 400, {"error": f"bad reason: over {MAX_REASON} characters"})
        return _answer(request, "reload", lambda: self._reload(reason or "control"))

    def _rescan_answer(self, request: Request) -> bytes | int:
        return _answer(request, "rescan", self._rescan)


class _ControlResource(_Channel):
    def __init__(self, cert_wanted: Callable[[str], bool | None] | None) -> None:
        super().__init__()
        self._cert_wanted = cert_wanted
        self._routes = {b"/cert-wanted": (b"POST", self._cert_wanted_answer)}

    def routes(self) -> Mapping[bytes, tuple[bytes, Callable[[Request], bytes | int]]]:
        return self._routes

    def _cert_wanted_answer(self, request: Request) -> bytes | int:
        raw = (request.args or {}).get(b"host", [b""])[0]
        try:
            host = hosts.normalise(raw.decode("utf-8"))
        except (UnicodeDecodeError, hosts.InvalidHost) as e:
            return _json(request, 400, {"error": f"bad host: {e}"})
        wanted = self._cert_wanted
        return _answer(
            request,
            "cert-wanted",
            lambda: {"coming": False if wanted is None else wanted(host)},
        )


def _answer(request: Request, call: str, produce: Callable[[], Answer]) -> bytes | int:
    """``produce()``'s answer as JSON: 200 now, 200 when its Deferred fires, or 500 (logged)."""
    try:
        result = produce()
    except Exception:
        _log.failure("worker channel: answering {call} failed", call=call)
        return _json(request, 500, {"error": f"{call} failed (see the log)"})
    if not isinstance(result, Deferred):
        return _json_or_500(request, call, result)
    still = answerable(request)

    def done(body: Mapping[str, Any]) -> None:
        if still():  # the caller gave up (its timeout): finish() would raise
            request.write(_json_or_500(request, call, body))
            request.finish()

    def failed(failure: Failure) -> None:
        _log.failure("worker channel: answering {call} failed", failure, call=call)
        if still():
            request.write(_json(request, 500, {"error": f"{call} failed: {failure.value}"}))
            request.finish()

    result.addCallbacks(done, failed)
    return NOT_DONE_YET


def _json_or_500(request: Request, call: str, body: object) -> bytes:
    try:
        return _json(request, 200, body)
    except (TypeError, ValueError):
        _log.error("worker channel: {call}'s answer is not JSON: {body!r}", call=call, body=body)
        return _json(request, 500, {"error": f"{call}'s answer is not JSON"})


def _json(request: Request, code: int, body: object) -> bytes:
    encoded = json.dumps(body, sort_keys=True).encode() + b"\n"
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"application/json")
    return encoded


# --- a worker's side of /cert-wanted ----------------------------------------------------------


class GivesUp(Protocol):
    """The certificate store's ``give_up``: release the handshakes held for ``host`` now (no
    certificate is coming), as when the issuer declines in a single process (lchat.tls)."""

    def give_up(self, host: str, /) -> object: ...


class WorkerLink:
    """A worker's certificate cue, answered by the control process (its issuer).

    :meth:`want` is what the worker's ``CertificateWanted`` calls (inside OpenSSL's SNI callback,
    or before a held handshake): it never blocks and never raises. Invariants:

    - at most one question about a host is in flight; its answer is remembered ``remember``
      seconds on ``clock`` (the reactor's by default), for ``capacity`` hosts at most (the oldest
      forgotten first);
    - while the question is in flight :meth:`want` says ``None`` ("maybe coming"), so the
      handshake is held locally, as a single process holds it while its issuer orders;
    - an answer of ``false``, and a failed call (counted as ``false`` for ``remember`` seconds,
      logged once per run of failures), releases that host's held handshakes at once
      (``store.give_up``): they get the default certificate rather than waiting out the hold.
    """

    def __init__(
        self,
        reactor: TimeReactor,  # and IReactorUNIX: the calls' connections and timeouts
        control_sock: str,
        store: GivesUp,
        *,
        clock: IReactorTime | None = None,  # how long answers are remembered
        remember: float = REMEMBER,
        timeout: float = ASK_TIMEOUT,
        capacity: int = MAX_HOSTS,
    ) -> None:
        self._reactor = reactor
        self._sock = control_sock
        self._store = store
        self._clock: IReactorTime | TimeReactor = clock if clock is not None else reactor
        self._remember = remember
        self._timeout = timeout
        self._capacity = capacity
        self._answers: dict[str, tuple[bool, float]] = {}  # host -> (coming, until), oldest first
        self._pending: set[str] = set()
        self._failing = False  # the last call failed (logged once until one succeeds)

    def want(self, host: str) -> bool | None:
        """``host`` (normalised) has no certificate: is one coming? True or False from the
        remembered answer, None while control is being asked."""
        known = self._answers.get(host)
        if known is not None:
            if self._clock.seconds() < known[1]:
                return known[0]
            del self._answers[host]
        if host in self._pending:
            return None
        if len(self._pending) >= self._capacity:
            _cert_wanted.labels("busy").inc()
            return False
        self._pending.add(host)
        path = "/cert-wanted?" + urllib.parse.urlencode({"host": host})
        d = ask(self._reactor, self._sock, "POST", path, self._timeout)
        d.addCallbacks(self._answered, self._failed, callbackArgs=(host,), errbackArgs=(host,))
        known = self._answers.get(host)  # a call that failed at once has answered already
        return None if known is None else known[0]

    def _answered(self, result: tuple[int, Any], host: str) -> None:
        status, body = result
        coming = body.get("coming", False) if isinstance(body, dict) else False
        if status != 200 or not isinstance(coming, bool | None):
            self._failed(Failure(ChannelError(self._sock, f"answered {status}: {body!r}")), host)
            return
        if self._failing:
            self._failing = False
            _log.info("worker: the control process answers about certificates again")
        self._settle(host, coming is not False, "coming" if coming is not False else "declined")

    def _failed(self, failure: Failure, host: str) -> None:
        if not failure.check(ChannelError):
            _log.failure(
                "worker: asking the control process about {host} failed", failure, host=host
            )
        elif not self._failing:
            _log.warn(
                "worker: cannot ask the control process whether a certificate is coming for "
                "{host} ({error}); handshakes for hosts without one get the default certificate "
                "for {remember:g}s (said once until it answers again)",
                host=host,
                error=failure.getErrorMessage(),
                remember=self._remember,
            )
        self._failing = True
        self._settle(host, False, "failed")

    def _settle(self, host: str, coming: bool, answer: str) -> None:
        _cert_wanted.labels(answer).inc()
        self._pending.discard(host)
        if len(self._answers) >= self._capacity:
            now = self._clock.seconds()
            for expired in [h for h, (_, until) in self._answers.items() if until <= now]:
                del self._answers[expired]
            while len(self._answers) >= self._capacity:
                del self._answers[next(iter(self._answers))]
        self._answers[host] = (coming, self._clock.seconds() + self._remember)
        if not coming:
            try:
                self._store.give_up(host)
            except Exception:
                _log.failure("worker: releasing the handshakes held for {host} failed", host=host)

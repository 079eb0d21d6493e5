"""The reference bot sidecar (docs/design.md §7, §8): `python -m lchat.space.sidecar`.

A small second process beside a space. On a hibernating host the activator co-spawns it once the
space is healthy and stops it first at sleep, so it lives exactly while its space is awake. It

- keeps a *charter*: a run every ``LCHAT_BOT_EVERY`` seconds on a fixed grid; a run posts one
  message to ``LCHAT_BOT_ROOM`` (if set). The next run time is persisted atomically beside the
  database (``$LCHAT_DB-bot.json``) so that being stopped at every sleep does not reset the
  schedule; a run whose time passed while stopped runs once on start (never once per missed
  period), then the grid continues;
- reports its next run on start and after each run (``POST /api/charter-next-due``, bot token),
  so a sleeping space is woken for it (the space folds it into ``GET /api/next-due``);
- optionally (``LCHAT_BOT_LISTEN=1``) keeps a WebSocket open to the room and logs what it hears;
- marks every request it makes, WebSocket upgrades included, with ``X-Lchat-Sidecar: 1``: the
  activator keeps that traffic activity-invisible (no idle credit, never a wake);
- retries every failure (nothing listening, 5xx, 503 + Retry-After) with capped backoff: it never
  exits because its space misbehaves, so it can never crash-loop;
- stops cleanly and quickly on SIGTERM (exit 0), giving an in-flight run and the report of the next
  run at most ``STOP_GRACE`` seconds.

It talks to the space's unix socket ``LCHAT_SOCKET`` directly, or, if ``LCHAT_SIDECAR_URL`` is set,
to that http(s) base URL (e.g. the router) with ``Host: $LCHAT_HOST``; over https the certificate is
verified against ``LCHAT_HOST`` (the name the router serves the space under).

Delivery is at least once: the schedule advances only after a run finished, so a run interrupted
by SIGTERM is repeated on the next start (rarely posting twice if the post had already landed).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Protocol, cast

from attrs import define, field, frozen
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    UNIXClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.error import ConnectingCancelledError
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory, connectionDone
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.internet.ssl import optionsForClientTLS
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgentEndpointFactory
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    TextMessage,
)
from wsproto.events import Request as WSRequest
from wsproto.utilities import LocalProtocolError, RemoteProtocolError
from zope.interface import implementer

from lchat import hosts, unixhttp
from lchat.backoff import Backoff
from lchat.files import write_atomic
from lchat.twisted_internals import quiet_pool
from lchat.unixhttp import Response
from lchat.webutil import BytesProducer

log = Logger(namespace="lchat.space.sidecar")

SIDECAR_HEADER = "X-Lchat-Sidecar"
DEFAULT_EVERY = 3600
MAX_EVERY = 10 * 366 * 86400  # ten years; more is a typo
MAX_TIME = 2**53  # as lchat.space.api: larger "unix seconds" are nonsense
REQUEST_TIMEOUT = 10.0  # one request, connect to last byte
BACKOFF_INITIAL = 1.0
BACKOFF_CAP = 60.0  # seconds; also the cap on an honoured Retry-After
BACKOFF = Backoff(BACKOFF_INITIAL, BACKOFF_CAP)  # every retry: posting, reporting, listening
STOP_GRACE = 3.0  # on SIGTERM: an in-flight run and the final report get this long together
MAX_RESPONSE = 1 << 20
ROOM = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as lchat.space.api.ROOM

ENV_HELP = """\
environment:
  LCHAT_BOT_TOKEN    bearer token for POST /api/charter-next-due (required)
  LCHAT_DB           the space's SQLite path; the schedule is kept in $LCHAT_DB-bot.json (required)
  LCHAT_SOCKET       the space's unix socket (required unless LCHAT_SIDECAR_URL is set)
  LCHAT_SIDECAR_URL  http(s) base URL to reach the space through instead (e.g. the router)
  LCHAT_HOST         the space's hostname: the Host header, TLS name and log tag
                     (required with LCHAT_SIDECAR_URL)
  LCHAT_BOT_EVERY    seconds between runs (default 3600)
  LCHAT_BOT_ROOM     room a run posts to (unset: runs keep the schedule but post nothing)
  LCHAT_BOT_MESSAGE  text a run posts (default: "scheduled run <time>")
  LCHAT_BOT_LISTEN   1 to keep a WebSocket open to LCHAT_BOT_ROOM and log what is said (default 0)
"""


class ConfigError(Exception):
    """A variable is missing or malformed; the message names it."""


class RequestFailed(Exception):
    """No usable answer from the space (nothing listening, timeout, cut off...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Stopping(Exception):
    """A retry loop noticed the sidecar is stopping."""


# -- configuration -----------------------------------------------------------------------------


@frozen
class BaseURL:
    scheme: str  # "http" or "https"
    hostname: str  # where to connect (the router), not the Host header
    port: int
    prefix: str  # path prefix without a trailing slash ("" for none)

    @classmethod
    def parse(cls, raw: str) -> BaseURL:
        try:
            url = urllib.parse.urlsplit(raw)
            port = url.port
        except ValueError as e:
            raise ConfigError(f"LCHAT_SIDECAR_URL is not a valid URL: {e}") from None
        if url.scheme not in ("http", "https"):
            raise ConfigError(f"LCHAT_SIDECAR_URL must be an http or https URL, not {raw!r}")
        if not url.hostname:
            raise ConfigError(f"LCHAT_SIDECAR_URL has no host: {raw!r}")
        if url.username is not None or url.password is not None or url.query or url.fragment:
            raise ConfigError("LCHAT_SIDECAR_URL must be a base URL (no credentials, query or #)")
        default = 443 if url.scheme == "https" else 80
        return cls(url.scheme, url.hostname, port or default, url.path.rstrip("/"))

    def __str__(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"


@frozen
class SidecarConfig:
    token: str
    db: str
    host: str = "space"
    socket: str | None = None
    url: BaseURL | None = None
    every: int = DEFAULT_EVERY
    room: str | None = None
    message: str | None = None
    listen: bool = False

    @property
    def state_path(self) -> str:
        return self.db + "-bot.json"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SidecarConfig:
        def get(name: str) -> str:
            return env.get(name, "").strip()

        token = env.get("LCHAT_BOT_TOKEN", "")
        if not token.strip():
            raise ConfigError(
                "LCHAT_BOT_TOKEN is not set: the sidecar needs the bot token to report its "
                "schedule; refusing to start"
            )
        db = get("LCHAT_DB")
        if not db:
            raise ConfigError("LCHAT_DB is not set (the schedule is kept beside the database)")

        url: BaseURL | None = None
        socket: str | None = None
        if get("LCHAT_SIDECAR_URL"):
            url = BaseURL.parse(get("LCHAT_SIDECAR_URL"))
        else:
            socket = get("LCHAT_SOCKET") or None
            if socket is None:
                raise ConfigError("LCHAT_SOCKET is not set (nor LCHAT_SIDECAR_URL)")

        host = "space"
        if get("LCHAT_HOST"):
            try:
                host = hosts.normalise(get("LCHAT_HOST"))
            except hosts.InvalidHost as e:
                raise ConfigError(f"LCHAT_HOST is not a valid hostname: {e}") from None
        elif url is not None:
            raise ConfigError("LCHAT_HOST is not set (required with LCHAT_SIDECAR_URL)")

        every = DEFAULT_EVERY
        if get("LCHAT_BOT_EVERY"):
            raw = get("LCHAT_BOT_EVERY")
            if re.fullmatch(r"[0-9]{1,12}", raw) is None or not 1 <= int(raw) <= MAX_EVERY:
                raise ConfigError(
                    f"LCHAT_BOT_EVERY must be a whole number of seconds from 1 to {MAX_EVERY}, "
                    f"not {raw!r}"
                )
            every = int(raw)

        room = get("LCHAT_BOT_ROOM") or None
        if room is not None and ROOM.fullmatch(room) is None:
            raise ConfigError(
                f"LCHAT_BOT_ROOM must be 1-64 letters, digits, '_' or '-', not {room!r}"
            )

        listen_raw = get("LCHAT_BOT_LISTEN").lower()
        if listen_raw in ("", "0", "off", "no", "false"):
            listen = False
        elif listen_raw in ("1", "on", "yes", "true"):
            listen = True
        else:
            raise ConfigError(f"LCHAT_BOT_LISTEN must be 1 or 0, not {listen_raw!r}")
        if listen and room is None:
            raise ConfigError("LCHAT_BOT_LISTEN=1 needs LCHAT_BOT_ROOM (the room to listen to)")

        message = env.get("LCHAT_BOT_MESSAGE") or None
        if message is not None and len(message.encode("utf-8", "surrogatepass")) > 64 * 1024:
            raise ConfigError("LCHAT_BOT_MESSAGE is longer than 64 KiB")

        return cls(
            token=token.strip(),
            db=db,
            host=host,
            socket=socket,
            url=url,
            every=every,
            room=room,
            message=message,
            listen=listen,
        )


# -- schedule logic (pure) ---------------------------------------------------------------------


def initial_due(saved: int | None, every: int, now: float) -> int:
    """The next run on start: the saved one, a fresh one (none saved), or a clamped one.

    A saved time in the past is returned as is: it is overdue and runs once, right away. A saved
    time more than one period ahead (the period was shortened, or the clock went back) is pulled
    in to one period from now.
    """
    fresh = math.ceil(now) + every
    if saved is None or saved > fresh:
        return fresh
    return saved


def next_slot(due: int, every: int, now: float) -> int:
    """The first time on the grid ``due + k * every`` that is after ``now`` (``due`` if ahead).

    However many periods were missed, this skips them all: one catch-up run, then the grid.
    """
    if now < due:
        return due
    return due + (int((now - due) // every) + 1) * every


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds asked for by a Retry-After header (delta-seconds or HTTP-date), or None."""
    if not value:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]{1,10}", value):
        return float(int(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def retryable(status: int) -> bool:
    """Worth asking again later: the space is busy, starting, stopping or broken for now."""
    return status in (408, 425, 429) or 500 <= status <= 599


def when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- the persisted schedule --------------------------------------------------------------------


@frozen
class StateFile:
    """``{"next_run": <unix seconds>}`` in one small file, replaced atomically.

    Written once per run (and on a fresh start); small enough to write on the reactor thread of
    this single-purpose process.
    """

    path: str

    def load(self) -> int | None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(4096)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warn(
                "cannot read schedule {path}: {error}; starting afresh", path=self.path, error=e
            )
            return None
        try:
            due = json.loads(raw)["next_run"]
        except (ValueError, TypeError, KeyError):
            due = None
        if type(due) is not int or not 0 <= due < MAX_TIME:
            log.warn("schedule {path} is unreadable; starting afresh", path=self.path)
            return None
        return due

    def save(self, due: int) -> None:
        write_atomic(self.path, json.dumps({"next_run": due}).encode(), 0o600)


# -- talking to the space ----------------------------------------------------------------------


def marked(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` plus the sidecar marker (whatever the caller passed under that name)."""
    out = {k: v for k, v in headers.items() if k.lower() != SIDECAR_HEADER.lower()}
    out[SIDECAR_HEADER] = "1"
    return out


class Client(Protocol):
    """How the sidecar reaches its space. Every request it sends carries the sidecar marker."""

    host: str  # the Host header

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        timeout: float = REQUEST_TIMEOUT,  # noqa: ASYNC109 -- Twisted: enforced via addTimeout
    ) -> Response: ...

    def endpoint(self) -> IStreamClientEndpoint: ...

    def target(self, path: str) -> str: ...


@define
class UnixClient:
    """Straight to the space's unix socket (the default)."""

    reactor: Any
    socket: str
    host: str

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        timeout: float = REQUEST_TIMEOUT,  # noqa: ASYNC109 -- Twisted: enforced via addTimeout
    ) -> Response:
        try:
            return await unixhttp.request(
                self.reactor,
                self.socket,
                method,
                path,
                host=self.host,
                headers=marked(headers),
                body=body,
                timeout=timeout,
                max_body=MAX_RESPONSE,
            )
        except unixhttp.UnixHTTPError as e:
            raise RequestFailed(str(e)) from None

    def endpoint(self) -> IStreamClientEndpoint:
        return UNIXClientEndpoint(self.reactor, self.socket, timeout=int(REQUEST_TIMEOUT))

    def target(self, path: str) -> str:
        return path


@implementer(IAgentEndpointFactory)
@frozen
class _Fixed:
    """Every URI goes to one endpoint (the base URL's address)."""

    endpoint: IStreamClientEndpoint

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return self.endpoint


def _cancelled(e: BaseException) -> bool:
    kinds = (CancelledError, ConnectingCancelledError)
    return isinstance(e, kinds) or any(
        isinstance(r, Failure) and r.check(*kinds) for r in getattr(e, "reasons", None) or []
    )


def _describe(e: BaseException) -> str:
    reasons = getattr(e, "reasons", None) or []
    if reasons:
        return "; ".join(r.getErrorMessage() if isinstance(r, Failure) else str(r) for r in reasons)
    return str(e) or type(e).__name__


@define
class URLClient:
    """Through an http(s) base URL (e.g. the router), with ``Host: <the space>``.

    Over https the certificate is verified against the space's name (the router picks the
    certificate by SNI), while the connection goes to the URL's address.
    """

    reactor: Any
    base: BaseURL
    host: str
    _agent: Agent = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._agent = Agent.usingEndpointFactory(
            self.reactor,
            _Fixed(self.endpoint()),
            pool=quiet_pool(self.reactor, persistent=False),
        )

    def endpoint(self) -> IStreamClientEndpoint:
        tcp = HostnameEndpoint(
            self.reactor, self.base.hostname, self.base.port, timeout=int(REQUEST_TIMEOUT)
        )
        if self.base.scheme == "https":
            return wrapClientTLS(optionsForClientTLS(self.host), tcp)
        return tcp

    def target(self, path: str) -> str:
        return self.base.prefix + path

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        timeout: float = REQUEST_TIMEOUT,  # noqa: ASYNC109 -- Twisted: enforced via addTimeout
    ) -> Response:
        attempt = Deferred.fromCoroutine(self._exchange(method, path, headers, body))
        attempt.addTimeout(timeout, cast(IReactorTime, self.reactor))
        try:
            return await attempt
        except defer.TimeoutError:
            raise RequestFailed(f"{self.base}: no response within {timeout:g}s") from None

    async def _exchange(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        # The URL names the space (so the Agent sends Host: <space>); _Fixed picks the address.
        url = f"http://{self.host}{self.target(path)}".encode("ascii")
        hdrs = Headers({k: [v] for k, v in marked(headers).items()})
        producer = BytesProducer(body) if body or method in ("POST", "PUT") else None
        try:
            resp = await self._agent.request(method.encode(), url, hdrs, producer)
            if resp.length is not UNKNOWN_LENGTH and resp.length > MAX_RESPONSE:
                raise RequestFailed(f"{self.base}: response of {resp.length} bytes is too large")
            data = await readBody(resp)
        except RequestFailed:
            raise
        except Exception as e:
            if _cancelled(e):
                raise CancelledError() from None
            raise RequestFailed(f"{self.base}: {_describe(e)}") from None
        out = {
            name.decode("latin-1").lower(): ", ".join(v.decode("latin-1") for v in values)
            for name, values in resp.headers.getAllRawHeaders()
        }
        return Response(status=resp.code, headers=out, body=data)


def client_for(reactor: Any, config: SidecarConfig) -> Client:
    if config.url is not None:
        return URLClient(reactor, config.url, config.host)
    assert config.socket is not None
    return UnixClient(reactor, config.socket, config.host)


# -- the WebSocket listener (wsproto: twisted's client cannot add our marker header) -----------


class WSHandle(Protocol):
    closed: Deferred[None]

    def close(self) -> None: ...


class _WSClient(TwistedProtocol):
    def __init__(self, host: str, target: str, on_text: Callable[[str], None]) -> None:
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._host = host
        self._target = target
        self._on_text = on_text
        self._text: list[str] = []
        self.opened: Deferred[None] = Deferred(lambda _: self._abort())
        self.closed: Deferred[None] = Deferred()

    def _abort(self) -> None:
        if self.transport is not None:
            cast(Any, self.transport).abortConnection()

    def _send(self, event: Event) -> None:
        try:
            data = self._ws.send(event)
        except LocalProtocolError:
            return
        if self.transport is not None:
            self.transport.write(data)

    def connectionMade(self) -> None:
        marker = (SIDECAR_HEADER.lower().encode(), b"1")
        self._send(WSRequest(host=self._host, target=self._target, extra_headers=[marker]))

    def dataReceived(self, data: bytes) -> None:
        try:
            self._ws.receive_data(data)
            for event in self._ws.events():
                self._handle(event)
        except RemoteProtocolError as e:
            log.warn("websocket protocol error: {error}", error=e)
            self._abort()

    def _handle(self, event: Event) -> None:
        if isinstance(event, AcceptConnection):
            if not self.opened.called:
                self.opened.callback(None)
        elif isinstance(event, RejectConnection):
            if not self.opened.called:
                self.opened.errback(RequestFailed(f"websocket refused: HTTP {event.status_code}"))
            assert self.transport is not None
            self.transport.loseConnection()
        elif isinstance(event, TextMessage):
            self._text.append(event.data)
            if event.message_finished:
                text, self._text = "".join(self._text), []
                try:
                    self._on_text(text)
                except Exception:
                    log.failure("handling a websocket message failed")
        elif isinstance(event, Ping):
            self._send(event.response())
        elif isinstance(event, CloseConnection):
            if self._ws.state is ConnectionState.REMOTE_CLOSING:
                self._send(event.response())
            assert self.transport is not None
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self.opened.called:
            self.opened.errback(
                RequestFailed(f"websocket closed before opening: {reason.getErrorMessage()}")
            )
        if not self.closed.called:
            self.closed.callback(None)

    def close(self) -> None:
        if self._ws.state is ConnectionState.OPEN:
            self._send(CloseConnection(code=1000))
        if self.transport is not None:
            self.transport.loseConnection()


class _One(Factory):
    def __init__(self, protocol: _WSClient) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: Any) -> _WSClient:
        return self._protocol


async def ws_connect(
    reactor: Any, client: Client, path: str, on_text: Callable[[str], None]
) -> WSHandle:
    """Open a WebSocket to ``path`` on the space (marker header included); RequestFailed if not."""
    proto = _WSClient(client.host, client.target(path), on_text)
    connecting = client.endpoint().connect(_One(proto))
    connecting.addTimeout(REQUEST_TIMEOUT, reactor)
    try:
        await connecting
    except defer.TimeoutError:
        raise RequestFailed(f"websocket: no connection within {REQUEST_TIMEOUT:g}s") from None
    except CancelledError:
        raise
    except Exception as e:
        raise RequestFailed(f"websocket: cannot connect: {_describe(e)}") from None
    opened = proto.opened.addTimeout(REQUEST_TIMEOUT, reactor)
    try:
        await opened
    except defer.TimeoutError:
        raise RequestFailed(f"websocket: no handshake within {REQUEST_TIMEOUT:g}s") from None
    return proto


Connector = Callable[[str, Callable[[str], None]], Awaitable[WSHandle]]


# -- the sidecar -------------------------------------------------------------------------------


@define(eq=False)
class Sidecar:
    """The charter, the reports and the optional listener, on an injected clock."""

    clock: Any  # IReactorTime (a task.Clock in tests)
    config: SidecarConfig
    client: Client
    state: StateFile
    connect_ws: Connector | None = None
    next_run: int = 0  # the next run, as persisted (unix seconds)
    reported: int | None = None  # the last next_run the space acknowledged (or rejected)
    runs: int = 0
    stopping: bool = False
    _timer: IDelayedCall | None = None
    _running: Deferred[None] | None = None
    _reporting: Deferred[None] | None = None
    _listening: Deferred[None] | None = None
    _ws: WSHandle | None = None
    _sleeps: set[Deferred[None]] = field(factory=set)

    @property
    def host(self) -> str:
        return self.config.host

    def now(self) -> float:
        return float(self.clock.seconds())

    # lifecycle

    def start(self) -> None:
        saved = self.state.load()
        now = self.now()
        self.next_run = initial_due(saved, self.config.every, now)
        if saved != self.next_run:
            self._save()
        overdue = self.next_run <= now
        log.info(
            "sidecar {host} started: every {every}s, room {room}, next run {next}{overdue}",
            host=self.host,
            every=self.config.every,
            room=self.config.room or "(none)",
            next=when(self.next_run),
            overdue=" (overdue: running now)" if overdue else "",
        )
        if overdue:
            self._fire()
        else:
            self._schedule()
            self._want_report()
        if self.config.listen:
            self._listening = Deferred.fromCoroutine(self._listen_loop())
            self._listening.addErrback(self._quiet, "listener")

    async def stop(self) -> None:
        """Stop quickly: no new run, no more retries; a run in flight and the report of the
        next run get at most STOP_GRACE seconds (together)."""
        if self.stopping:
            return
        self.stopping = True
        deadline = self.now() + STOP_GRACE
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        for d in list(self._sleeps):
            d.cancel()
        if self._ws is not None:
            self._ws.close()
        if self._listening is not None:
            self._listening.cancel()
        await self._bounded(self._running, deadline)
        if self.reported != self.next_run:
            self._want_report()  # one last attempt, no retries
        await self._bounded(self._reporting, deadline)
        log.info("sidecar {host} stopped", host=self.host)

    # the charter

    def _schedule(self) -> None:
        if self.stopping:
            return
        delay = max(0.0, self.next_run - self.now())
        self._timer = self.clock.callLater(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.stopping:
            return
        if self.now() < self.next_run:  # woke early (clock adjusted): wait on
            self._schedule()
            return
        self._running = Deferred.fromCoroutine(self._run(self.next_run))
        self._running.addErrback(self._quiet, "run")

    async def _run(self, due: int) -> None:
        deadline = next_slot(due, self.config.every, self.now())  # do not run into the next slot
        outcome = "nothing to post (no LCHAT_BOT_ROOM)"
        if self.config.room is not None:
            try:
                outcome = await self._post(self.config.room, due, deadline)
            except (CancelledError, _Stopping):
                raise  # interrupted by stop: not advanced, so it runs again on the next start
            except Exception:
                log.failure("sidecar {host}: run for {due} failed", host=self.host, due=when(due))
                outcome = "failed"
        self.runs += 1
        self.next_run = next_slot(due, self.config.every, self.now())
        self._save()
        log.info(
            "sidecar {host}: run for {due}: {outcome}; next run {next}",
            host=self.host,
            due=when(due),
            outcome=outcome,
            next=when(self.next_run),
        )
        self._schedule()
        self._want_report()

    async def _post(self, room: str, due: int, deadline: int) -> str:
        text = self.config.message or f"scheduled run {when(due)}"
        body = json.dumps({"body": text}).encode()
        backoff = BACKOFF.delays()
        while True:
            wait: float | None = None
            try:
                resp = await self.client.request(
                    "POST",
                    f"/api/rooms/{room}/messages",
                    headers={"Content-Type": "application/json"},
                    body=body,
                )
            except RequestFailed as e:
                problem = e.reason
            else:
                if resp.status == 201:
                    return f"posted message {_field(resp.body, 'id')} to {room}"
                if not retryable(resp.status):
                    log.error(
                        "sidecar {host}: posting to {room} refused: HTTP {status} {detail}",
                        host=self.host,
                        room=room,
                        status=resp.status,
                        detail=_field(resp.body, "error"),
                    )
                    return f"post refused (HTTP {resp.status})"
                problem = f"HTTP {resp.status}"
                wait = retry_after(resp.headers.get("retry-after"), self.now())
            if self.stopping:
                raise _Stopping()
            delay = backoff.next(wait)
            if self.now() + delay >= deadline:
                return f"gave up posting ({problem}) at the next slot"
            log.warn(
                "sidecar {host}: posting to {room} failed ({problem}); retrying in {delay:g}s",
                host=self.host,
                room=room,
                problem=problem,
                delay=delay,
            )
            await self._sleep(delay)

    def _save(self) -> None:
        try:
            self.state.save(self.next_run)
        except OSError as e:
            log.error(
                "sidecar {host}: cannot save the schedule to {path}: {error}",
                host=self.host,
                path=self.state.path,
                error=e,
            )

    # reporting the next run

    def _want_report(self) -> None:
        if self._reporting is None or self._reporting.called:
            self._reporting = Deferred.fromCoroutine(self._report_loop())
            self._reporting.addErrback(self._quiet, "report")

    async def _report_loop(self) -> None:
        """Until the space knows our latest next run (a run meanwhile just changes the value)."""
        backoff = BACKOFF.delays()
        while self.reported != self.next_run:
            due = self.next_run
            wait: float | None = None
            try:
                resp = await self.client.request(
                    "POST",
                    "/api/charter-next-due",
                    headers={
                        "Authorization": f"Bearer {self.config.token}",
                        "Content-Type": "application/json",
                    },
                    body=json.dumps({"due": due}).encode(),
                )
            except RequestFailed as e:
                problem = e.reason
            else:
                if 200 <= resp.status < 300:
                    self.reported = due
                    backoff.reset()
                    log.info(
                        "sidecar {host}: reported next run {due} ({at})",
                        host=self.host,
                        due=due,
                        at=when(due),
                    )
                    continue
                if not retryable(resp.status):
                    self.reported = due  # asking again will not help; a later run tries anew
                    log.error(
                        "sidecar {host}: report of next run {due} refused: HTTP {status} {detail}"
                        "{hint}",
                        host=self.host,
                        due=due,
                        status=resp.status,
                        detail=_field(resp.body, "error"),
                        hint=" (check LCHAT_BOT_TOKEN)" if resp.status in (401, 403) else "",
                    )
                    continue
                problem = f"HTTP {resp.status}"
                wait = retry_after(resp.headers.get("retry-after"), self.now())
            if self.stopping:
                log.warn(
                    "sidecar {host}: could not report next run {due} before stopping ({problem})",
                    host=self.host,
                    due=due,
                    problem=problem,
                )
                return
            delay = backoff.next(wait)
            log.warn(
                "sidecar {host}: reporting next run failed ({problem}); retrying in {delay:g}s",
                host=self.host,
                problem=problem,
                delay=delay,
            )
            await self._sleep(delay)

    # listening

    async def _listen_loop(self) -> None:
        assert self.config.room is not None
        connect = self.connect_ws
        if connect is None:
            return
        path = f"/api/rooms/{self.config.room}/ws"
        backoff = BACKOFF.delays()
        while not self.stopping:
            try:
                handle = await connect(path, self._heard)
            except RequestFailed as e:
                problem = e.reason
            else:
                self._ws = handle
                backoff.reset()
                log.info(
                    "sidecar {host}: listening to room {room}",
                    host=self.host,
                    room=self.config.room,
                )
                try:
                    await handle.closed
                finally:
                    self._ws = None
                problem = "connection closed"
            if self.stopping:
                return
            delay = backoff.next()
            log.warn(
                "sidecar {host}: websocket: {problem}; reconnecting in {delay:g}s",
                host=self.host,
                problem=problem,
                delay=delay,
            )
            await self._sleep(delay)

    def _heard(self, text: str) -> None:
        try:
            frame = json.loads(text)
        except ValueError:
            return
        if isinstance(frame, dict) and "id" in frame:
            log.info(
                "sidecar {host}: heard message {id} in {room}",
                host=self.host,
                id=frame.get("id"),
                room=frame.get("room"),
            )

    # helpers

    async def _sleep(self, delay: float) -> None:
        if self.stopping:
            raise _Stopping()
        d: Deferred[None] = deferLater(self.clock, delay)
        self._sleeps.add(d)
        try:
            await d
        finally:
            self._sleeps.discard(d)

    async def _bounded(self, task: Deferred[None] | None, deadline: float) -> None:
        if task is None or task.called:
            return
        remaining = max(0.0, deadline - self.now())
        try:
            await task.addTimeout(remaining, self.clock)
        except (defer.TimeoutError, CancelledError, _Stopping):
            pass

    def _quiet(self, failure: Failure, what: str) -> None:
        """Ends of background tasks: stopping is expected, anything else is a bug worth a log."""
        if failure.check(CancelledError, _Stopping):
            return None
        log.failure("sidecar {host}: {what} failed", failure, host=self.host, what=what)
        return None


def _field(body: bytes, name: str) -> str:
    try:
        value = json.loads(body).get(name)
    except (ValueError, AttributeError):
        return ""
    return "" if value is None else str(value)


# -- the process -------------------------------------------------------------------------------


def run(reactor: Any, config: SidecarConfig) -> int:
    """Run the sidecar on ``reactor`` until SIGTERM/SIGINT; return the exit code."""
    client = client_for(reactor, config)

    def connect(path: str, on_text: Callable[[str], None]) -> Awaitable[WSHandle]:
        return ws_connect(reactor, client, path, on_text)

    sidecar = Sidecar(reactor, config, client, StateFile(config.state_path), connect)
    reactor.addSystemEventTrigger(
        "before", "shutdown", lambda: Deferred.fromCoroutine(sidecar.stop())
    )
    reactor.callWhenRunning(sidecar.start)
    reactor.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    from lchat.space.server import parse_no_options

    stop = parse_no_options(
        argv,
        "python -m lchat.space.sidecar",
        "Run the reference lchat bot sidecar next to a space (configured by environment).",
        ENV_HELP,
    )
    if stop is not None:
        return stop
    try:
        config = SidecarConfig.from_env(os.environ)
    except ConfigError as e:
        print(f"lchat sidecar: {e}", file=sys.stderr)
        return 2
    from lchat.space.server import start_logging

    start_logging()
    from twisted.internet import reactor

    return run(reactor, config)


if __name__ == "__main__":
    sys.exit(main())

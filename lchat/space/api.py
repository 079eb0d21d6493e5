"""The space's HTTP API (docs/design.md §8) and the chat logic behind it.

`Space` is the logic (store, hub, scheduler tick); `Api` maps HTTP onto it; `SpaceRequest` and
`SpaceSite` track requests in flight so that a SIGTERM drain can wait for them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site
from twisted.web.websocket import WebSocketResource

import lchat
from lchat.deferutil import fire
from lchat.space.config import Config
from lchat.space.store import Message, Store
from lchat.space.ws import Hub, RoomSocketFactory

log = Logger(namespace="lchat.space.api")

ROOM = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_BODY = 64 * 1024  # bytes of UTF-8 in one message body
MAX_REQUEST = 1024 * 1024  # a JSON-escaped MAX_BODY fits with room to spare
MAX_TIME = 2**53  # larger "unix seconds" are nonsense (and lose precision in JavaScript)
DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
IDLE_TIMEOUT = 120  # idle keep-alive HTTP connections

_T = TypeVar("_T")
Reply = tuple[int, object | None]  # status code and JSON payload (None: no body)


@define
class HTTPError(Exception):
    code: int
    message: str


def check_body(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("body must be a non-empty string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("body must be valid Unicode") from None
    if size > MAX_BODY:
        raise ValueError(f"body exceeds {MAX_BODY} bytes")
    return value


def check_time(value: object, name: str) -> int:
    if type(value) is not int or not 0 <= value < MAX_TIME:
        raise ValueError(f"{name} must be a non-negative integer (unix seconds)")
    return value


@define
class Space:
    """The chat logic, independent of HTTP."""

    reactor: IReactorTime
    store: Store
    hub: Hub
    config: Config
    draining: bool = False

    def now(self) -> int:
        return int(self.reactor.seconds())

    def post(self, room: str, body: object) -> Deferred[Message]:
        """Store and push a message; raises ValueError (synchronously) for a bad body."""
        text = check_body(body)
        return self.store.post(room, text, self.now()).addCallback(self._published)

    def _published(self, message: Message) -> Message:
        self.hub.publish(message)
        return message

    async def tick(self) -> None:
        """Deliver scheduled messages that are due; never fails, so the LoopingCall keeps going."""
        try:
            delivered = await self.store.deliver_due(self.now())
        except Exception:
            log.failure("scheduled delivery failed")
            return
        for message in delivered:
            self.hub.publish(message)


@define(eq=False)
class Tracker(Generic[_T]):
    """A set whose emptiness can be awaited (in-flight requests, open connections)."""

    _items: set[_T] = field(factory=set)
    _waiters: list[Deferred[None]] = field(factory=list)

    def add(self, item: _T) -> None:
        self._items.add(item)

    def discard(self, item: _T) -> None:
        self._items.discard(item)
        if not self._items:
            waiters, self._waiters = self._waiters, []
            fire(waiters, None)  # a timed-out (cancelled) waiter is skipped

    def __iter__(self) -> Iterator[_T]:
        return iter(list(self._items))  # a copy: callers discard while iterating

    def idle(self) -> Deferred[None]:
        if not self._items:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        return d


class SpaceRequest(Request):
    """Counts as in flight from the end of its headers (so a slow upload is waited for)."""

    gone = False

    def gotLength(self, length: int | None) -> None:
        super().gotLength(length)
        site = getattr(self.channel, "site", None)
        if isinstance(site, SpaceSite):
            site.inflight.add(self)
            self.notifyFinish().addBoth(lambda _: site.inflight.discard(self))

    def connectionLost(self, reason: Failure) -> None:
        self.gone = True
        super().connectionLost(reason)


class SpaceSite(Site):
    noisy = False

    def __init__(self, resource: Resource, reactor: IReactorTime) -> None:
        super().__init__(
            resource,
            requestFactory=SpaceRequest,
            parsePOSTFormSubmission=False,
            timeout=IDLE_TIMEOUT,
            reactor=reactor,
        )
        self.inflight: Tracker[SpaceRequest] = Tracker()

    def log(self, request: http.Request) -> None:
        log.debug(
            "{method} {uri} {code}",
            method=request.method.decode("latin-1"),
            uri=request.uri.decode("latin-1"),
            code=request.code,
        )


ALLOWED: dict[str, tuple[bytes, ...]] = {
    "version": (b"GET",),
    "next-due": (b"GET",),
    "charter-next-due": (b"POST",),
    "messages": (b"GET", b"POST"),
    "setup": (b"POST",),
    "ws": (b"GET",),
}


def route(path: bytes) -> tuple[str, str | None] | None:
    """Map a path to (route name, raw room segment or None)."""
    parts = path.split(b"/")
    if parts[:2] != [b"", b"api"]:
        return None
    rest = parts[2:]
    if len(rest) == 1 and rest[0] in (b"version", b"next-due", b"charter-next-due", b"setup"):
        return rest[0].decode(), None
    if len(rest) == 3 and rest[0] == b"rooms" and rest[2] in (b"messages", b"ws"):
        return rest[2].decode(), rest[1].decode("latin-1")
    return None


def _json(request: Request, code: int, payload: object) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"application/json")
    # Ends with a newline, as every JSON answer of ours does (curl's prompt lands on its own line).
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _bearer(request: Request, token: bytes | None) -> bool:
    """Fail closed: no configured token means nobody is authorized."""
    header = request.getHeader(b"authorization")
    if token is None or header is None:
        return False
    scheme, _, presented = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(), token)


def _json_object(request: Request) -> dict[str, Any]:
    assert request.content is not None
    request.content.seek(0)
    raw = request.content.read(MAX_REQUEST + 1)
    if len(raw) > MAX_REQUEST:
        raise HTTPError(413, "request too large")
    try:
        obj = json.loads(raw)
    except ValueError:
        raise HTTPError(400, "invalid JSON") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "expected a JSON object")
    return obj


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    values = (request.args or {}).get(name.encode())
    if not values:
        return default
    raw = values[-1]
    if re.fullmatch(rb"[0-9]{1,16}", raw) is None or not low <= int(raw) <= high:
        raise HTTPError(400, f"{name} must be an integer from {low} to {high}")
    return int(raw)


class Api(Resource):
    """Every path under /api; a leaf, so routing is one readable function."""

    isLeaf = True

    def __init__(self, space: Space) -> None:
        super().__init__()
        self._space = space
        self._handlers: dict[tuple[str, bytes], Callable[[Request, str], Awaitable[Reply]]] = {
            ("version", b"GET"): self._version,
            ("next-due", b"GET"): self._next_due,
            ("charter-next-due", b"POST"): self._charter_next_due,
            ("messages", b"GET"): self._list_messages,
            ("messages", b"POST"): self._post_message,
            ("setup", b"POST"): self._setup,
        }

    def render(self, request: Request) -> bytes | int:
        found = route(request.path)
        if found is None:
            return _json(request, 404, {"error": "not found"})
        name, room = found
        if name == "setup" and self._space.config.setup_invite_sha256 is None:
            return _json(request, 404, {"error": "not found"})  # no setup step: as before
        if request.method not in ALLOWED[name]:
            request.setHeader(b"allow", b", ".join(ALLOWED[name]))
            return _json(request, 405, {"error": "method not allowed"})
        if room is not None and ROOM.fullmatch(room) is None:
            return _json(request, 400, {"error": "invalid room name"})
        if name == "ws":
            assert room is not None
            return self._websocket(request, room)
        handler = self._handlers[name, request.method]
        Deferred.fromCoroutine(self._respond(request, handler(request, room or "")))
        return NOT_DONE_YET

    async def _respond(self, request: Request, reply: Awaitable[Reply]) -> None:
        try:
            code, payload = await reply
        except HTTPError as e:
            code, payload = e.code, {"error": e.message}
        except Exception:
            log.failure("{method} {uri} failed", method=request.method, uri=request.uri)
            code, payload = 500, {"error": "internal error"}
        if isinstance(request, SpaceRequest) and request.gone:
            return
        if payload is None:
            request.setResponseCode(code)
        else:
            data = _json(request, code, payload)
            request.setHeader(b"content-length", b"%d" % len(data))
            request.write(data)
        request.finish()

    def _websocket(self, request: Request, room: str) -> bytes | int:
        if self._space.draining:
            return _json(request, 503, {"error": "shutting down"})
        factory = RoomSocketFactory(room, self._space.hub, self._space.post)
        result: bytes | int = WebSocketResource(factory).render(request)
        if result is NOT_DONE_YET:
            # Upgraded: no longer an HTTP request in flight, and no HTTP idle timeout.
            site = getattr(request.channel, "site", None)
            if isinstance(site, SpaceSite) and isinstance(request, SpaceRequest):
                site.inflight.discard(request)
            request.channel.setTimeout(None)
        return result

    async def _version(self, request: Request, room: str) -> Reply:
        return 200, {"version": lchat.__version__, "build": self._space.config.build}

    async def _next_due(self, request: Request, room: str) -> Reply:
        if not _bearer(request, self._space.config.admin_token):
            raise HTTPError(403, "forbidden")
        return 200, {"due": await self._space.store.next_due(self._space.now())}

    async def _charter_next_due(self, request: Request, room: str) -> Reply:
        if not _bearer(request, self._space.config.bot_token):
            raise HTTPError(403, "forbidden")
        try:
            due = check_time(_json_object(request).get("due"), "due")
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        await self._space.store.set_charter_due(due)
        return 204, None

    async def _setup(self, request: Request, room: str) -> Reply:
        """``POST /api/setup {"invite": "..."}`` (docs/hibernation.md, "the contract for a
        space"): accepted once, by the invite whose SHA-256 the env holds; 404 without one (no
        setup step), 403 for a wrong invite or a second claim, nothing written either way."""
        expected = self._space.config.setup_invite_sha256
        if expected is None:
            raise HTTPError(404, "not found")
        invite = _json_object(request).get("invite")
        if not isinstance(invite, str) or not invite:
            raise HTTPError(400, "invite must be a non-empty string")
        presented = hashlib.sha256(invite.encode("utf-8", "surrogatepass")).hexdigest()
        if not hmac.compare_digest(presented, expected):
            log.warn("setup: a wrong invite was presented for {host}", host=self._space.config.host)
            raise HTTPError(403, "wrong setup invite")
        if not await self._space.store.claim_setup(self._space.now()):
            log.warn(
                "setup: {host} is already set up; a second claim was refused",
                host=self._space.config.host,
            )
            raise HTTPError(403, "setup is already complete: the invite was used")
        log.info("setup: {host} claimed with its setup invite", host=self._space.config.host)
        return 200, {"setup_complete": True}

    async def _list_messages(self, request: Request, room: str) -> Reply:
        after = _query_int(request, "after", 0, 0, MAX_TIME)
        limit = _query_int(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        messages = await self._space.store.messages(room, after, limit)
        return 200, {"messages": [m.to_json() for m in messages]}

    async def _post_message(self, request: Request, room: str) -> Reply:
        obj = _json_object(request)
        try:
            body = check_body(obj.get("body"))
            deliver_at = obj.get("deliver_at")
            if deliver_at is not None:
                deliver_at = check_time(deliver_at, "deliver_at")
                if deliver_at <= self._space.now():
                    raise ValueError("deliver_at must be in the future")
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        if deliver_at is None:
            message = await self._space.post(room, body)
            return 201, message.to_json()
        scheduled = await self._space.store.schedule(room, body, deliver_at)
        return 201, {"id": scheduled, "room": room, "deliver_at": deliver_at, "scheduled": True}

"""Home's HTTP surface (docs/home.md): the routes of :class:`~lchat.home.api.HomeAPI` as JSON over
HTTP, the rate limits before each, and a listener that refuses an oversized body before it buffers
it. Every answer is JSON but the vault's bytes; each is counted by route and status."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

import lchat
from lchat.home import passkeys as pk
from lchat.home.api import DEVICE_ID, QUOTA_REFUSALS, ApiError, HomeAPI, credential_key
from lchat.home.limits import IPNetwork, Limits, RateLimited, client_address
from lchat.home.stateless import CeremonyRejected
from lchat.home.store import NO_VERSION, DocumentTooLarge, HomeStoreError
from lchat.webutil import answerable

_log = Logger(namespace="lchat.home")

MAX_BODY = 64 * 1024  # any JSON request body
# What the listener buffers of any request body, at most: the largest a route accepts (a JSON
# body; the vault's 18 KiB fits). Larger is refused with 413 before it is buffered.
LISTENER_MAX_BODY = MAX_BODY
_VERSION = re.compile(r'(?:W/)?"([^"\\]{1,256})"|([^\s",]{1,256})')
STEP_UP_HEADER = "step-up"
# What a route answers: the status, the body (JSON-able, the vault's bytes, or None) and headers.
Answer = tuple[int, Any, dict[str, str]]
Handler = Callable[[Request], Awaitable[Answer]]
REQUESTS = Counter(
    "lchat_home_requests_total",
    "Home API requests by route and outcome (the HTTP status, or 'error' for a bug)",
    ["route", "status"],
)


class CappedRequest(Request):
    """A request whose body is refused past :data:`LISTENER_MAX_BODY` bytes, before it is buffered.

    twisted.web reads a whole body into memory (or a temporary file) before rendering, so a
    route's own size check comes too late against a hostile client sending gigabytes. This one
    answers ``413`` as soon as the ``Content-Length`` says too much, or as soon as the chunks
    received pass the cap, keeps nothing more, and closes the connection (the rest of the body
    is never read). Install it as the site's ``requestFactory``.
    """

    max_body = LISTENER_MAX_BODY
    _refused = False
    _received = 0

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self.max_body:
            self._refuse()
        super().gotLength(0 if self._refused else length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        if self._received > self.max_body:
            self._refuse()
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self._refused:
            return  # answered already; the connection is closing
        super().requestReceived(command, path, version)

    def _refuse(self) -> None:
        if self._refused:
            return
        self._refused = True
        REQUESTS.labels("oversize", "413").inc()
        body = json.dumps({"error": f"a request body is at most {self.max_body} bytes"}).encode()
        head = (
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
            b"cache-control: no-store\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        ) % (len(body) + 1)
        transport = self.channel.transport
        if transport is None:  # the client is gone already
            return
        transport.write(head + body + b"\n")
        transport.loseConnection()


class HomeResource(Resource):
    """Routes requests to :class:`HomeAPI`; every answer is JSON but the vault's bytes."""

    isLeaf = True

    def __init__(self, api: HomeAPI, trusted_proxies: Sequence[IPNetwork] = ()) -> None:
        super().__init__()
        self._api = api
        self._trusted = tuple(trusted_proxies)

    def render(self, request: Request) -> bytes | int:
        path = (request.path or b"").decode("latin-1")
        method = (request.method or b"").decode("latin-1")
        route, handler = self._route(method, path)
        still = answerable(request)
        client = client_address(request, self._trusted)
        d = Deferred.fromCoroutine(_answer(request, route, handler, self._api.limits, client))

        def failed(f: Failure) -> None:
            _log.failure("home: {route} failed", f, route=route)
            REQUESTS.labels(route, "error").inc()
            if still():
                _write_json(request, 500, {"error": "internal error"})

        d.addErrback(failed)
        return NOT_DONE_YET

    def _route(self, method: str, path: str) -> tuple[str, Handler]:
        api = self._api
        parts = path.rstrip("/").split("/")
        table: dict[tuple[str, str], tuple[str, Any]] = {
            ("GET", "/api/version"): ("version", self._version),
            ("POST", "/api/register/begin"): ("register_begin", self._json(api.register_begin)),
            ("POST", "/api/register/finish"): (
                "register_finish",
                self._session(api.register_finish),
            ),
            ("POST", "/api/login/begin"): ("login_begin", self._json(api.login_begin)),
            ("POST", "/api/login/finish"): ("login_finish", self._session(api.login_finish)),
            ("POST", "/api/tokens"): ("tokens", self._json(api.mint_token)),
            ("POST", "/api/step-up/begin"): ("step_up_begin", self._step_up_begin),
            ("POST", "/api/step-up/finish"): ("step_up_finish", self._step_up_finish),
            ("GET", "/api/devices"): ("devices", self._devices),
            ("GET", "/api/vault"): ("vault_get", self._vault_get),
            ("PUT", "/api/vault"): ("vault_put", self._vault_put),
            ("GET", "/api/vault/versions"): ("vault_versions", self._vault_versions),
        }
        found = table.get((method, "/".join(parts)))
        if found is not None:
            return found[0], found[1]
        if len(parts) == 5 and parts[:4] == ["", "api", "vault", "versions"] and method == "GET":
            return "vault_version", lambda r: self._vault_version(r, parts[4])
        if len(parts) == 4 and parts[:3] == ["", "api", "devices"] and method == "DELETE":
            return "device_delete", lambda r: self._revoke(r, parts[3], device=True)
        if len(parts) == 4 and parts[:3] == ["", "api", "credentials"] and method == "DELETE":
            return "credential_delete", lambda r: self._revoke(r, parts[3], device=False)
        known = {p for _, p in table} | {"/api/vault/versions", "/api/devices", "/api/credentials"}
        prefix = "/".join(parts[:4])
        if "/".join(parts) in known or prefix in known:
            return "method", _refuse(405, "method not allowed")
        return "unknown", _refuse(404, "not found")

    async def _version(self, request: Request) -> Answer:
        return 200, {"version": lchat.__version__, "service": "home"}, {}

    def _json(self, fn: Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]) -> Handler:
        async def handle(request: Request) -> Answer:
            return 200, await fn(_body(request)), {}

        return handle

    def _session(
        self, fn: Callable[[str, Mapping[str, Any]], Awaitable[dict[str, Any]]]
    ) -> Handler:
        async def handle(request: Request) -> Answer:
            return 200, await fn(_session_arg(request), _body(request)), {}

        return handle

    async def _devices(self, request: Request) -> Answer:
        uid, device = await self._api.authenticate(request)
        return 200, await self._api.devices(uid, device), {}

    async def _step_up_begin(self, request: Request) -> Answer:
        uid, device = await self._api.authenticate(request)
        return 200, await self._api.step_up_begin(uid, device, _body(request)), {}

    async def _step_up_finish(self, request: Request) -> Answer:
        uid, device = await self._api.authenticate(request)
        session = _session_arg(request)
        return 200, await self._api.step_up_finish(uid, device, session, _body(request)), {}

    async def _revoke(self, request: Request, ident: str, *, device: bool) -> Answer:
        uid, own = await self._api.authenticate(request)
        presented = (request.getHeader(STEP_UP_HEADER) or "").strip()
        if device:
            if not DEVICE_ID.fullmatch(ident):
                raise ApiError(400, "not a device id")
            if ident != own:  # signing this device out needs no step-up; another one does
                await self._api.require_step_up(uid, own, f"DELETE /api/devices/{ident}", presented)
            await self._api.revoke_device(uid, ident)
        else:
            credential_key(ident)  # 400 for a malformed id before a step-up is asked for
            await self._api.require_step_up(uid, own, f"DELETE /api/credentials/{ident}", presented)
            await self._api.revoke_credential(uid, ident)
        return 204, None, {}

    async def _vault_get(self, request: Request) -> Answer:
        uid, _ = await self._api.authenticate(request)
        got = await self._api.vault_get(uid)
        if got is None:
            raise ApiError(404, "no vault yet", version=NO_VERSION)
        data, version = got
        return 200, data, {"etag": _etag(version)}

    async def _vault_put(self, request: Request) -> Answer:
        uid, _ = await self._api.authenticate(request)
        kind = (request.getHeader("content-type") or "").split(";")[0].strip().lower()
        if kind != "application/octet-stream":
            raise ApiError(415, "the vault is application/octet-stream (client ciphertext)")
        expected = _expected_version(request)
        cap = self._api.vault_max + 1
        data = request.content.read(cap) if request.content is not None else b""
        version = await self._api.vault_put(uid, data, expected)
        return 200, {"version": version}, {"etag": _etag(version)}

    async def _vault_versions(self, request: Request) -> Answer:
        uid, _ = await self._api.authenticate(request)
        return 200, await self._api.vault_versions(uid), {}

    async def _vault_version(self, request: Request, version: str) -> Answer:
        uid, _ = await self._api.authenticate(request)
        return 200, await self._api.vault_version(uid, version), {"etag": _etag(version)}


def _session_arg(request: Request) -> str:
    session = (request.args or {}).get(b"session", [b""])[0].decode("ascii", "replace")
    if not session:
        raise ApiError(400, "?session= is missing: begin the ceremony first")
    return session


def _refuse(status: int, message: str) -> Callable[[Request], Awaitable[Any]]:
    async def handle(request: Request) -> Any:
        raise ApiError(status, message)

    return handle


def _etag(version: str) -> str:
    return f'"{version}"'


def _expected_version(request: Request) -> str:
    """``If-Match: "<version>"`` replaces that version; ``If-None-Match: *`` (or ``If-Match:
    "0"``) creates only. One of them is required: a blind overwrite could lose another device's
    write."""
    if (request.getHeader("if-none-match") or "").strip() == "*":
        return NO_VERSION
    header = (request.getHeader("if-match") or "").strip()
    if not header:
        raise ApiError(
            428, 'say which version you replace: If-Match: "<version>" (If-None-Match: * if none)'
        )
    match = _VERSION.fullmatch(header)
    if match is None:
        raise ApiError(400, "If-Match must name one version")
    return match.group(1) or match.group(2)


def _body(request: Request) -> Mapping[str, Any]:
    kind = (request.getHeader("content-type") or "application/json").split(";")[0].strip()
    if kind.lower() != "application/json":
        raise ApiError(415, "the body must be application/json")
    raw = request.content.read(MAX_BODY + 1) if request.content is not None else b""
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"the body is at most {MAX_BODY} bytes")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


# What each route costs of the per-address limits beside "ip" (every request).
_ROUTE_LIMITS: dict[str, tuple[str, ...]] = {"register_begin": ("register_ip", "register")}


async def _answer(
    request: Request,
    route: str,
    handler: Handler,
    limits: Limits,
    client: str,
) -> None:
    """Run ``handler`` behind the per-address limits; a 401 it answers counts as a failure of
    ``client`` (never of an account: see lchat.home.limits)."""
    still = answerable(request)
    try:
        if route != "version":
            # An address that failed too often is refused before anything is looked at.
            limits.check([("failures_ip", client)])
            wanted = [("ip", client)]
            wanted += [
                (n, "*" if n == "register" else client) for n in _ROUTE_LIMITS.get(route, ())
            ]
            limits.take(wanted)
        status, body, headers = await handler(request)
    except RateLimited as e:
        status = 429
        body = {"error": str(e), "limit": e.limit, "retry_after": int(e.header)}
        headers = {"retry-after": e.header}
    except DocumentTooLarge as e:
        QUOTA_REFUSALS.labels("document_size").inc()
        status, body, headers = 413, {"error": f"this account is full: {e}"}, {}
    except ApiError as e:
        status, body, headers = e.status, {"error": e.message, **e.extra}, {}
        if e.status == 409 and "current" in e.extra:
            headers = {"etag": _etag(e.extra["current"])}
    except (CeremonyRejected, pk.PasskeyError) as e:
        status, body, headers = 401, {"error": str(e), "reason": e.reason}, {}
    except HomeStoreError as e:
        _log.warn("home: {route}: the store failed: {error}", route=route, error=e)
        status, body, headers = 503, {"error": "storage is unavailable; try again"}, {}
        headers["retry-after"] = "2"
    REQUESTS.labels(route, str(status)).inc()
    if status == 401:
        limits.buckets["failures_ip"].spend(client)
    if not still():
        return
    for name, value in headers.items():
        request.setHeader(name.encode(), value.encode())
    if isinstance(body, bytes):
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/octet-stream")
        request.setHeader(b"cache-control", b"no-store")
        request.write(body)
        request.finish()
    elif body is None:
        request.setResponseCode(status)
        request.finish()
    else:
        _write_json(request, status, body)


def _write_json(request: Request, status: int, body: Any) -> None:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    request.write(json.dumps(body, sort_keys=True).encode() + b"\n")
    request.finish()

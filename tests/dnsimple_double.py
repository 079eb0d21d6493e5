"""A stand-in for DNSimple's API *server*: real HTTP on a loopback port, enough of API v2 for DNS-01.

Our client (``lchat.dns.dnsimple.DNSimple``) is never mocked: tests point it at this server, which
speaks the wire format of https://developer.dnsimple.com/v2/ (shapes checked against the fixtures
of DNSimple's official clients):

- every answer is ``{"data": ...}``; lists add ``"pagination": {"current_page", "per_page",
  "total_entries", "total_pages"}`` (``page``/``per_page`` parameters, at most 100 a page);
- errors are ``{"message": "..."}`` (validation errors add ``"errors": {field: [..]}``);
- ``Authorization: Bearer <token>`` or 401 ``{"message": "Authentication failed"}``.

Endpoints::

    GET    /v2/whoami                          {"data": {"user": null, "account": {"id", "email", ..}}}
    GET    /v2/{account}/zones                 ?name_like= (substring), paginated
    GET    /v2/{account}/zones/{zone}/records  ?name= (exact, "" is the apex) &name_like= &type=
    POST   /v2/{account}/zones/{zone}/records  {"name", "type", "content", "ttl"} -> 201
    DELETE /v2/{account}/zones/{zone}/records/{id}  -> 204, 404 if unknown

Zones come with their SOA and NS system records, as on DNSimple. TXT content is stored quoted,
as DNSimple has normalised it since late 2023 (``abc`` is answered as ``"abc"``).

Test hooks: ``on_change(fqdn, value, present)`` after a TXT record is created or deleted (wire it to
pebble-challtestsrv so a CA sees the value); ``fail_next(n, status)`` and ``fail_always(status)``
for error injection (``after_apply=True``: do the work, then answer the error, a lost response);
``request_log`` of ``(method, path)``; ``txt_values(fqdn)`` and ``records(zone)`` to inspect state.

Usable from sync code and from trial tests (``start()``/``stop()``, or a ``with`` block)::

    double = DNSimpleDouble(token="t0k", zones=["example.com"]).start()
    self.addCleanup(double.stop)
    provider = DNSimple("t0k", base_url=double.url, sleep=time.sleep, now=time.time)
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
import threading
import traceback
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from attrs import define, field

OnChange = Callable[[str, str, bool], None]

MAX_PER_PAGE = 100
DEFAULT_PER_PAGE = 30

_ZONES = re.compile(r"^/v2/(?P<account>[^/]+)/zones$")
_RECORDS = re.compile(r"^/v2/(?P<account>[^/]+)/zones/(?P<zone>[^/]+)/records$")
_RECORD = re.compile(r"^/v2/(?P<account>[^/]+)/zones/(?P<zone>[^/]+)/records/(?P<id>[^/]+)$")


@define
class _Record:
    id: int
    zone: str
    name: str
    type: str
    text: str  # for TXT: the value itself, unquoted; otherwise the content as given
    ttl: int
    system: bool = False
    created: str = field(factory=lambda: _now())

    @property
    def fqdn(self) -> str:
        return f"{self.name}.{self.zone}" if self.name else self.zone

    def content(self) -> str:
        if self.type == "TXT":
            return '"' + self.text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return self.text

    def json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "zone_id": self.zone,
            "parent_id": None,
            "name": self.name,
            "content": self.content(),
            "ttl": self.ttl,
            "priority": None,
            "type": self.type,
            "regions": ["global"],
            "system_record": self.system,
            "created_at": self.created,
            "updated_at": self.created,
        }


@define
class _Failure:
    status: int
    retry_after: str | None
    after_apply: bool
    method: str | None = None  # only requests with this method; None: any


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unquote_content(content: str) -> str:
    """What DNSimple does with TXT content: a quoted string is unescaped, bare text is the value."""
    if len(content) >= 2 and content.startswith('"') and content.endswith('"'):
        return re.sub(r"\\(.)", r"\1", content[1:-1])
    return content


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    double: DNSimpleDouble


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real API (and requests' pool)
    server: _Server
    timeout = 10  # an idle keep-alive connection's thread goes away after this

    def do_GET(self) -> None:
        self.server.double._handle(self, "GET")

    def do_POST(self) -> None:
        self.server.double._handle(self, "POST")

    def do_DELETE(self) -> None:
        self.server.double._handle(self, "DELETE")

    def do_PUT(self) -> None:
        self.server.double._handle(self, "PUT")

    def do_PATCH(self) -> None:
        self.server.double._handle(self, "PATCH")

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the double's, not stderr's


class DNSimpleDouble:
    """DNSimple's API for one account holding ``zones``, reachable with ``token`` at :attr:`url`."""

    def __init__(
        self,
        *,
        token: str,
        zones: Iterable[str] = (),
        account_id: int = 1010,
        email: str = "example-account@example.com",
        on_change: OnChange | None = None,
        max_per_page: int = MAX_PER_PAGE,
    ) -> None:
        self.token = token
        self.account_id = account_id
        self.email = email
        self.on_change = on_change
        self.max_per_page = max_per_page
        self.request_log: list[tuple[str, str]] = []  # (method, path without the query)
        self.sink_errors: list[str] = []  # tracebacks of on_change calls that raised
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._zone_ids = itertools.count(1)
        self._zones: dict[str, int] = {}
        self._records: dict[int, _Record] = {}
        self._failures: list[_Failure] = []
        self._failing: _Failure | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        for zone in zones:
            self.add_zone(zone)

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL to give the client (``http://127.0.0.1:<port>``), once started."""
        if self._server is None:
            raise RuntimeError("the DNSimple double is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> DNSimpleDouble:
        if self._server is None:
            server = _Server(("127.0.0.1", 0), _Handler)
            server.double = self
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="dnsimple-double",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> DNSimpleDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state -----------------------------------------------------------------------------------

    def add_zone(self, name: str) -> None:
        """Add a zone (with its SOA and NS system records)."""
        zone = name.lower().rstrip(".")
        with self._lock:
            if zone in self._zones:
                return
            self._zones[zone] = next(self._zone_ids)
            soa = "ns1.dnsimple.com admin.dnsimple.com 1 86400 7200 604800 300"
            self._add(zone, "", "SOA", soa, 3600, system=True)
            for n in (1, 2, 3, 4):
                self._add(zone, "", "NS", f"ns{n}.dnsimple.com", 3600, system=True)

    def add_record(self, zone: str, name: str, type: str, content: str, ttl: int = 3600) -> int:
        """Seed a record (a TXT someone else put there, say); its id. No on_change call."""
        with self._lock:
            zone = zone.lower().rstrip(".")
            if zone not in self._zones:
                raise KeyError(zone)
            text = _unquote_content(content) if type.upper() == "TXT" else content
            return self._add(zone, name.lower(), type.upper(), text, ttl).id

    def records(self, zone: str) -> list[dict[str, Any]]:
        """Every record of ``zone`` as the API renders it."""
        zone = zone.lower().rstrip(".")
        with self._lock:
            return [r.json() for r in self._records.values() if r.zone == zone]

    def txt_values(self, fqdn: str) -> list[str]:
        """The TXT values (unquoted) at ``fqdn`` in any zone, oldest first."""
        fqdn = fqdn.lower().rstrip(".")
        with self._lock:
            return [r.text for r in self._records.values() if r.type == "TXT" and r.fqdn == fqdn]

    def fail_next(
        self,
        n: int = 1,
        status: int = 500,
        *,
        retry_after: str | None = None,
        after_apply: bool = False,
        method: str | None = None,
    ) -> None:
        """The next ``n`` requests (of ``method`` only, when given) answer ``status``, with
        ``Retry-After`` if given. With ``after_apply`` the request is carried out first (a mutation
        whose answer is lost). Queued failures are used in order."""
        with self._lock:
            self._failures.extend(
                _Failure(status, retry_after, after_apply, method) for _ in range(n)
            )

    def fail_always(self, status: int | None = 500) -> None:
        """Every request answers ``status`` from now on; ``None`` heals the server."""
        with self._lock:
            self._failing = None if status is None else _Failure(status, None, False)

    def calls(self, method: str | None = None) -> list[str]:
        """Paths requested (with ``method`` only, when given), in order."""
        with self._lock:
            return [p for m, p in self.request_log if method is None or m == method]

    def _take_failure(self, method: str) -> _Failure | None:
        for i, failure in enumerate(self._failures):
            if failure.method is None or failure.method == method:
                return self._failures.pop(i)
        return None

    def _add(
        self, zone: str, name: str, type: str, text: str, ttl: int, system: bool = False
    ) -> _Record:
        record = _Record(next(self._ids), zone, name, type, text, ttl, system)
        self._records[record.id] = record
        return record

    # -- HTTP ------------------------------------------------------------------------------------

    def _handle(self, handler: _Handler, method: str) -> None:
        parts = urlsplit(handler.path)
        path = unquote(parts.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        with self._lock:
            self.request_log.append((method, path))
            failure = self._failing or self._take_failure(method)
        if failure is not None and not failure.after_apply:
            self._send_failure(handler, failure)
            return
        if handler.headers.get("Authorization", "") != f"Bearer {self.token}":
            self._send(handler, 401, {"message": "Authentication failed"})
            return
        status, body, changes = self._route(method, path, query, raw)
        for fqdn, value, present in changes:
            self._notify(fqdn, value, present)
        if failure is not None:
            self._send_failure(handler, failure)
            return
        self._send(handler, status, body)

    def _notify(self, fqdn: str, value: str, present: bool) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(fqdn, value, present)
        except Exception:
            self.sink_errors.append(traceback.format_exc())

    def _route(
        self, method: str, path: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, Any, list[tuple[str, str, bool]]]:
        if path == "/v2/whoami":
            if method != "GET":
                return 405, {"message": "Method not allowed"}, []
            account = {
                "id": self.account_id,
                "email": self.email,
                "plan_identifier": "teams-v1-monthly",
                "created_at": "2015-09-18T23:04:37Z",
                "updated_at": "2016-06-09T20:03:39Z",
            }
            return 200, {"data": {"user": None, "account": account}}, []
        for pattern, handler in (
            (_ZONES, self._zones_endpoint),
            (_RECORDS, self._records_endpoint),
            (_RECORD, self._record_endpoint),
        ):
            m = pattern.match(path)
            if m is None:
                continue
            if m["account"] != str(self.account_id):
                return 404, {"message": f"Account `{m['account']}` not found"}, []
            return handler(method, m.groupdict(), query, raw)
        return 404, {"message": "Not found"}, []

    def _zones_endpoint(
        self, method: str, args: dict[str, str], query: dict[str, str], raw: bytes
    ) -> tuple[int, Any, list[tuple[str, str, bool]]]:
        if method != "GET":
            return 405, {"message": "Method not allowed"}, []
        like = query.get("name_like", "").lower()
        with self._lock:
            zones = [
                {
                    "id": zid,
                    "account_id": self.account_id,
                    "name": name,
                    "reverse": False,
                    "secondary": False,
                    "last_transferred_at": None,
                    "active": True,
                    "created_at": "2015-04-23T07:40:03Z",
                    "updated_at": "2015-04-23T07:40:03Z",
                }
                for name, zid in sorted(self._zones.items())
                if like in name
            ]
        return self._page(zones, query)

    def _records_endpoint(
        self, method: str, args: dict[str, str], query: dict[str, str], raw: bytes
    ) -> tuple[int, Any, list[tuple[str, str, bool]]]:
        zone = args["zone"].lower()
        with self._lock:
            if zone not in self._zones:
                return 404, {"message": f"Zone `{args['zone']}` not found"}, []
            if method == "GET":
                records = [
                    r.json()
                    for r in self._records.values()
                    if r.zone == zone
                    and ("name" not in query or r.name == query["name"].lower())
                    and query.get("name_like", "").lower() in r.name
                    and ("type" not in query or r.type == query["type"].upper())
                ]
                return self._page(records, query)
            if method != "POST":
                return 405, {"message": "Method not allowed"}, []
            try:
                attrs = json.loads(raw or b"{}")
            except ValueError:
                return 400, {"message": "Invalid JSON"}, []
            errors: dict[str, list[str]] = {}
            if not isinstance(attrs, dict):
                return 400, {"message": "Invalid JSON"}, []
            for key in ("name", "type", "content"):
                if not isinstance(attrs.get(key), str):
                    errors[key] = ["can't be blank"]
            ttl = attrs.get("ttl", 3600)
            if not isinstance(ttl, int) or ttl < 1:
                errors["ttl"] = ["is not a number"]
            if not errors and attrs["type"].upper() != "TXT":
                errors["type"] = ["only TXT records are supported by this double"]
            if errors:
                return 400, {"message": "Validation failed", "errors": errors}, []
            record = self._add(
                zone, attrs["name"].lower(), "TXT", _unquote_content(attrs["content"]), ttl
            )
            return 201, {"data": record.json()}, [(record.fqdn, record.text, True)]

    def _record_endpoint(
        self, method: str, args: dict[str, str], query: dict[str, str], raw: bytes
    ) -> tuple[int, Any, list[tuple[str, str, bool]]]:
        zone = args["zone"].lower()
        with self._lock:
            if zone not in self._zones:
                return 404, {"message": f"Zone `{args['zone']}` not found"}, []
            try:
                record = self._records.get(int(args["id"]))
            except ValueError:
                record = None
            if record is None or record.zone != zone:
                return 404, {"message": f"Record `{args['id']}` not found"}, []
            if method == "GET":
                return 200, {"data": record.json()}, []
            if method != "DELETE":
                return 405, {"message": "Method not allowed"}, []
            if record.system:
                return 400, {"message": "System records cannot be deleted"}, []
            del self._records[record.id]
            changes = [(record.fqdn, record.text, False)] if record.type == "TXT" else []
            return 204, None, changes

    def _page(
        self, items: list[dict[str, Any]], query: dict[str, str]
    ) -> tuple[int, Any, list[Any]]:
        try:
            page = max(1, int(query.get("page", "1")))
            per_page = min(self.max_per_page, max(1, int(query.get("per_page", DEFAULT_PER_PAGE))))
        except ValueError:
            return 400, {"message": "Invalid pagination parameters"}, []
        total_pages = max(1, -(-len(items) // per_page))
        body = {
            "data": items[(page - 1) * per_page : page * per_page],
            "pagination": {
                "current_page": page,
                "per_page": per_page,
                "total_entries": len(items),
                "total_pages": total_pages,
            },
        }
        return 200, body, []

    def _send_failure(self, handler: _Handler, failure: _Failure) -> None:
        headers = {"Retry-After": failure.retry_after} if failure.retry_after else {}
        message = "Too Many Requests" if failure.status == 429 else "Internal Server Error"
        self._send(handler, failure.status, {"message": message}, headers)

    def _send(
        self, handler: _Handler, status: int, body: Any, headers: dict[str, str] | None = None
    ) -> None:
        data = b"" if body is None or status == 204 else json.dumps(body).encode()
        handler.send_response(status)
        if data:
            handler.send_header("Content-Type", "application/json; charset=utf-8")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("X-RateLimit-Limit", "2400")
        handler.send_header("X-RateLimit-Remaining", "2399")
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        if data:
            handler.wfile.write(data)

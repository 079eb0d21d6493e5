"""The local admin API on ``<run>/router.sock`` (mode 0600): how the CLI talks to the running router.

``GET /status`` (JSON), ``POST /reload`` (re-read the registry now, answer when done: with worker
processes, once every worker has its table too, and the answer says how many do), ``GET /metrics``
(Prometheus text format: with worker processes, the box's, merged from every worker's), ``POST /restart?host=H`` (run an always-on space anew: ``lchat deploy``). Only root or the router's own user can open the socket; there is no other
authentication, so nothing here may ever be exposed on TCP.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.parse
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from attrs import asdict, frozen
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

import lchat
from lchat import hosts
from lchat.registry import RouteTable
from lchat.routesource import RouteSource
from lchat.supervise import ChildStatus
from lchat.webutil import QuietSite, answerable

ChildrenStatus = Callable[[], Mapping[str, ChildStatus]]  # builtin units' supervisor.status
# POST /reload: re-read the registry (the reason given) -> the answer's JSON body
Reload = Callable[[str], Deferred[dict[str, Any]]]
# GET /metrics: the Prometheus text (now, or once the worker processes' were gathered)
Metrics = Callable[[], "Deferred[bytes] | bytes"]
# host (normalised) -> (HTTP status, JSON body), never waking the space (docs/hibernation.md)
StatsProvider = Callable[[str], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]


class AlreadyRunning(Exception):
    pass


@frozen
class Capacity:
    """The box's limits (0 = none) and how to count its always-on space processes, for ``GET
    /status``'s ``capacity`` (docs/hibernation.md "Capacity")."""

    max_instances: (
        int  # LCHAT_MAX_INSTANCES: always-on space processes (add-instance refuses beyond)
    )
    max_registered: int  # LCHAT_MAX_REGISTERED: instance rows (add-instance refuses beyond)
    always_on: Callable[[], int]  # always-on space processes running now
    # On a mesh box: instance rows per box URL they count for (LCHAT_MAX_REGISTERED is per owner).
    owned: Callable[[], dict[str, int]] | None = None


def clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a router that died; refuse if a live router answers on it."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    except OSError as e:
        raise AlreadyRunning(f"admin socket {path} exists and cannot be probed: {e}") from e
    finally:
        probe.close()
    raise AlreadyRunning(f"another router is already running (its admin socket {path} answers)")


class _Json(Resource):
    isLeaf = True

    def __init__(self, admin: AdminAPI) -> None:
        super().__init__()
        self._admin = admin

    def render(self, request: Request) -> bytes | int:
        path = request.path
        if path == b"/status" and request.method in (b"GET", b"HEAD"):
            return _json(request, 200, self._admin.status())
        if path == b"/reload" and request.method == b"POST":
            still = answerable(request)
            d = self._admin.reload("admin API")
            d.addCallback(lambda body: _finish(request, still, 200, body))
            d.addErrback(lambda f: _finish(request, still, 500, {"error": f.getErrorMessage()}))
            return NOT_DONE_YET
        if path == b"/metrics" and request.method in (b"GET", b"HEAD"):
            return _render_metrics(self._admin.metrics, request)
        if path in (b"/wake", b"/sleep") and request.method == b"POST":
            return _wake_or_sleep(self._admin, request, path.decode()[1:])
        if path == b"/release" and request.method == b"POST":
            return _release(self._admin, request)
        if path == b"/restart" and request.method == b"POST":
            return _restart(self._admin, request)
        if path.startswith(b"/stats/"):
            return _stats(self._admin, request)
        if path == b"/probe" and request.method == b"POST":
            return _probe(self._admin, request)
        if path in _PATHS:
            return _json(request, 405, {"error": "method not allowed"})
        return _json(request, 404, {"error": "not found"})


_PATHS = frozenset(
    b"/status /reload /metrics /wake /sleep /release /restart /probe".split()
)  # (405)


class AdminAPI:
    def __init__(
        self,
        reactor: IReactorTime,  # its clock: uptime, and how long a wake or sleep took
        routes: RouteSource,
        units: str,
        children: ChildrenStatus | None = None,  # builtin units' children
        activator: Any = None,  # lchat.activator.Activator, when hibernation is on
        mesh: Callable[[], dict[str, Any]] | None = None,  # the mesh's view, when it is on
        acme: Callable[[], dict[str, Any]] | None = None,  # the issuer's view, when ACME is on
        backup: Callable[[], dict[str, Any]] | None = None,  # the fleet backup's, when it is on
        capacity: Capacity | None = None,  # the limits, for "capacity"
        stats: StatsProvider | None = None,  # GET /stats/<host> (lchat.spacestats.SpaceStats)
        restart: Callable[[str], Deferred[int | None]] | None = None,  # builtin units' restart
        probe: StatsProvider | None = None,  # POST /probe?host= (lchat.readiness.Readiness)
        reload: Reload | None = None,  # POST /reload (default: routes.reload, {"routes": n})
        metrics: Metrics = generate_latest,  # GET /metrics (with workers: the merged scrape)
        workers: Callable[[], dict[str, Any]] | None = None,  # status()["workers"], with workers
    ) -> None:
        self.routes = routes
        self.reload = reload or self._reload_routes
        self.metrics = metrics
        self._workers = workers
        self._units = units
        self._children = children or (lambda: {})
        self.activator = activator
        self._mesh = mesh
        self._acme = acme
        self._backup = backup
        self._capacity = capacity
        self.stats = stats
        self.restart = restart
        self.probe = probe
        self.clock = reactor.seconds
        self._started = self.clock()

    def site(self) -> Site:
        return QuietSite(_Json(self))

    def _reload_routes(self, reason: str) -> Deferred[dict[str, Any]]:
        """One process's reload: its own table, and how many routes it holds."""
        return self.routes.reload(reason).addCallback(lambda table: {"routes": len(table)})

    def status(self) -> dict[str, Any]:
        table: RouteTable = self.routes.table
        children = {
            host: asdict(child, filter=lambda field, _: field.name != "since")
            for host, child in self._children().items()
        }
        awake = self.activator.status() if self.activator is not None else {}
        holds = self.activator.held_asleep() if self.activator is not None else {}
        per_host = {}
        for route in table:
            entry: dict[str, Any] = {
                "kind": route.kind,
                "status": route.status,
                "hibernate": route.hibernate,
                "replication": route.replication,
            }
            if route.last_error:
                entry["last_error"] = route.last_error
            if route.host in children:
                entry["process"] = children[route.host]
            if route.hibernate:
                entry["next_due"] = route.next_due
                entry["state"] = awake.get(route.host, {}).get("state", "asleep")
            if route.elsewhere:  # a peer's always-on space: requests are forwarded there
                entry["state"] = "elsewhere"
                entry["lives_at"] = route.lives_at
            if route.host in awake:  # also while it stops after its flag was cleared
                entry["activator"] = awake[route.host]
            if route.host in holds:
                entry["held_for"] = holds[route.host]
            per_host[route.host] = entry
        return {
            "version": lchat.__version__,
            "uptime": round(self.clock() - self._started, 3),
            "units": self._units,
            "routes": len(table),
            "by_status": table.count_by_status(),
            "hosts": per_host,
            "hibernation": self.activator is not None,
            **({"mesh": self._mesh()} if self._mesh is not None else {}),
            **({"acme": self._acme()} if self._acme is not None else {}),
            **({"backup": self._backup()} if self._backup is not None else {}),
            **({"capacity": self._capacity_now(table)} if self._capacity is not None else {}),
            # (LCHAT_WORKERS >= 2: the worker processes, from the pool's last watchdog round)
            **({"workers": self._workers()} if self._workers is not None else {}),
        }

    def _capacity_now(self, table: RouteTable) -> dict[str, Any]:
        """The limits and what counts against them: ``resident`` = ``always_on`` (against
        ``max_instances``) + ``hibernating`` (the slots hibernating spaces hold: waking, awake or
        stopping); ``registered``: instance rows in this box's registry (on a mesh, replicated
        ones too); with hibernation, the activator's figures (``max_awake``, and the memory ones:
        lchat.hibernation.capacity.Capacity.status); on a mesh box, ``registered_owned``: the
        rows per owner (the ceiling's count)."""
        assert self._capacity is not None
        always_on = self._capacity.always_on()
        hibernating = self.activator.slots_held() if self.activator is not None else 0
        return {
            "max_instances": self._capacity.max_instances,
            "resident": always_on + hibernating,
            "always_on": always_on,
            "hibernating": hibernating,
            "max_registered": self._capacity.max_registered,
            "registered": sum(1 for r in table if r.kind == "instance"),
            **(self.activator.capacity() if self.activator is not None else {}),
            **({"registered_owned": self._capacity.owned()} if self._capacity.owned else {}),
        }


class _Metrics(Resource):
    isLeaf = True

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._metrics = metrics

    def render_GET(self, request: Request) -> bytes | int:
        if request.path != b"/metrics":
            request.setResponseCode(404)
            return b"not found\n"
        return _render_metrics(self._metrics, request)


def metrics_site(metrics: Metrics = generate_latest) -> Site:
    """``GET /metrics`` alone, for LCHAT_METRICS_ADDR: safe to expose to a scraper on TCP.
    ``metrics``: the text to serve (with worker processes, the box's merged scrape)."""
    return QuietSite(_Metrics(metrics))


def _render_metrics(metrics: Metrics, request: Request) -> bytes | int:
    """The Prometheus text ``metrics`` gives, at once or when its Deferred fires (a failure is a
    500 naming it: a scraper records the gap rather than a partial box)."""
    request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
    text = metrics()
    if isinstance(text, bytes):
        return text
    still = answerable(request)

    def done(body: bytes) -> None:
        if still():
            request.write(body)
            request.finish()

    def failed(f: Any) -> None:
        if still():
            request.setResponseCode(500)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            request.write(f"metrics failed: {f.getErrorMessage()}\n".encode())
            request.finish()

    text.addCallbacks(done, failed)
    return NOT_DONE_YET


def _hibernating_host(admin: AdminAPI, request: Request) -> tuple[str, Any] | bytes:
    """The ``host`` argument as a hibernating instance's route, or the error answer."""
    if admin.activator is None:
        return _json(request, 409, {"error": "hibernation is off (LCHAT_HIBERNATE_BUCKET)"})
    host = _host_arg(request)
    if isinstance(host, bytes):
        return host
    route = admin.routes.table.get(host)
    if route is None or not route.hibernate or route.kind != "instance":
        return _json(request, 404, {"error": f"{host} is not a hibernating instance"})
    return host, route


def _host_arg(request: Request) -> str | bytes:
    """The ``host`` argument, normalised, or the 400 answer."""
    raw = (request.args or {}).get(b"host", [b""])[0]
    try:
        return hosts.normalise(raw.decode("utf-8", "strict"))
    except (UnicodeDecodeError, hosts.InvalidHost) as e:
        return _json(request, 400, {"error": f"bad host: {e}"})


def _release(admin: AdminAPI, request: Request) -> bytes:
    """``POST /release?host=H``: end a hold ``POST /sleep?host=H&hold=S`` put on the space."""
    found = _hibernating_host(admin, request)
    if isinstance(found, bytes):
        return found
    host, _ = found
    released = admin.activator.release_hold(host)
    return _json(request, 200, {"host": host, "released": released})


def _restart(admin: AdminAPI, request: Request) -> bytes | int:
    """``POST /restart?host=H``: stop an always-on space this router runs (builtin units) and
    start it again from the same command (``lchat deploy`` repointed ``live/<host>``); answers
    once the new run has started, with its pid, before it is ready (the caller health-checks)."""
    if admin.restart is None:
        return _json(request, 409, {"error": "this router does not run always-on spaces itself"})
    host = _host_arg(request)
    if isinstance(host, bytes):
        return host
    try:
        d = admin.restart(host)
    except KeyError:
        return _json(request, 404, {"error": f"{host} is not an always-on space run here"})
    still = answerable(request)
    d.addCallback(lambda pid: _finish(request, still, 200, {"host": host, "pid": pid}))
    d.addErrback(lambda f: _finish(request, still, 500, {"host": host, "error": str(f.value)}))
    return NOT_DONE_YET


def _wake_or_sleep(admin: AdminAPI, request: Request, what: str) -> bytes | int:
    """``POST /wake?host=H`` (the warm request of ``lchat hibernate --on``) and ``POST
    /sleep?host=H[&hold=S]``: answer once the space is awake / asleep. ``hold``: no wake of it on
    this box for ``S`` seconds (at most 3600) or until ``POST /release?host=H`` (``lchat
    relocate`` keeps it asleep while it copies the replica); the hold begins before the sleep, so
    requests queued meanwhile cannot wake it again."""
    found = _hibernating_host(admin, request)
    if isinstance(found, bytes):
        return found
    host, route = found
    activator = admin.activator
    if what == "sleep" and b"hold" in (request.args or {}):
        raw_hold = request.args[b"hold"][0]
        try:
            hold = float(raw_hold.decode("ascii"))
            if not 0 < hold <= 3600:
                raise ValueError(hold)
        except (UnicodeDecodeError, ValueError):
            return _json(request, 400, {"error": "hold must be seconds, more than 0, at most 3600"})
        activator.hold(host, hold, "admin")
    started = admin.clock()
    still = answerable(request)
    d = activator.wake(route, "admin") if what == "wake" else activator.sleep(host, "admin")

    def done(_: object) -> None:
        _finish(
            request,
            still,
            200,
            {
                "host": host,
                "state": activator.state(host),
                "seconds": round(admin.clock() - started, 3),
            },
        )

    def failed(f: Any) -> None:
        body: dict[str, Any] = {"host": host, "error": getattr(f.value, "message", str(f.value))}
        # WakeFailed's stable word and its Retry-After: `hibernate --off` waits out a lease a
        # peer is still releasing (reason lease_held) rather than failing at once.
        reason = getattr(f.value, "reason", None)
        if isinstance(reason, str):
            body["reason"] = reason
            body["retry_after"] = round(float(getattr(f.value, "retry_after", 0.0)), 3)
        _finish(request, still, 503, body)

    d.addCallbacks(done, failed)
    return NOT_DONE_YET


def _stats(admin: AdminAPI, request: Request) -> bytes | int:
    """``GET /stats/<host>``: a space's setup_complete, members and has_content, read read-only
    off its local database without waking it (lchat.spacestats)."""
    if request.method not in (b"GET", b"HEAD"):
        return _json(request, 405, {"error": "method not allowed"})
    if admin.stats is None:
        return _json(request, 404, {"error": "stats are not served by this router"})
    raw = request.path[len(b"/stats/") :]
    try:
        host = hosts.normalise(urllib.parse.unquote_to_bytes(raw).decode("utf-8", "strict"))
    except (UnicodeDecodeError, hosts.InvalidHost) as e:
        return _json(request, 400, {"error": f"bad host: {e}", "reason": "bad_host"})
    still = answerable(request)
    d = Deferred.fromCoroutine(admin.stats(host))
    d.addCallback(lambda answer: _finish(request, still, *answer))
    d.addErrback(lambda f: _finish(request, still, 500, {"host": host, "error": str(f.value)}))
    return NOT_DONE_YET


def _probe(admin: AdminAPI, request: Request) -> bytes | int:
    """``POST /probe?host=H``: wake the space on the box that would run it, read its version,
    sleep it (lchat.readiness); answers once done, whatever the outcome."""
    if admin.probe is None:
        return _json(request, 409, {"error": "hibernation is off (LCHAT_HIBERNATE_BUCKET)"})
    host = _host_arg(request)
    if isinstance(host, bytes):
        return host
    still = answerable(request)
    d = Deferred.fromCoroutine(admin.probe(host))
    d.addCallback(lambda answer: _finish(request, still, *answer))
    d.addErrback(lambda f: _finish(request, still, 500, {"host": host, "error": str(f.value)}))
    return NOT_DONE_YET


def _json(request: Request, code: int, body: object) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(body, sort_keys=True).encode() + b"\n"


def _finish(request: Request, still: Callable[[], bool], code: int, body: object) -> None:
    if not still():  # the client went away: finish() would raise
        return
    request.write(_json(request, code, body))
    request.finish()

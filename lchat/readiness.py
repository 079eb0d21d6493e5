"""The readiness probe: can a hibernating space boot? Wake it, read its version, sleep it.

``lchat probe <host>`` and ``lchat add-instance --hibernate --probe`` ask the router
(``POST /probe?host=H`` on the admin socket, :meth:`Readiness.answer`), which probes on the box
that would run the space (docs/operations.md, "Creating spaces"):

1. On a mesh box, for a space under ``LCHAT_MESH_DOMAINS`` that is asleep here, the box that
   holds it awake, else its owner by the hash (``MeshRouter.answering_box``, as wake-free stats
   ask it, lchat.spacestats): when that is a peer, the peer's own probe
   (``POST /api/mesh/wake/<host>``, :meth:`Readiness.answer_here`), passed on with ``box``; no
   answer is 503 ``owner_unreachable``, a peer without the endpoint 503 ``peer_too_old``.
2. Here: the activator's wake (the admin ``POST /wake`` path: the lease, the build floor,
   capacity, the spawn, the health check), then ``GET /api/version`` on the space's socket, then
   the activator's sleep (the admin ``POST /sleep`` path: its checkpoint lands the first replica
   in the bucket). A space that was already awake is read and left awake (members use it).

Answers: 200 ``{"host", "box", "seconds", "version", "build", "state"}`` (``seconds``: from the
wake's start to the version's answer); a failed wake is 503 with the activator's ``reason``
(``not_ready``, ``spawn``, ``build_behind``, ``capacity``, ``lease_held`` ...) and its message;
a space that woke but whose sleep failed is 500 ``sleep_failed`` (it stays awake; the idle sweep
sleeps it later). The registry row is never touched: a failed probe leaves the space registered.
Every outcome counts in ``lchat_probes_total{outcome}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from attrs import frozen
from prometheus_client import Counter
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.hibernation.space import WakeFailed
from lchat.mesh.witness import PeerCallError
from lchat.registry import Route
from lchat.routesource import RouteSource

PEER_TIMEOUT = 120.0  # seconds a peer has for its whole probe (a cold wake restores a replica)
VERSION_TIMEOUT = 5.0  # seconds the awake space has to answer GET /api/version

_probes = Counter(
    "lchat_probes_total",
    "Readiness probes (wake, version, sleep) by outcome: ok, a wake's failure reason, "
    "sleep_failed, no_version, owner_unreachable, peer_too_old, unknown_host, not_hibernating",
    ["outcome"],
)
_log = Logger(namespace="lchat.probe")

# POST /api/mesh/wake/<host> on a peer: (status, body) whatever the status; raises PeerCallError
# when no answer came (lchat.mesh.client.ask_wake).
AskPeer = Callable[[str, str], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]
# GET /api/version on an awake space's socket: (status, body bytes); raises on no answer.
ReadVersion = Callable[[str, str], Coroutine[Any, Any, tuple[int, bytes]]]


class ProbeActivator(Protocol):
    """What the probe needs of lchat.hibernation.activator.Activator."""

    def wake(self, route: Route, reason: str) -> Deferred[None]: ...

    def sleep(self, host: str, reason: str) -> Deferred[None]: ...

    def state(self, host: str) -> str: ...

    def socket_of(self, host: str) -> str | None: ...


@frozen
class MeshProbe:
    """What :class:`Readiness` needs on a mesh box (built in lchat.tap)."""

    self_url: str  # this box's LCHAT_MESH_SELF, normalised
    in_scope: Callable[[str], bool]  # under LCHAT_MESH_DOMAINS (MeshRouter.in_scope)
    answering_box: Callable[[Route], Coroutine[Any, Any, str]]  # MeshRouter.answering_box
    ask: AskPeer


class Readiness:
    """``POST /probe`` of the admin API (:meth:`answer`) and ``POST /api/mesh/wake/<host>`` of
    the mesh API (:meth:`answer_here`); the module docstring. Never changes a registry row."""

    def __init__(
        self,
        routes: RouteSource,
        activator: ProbeActivator,  # lchat.hibernation.activator.Activator
        read_version: ReadVersion,
        clock: IReactorTime,
        self_url: str = "",  # this box, named in every answer ("" off a mesh: "this box")
        mesh: MeshProbe | None = None,
    ) -> None:
        self.routes = routes
        self.activator = activator
        self.read_version = read_version
        self.clock = clock
        self.self_url = self_url
        self.mesh = mesh

    async def answer(self, host: str) -> tuple[int, dict[str, Any]]:
        """Probe ``host`` on the box that would run it: the HTTP status and JSON body."""
        return await self._answer(host, forward=True)

    async def answer_here(self, host: str) -> tuple[int, dict[str, Any]]:
        """Probe ``host`` on this box, never another (what a peer asks of it)."""
        return await self._answer(host, forward=False)

    async def _answer(self, host: str, *, forward: bool) -> tuple[int, dict[str, Any]]:
        route = self.routes.table.get(host)
        if route is None:
            return self._refuse(404, host, "unknown_host", f"{host} is not registered here")
        if route.kind != "instance" or not route.hibernate or route.elsewhere:
            return self._refuse(
                409,
                host,
                "not_hibernating",
                f"{host} is not a hibernating instance of this box: only those are probed "
                "(an always-on space is health-checked by its start)",
            )
        mesh = self.mesh
        if (
            forward
            and mesh is not None
            and mesh.in_scope(host)
            and self.activator.state(host) == "asleep"
        ):
            box = await mesh.answering_box(route)
            if box != mesh.self_url:
                return await self._ask(mesh, box, host)
        return await self._here(route)

    async def _here(self, route: Route) -> tuple[int, dict[str, Any]]:
        host, box = route.host, self.self_url or "this box"
        was_awake = self.activator.state(host) == "awake"
        started = self.clock.seconds()
        try:
            await self.activator.wake(route, "probe")
        except WakeFailed as e:
            _probes.labels(e.reason).inc()
            _log.warn(
                "probe: {host} did not wake on {box} ({reason}: {why}); its row stays",
                host=host,
                box=box,
                reason=e.reason,
                why=e.message,
            )
            return 503, {"host": host, "box": box, "reason": e.reason, "error": e.message}
        socket = self.activator.socket_of(host)
        try:
            if socket is None:
                raise ValueError("it went back to sleep at once")
            code, raw = await self.read_version(socket, host)
            if code != 200:
                raise ValueError(f"GET /api/version answered {code}")
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("GET /api/version did not answer a JSON object")
        except Exception as e:
            _probes.labels("no_version").inc()
            _log.warn("probe: {host} woke on {box} but {why}", host=host, box=box, why=e)
            if not was_awake:
                await self._sleep(host)
            return 503, {
                "host": host,
                "box": box,
                "reason": "no_version",
                "error": f"{host} woke but its version could not be read: {e}",
            }
        seconds = round(self.clock.seconds() - started, 3)
        answer = {
            "host": host,
            "box": box,
            "seconds": seconds,
            "version": str(body.get("version", "")),
            "build": str(body.get("build", "")),
        }
        if not was_awake:
            why = await self._sleep(host)
            if why is not None:
                _probes.labels("sleep_failed").inc()
                return 500, {
                    **answer,
                    "reason": "sleep_failed",
                    "state": self.activator.state(host),
                    "error": f"{host} woke and answered, but its sleep failed ({why}): it "
                    "stays awake until the idle sweep sleeps it",
                }
        _probes.labels("ok").inc()
        _log.info(
            "probe: {host} ready in {seconds}s on {box}, build {build}{left}",
            host=host,
            seconds=seconds,
            box=box,
            build=answer["build"],
            left=" (it was awake: left awake)" if was_awake else "",
        )
        return 200, {**answer, "state": self.activator.state(host), "was_awake": was_awake}

    async def _sleep(self, host: str) -> str | None:
        """Sleep ``host`` (the admin sleep path); why it failed, or None."""
        try:
            await self.activator.sleep(host, "probe")
        except Exception as e:
            return str(e) or type(e).__name__
        return None

    async def _ask(self, mesh: MeshProbe, box: str, host: str) -> tuple[int, dict[str, Any]]:
        """The probe of ``box``, which holds or owns ``host``: passed on with ``box``."""
        asking = Deferred.fromCoroutine(mesh.ask(box, host))
        asking.addTimeout(PEER_TIMEOUT, self.clock)
        try:
            code, body = await asking
        except (PeerCallError, TimeoutError, CancelledError) as e:
            why = str(e) or f"no answer within {PEER_TIMEOUT:g}s"
            return self._refuse(
                503,
                host,
                "owner_unreachable",
                f"{host} is held or owned by {box}, which must run the probe, but it did not "
                f"answer: {why}",
                box,
            )
        if code == 404 and "reason" not in body:
            return self._refuse(
                503,
                host,
                "peer_too_old",
                f"{box}, which owns {host}, has no probe endpoint (POST /api/mesh/wake): it runs "
                f"an older lchat; upgrade it, or run `lchat probe {host}` on that box",
                box,
            )
        outcome = "ok" if code == 200 else str(body.get("reason") or "error")
        _log.info(
            "probe: {host} probed on its owner {box}: {outcome}",
            host=host,
            box=box,
            outcome=outcome,
        )
        return code, {**body, "box": box}

    def _refuse(
        self, code: int, host: str, reason: str, error: str, box: str = ""
    ) -> tuple[int, dict[str, Any]]:
        _probes.labels(reason).inc()
        _log.warn("probe: {host}: {reason}: {error}", host=host, reason=reason, error=error)
        return code, {
            "host": host,
            "box": box or self.self_url or "this box",
            "reason": reason,
            "error": error,
        }

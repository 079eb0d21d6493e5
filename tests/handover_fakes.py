"""In-memory seams for the hand-over commands (lchat.handover.seams), on one fake clock.

- :class:`InMemoryAdmin`: the admin API's real resource (lchat.admin) answering in memory, over
  a real RouteSource of a real Registry; only the activator behind it is scripted
  (:class:`ScriptedActivator`). A call that is not answered within its timeout is the
  ``ProtocolError`` the real client raises; a router that is down is ``Unreachable``.
- :class:`RecordingUnits` and :class:`RecordingPeers`: record every call.
- the bucket is a real FileStore in a temp directory (:func:`file_bucket`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from attrs import define, field
from twisted.internet import task
from twisted.internet.defer import Deferred, fail, succeed
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from lchat import admin_client, systemd_units, threads
from lchat.admin import AdminAPI, _Json
from lchat.admin_client import Response
from lchat.handover.seams import Clock, StoreBucket
from lchat.hibernation.space import WakeFailed
from lchat.objstore.file import FileStore
from lchat.registry import Registry, Route, RouteSource
from lchat.systemd_units import UnitError


def clock_of(reactor: task.Clock) -> Clock:
    """The command's blocking clock as the fake reactor's: a sleep advances it."""
    return Clock(monotonic=reactor.seconds, sleep=reactor.advance)


def run_inline(reactor: task.Clock) -> Callable[..., Any]:
    """A runner (as ``lchat.cli.runner.run``) for coroutines that finish without waiting."""

    def run(main: Callable[[Any], Coroutine[Any, Any, Any]], budget: float) -> Any:
        out: list[Any] = []
        Deferred.fromCoroutine(main(reactor)).addBoth(out.append)
        assert out, "the coroutine waited on something: not an inline bucket"
        if isinstance(out[0], Exception) or hasattr(out[0], "raiseException"):
            out[0].raiseException()
        return out[0]

    return run


def file_bucket(reactor: task.Clock, root: str) -> StoreBucket:
    """The hibernation bucket as a real FileStore (must exist, as the router opens it)."""

    async def open_store(_: Any) -> FileStore:
        return FileStore(reactor, root, threads.inline)

    return StoreBucket(open_store, run_inline(reactor))


@define
class ScriptedActivator:
    """What lchat.admin asks of the activator; each wake's outcome is scripted in ``wakes``:
    seconds until awake (float), a WakeFailed, or None (never answers). Default: 0.5 s."""

    reactor: task.Clock
    wakes: list[float | WakeFailed | None] = field(factory=list)
    states: dict[str, str] = field(factory=dict)
    calls: list[tuple[str, str]] = field(factory=list)
    after_sleep: Callable[[str], None] = lambda host: None  # once an awake space has slept
    sleep_hangs: bool = False

    def status(self) -> dict[str, dict[str, Any]]:
        return {h: {"state": s} for h, s in self.states.items() if s != "asleep"}

    def held_asleep(self) -> dict[str, float]:
        return {}

    def slots_held(self) -> int:
        return len(self.status())

    def state(self, host: str) -> str:
        return self.states.get(host, "asleep")

    def wake(self, route: Route, why: str) -> Deferred[None]:
        self.calls.append(("wake", route.host))
        outcome = self.wakes.pop(0) if self.wakes else 0.5
        if isinstance(outcome, WakeFailed):
            return fail(outcome)
        if outcome is None:
            return Deferred()
        self.states[route.host] = "waking"

        def awake() -> None:
            self.states[route.host] = "awake"

        return task.deferLater(self.reactor, outcome, awake)

    def sleep(self, host: str, why: str) -> Deferred[None]:
        self.calls.append(("sleep", host))
        if self.sleep_hangs:
            return Deferred()
        if self.states.pop(host, "asleep") != "asleep":
            self.after_sleep(host)
        return succeed(None)


class InMemoryAdmin:
    """:class:`lchat.handover.seams.RouterAdmin` answered by lchat.admin's real resource."""

    def __init__(
        self,
        reactor: task.Clock,
        registry: Registry,
        activator: ScriptedActivator | None,
        *,
        units: str = "builtin",
        children: Any = None,  # the supervisor's view of its children (lchat.admin)
        restart: Callable[[str], Deferred[int | None]] | None = None,
        mesh: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.reactor = reactor
        self.routes = RouteSource(reactor, registry, run_in_thread=threads.inline)
        self.api = AdminAPI(
            reactor, self.routes, units, children, activator=activator, mesh=mesh, restart=restart
        )
        self.down: BaseException | None = None  # FileNotFoundError: no router runs
        self.calls: list[str] = []

    def call(self, method: str, path: str, timeout: float, **args: str) -> Response:
        self.calls.append(f"{method} {path}")
        if self.down is not None:
            raise admin_client.Unreachable(f"router.sock: {self.down}") from self.down
        request: Any = DummyRequest([path[1:].encode()])
        request.method, request.path = method.encode(), path.encode()
        request.args = {k.encode(): [v.encode()] for k, v in args.items()}
        body = _Json(self.api).render(request)
        if body is NOT_DONE_YET:
            deadline = self.reactor.seconds() + timeout
            while not request.finished and self.reactor.seconds() < deadline:
                due = [c.getTime() for c in self.reactor.getDelayedCalls()]
                self.reactor.advance(max(0.0, min([deadline, *due]) - self.reactor.seconds()))
            if not request.finished:
                raise admin_client.ProtocolError("router.sock: timed out")
            body = b"".join(request.written)
        assert isinstance(body, bytes)
        return Response(request.responseCode or 200, body)

    def status(self, timeout: float) -> Response:
        return self.call("GET", "/status", timeout)

    def reload(self) -> Response:
        return self.call("POST", "/reload", 5.0)

    def wake(self, host: str, timeout: float) -> Response:
        return self.call("POST", "/wake", timeout, host=host)

    def sleep(self, host: str, timeout: float) -> Response:
        return self.call("POST", "/sleep", timeout, host=host)

    def restart(self, host: str, timeout: float) -> Response:
        return self.call("POST", "/restart", timeout, host=host)


@define
class RecordingUnits:
    """:class:`lchat.handover.seams.Units`: ``held``: socket -> the time its listener goes (a
    squatter: forever); ``healthy``: whether a started space answers."""

    reactor: task.Clock
    systemd: bool = True
    healthy: bool = True
    held: dict[str, float] = field(factory=dict)
    failing: dict[str, UnitError] = field(factory=dict)  # unit name -> its systemctl failure
    calls: list[str] = field(factory=list)

    def name(self, host: str, *, sidecar: bool = False) -> str:
        return systemd_units.unit_name(host, sidecar=sidecar)

    def _run(self, verb: str, unit: str) -> None:
        self.calls.append(f"{verb} {unit}")
        if unit in self.failing:
            raise self.failing[unit]

    def stop(self, host: str, *, sidecar: bool = False) -> None:
        self._run("stop", self.name(host, sidecar=sidecar))

    def start(self, host: str, socket: str) -> None:
        self._run("start", self.name(host))

    def start_sidecar(self, host: str) -> None:
        self._run("start", self.name(host, sidecar=True))

    def restart(self, host: str) -> None:
        self._run("restart", self.name(host))

    def listening(self, socket: str) -> bool:
        return self.reactor.seconds() < self.held.get(socket, float("-inf"))

    def answers(self, socket: str, host: str, timeout: float) -> bool:
        self.calls.append(f"health {host}")
        if not self.healthy:
            self.reactor.advance(timeout)  # as long as the real poll waits
        return self.healthy


@define
class RecordingPeers:
    active: bool = True
    covers: bool = True  # the host is a mesh host
    pushed: list[Route] = field(factory=list)

    def push(self, route: Route) -> None:
        if self.active:
            self.pushed.append(route)

    def replicates(self, route: Route) -> bool:
        return self.active and self.covers

"""The mesh API's calls about one space on this box, asked by a peer (docs/mesh.md, "The mesh
API"): its wake-free stats (``GET /api/mesh/stats/{host}``), its readiness probe (``POST
/api/mesh/wake/{host}``), and the hold of ``lchat relocate`` run on another box (``POST
/api/mesh/hold``, ``/release``). :class:`lchat.mesh.api.MeshAPI` authenticates and dispatches;
the answers are this box's own, never forwarded again, each carrying ``box`` (this box's
``LCHAT_MESH_SELF``).

Invariants: a router without the collaborator a call needs answers 404 without a ``reason``, as an
older lchat does, so a peer tells "too old" from "no such space" (``reason: unknown_host``); a hold
is placed before the space is slept, so a request queued meanwhile cannot wake it again, and it
lasts ``0 < seconds <=`` :data:`MAX_HOLD` (a crashed caller never strands the space).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from lchat import hosts
from lchat.mesh import tokens
from lchat.mesh.route_payload import PayloadError
from lchat.registry import Registry, Route
from lchat.threads import RunInThread
from lchat.webutil import answerable

MAX_HOLD = 3600.0  # the router's bound on an operator hold (lchat.hibernation.capacity.Holds)
MAX_BODY = 64 * 1024  # as the API's (lchat.mesh.api.MAX_BODY): a hold's body is far smaller
INTERNAL = {"error": "internal error: see the router's log"}  # a 500's body (the log says why)
_log = Logger(namespace="lchat.mesh.api")

# The API's answer (op, outcome, status, body) -> bytes, and its finish of a deferred answer.
Answer = Callable[[Request, str, str, int, "dict[str, Any] | bytes"], bytes]
Finish = Callable[[Request, Callable[[], bool], str, str, int, "dict[str, Any] | bytes"], None]


class SpaceHolds(Protocol):
    """What ``POST /api/mesh/hold`` and ``/release`` drive: the activator's operator holds and
    its sleep (lchat.hibernation.activator.Activator)."""

    def hold(self, host: str, seconds: float, why: str) -> None: ...
    def release_hold(self, host: str) -> bool: ...
    def sleep(self, host: str, reason: str) -> Deferred[None]: ...
    def state(self, host: str) -> str: ...


# One host's answer of this box: (status, JSON body); the mesh API adds ``box``.
HostAnswer = Callable[[str], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]


class SpaceCalls:
    """The four calls (the module docstring); ``answer`` and ``finish`` are the API's, which
    count each call in ``lchat_mesh_route_calls_total`` and write it."""

    def __init__(
        self,
        box: str,
        registry: Registry,
        run_in_thread: RunInThread,
        answer: Answer,
        finish: Finish,
        *,
        stats: HostAnswer | None,
        probe: HostAnswer | None,
        holds: SpaceHolds | None,
    ) -> None:
        self._box = box
        self._registry = registry
        self._run = run_in_thread
        self._answer = answer
        self._finish = finish
        self._stats = stats
        self._probe = probe
        self._holds = holds

    def host_answer(self, request: Request, op: str, segment: bytes) -> bytes | int:
        """``GET /api/mesh/stats/{host}`` and ``POST /api/mesh/wake/{host}`` (the module
        docstring of lchat.mesh.api): this box's own answer about one host, with ``box``; answered on the reactor
        (a stats read runs in the router's threads, a probe waits on the activator)."""
        provider = self._stats if op == "stats" else self._probe
        if provider is None:
            return self._answer(request, op, "not_found", 404, {"error": "not served here"})
        try:
            host = hosts.normalise(segment.decode("ascii"))
        except (UnicodeDecodeError, hosts.InvalidHost) as e:
            return self._answer(request, op, "invalid", 400, {"error": f"host: {e}"})
        still = answerable(request)
        box = self._box

        def done(result: tuple[int, dict[str, Any]]) -> None:
            code, body = result
            outcome = "ok" if code == 200 else str(body.get("reason") or "error")
            self._finish(request, still, op, outcome, code, {**body, "box": box})

        def failed(failure: Failure) -> None:
            _log.failure("mesh: {op} of {host} failed", failure, op=op, host=host)
            self._finish(request, still, op, "error", 500, INTERNAL)

        Deferred.fromCoroutine(provider(host)).addCallbacks(done, failed)
        return NOT_DONE_YET

    def hold_or_release(self, request: Request, op: str) -> bytes | int:
        """``POST /api/mesh/hold`` / ``/release`` (the module docstring): the row is read in a
        thread; the hold, the sleep and the release run on the reactor."""
        holds = self._holds
        if holds is None:
            return self._answer(request, op, "not_found", 404, {"error": "not served here"})
        try:
            host, seconds = _read_hold(request, with_seconds=op == "hold")
        except PayloadError as e:
            return self._answer(request, op, "invalid", 400, {"error": str(e)})
        still = answerable(request)
        box = self._box
        if op == "release":
            released = holds.release_hold(host)
            _log.info(
                "mesh: {host}: a peer lifted its hold here ({what}); it may wake again",
                host=host,
                what="released" if released else "there was none left",
            )
            outcome = "released" if released else "not_held"
            return self._answer(request, op, outcome, 200, {"host": host, "released": released})

        def held(route: Route | None) -> Deferred[None] | None:
            if route is None or route.kind != "instance" or not route.hibernate:
                error = f"{host} is not a hibernating instance on this box"
                body = {"error": error, "reason": "unknown_host", "host": host, "box": box}
                self._finish(request, still, op, "unknown_host", 404, body)
                return None
            # The hold first: a request queued meanwhile cannot wake it again once it is asleep.
            holds.hold(host, seconds, "lchat relocate, asked by a peer")
            _log.info(
                "mesh: {host}: a peer's lchat relocate ({client}) asked this box to sleep it and "
                "hold it asleep for up to {seconds:g}s (until it releases the hold)",
                host=host,
                seconds=seconds,
                client=tokens.client_of(request),
            )
            answer = {"host": host, "held": seconds, "box": box}
            return holds.sleep(host, "relocate").addCallback(
                lambda _: self._finish(
                    request, still, op, "held", 200, {**answer, "state": holds.state(host)}
                )
            )

        def failed(failure: Failure) -> None:
            _log.failure("mesh: holding {host} for a peer failed", failure, host=host)
            self._finish(request, still, op, "error", 500, INTERNAL)

        d: Deferred[Route | None] = self._run(lambda: self._registry.get(host))
        d.addCallback(held).addErrback(failed)
        return NOT_DONE_YET


def _read_hold(request: Request, *, with_seconds: bool) -> tuple[str, float]:
    """The body of ``POST /api/mesh/hold`` (``{"host", "seconds"}``) or ``/release``
    (``{"host"}``): exactly those fields, the host normalised, the seconds in (0, 3600]."""
    content_type = (request.getHeader(b"content-type") or b"").decode("latin-1")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise PayloadError("Content-Type must be application/json")
    if getattr(request, "too_large", False):
        raise PayloadError(f"the body is larger than {MAX_BODY} bytes")
    raw = request.content.read(MAX_BODY + 1) if request.content is not None else b""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise PayloadError(f"the body is not JSON: {e}") from e
    fields = {"host", "seconds"} if with_seconds else {"host"}
    if not isinstance(body, dict) or set(body) != fields:
        raise PayloadError(f"the body must be an object with exactly {', '.join(sorted(fields))}")
    if not isinstance(body["host"], str):
        raise PayloadError("host must be a string")
    try:
        host = hosts.normalise(body["host"])
    except hosts.InvalidHost as e:
        raise PayloadError(f"host: {e}") from e
    if not with_seconds:
        return host, 0.0
    seconds = body["seconds"]
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0 < seconds <= MAX_HOLD
    ):
        raise PayloadError(f"seconds must be a number more than 0, at most {MAX_HOLD:g}")
    return host, float(seconds)

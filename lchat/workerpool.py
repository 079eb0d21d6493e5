"""The control process's side of its data-plane workers (``LCHAT_WORKERS`` >= 2; docs/performance.md,
"Many cores"): one worker per slot kept running, each watched, route and certificate changes pushed
to all of them, and what each last said kept for ``/status``.

- **Supervision** is :class:`lchat.supervise.Supervisor`'s (``noun="worker"``, its own metrics
  ``lchat_worker_restarts_total{slot}`` and ``lchat_workers{state}``): a worker that dies is
  restarted after 1 s, 2 s, 4 s, then every 5 s, back to 1 s once a run has stayed up 10 s.
- **The watchdog** asks every ready worker ``GET /status`` every 2 s (2 s timeout). A worker that
  misses 3 in a row has a blocked loop: it is SIGTERMed and SIGKILLed 1 s later
  (``lchat_worker_kills_total{why="hung"}``), then restarted like a crash. Each answer is cached:
  :meth:`WorkerPool.status` is synchronous, read from that cache.
- **Pushes**: :meth:`WorkerPool.reload_all` asks every ready worker ``POST /reload`` at once and
  waits (at most 5 s) for their acknowledgements; :meth:`WorkerPool.table_changed` and
  :meth:`WorkerPool.certificates_changed` send ``POST /reload`` / ``POST /rescan`` without
  waiting, coalesced per worker: at most one in flight and one queued, so a burst of changes
  costs a worker at most two calls and the last change is always delivered after it happened.
- **Behind**: a worker whose route fingerprint (or certificate count) differs from the control
  process's is *behind* (``lchat_workers_behind{what}``, ``/status``); the watchdog's answer that
  says so sends it one more push, and its own polls are the backstop.

Every call to a worker goes through the injected ``ask`` (:mod:`lchat.workerchannel`'s, whose
signature :class:`Ask` states); every clock is the reactor given. The pool takes the workers'
:class:`~lchat.child.ChildSpec` as built by the wiring (argv, environment, inherited sockets); slot
*k* is ``specs[k - 1]`` and is named ``worker k`` in logs and metrics.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol
from urllib.parse import quote

from attrs import define, evolve, field
from prometheus_client import Counter, Gauge
from twisted.application import service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.child import ChildSpec, ExitInfo, RunningChild
from lchat.supervise import ChildStatus, Supervisor

log = Logger(namespace="lchat.workerpool")

NOUN = "worker"

WORKER_RESTARTS = Counter(
    "lchat_worker_restarts_total", "Restarts of data-plane worker processes", ["slot"]
)
WORKERS = Gauge("lchat_workers", "Data-plane worker processes by state", ["state"])
WORKER_KILLS = Counter(
    "lchat_worker_kills_total", "Workers the control process killed, by why", ["why"]
)
WORKERS_BEHIND = Gauge(
    "lchat_workers_behind",
    "Ready workers whose routes or certificates differ from the control process's",
    ["what"],
)
SCRAPE_FAILURES = Counter(
    "lchat_worker_scrape_failures_total", "Workers that did not answer a metrics scrape"
)

What = Literal["routes", "certificates"]
WHATS: tuple[What, ...] = ("routes", "certificates")
_PUSH_PATH: dict[What, str] = {
    "routes": "/reload?reason=" + quote("control's table changed"),
    "certificates": "/rescan",
}
# Which field of a worker's answer holds its view (/status; the answer to /reload, /rescan).
_STATUS_FIELD: dict[What, str] = {"routes": "routes_fingerprint", "certificates": "certificates"}
_ANSWER_FIELD: dict[What, str] = {"routes": "fingerprint", "certificates": "certificates"}


class Ask(Protocol):
    """One call to a worker's channel socket: ``(status, body)``, the body JSON-decoded when the
    answer is JSON, else bytes; fails on no answer within ``timeout`` seconds."""

    def __call__(
        self, reactor: IReactorTime, sock_path: str, method: str, path: str, timeout: float, /
    ) -> Deferred[tuple[int, Any]]: ...


class WorkerDidNotAnswer(Exception):
    """A worker answered a channel call with something other than a 200 and a JSON object."""


@define
class _Push:
    in_flight: bool = False
    queued: bool = False  # one more is due once the one in flight is answered


@define(eq=False)
class _Slot:
    """One slot's bookkeeping. The fields under ``run`` describe that run only and are reset
    when the supervisor starts another (:meth:`WorkerPool._sync`)."""

    number: int
    spec: ChildSpec
    pushes: dict[What, _Push] = field(factory=lambda: {what: _Push() for what in WHATS})
    run: RunningChild | None = None
    status: Mapping[str, Any] | None = None  # the run's last answer to GET /status
    misses: int = 0  # watchdog pings in a row it did not answer
    ping: Deferred[tuple[int, Any]] | None = None  # the watchdog's call in flight
    killed: bool = False  # the watchdog gave up on this run
    current: dict[What, bool | None] = field(factory=lambda: dict.fromkeys(WHATS))
    said_behind: set[What] = field(factory=set)  # logged as behind; its catching up is logged

    @property
    def name(self) -> str:
        return str(self.number)

    @property
    def sock(self) -> str:
        assert self.spec.ready_socket is not None
        return self.spec.ready_socket

    def forget_run(self, run: RunningChild | None) -> None:
        ping, self.ping = self.ping, None
        self.run, self.status, self.misses, self.killed = run, None, 0, False
        self.current = dict.fromkeys(WHATS)
        self.said_behind.clear()
        if ping is not None:
            ping.cancel()  # (its errback sees another run: no miss counted)


_UNSET: Any = object()


class WorkerPool(service.Service):
    """The control process's workers, one per slot: supervised, watched, pushed to.

    Invariants: only a *ready* worker (its channel answered ``GET /api/version``) is pinged, pushed
    to or scraped; an answer from a run that has since ended is ignored; at most one watchdog call
    and one push of each kind are in flight per worker. ``stopService`` fires once every worker has
    exited (SIGTERM, SIGKILL after ``kill_timeout``).
    """

    def __init__(
        self,
        reactor: IReactorTime,
        specs: Sequence[ChildSpec],
        ask: Ask,
        *,
        routes_fingerprint: Callable[[], object] | None = None,
        certificates: Callable[[], object] | None = None,
        on_ended: Callable[[int], None] | None = None,
        kill_timeout: float = 25.0,
        ready_timeout: float = 30.0,
        min_restart_delay: float = 1.0,
        max_restart_delay: float = 5.0,
        healthy_after: float = 10.0,
        fail_after: int = 3,
        watch_every: float = 2.0,
        watch_timeout: float = 2.0,
        hung_after: int = 3,
        hung_kill_after: float = 1.0,
        reload_timeout: float = 5.0,
        scrape_timeout: float = 1.0,
        new_session: bool = True,
    ) -> None:
        """``routes_fingerprint`` and ``certificates``: the control process's own view (its
        route table's fingerprint, its certificate count), what a worker's is compared with;
        None: never "behind". ``on_ended(slot)``: a run of that slot has ended (its counters are
        final: lchat.metricsmerge carries them). ``kill_timeout``: at stop, how long a worker
        may drain before SIGKILL."""
        if not specs:
            raise ValueError("a worker pool needs at least one worker")
        for spec in specs:
            if spec.ready_socket is None:
                raise ValueError(f"worker spec {spec.name}: no channel socket (ready_socket)")
        self._reactor = reactor
        self._ask = ask
        self._routes_fingerprint = routes_fingerprint
        self._certificates = certificates
        self.on_ended = on_ended
        self.watch_every = watch_every
        self.watch_timeout = watch_timeout
        self.hung_after = hung_after
        self.hung_kill_after = hung_kill_after
        self.reload_timeout = reload_timeout
        self.scrape_timeout = scrape_timeout
        self._slots = {
            k: _Slot(k, evolve(spec, name=str(k), noun=NOUN)) for k, spec in enumerate(specs, 1)
        }
        self._sup = Supervisor(
            reactor,
            self._state_changed,
            min_restart_delay=min_restart_delay,
            max_restart_delay=max_restart_delay,
            kill_timeout=kill_timeout,
            ready_timeout=ready_timeout,
            healthy_after=healthy_after,
            fail_after=fail_after,
            new_session=new_session,
            noun=NOUN,
            restarts=WORKER_RESTARTS,
            children=WORKERS,
            on_exit=self._exited,
        )
        self._sup.want({slot.name: slot.spec for slot in self._slots.values()})
        self._watchdog = LoopingCall(self._watch)
        self._watchdog.clock = reactor

    # -- the service -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._sup.startService()
        self._watchdog.start(self.watch_every, now=False)

    def stopService(self) -> Deferred[None]:
        """SIGTERM every worker (each drains as a single router does), SIGKILL one still there
        after ``kill_timeout``; fires once all have exited."""
        super().stopService()
        if self._watchdog.running:
            self._watchdog.stop()
        for slot in self._slots.values():
            for push in slot.pushes.values():
                push.queued = False
            if slot.ping is not None:
                ping, slot.ping = slot.ping, None
                ping.cancel()
        return self._sup.stopService()

    # -- what the wiring asks --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``{"wanted": N, "serving": k, "list": [...]}``, one entry per slot, from the
        supervisor and the watchdog's last answers (synchronous). ``serving``: ready workers
        that answered the watchdog's last ping. ``routes_current``/``certificates_current``:
        None until known (not ready yet, or nothing to compare with)."""
        states = self._sup.status()
        entries = []
        serving = 0
        for slot in self._slots.values():
            self._sync(slot)
            st = states.get(slot.name) or ChildStatus("stopped", None, 0, None, 0.0)
            if st.state == "ready" and slot.misses == 0 and not slot.killed:
                serving += 1
            seen = slot.status or {}
            entries.append(
                {
                    "slot": slot.number,
                    "pid": st.pid,
                    "state": st.state,
                    "restarts": st.restarts,
                    "since": st.since,
                    "last_error": st.last_error,
                    "routes_current": slot.current["routes"],
                    "certificates_current": slot.current["certificates"],
                    "connections": seen.get("connections"),
                    "accepted": seen.get("accepted"),
                    "in_flight": seen.get("in_flight"),
                }
            )
        return {"wanted": len(self._slots), "serving": serving, "list": entries}

    def worker_sockets(self) -> list[tuple[int, str]]:
        """``(slot, channel socket)`` of every ready worker: whom a metrics scrape asks."""
        return [(slot.number, slot.sock) for slot in self._ready()]

    def reload_all(self, reason: str, fingerprint: object = _UNSET) -> Deferred[dict[str, Any]]:
        """Ask every ready worker to reload its routes now and wait for their answers (at most
        ``reload_timeout``): ``{"current": k, "of": N, "behind": [slots]}``. A worker is current
        when it answered with ``fingerprint`` (default: the control process's, from
        ``routes_fingerprint``; with neither, any answer), behind when it answered another one
        or none. A worker not ready is neither (it loads the registry as it starts)."""
        want = self._reference("routes") if fingerprint is _UNSET else fingerprint
        path = "/reload?reason=" + quote(reason, safe="")
        calls = []
        for slot in self._ready():
            run = slot.run
            d = self._call(slot, "POST", path, self.reload_timeout)
            d.addBoth(self._acked, slot, run, want)
            calls.append(d)

        def summary(acks: list[tuple[int, bool]]) -> dict[str, Any]:
            behind = sorted(number for number, current in acks if not current)
            return {"current": len(acks) - len(behind), "of": len(self._slots), "behind": behind}

        return defer.gatherResults(calls).addCallback(summary)

    def table_changed(self) -> None:
        """The control process swapped its route table: every ready worker reloads (no wait)."""
        self._broadcast("routes")

    def certificates_changed(self) -> None:
        """The control process's certificate store changed (issuance, renewal, a new ticket
        key): every ready worker rescans (no wait)."""
        self._broadcast("certificates")

    def scrape(self) -> Deferred[dict[int, str | None]]:
        """Every ready worker's ``GET /metrics`` text, asked at once (``scrape_timeout`` each);
        a worker that does not answer is ``None`` (its gauges go stale, not its counters) and
        counted in ``lchat_worker_scrape_failures_total``."""
        slots = self._ready()

        def one(slot: _Slot) -> Deferred[tuple[int, str | None]]:
            def text(answer: tuple[int, Any]) -> tuple[int, str | None]:
                code, body = answer
                if code != 200:
                    raise WorkerDidNotAnswer(f"GET /metrics answered {code}")
                return slot.number, body.decode() if isinstance(body, bytes) else str(body)

            def failed(f: Failure) -> tuple[int, str | None]:
                SCRAPE_FAILURES.inc()
                log.debug(
                    "worker {slot}: metrics scrape failed: {why}",
                    slot=slot.number,
                    why=f.getErrorMessage(),
                )
                return slot.number, None

            return self._call(slot, "GET", "/metrics", self.scrape_timeout).addCallbacks(
                text, failed
            )

        d = defer.gatherResults([one(slot) for slot in slots])
        return d.addCallback(dict)

    # -- supervision -----------------------------------------------------------------------------

    def _state_changed(self, name: str, state: str, detail: str) -> None:
        slot = self._slots[int(name)]
        self._sync(slot)
        if state != "ready":
            # Not pushed to, not counted behind: it reloads everything as it starts.
            for push in slot.pushes.values():
                push.queued = False
        self._update_behind()

    def _exited(self, name: str, info: ExitInfo) -> None:
        slot = self._slots[int(name)]
        slot.forget_run(None)
        self._update_behind()
        if self.on_ended is not None:
            try:
                self.on_ended(slot.number)
            except Exception:
                log.failure("on_ended failed for worker {slot}", slot=slot.number)

    def _sync(self, slot: _Slot) -> None:
        """Point ``slot`` at the supervisor's current run, forgetting a previous run's state."""
        run = self._sup.child(slot.name)
        if run is not slot.run:
            slot.forget_run(run)

    def _ready(self) -> list[_Slot]:
        states = self._sup.status()
        ready = []
        for slot in self._slots.values():
            self._sync(slot)
            st = states.get(slot.name)
            if st is not None and st.state == "ready" and slot.run is not None:
                ready.append(slot)
        return ready

    # -- the watchdog ----------------------------------------------------------------------------

    def _watch(self) -> None:
        for slot in self._ready():
            if slot.killed:
                continue
            run = slot.run
            assert run is not None
            if slot.ping is not None:
                # Unanswered for a whole period (its own timeout may not have fired yet, at the
                # same instant): one miss, counted here and not again by its errback.
                ping, slot.ping = slot.ping, None
                ping.cancel()
                self._missed(slot, run, "no answer")
                if slot.killed:
                    continue
            d = self._call(slot, "GET", "/status", self.watch_timeout)
            slot.ping = d
            d.addCallbacks(
                self._answered,
                self._failed,
                callbackArgs=(slot, run, d),
                errbackArgs=(slot, run, d),
            )

    def _answered(
        self, answer: tuple[int, Any], slot: _Slot, run: RunningChild, d: Deferred[Any]
    ) -> None:
        if slot.ping is not d or slot.run is not run or not self.running:
            return  # cancelled, counted already, or about a run that has ended
        slot.ping = None
        code, body = answer
        if code != 200 or not isinstance(body, dict):
            self._missed(slot, run, f"GET /status answered {code}")
            return
        slot.misses = 0
        slot.status = body
        for what in WHATS:
            if _STATUS_FIELD[what] in body:
                current = self._compare(what, body[_STATUS_FIELD[what]])
                self._set_current(slot, what, current, say=False)
                if current is False:
                    self._push(slot, what)  # catch it up now rather than at its next poll
        self._update_behind()

    def _failed(self, failure: Failure, slot: _Slot, run: RunningChild, d: Deferred[Any]) -> None:
        if slot.ping is not d or slot.run is not run or not self.running:
            return
        slot.ping = None
        self._missed(slot, run, failure.getErrorMessage())

    def _missed(self, slot: _Slot, run: RunningChild, why: str) -> None:
        slot.misses += 1
        log.debug(
            "worker {slot} did not answer the watchdog ({n} in a row): {why}",
            slot=slot.number,
            n=slot.misses,
            why=why,
        )
        if slot.misses >= self.hung_after and not slot.killed:
            slot.killed = True
            log.error(
                "worker {slot} did not answer for {seconds:g}s: killing it",
                slot=slot.number,
                seconds=slot.misses * self.watch_every,
                pid=run.pid,
            )
            WORKER_KILLS.labels(why="hung").inc()
            # SIGTERM first for the record; a blocked loop never runs its handler, so SIGKILL
            # follows soon. The supervisor then sees a crash and restarts it.
            run.terminate(self.hung_kill_after)

    # -- pushes ----------------------------------------------------------------------------------

    def _broadcast(self, what: What) -> None:
        if not self.running:
            return
        for slot in self._ready():
            self._push(slot, what)

    def _push(self, slot: _Slot, what: What) -> None:
        push = slot.pushes[what]
        if push.in_flight:
            push.queued = True
            return
        push.in_flight = True
        run = slot.run
        d = self._call(slot, "POST", _PUSH_PATH[what], self.reload_timeout)
        d.addBoth(self._pushed, slot, what, run)

    def _pushed(self, outcome: object, slot: _Slot, what: What, run: RunningChild | None) -> None:
        push = slot.pushes[what]
        push.in_flight = False
        if slot.run is run and self.running:
            if isinstance(outcome, Failure) or not _ok(outcome):
                why = outcome.getErrorMessage() if isinstance(outcome, Failure) else _code(outcome)
                self._set_current(slot, what, False, say=True, why=f"the push failed: {why}")
            else:
                body = _body(outcome)
                if _ANSWER_FIELD[what] in body:
                    current = self._compare(what, body[_ANSWER_FIELD[what]])
                    self._set_current(slot, what, current, say=False)
            self._update_behind()
        if push.queued:
            push.queued = False
            if self.running and slot in self._ready():
                self._push(slot, what)

    def _acked(
        self, outcome: object, slot: _Slot, run: RunningChild | None, want: object
    ) -> tuple[int, bool]:
        if isinstance(outcome, Failure) or not _ok(outcome):
            why = outcome.getErrorMessage() if isinstance(outcome, Failure) else _code(outcome)
            current, detail = False, f"no acknowledgement: {why}"
        else:
            got = _body(outcome).get("fingerprint")
            current = want is None or _same(got, want)
            detail = "it answered another route table"
        if slot.run is run and self.running:
            self._set_current(slot, "routes", current, say=True, why=detail)
            self._update_behind()
        return slot.number, current

    # -- behind ----------------------------------------------------------------------------------

    def _reference(self, what: What) -> object:
        source = self._routes_fingerprint if what == "routes" else self._certificates
        return source() if source is not None else None

    def _compare(self, what: What, theirs: object) -> bool | None:
        ours = self._reference(what)
        return None if ours is None else _same(theirs, ours)

    def _set_current(
        self, slot: _Slot, what: What, current: bool | None, *, say: bool, why: str = ""
    ) -> None:
        slot.current[what] = current
        if current is False and say and what not in slot.said_behind:
            slot.said_behind.add(what)
            log.warn(
                "worker {slot} is behind on {what} ({why}); its own poll will catch up",
                slot=slot.number,
                what=what,
                why=why,
            )
        elif current and what in slot.said_behind:
            slot.said_behind.discard(what)
            log.info("worker {slot} caught up on {what}", slot=slot.number, what=what)

    def _update_behind(self) -> None:
        ready = self._ready()
        for what in WHATS:
            WORKERS_BEHIND.labels(what=what).set(sum(s.current[what] is False for s in ready))

    # -- calls -----------------------------------------------------------------------------------

    def _call(self, slot: _Slot, method: str, path: str, timeout: float) -> Deferred[Any]:
        """``ask``, bounded by ``timeout`` here too: a call the channel never ends would
        otherwise hold the slot's watchdog or push forever."""
        try:
            d = self._ask(self._reactor, slot.sock, method, path, timeout)
        except Exception:
            return defer.fail()
        return d.addTimeout(timeout, self._reactor)


def _ok(answer: object) -> bool:
    return isinstance(answer, tuple) and answer[0] == 200


def _code(answer: object) -> str:
    return f"answered {answer[0]}" if isinstance(answer, tuple) else "no answer"


def _body(answer: object) -> Mapping[str, Any]:
    body = answer[1] if isinstance(answer, tuple) else None
    return body if isinstance(body, dict) else {}


def _same(a: object, b: object) -> bool:
    """Equal once both are as JSON carries them (a fingerprint's tuples arrive as lists)."""
    try:
        return bool(json.loads(json.dumps(a)) == json.loads(json.dumps(b)))
    except (TypeError, ValueError):
        return a == b

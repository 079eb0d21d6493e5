"""The supervisor: keeps a desired set of children running (builtin units, sidecars), restarting
them with capped exponential backoff and reporting each state change to a callback, the log and
metrics. One child and its signals: :mod:`lchat.child`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

from attrs import define, frozen
from prometheus_client import Counter, Gauge
from twisted.application import service
from twisted.internet import defer
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.backoff import Backoff
from lchat.child import ChildExited, ChildSpec, ExitInfo, RunningChild, SpawnError, spawn

State = Literal["starting", "ready", "backoff", "failed", "stopped"]
STATES: tuple[State, ...] = ("starting", "ready", "backoff", "failed", "stopped")

log = Logger(namespace="lchat.supervise")

RESTARTS = Counter("lchat_space_restarts_total", "Restarts of supervised space processes", ["host"])
CHILDREN = Gauge("lchat_space_children", "Supervised space processes by state", ["state"])


@frozen
class ChildStatus:
    state: State
    pid: int | None
    restarts: int
    last_error: str | None
    since: float  # reactor time of the last state change


# --- supervisor ---------------------------------------------------------------------------------


@define
class _Entry:
    spec: ChildSpec
    state: State = "stopped"
    detail: str = ""
    since: float = 0.0
    child: RunningChild | None = None
    restarts: int = 0
    failures: int = 0  # consecutive runs that never became ready
    delay: float = 0.0  # backoff before the next restart
    last_error: str | None = None
    ready: bool = False  # the current run has passed its readiness probe
    stopping: bool = False  # we are terminating the current run on purpose
    not_ready: str | None = None  # we are terminating it because readiness timed out
    restart_call: IDelayedCall | None = None
    healthy_call: IDelayedCall | None = None


class Supervisor(service.Service):
    """Keeps the wanted children running; reports ``on_state(name, state, detail)``.

    ``noun`` names the children in the log ("space a.example.com", "worker 2"); ``restarts``
    (one label: the child's name) and ``children`` (label ``state``) are the metrics this
    supervisor reports to, so that two kinds of children keep separate figures. The defaults are
    the spaces'. Invariant: ``children`` holds this supervisor's counts only if it is the only
    supervisor reporting to it.

    ``on_exit(name, info)`` is told of the end of every run, wanted or not, ready or not, before
    the supervisor decides what follows (a run that never reached a new state, e.g. one more
    failed start, is reported too). It may read the supervisor, not change it.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        on_state: Callable[[str, str, str], None] | None = None,
        min_restart_delay: float = 1.0,
        max_restart_delay: float = 60.0,
        kill_timeout: float = 20.0,
        ready_timeout: float = 30.0,
        healthy_after: float = 10.0,
        fail_after: int = 3,
        *,
        new_session: bool = True,
        noun: str = "space",
        restarts: Counter = RESTARTS,
        children: Gauge = CHILDREN,
        on_exit: Callable[[str, ExitInfo], None] | None = None,
    ) -> None:
        self._reactor = reactor
        self._on_exit = on_exit
        self._noun = noun
        self._restarts = restarts
        self._children = children
        self._on_state = on_state
        # Restarts wait min_restart_delay, doubling to max_restart_delay; back to the minimum
        # once a run has stayed up for healthy_after (or its spec changed).
        self.restart_backoff = Backoff(min_restart_delay, max(min_restart_delay, max_restart_delay))
        self.kill_timeout = kill_timeout
        self.ready_timeout = ready_timeout
        self.healthy_after = healthy_after
        self.fail_after = fail_after
        self._new_session = new_session
        self._wanted: dict[str, ChildSpec] = {}
        self._entries: dict[str, _Entry] = {}
        # on_state calls wait here until the transition that caused them is complete, so a
        # callback may re-enter (want(), stopService()) without seeing half-updated entries.
        self._notices: deque[tuple[str, State, str]] = deque()

    # -- public API ------------------------------------------------------------------------------

    def want(self, specs: Mapping[str, ChildSpec]) -> None:
        """Make ``specs`` the desired set: start new names, stop dropped ones, restart changed."""
        self._wanted = dict(specs)
        for name in list(self._entries):
            if name not in self._wanted:
                self._drop(name)
        for name, spec in self._wanted.items():
            entry = self._entries.get(name)
            if entry is None:
                self._entries[name] = _Entry(
                    spec=spec, since=self._reactor.seconds(), delay=self.restart_backoff.initial
                )
                if self.running:
                    self._start(name)
                continue
            changed = entry.spec != spec
            entry.spec = spec
            if changed:
                entry.failures, entry.delay = 0, self.restart_backoff.initial
            if entry.child is not None:
                if changed or entry.stopping:
                    # Replace the run; it starts again with the new spec once it is gone.
                    self._terminate(entry)
            elif self.running and (changed or entry.restart_call is None):
                self._cancel(entry)
                self._start(name)
        self._update_gauge()
        self._notify()

    def status(self) -> Mapping[str, ChildStatus]:
        return {
            name: ChildStatus(
                state=e.state,
                pid=e.child.pid if e.child is not None else None,
                restarts=e.restarts,
                last_error=e.last_error,
                since=e.since,
            )
            for name, e in self._entries.items()
        }

    def child(self, name: str) -> RunningChild | None:
        """The current run of ``name``, if any."""
        entry = self._entries.get(name)
        return entry.child if entry is not None else None

    def restart(self, name: str) -> Deferred[int | None]:
        """Run ``name`` anew with the same spec, now: a deploy repointed the program its spec
        names (``live/<host>``). A running child is stopped first; one waiting in backoff or
        failed starts at once, its backoff forgotten. Fires with the new run's pid (None if it
        could not even be spawned) once it has started; KeyError for a name not wanted."""
        entry = self._entries.get(name)
        if entry is None or name not in self._wanted or not self.running:
            raise KeyError(name)
        entry.failures, entry.delay = 0, self.restart_backoff.initial
        if entry.child is not None:
            # _child_ended (called first: it waited on this run since it started) starts the
            # new run before this Deferred fires.
            ended = self._terminate(entry)
            return ended.addCallback(lambda _: entry.child.pid if entry.child else None)
        self._cancel(entry)
        self._start(name)
        self._notify()
        return succeed(entry.child.pid if entry.child is not None else None)

    def startService(self) -> None:
        super().startService()
        for name in self._wanted:
            entry = self._entries[name]
            if entry.child is None:
                self._cancel(entry)
                self._start(name)
        self._notify()

    def stopService(self) -> Deferred[None]:
        """Terminate every child in parallel; fires once all have ended."""
        super().stopService()
        waits: list[Deferred[ExitInfo]] = []
        for name, entry in list(self._entries.items()):
            self._cancel(entry)
            if entry.child is not None:
                waits.append(self._terminate(entry))
            else:
                self._set_state(name, entry, "stopped", "")
        self._notify()
        d = defer.gatherResults(waits, consumeErrors=True)
        return d.addCallback(lambda _: None)

    # -- transitions -----------------------------------------------------------------------------

    def _start(self, name: str) -> None:
        entry = self._entries[name]
        entry.restart_call = None
        entry.ready = False
        entry.stopping = False
        entry.not_ready = None
        try:
            child = spawn(self._reactor, entry.spec, new_session=self._new_session)
        except SpawnError as e:
            self._run_failed(name, entry, str(e), immediate=True)
            return
        except Exception as e:  # a broken spec must never escape into the reactor
            log.failure("{noun} {host}: spawn crashed", Failure(), noun=self._noun, host=name)
            self._run_failed(name, entry, f"cannot spawn: {e}", immediate=True)
            return
        entry.child = child
        log.info("{noun} {host} started pid {pid}", noun=self._noun, host=name, pid=child.pid)
        if entry.state != "failed":  # a failed child stays failed until it is ready again
            self._set_state(name, entry, "starting", f"pid {child.pid}")
        args = (name, entry, child)
        child.ended.addCallback(self._safely(self._child_ended), *args)
        if entry.child is not child:
            return  # it ended already
        child.wait_ready(self.ready_timeout).addCallbacks(
            self._safely(self._child_ready),
            self._safely(self._child_not_ready),
            callbackArgs=args,
            errbackArgs=args,
        )

    def _child_ready(self, _: object, name: str, entry: _Entry, child: RunningChild) -> None:
        if entry.child is not child or entry.stopping:
            return
        entry.ready = True
        entry.failures = 0
        entry.healthy_call = self._reactor.callLater(self.healthy_after, self._healthy, entry)
        self._set_state(name, entry, "ready", f"pid {child.pid}")

    def _child_not_ready(
        self, failure: Failure, name: str, entry: _Entry, child: RunningChild
    ) -> None:
        if entry.child is not child or failure.check(ChildExited, defer.CancelledError):
            return  # an exit is handled by _child_ended, with the exit status
        entry.not_ready = failure.getErrorMessage()
        log.warn(
            "{noun} {host}: {detail}; stopping it",
            noun=self._noun,
            host=name,
            detail=entry.not_ready,
        )
        child.terminate(self.kill_timeout)

    def _healthy(self, entry: _Entry) -> None:
        entry.healthy_call = None
        entry.delay = self.restart_backoff.initial

    def _child_ended(self, info: ExitInfo, name: str, entry: _Entry, child: RunningChild) -> None:
        if entry.child is not child:
            return
        entry.child = None
        if self._on_exit is not None:
            try:
                self._on_exit(name, info)
            except Exception:
                log.failure("on_exit callback failed for {host}", host=name)
        self._cancel(entry)  # (its healthy call: no restart is due while a run lives)
        if self._entries.get(name) is not entry:
            return
        if entry.stopping:
            entry.stopping = False
            if self.running and name in self._wanted:
                self._start(name)  # a spec change or re-add: run the new spec now
            else:
                if name not in self._wanted:
                    del self._entries[name]
                self._set_state(name, entry, "stopped", info.describe())
            return
        if entry.ready:
            why = info.describe()
            if info.last_stderr:
                why += f": {info.last_stderr}"
            entry.last_error = why
            self._schedule_restart(name, entry, "backoff", why)
            return
        detail = entry.not_ready or str(ChildExited(name, info))
        self._run_failed(name, entry, detail, immediate=False)

    def _run_failed(self, name: str, entry: _Entry, detail: str, *, immediate: bool) -> None:
        """A run that never became ready (or never started)."""
        entry.failures += 1
        entry.last_error = detail
        if not self.running or name not in self._wanted:
            self._set_state(name, entry, "stopped", detail)
            return
        failed = immediate or entry.failures >= self.fail_after
        self._schedule_restart(name, entry, "failed" if failed else "backoff", detail)

    def _schedule_restart(self, name: str, entry: _Entry, state: State, detail: str) -> None:
        if not self.running or name not in self._wanted:
            self._set_state(name, entry, "stopped", detail)
            return
        delay = entry.delay
        entry.delay = self.restart_backoff.after(entry.delay)
        was_failed = entry.state == "failed"
        if state == "failed":
            if not was_failed or entry.detail != detail:
                log.error(
                    "{noun} {host} failed: {detail}", noun=self._noun, host=name, detail=detail
                )
            log.debug(
                "{noun} {host}: retrying in {delay:g}s", noun=self._noun, host=name, delay=delay
            )
        elif was_failed:
            state = "failed"  # stays failed until it is ready again
            log.debug(
                "{noun} {host}: still failing ({detail}); retrying in {delay:g}s",
                noun=self._noun,
                host=name,
                detail=detail,
                delay=delay,
            )
        else:
            log.warn(
                "{noun} {host} exited unexpectedly ({why}) — restarting in {delay:g}s",
                noun=self._noun,
                host=name,
                why=detail,
                delay=delay,
            )
        entry.restart_call = self._reactor.callLater(
            delay, self._safely(self._restart), name, entry
        )
        self._set_state(name, entry, state, detail)

    def _restart(self, name: str, entry: _Entry) -> None:
        entry.restart_call = None
        if self._entries.get(name) is not entry or not self.running or entry.child is not None:
            return
        entry.restarts += 1
        self._restarts.labels(name).inc()
        self._start(name)

    def _drop(self, name: str) -> None:
        entry = self._entries[name]
        self._cancel(entry)
        if entry.child is not None:
            self._terminate(entry)
        else:
            del self._entries[name]
            self._set_state(name, entry, "stopped", "")

    def _terminate(self, entry: _Entry) -> Deferred[ExitInfo]:
        assert entry.child is not None
        entry.stopping = True
        return entry.child.terminate(self.kill_timeout)

    def _cancel(self, entry: _Entry) -> None:
        for call in (entry.restart_call, entry.healthy_call):
            if call is not None and call.active():
                call.cancel()
        entry.restart_call = entry.healthy_call = None

    # -- reporting -------------------------------------------------------------------------------

    def _set_state(self, name: str, entry: _Entry, state: State, detail: str) -> None:
        if entry.state == state and entry.detail == detail:
            return
        entry.state, entry.detail, entry.since = state, detail, self._reactor.seconds()
        if state == "ready":
            log.info(
                "{noun} {host} ready",
                noun=self._noun,
                host=name,
                pid=entry.child and entry.child.pid,
            )
        elif state == "stopped":
            log.info("{noun} {host} stopped", noun=self._noun, host=name, detail=detail)
        self._update_gauge()
        self._notices.append((name, state, detail))

    def _notify(self) -> None:
        """Deliver queued state changes; called when a transition is complete."""
        while self._notices:
            name, state, detail = self._notices.popleft()
            if self._on_state is None:
                continue
            try:
                self._on_state(name, state, detail)
            except Exception:
                log.failure("on_state callback failed for {host}", host=name)

    def _update_gauge(self) -> None:
        counts = dict.fromkeys(STATES, 0)
        for e in self._entries.values():
            counts[e.state] += 1
        for state, n in counts.items():
            self._children.labels(state=state).set(n)

    def _safely(self, fn: Callable[..., None]) -> Callable[..., None]:
        """Wrap a reactor-driven callback: nothing a child does may raise into the reactor,
        and the state changes it caused are reported once it is done."""

        def run(*args: Any) -> None:
            try:
                fn(*args)
            except Exception:
                log.failure("supervisor bug in {fn}", fn=fn.__name__)
            self._notify()

        return run

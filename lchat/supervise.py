"""Child processes: spawn, readiness, SIGTERM->SIGKILL, restart with capped backoff.

Two layers, modelled on ``twisted.runner.procmon``:

* :func:`spawn` starts one child and hands back a :class:`RunningChild` (``ended``, ``terminate``,
  ``wait_ready``). The activator uses it directly for wakes: one run, no restarts.
* :class:`Supervisor` keeps a desired set of children running (builtin units), restarting them with
  capped exponential backoff and reporting each state change to a callback, the log and metrics.

Children run in their own session (via util-linux ``setsid``, which execs in place so the pid is
the child's): Twisted's ``spawnProcess`` has no hook to call ``setsid()`` in the child (only
``usePTY`` does, which merges stderr into a tty). So signals go to the whole process group and a
space's own children die with it; leftovers are SIGKILLed when the leader exits, so nothing can
keep holding the space's socket. Without ``setsid`` on PATH we fall back to signalling the child
alone, and say so once in the log.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, cast
from typing import Protocol as TypingProtocol

from attrs import define, field, frozen
from prometheus_client import Counter, Gauge
from twisted.application import service
from twisted.internet import defer, error
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IProcessTransport, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import unixhttp
from lchat.backoff import Backoff
from lchat.isolation import IsolationError, SpaceUser, argv_as

State = Literal["starting", "ready", "backoff", "failed", "stopped"]
STATES: tuple[State, ...] = ("starting", "ready", "backoff", "failed", "stopped")

MAX_LINE = 4096  # longest child output line we log; the rest of the line is dropped
STDERR_TAIL = 10  # stderr lines kept for ExitInfo / failure details
_PIPE_GRACE = 2.0  # after the child exits, how long orphans may hold its pipes open

log = Logger(namespace="lchat.supervise")
child_log = Logger(namespace="lchat.space")

RESTARTS = Counter("lchat_space_restarts_total", "Restarts of supervised space processes", ["host"])
CHILDREN = Gauge("lchat_space_children", "Supervised space processes by state", ["state"])


class Reactor(TypingProtocol):
    """The reactor surface we use: ``IReactorProcess`` + ``IReactorTime`` (+ UNIX for probes)."""

    def callLater(
        self, delay: float, callable: Callable[..., Any], *args: object, **kw: object
    ) -> IDelayedCall: ...

    def seconds(self) -> float: ...

    # A read-only attribute, not a method: zope interfaces declare methods without ``self``,
    # which a method protocol member cannot match (no mypy-zope here).
    @property
    def spawnProcess(self) -> Callable[..., IProcessTransport]: ...


# --- values and errors --------------------------------------------------------------------------


def _as_argv(argv: Iterable[str]) -> tuple[str, ...]:
    return tuple(argv)


@frozen
class ChildSpec:
    name: str  # the host; used in logs and metrics
    argv: tuple[str, ...] = field(converter=_as_argv)
    env: Mapping[str, str] = field(repr=False)  # the complete environment; holds secrets
    cwd: str | None = None
    ready_socket: str | None = None  # ready once GET /api/version answers 200 here
    user: SpaceUser | None = None  # run as this user (lchat.isolation); None: as the router


@frozen
class ExitInfo:
    code: int | None  # exit status, when the child exited
    signal: int | None  # signal number, when a signal ended it
    stderr_tail: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        if self.code is None:
            return "ended (status unknown)"
        return f"exited with code {self.code}"

    @property
    def last_stderr(self) -> str | None:
        return self.stderr_tail[-1] if self.stderr_tail else None


@frozen
class ChildStatus:
    state: State
    pid: int | None
    restarts: int
    last_error: str | None
    since: float  # reactor time of the last state change


class SpawnError(Exception):
    """The child could not be started at all (missing binary, not executable, bad cwd)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class NotReady(Exception):
    """``wait_ready`` gave up. ``str()`` is a human detail for operators."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class ChildExited(NotReady):
    def __init__(self, name: str, info: ExitInfo) -> None:
        detail = f"{info.describe()} before becoming ready"
        if info.last_stderr:
            detail += f": {info.last_stderr}"
        super().__init__(name, detail)
        self.info = info


class ReadyTimeout(NotReady):
    pass


# --- one child ----------------------------------------------------------------------------------


class _Lines:
    """Splits a byte stream into capped lines, one log event per line."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._buf = b""
        self._skipping = False  # dropping the tail of an over-long line

    def feed(self, data: bytes) -> None:
        self._buf += data
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line, self._buf = self._buf[:nl], self._buf[nl + 1 :]
            if self._skipping:
                self._skipping = False
            else:
                self._line(line)
        if len(self._buf) > MAX_LINE:
            if not self._skipping:
                self._line(self._buf)
            self._skipping = True
            self._buf = b""

    def flush(self) -> None:
        if self._buf and not self._skipping:
            self._line(self._buf)
        self._buf = b""
        self._skipping = False

    def _line(self, raw: bytes) -> None:
        text = raw.rstrip(b"\r").decode("utf-8", "replace")
        if len(text) > MAX_LINE:
            text = text[:MAX_LINE] + "…"
        self._emit(text)


class _ChildProtocol(ProcessProtocol):
    def __init__(self, child: RunningChild) -> None:
        self._child = child

    def outReceived(self, data: bytes) -> None:
        self._child._out.feed(data)

    def errReceived(self, data: bytes) -> None:
        self._child._err.feed(data)

    def processExited(self, reason: Failure) -> None:
        self._child._on_exited(reason)

    def processEnded(self, reason: Failure) -> None:
        self._child._on_ended(reason)


class RunningChild:
    """One spawned child. Build with :func:`spawn`."""

    def __init__(self, reactor: Reactor, spec: ChildSpec, own_group: bool) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.started_at = reactor.seconds()
        self.exit_info: ExitInfo | None = None
        self._reactor = reactor
        self._own_group = own_group
        self._transport: IProcessTransport | None = None
        self._status: Failure | None = None  # from processExited: the leader is reaped
        self._waiters: list[Deferred[ExitInfo]] = []
        self._kill_call: IDelayedCall | None = None
        self._grace_call: IDelayedCall | None = None
        self._terminating = False
        self._tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self._out = _Lines(lambda line: self._log_line("stdout", line))
        self._err = _Lines(lambda line: self._log_line("stderr", line))

    def __repr__(self) -> str:
        return f"<RunningChild {self.spec.name} pid={self.pid}>"

    @property
    def ended(self) -> Deferred[ExitInfo]:
        """Fires with :class:`ExitInfo` once the child has ended (never errbacks).

        Each access returns a new Deferred, so any number of parties can wait independently
        (and cancel their own wait) without disturbing each other's callback chains.
        """
        if self.exit_info is not None:
            return succeed(self.exit_info)
        d: Deferred[ExitInfo] = Deferred(self._waiters.remove)
        self._waiters.append(d)
        return d

    def terminate(self, timeout: float = 20.0) -> Deferred[ExitInfo]:
        """SIGTERM now, SIGKILL after ``timeout``; fires with ExitInfo once it is gone.

        Idempotent: a second call only brings the SIGKILL forward if its timeout is shorter.
        """
        if self.exit_info is not None:
            return succeed(self.exit_info)
        if not self._terminating:
            self._terminating = True
            self._signal("TERM")
            self._kill_call = self._reactor.callLater(timeout, self._kill)
        elif self._kill_call is not None and self._kill_call.active():
            if self._kill_call.getTime() > self._reactor.seconds() + timeout:
                self._kill_call.reset(timeout)
        return self.ended

    def wait_ready(self, timeout: float = 30.0, interval: float = 0.2) -> Deferred[None]:
        """Fires once the child answers ``GET /api/version`` with 200 on ``spec.ready_socket``.

        Fails with :class:`ChildExited` if the child ends first, :class:`ReadyTimeout` after
        ``timeout`` seconds. Without a ready_socket the child is ready once spawned.
        """
        if self.exit_info is not None:
            return fail(ChildExited(self.spec.name, self.exit_info))
        if self.spec.ready_socket is None:
            return succeed(None)
        probing = Deferred.fromCoroutine(self._probe(self.spec.ready_socket, timeout, interval))
        exited = self.ended

        def cancel(_: Deferred[None]) -> None:
            probing.cancel()
            exited.cancel()

        result: Deferred[None] = Deferred(cancel)

        def probe_done(outcome: object) -> None:
            exited.cancel()
            if not result.called:
                if isinstance(outcome, Failure):
                    result.errback(outcome)
                else:
                    result.callback(None)

        def child_ended(info: ExitInfo) -> None:
            if not result.called:
                result.errback(ChildExited(self.spec.name, info))
            probing.cancel()

        def wait_cancelled(f: Failure) -> None:
            f.trap(defer.CancelledError)

        probing.addBoth(probe_done)
        exited.addCallbacks(child_ended, wait_cancelled)
        return result

    async def _probe(self, socket_path: str, budget: float, interval: float) -> None:
        deadline = self._reactor.seconds() + budget
        last = "no answer yet"
        while True:
            remaining = deadline - self._reactor.seconds()
            if remaining <= 0:
                raise ReadyTimeout(self.spec.name, f"not ready after {budget:g}s ({last})")
            if not os.path.exists(socket_path):  # noqa: ASYNC240 -- one stat, see below
                # A stat costs microseconds; a failed HTTP attempt costs the reactor far more.
                last = "no socket yet"
            else:
                try:
                    resp = await unixhttp.request(
                        self._reactor,
                        socket_path,
                        "GET",
                        "/api/version",
                        host=self.spec.name,
                        timeout=min(remaining, 5.0),
                    )
                except unixhttp.UnixHTTPError as e:
                    last = e.reason
                else:
                    if resp.status == 200:
                        return
                    last = f"GET /api/version answered {resp.status}"
            await deferLater(cast(IReactorTime, self._reactor), min(interval, max(remaining, 0)))

    # -- signals ---------------------------------------------------------------------------------

    def _kill(self) -> None:
        self._kill_call = None
        log.warn(
            "space {host} did not stop after SIGTERM; sending SIGKILL",
            host=self.spec.name,
            pid=self.pid,
        )
        self._signal("KILL")

    def _signal(self, name: str) -> None:
        if self._status is not None or self._transport is None:
            return  # already reaped: the pid may belong to someone else now
        if self._own_group and self.pid is not None:
            # The leader is unreaped, so its pid is still our group id.
            self._killpg(getattr(signal, f"SIG{name}"))
            return
        try:
            self._transport.signalProcess(name)
        except error.ProcessExitedAlready:
            pass
        except OSError as e:
            log.warn(
                "space {host}: signal {sig} failed: {err}", host=self.spec.name, sig=name, err=e
            )

    def _killpg(self, signum: int) -> None:
        assert self.pid is not None
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warn("space {host}: killpg failed: {err}", host=self.spec.name, err=e)

    # -- process events --------------------------------------------------------------------------

    def _log_line(self, stream: str, line: str) -> None:
        if stream == "stderr":
            self._tail.append(line)
        child_log.info("{host} {stream}: {line}", host=self.spec.name, stream=stream, line=line)

    def _on_exited(self, reason: Failure) -> None:
        if self._status is not None:
            return
        if self._own_group and self.pid is not None:
            # Sweep the group before we forget its id: orphans must not keep the socket (and
            # our pipes) busy. Safe: a pgid is not reused while any member is alive, and a new
            # process that got the leader's old pid is in its parent's group, not this one.
            self._killpg(signal.SIGKILL)
        self._status = reason
        self._cancel_kill()
        # If something still holds the pipes open, processEnded would never come; close ours.
        if self._transport is not None:
            self._grace_call = self._reactor.callLater(_PIPE_GRACE, self._close_pipes)

    def _close_pipes(self) -> None:
        self._grace_call = None
        if self._transport is not None and self.exit_info is None:
            self._transport.loseConnection()

    def _on_ended(self, reason: Failure) -> None:
        if self.exit_info is not None:
            return
        status = self._status or reason
        self._status = status
        self._cancel_kill()
        if self._grace_call is not None and self._grace_call.active():
            self._grace_call.cancel()
        self._out.flush()
        self._err.flush()
        value = status.value
        code = getattr(value, "exitCode", None)
        sig = getattr(value, "signal", None)
        if not isinstance(value, error.ProcessDone | error.ProcessTerminated):
            code, sig = None, None
        self.exit_info = ExitInfo(code=code, signal=sig, stderr_tail=tuple(self._tail))
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.callback(self.exit_info)

    def _cancel_kill(self) -> None:
        if self._kill_call is not None and self._kill_call.active():
            self._kill_call.cancel()
        self._kill_call = None


_setsid_path: str | Literal[False] | None = False  # False: not looked up yet


def _setsid() -> str | None:
    global _setsid_path
    if _setsid_path is False:
        _setsid_path = shutil.which("setsid")
        if _setsid_path is None:
            log.warn("setsid not found on PATH: children share our process group")
    return _setsid_path


def _resolve(spec: ChildSpec) -> str:
    if not spec.argv:
        raise SpawnError(spec.name, f"space {spec.name}: empty command line")
    exe = spec.argv[0]
    if os.sep not in exe:
        # Look it up on the child's PATH ourselves: posix_spawnp would search ours.
        found = shutil.which(exe, path=spec.env.get("PATH", os.defpath))
        if found is None:
            raise SpawnError(spec.name, f"space binary {exe} not found on PATH")
        return os.path.abspath(found)
    path = exe if os.path.isabs(exe) or spec.cwd is None else os.path.join(spec.cwd, exe)
    if not os.path.exists(path):
        raise SpawnError(spec.name, f"space binary {path} not found")
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise SpawnError(spec.name, f"space binary {path} is not executable")
    return os.path.abspath(path)


def spawn(reactor: Reactor, spec: ChildSpec, *, new_session: bool = True) -> RunningChild:
    """Start ``spec`` now. Raises :class:`SpawnError` if it cannot even be started.

    ``new_session``: run the child in its own session/process group (see module docstring).
    """
    exe = _resolve(spec)
    if spec.cwd is not None and not os.path.isdir(spec.cwd):
        raise SpawnError(spec.name, f"space {spec.name}: working directory {spec.cwd} not found")
    setsid = _setsid() if new_session else None
    argv = [exe, *spec.argv[1:]]
    if spec.user is not None:
        try:
            argv = argv_as(spec.user, argv)
        except IsolationError as e:
            raise SpawnError(spec.name, f"space {spec.name}: {e}") from e
    if setsid is not None:
        argv = [setsid, *argv]
    child = RunningChild(reactor, spec, own_group=setsid is not None)
    proto = _ChildProtocol(child)
    try:
        transport = reactor.spawnProcess(
            proto,
            argv[0],
            argv,
            env=dict(spec.env),
            path=spec.cwd,
            childFDs={0: "w", 1: "r", 2: "r"},
        )
    except OSError as e:
        raise SpawnError(spec.name, f"space {spec.name}: cannot spawn {exe}: {e}") from e
    child._transport = transport
    child.pid = transport.pid
    if child.exit_info is None:
        transport.closeStdin()  # spaces don't read stdin; EOF beats a forever-blocked read
    return child


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
    """Keeps the wanted children running; reports ``on_state(name, state, detail)``."""

    def __init__(
        self,
        reactor: Reactor,
        on_state: Callable[[str, str, str], None] | None = None,
        min_restart_delay: float = 1.0,
        max_restart_delay: float = 60.0,
        kill_timeout: float = 20.0,
        ready_timeout: float = 30.0,
        healthy_after: float = 10.0,
        fail_after: int = 3,
        *,
        new_session: bool = True,
    ) -> None:
        self._reactor = reactor
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
            log.failure("space {host}: spawn crashed", Failure(), host=name)
            self._run_failed(name, entry, f"cannot spawn: {e}", immediate=True)
            return
        entry.child = child
        log.info("space {host} started pid {pid}", host=name, pid=child.pid)
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
        log.warn("space {host}: {detail}; stopping it", host=name, detail=entry.not_ready)
        child.terminate(self.kill_timeout)

    def _healthy(self, entry: _Entry) -> None:
        entry.healthy_call = None
        entry.delay = self.restart_backoff.initial

    def _child_ended(self, info: ExitInfo, name: str, entry: _Entry, child: RunningChild) -> None:
        if entry.child is not child:
            return
        entry.child = None
        if entry.healthy_call is not None and entry.healthy_call.active():
            entry.healthy_call.cancel()
        entry.healthy_call = None
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
                log.error("space {host} failed: {detail}", host=name, detail=detail)
            log.debug("space {host}: retrying in {delay}s", host=name, delay=delay)
        elif was_failed:
            state = "failed"  # stays failed until it is ready again
            log.debug(
                "space {host}: still failing ({detail}); retrying in {delay}s",
                host=name,
                detail=detail,
                delay=delay,
            )
        else:
            log.warn(
                "space {host} exited unexpectedly ({why}) — restarting in {delay}s",
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
        RESTARTS.labels(host=name).inc()
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
            log.info("space {host} ready", host=name, pid=entry.child and entry.child.pid)
        elif state == "stopped":
            log.info("space {host} stopped", host=name, detail=detail)
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
            CHILDREN.labels(state=state).set(n)

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


# --- a leftover on a socket -----------------------------------------------------------------------


async def evict_listener(
    reactor: IReactorTime,
    run_in_thread: Callable[[Callable[[], Any]], Deferred[Any]],
    socket_path: str,
    grace: float,
    name: str,
) -> int | None:
    """Stop whatever process still listens on unix socket ``socket_path`` (SIGTERM to its group,
    SIGKILL after ``grace`` seconds); returns its pid, or None when nothing (or this process)
    listens. A space left running by a previous router process of this box would make a new
    child refuse to start on its socket."""
    pid = await run_in_thread(lambda: listener_pid(socket_path))
    if pid is None or pid == os.getpid():
        return None
    log.warn(
        "{name}: pid {pid} (left by a previous router) still listens on {socket}: stopping it",
        name=name,
        pid=pid,
        socket=socket_path,
    )
    signal_group(pid, signal.SIGTERM)
    deadline = reactor.seconds() + grace
    while await run_in_thread(lambda: listener_pid(socket_path)) == pid:
        if reactor.seconds() >= deadline:
            signal_group(pid, signal.SIGKILL)
            await deferLater(reactor, 0.2, lambda: None)
            break
        await deferLater(reactor, 0.1, lambda: None)
    return pid


def listener_pid(path: str) -> int | None:
    """The pid of the process listening on unix socket ``path`` (SO_PEERCRED), or None."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(path)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    finally:
        sock.close()
    pid = struct.unpack("3i", creds)[0]
    return pid if pid > 0 else None


def signal_group(pid: int, signum: int) -> None:
    """Signal the process group ``pid`` leads (our children are session leaders), else ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass

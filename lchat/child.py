"""One child process: spawn, readiness, SIGTERM->SIGKILL, its output in the log; and whatever
still listens on a space's socket.

:func:`spawn` starts one child and hands back a :class:`RunningChild` (``ended``, ``terminate``,
``wait_ready``), modelled on ``twisted.runner.procmon``. The activator uses it directly for wakes
(one run, no restarts); :class:`lchat.supervise.Supervisor` keeps a desired set of them running.

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
from typing import Any, Literal

from attrs import field, frozen
from twisted.internet import defer, error
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import (
    IDelayedCall,
    IProcessTransport,
    IReactorProcess,
    IReactorTime,
)
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import unixhttp
from lchat.deferutil import fire, relay
from lchat.isolation import IsolationError, SpaceUser, argv_as

MAX_LINE = 4096  # longest child output line we log; the rest of the line is dropped
STDERR_TAIL = 10  # stderr lines kept for ExitInfo / failure details
_PIPE_GRACE = 2.0  # after the child exits, how long orphans may hold its pipes open

log = Logger(namespace="lchat.supervise")
child_log = Logger(namespace="lchat.space")


# --- values and errors --------------------------------------------------------------------------


def _as_argv(argv: Iterable[str]) -> tuple[str, ...]:
    return tuple(argv)


def _as_fds(fds: Mapping[int, int]) -> Mapping[int, int]:
    return dict(fds)


def _extra_fds(_: object, __: object, fds: Mapping[int, int]) -> None:
    for child_fd, our_fd in fds.items():
        if child_fd < 3 or our_fd < 0:
            # 0-2 are the child's stdin/stdout/stderr, which spawn() sets up itself.
            raise ValueError(
                f"extra fd {child_fd}: {our_fd} must map a child fd >= 3 to one of ours"
            )


@frozen
class ChildSpec:
    """What to run. Invariant: equal specs run the same process (the supervisor replaces a run
    whose spec changed), so everything a run depends on is in here."""

    name: str  # the host (a worker: its slot number); used in logs and metrics
    argv: tuple[str, ...] = field(converter=_as_argv)
    env: Mapping[str, str] = field(repr=False)  # the complete environment; holds secrets
    cwd: str | None = None
    ready_socket: str | None = None  # ready once GET /api/version answers 200 here
    user: SpaceUser | None = None  # run as this user (lchat.isolation); None: as the router
    # Extra descriptors the child inherits: its fd number -> ours (a worker's listening sockets).
    # Ours stay open in this process: the child gets its own copy.
    fds: Mapping[int, int] = field(factory=dict, converter=_as_fds, validator=_extra_fds)
    # The child's stdout and stderr are ours (the journal, once) instead of pipes we log line by
    # line: for a child that logs through its own observer. No stderr tail in its ExitInfo then.
    inherit_output: bool = False
    noun: str = "space"  # what the child is, in log lines and errors: "space a.example.com"


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


class _ChildError(Exception):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class SpawnError(_ChildError):
    """The child could not be started at all (missing binary, not executable, bad cwd)."""


class NotReady(_ChildError):
    """``wait_ready`` gave up. ``str()`` is a human detail for operators."""


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


class RunningChild(ProcessProtocol):
    """One spawned child, and the protocol of its process. Build with :func:`spawn`."""

    def __init__(self, reactor: IReactorTime, spec: ChildSpec, own_group: bool) -> None:
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
            relay(outcome, result)

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
            await deferLater(self._reactor, min(interval, max(remaining, 0)))

    # -- signals ---------------------------------------------------------------------------------

    def _kill(self) -> None:
        self._kill_call = None
        log.warn(
            "{noun} {host} did not stop after SIGTERM; sending SIGKILL",
            noun=self.spec.noun,
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
                "{noun} {host}: signal {sig} failed: {err}",
                noun=self.spec.noun,
                host=self.spec.name,
                sig=name,
                err=e,
            )

    def _killpg(self, signum: int) -> None:
        assert self.pid is not None
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warn(
                "{noun} {host}: killpg failed: {err}",
                noun=self.spec.noun,
                host=self.spec.name,
                err=e,
            )

    # -- process events --------------------------------------------------------------------------

    def outReceived(self, data: bytes) -> None:
        self._out.feed(data)

    def errReceived(self, data: bytes) -> None:
        self._err.feed(data)

    def _log_line(self, stream: str, line: str) -> None:
        if stream == "stderr":
            self._tail.append(line)
        child_log.info("{host} {stream}: {line}", host=self.spec.name, stream=stream, line=line)

    def processExited(self, reason: Failure) -> None:
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

    def processEnded(self, reason: Failure) -> None:
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
        fire(waiters, self.exit_info)

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
        raise SpawnError(spec.name, f"{spec.noun} {spec.name}: empty command line")
    exe = spec.argv[0]
    if os.sep not in exe:
        # Look it up on the child's PATH ourselves: posix_spawnp would search ours.
        found = shutil.which(exe, path=spec.env.get("PATH", os.defpath))
        if found is None:
            raise SpawnError(spec.name, f"{spec.noun} binary {exe} not found on PATH")
        return os.path.abspath(found)
    path = exe if os.path.isabs(exe) or spec.cwd is None else os.path.join(spec.cwd, exe)
    if not os.path.exists(path):
        raise SpawnError(spec.name, f"{spec.noun} binary {path} not found")
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise SpawnError(spec.name, f"{spec.noun} binary {path} is not executable")
    return os.path.abspath(path)


def spawn(reactor: IReactorTime, spec: ChildSpec, *, new_session: bool = True) -> RunningChild:
    """Start ``spec`` now, on ``reactor`` (which also provides ``IReactorProcess``, adapted to
    here: a supervisor on a fake clock that never spawns needs no more). Raises
    :class:`SpawnError` if it cannot even be started.

    ``new_session``: run the child in its own session/process group (see module docstring).
    """
    exe = _resolve(spec)
    if spec.cwd is not None and not os.path.isdir(spec.cwd):
        raise SpawnError(
            spec.name, f"{spec.noun} {spec.name}: working directory {spec.cwd} not found"
        )
    setsid = _setsid() if new_session else None
    argv = [exe, *spec.argv[1:]]
    if spec.user is not None:
        try:
            argv = argv_as(spec.user, argv)
        except IsolationError as e:
            raise SpawnError(spec.name, f"{spec.noun} {spec.name}: {e}") from e
    if setsid is not None:
        argv = [setsid, *argv]
    child = RunningChild(reactor, spec, own_group=setsid is not None)
    # stdin a pipe we close at once; stdout/stderr pipes we log, or ours; then the extra fds.
    out: dict[int, int | str] = {1: 1, 2: 2} if spec.inherit_output else {1: "r", 2: "r"}
    try:
        transport = IReactorProcess(reactor).spawnProcess(
            child,
            argv[0],
            argv,
            env=dict(spec.env),
            path=spec.cwd,
            childFDs={0: "w", **out, **spec.fds},
        )
    except OSError as e:
        raise SpawnError(spec.name, f"{spec.noun} {spec.name}: cannot spawn {exe}: {e}") from e
    child._transport = transport
    child.pid = transport.pid
    if child.exit_info is None:
        transport.closeStdin()  # spaces don't read stdin; EOF beats a forever-blocked read
    return child


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

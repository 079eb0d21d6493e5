"""Stand-ins for a space's process and its contract, for state-machine tests on a fake clock
(tests/test_activator_machine.py), in the spirit of Twisted's procmon tests: everything that
decides is real (activator, lifecycle, lease, replicator, registry, a ``file:`` store); only the
child process and the HTTP questions put to it are replaced, each keeping the real one's contract.

- :class:`Spawner` is a ``Lifecycle(spawner=...)`` (``(reactor, spec) -> child``) that makes
  :class:`FakeChild` objects and remembers them;
- :class:`FakeChild` is what the lifecycle and the activator use of
  :class:`lchat.child.RunningChild`: ``pid``, ``exit_info``, ``ended`` (a new Deferred per
  access, never failing), ``wait_ready`` (fails with ``ChildExited`` if it ends first and
  ``ReadyTimeout`` after its timeout, on the fake clock), ``terminate`` (SIGTERM, SIGKILL after the
  grace). Like a space, it creates its SQLite database in WAL mode at ``LCHAT_DB`` and keeps a
  connection open while it runs, so that real replication has something to ship;
- :class:`FakeContract` is a ``Lifecycle(contract=...)``: ``next_due`` answers what the test set;
- :class:`RecordingStore` wraps a real store and writes each call into the :class:`Journal`;
- :class:`FakeReactor` is a ``MemoryReactorClock`` that also spawns processes: each
  ``spawnProcess`` makes a :class:`FakeProcess` (the test ends it with ``exit``) and records its
  arguments, ``childFDs`` included; for :mod:`lchat.supervise` and :mod:`lchat.workerpool`.

The :class:`Journal` is one ordered list of what happened, with the fake clock's time, so a test
can assert the order of steps across all of them.
"""

from __future__ import annotations

import itertools
import signal
import sqlite3
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IDelayedCall, IReactorProcess, IReactorTime
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from lchat.child import ChildExited, ChildSpec, ExitInfo, ReadyTimeout, SpawnError


def inline(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
    """The thread runner for a fake clock (lchat.threads.RunInThread): the work runs at once, on
    the calling thread, since there is no pool to hop to, and the disk work these tests do takes
    microseconds."""
    return maybeDeferred(f, *args)


class Journal:
    """What happened, in order: ``(clock time, event, detail)``."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.entries: list[tuple[float, str, str]] = []

    def add(self, event: str, detail: str = "") -> None:
        self.entries.append((self._clock.seconds(), event, detail))

    def events(self, *, since: int = 0) -> list[str]:
        """The event names from entry ``since`` on."""
        return [event for _, event, _ in self.entries[since:]]

    def mark(self) -> int:
        """The index of the next entry (for :meth:`events`' ``since``)."""
        return len(self.entries)


class RecordingStore:
    """A real store, each call written to the journal as ``store.<method>`` with its key;
    ``observe(method, key)``, when set, is called before each call reaches the store."""

    def __init__(self, store: Any, journal: Journal) -> None:
        self._store = store
        self._journal = journal
        self.calls: list[tuple[str, str]] = []
        self.observe: Callable[[str, str], None] | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name in ("describe",) or not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            key = str(args[0]) if args else ""
            self.calls.append((name, key))
            self._journal.add(f"store.{name}", key)
            if self.observe is not None:
                self.observe(name, key)
            return await attr(*args, **kwargs)

        return call

    def count(self) -> int:
        return len(self.calls)


class FakeChild:
    """One space "process". See the module docstring for the contract it keeps."""

    def __init__(
        self, clock: IReactorTime, spec: ChildSpec, pid: int, journal: Journal, *, ready: bool
    ) -> None:
        self.spec = spec
        self.host = spec.name
        self.pid = pid
        self.exit_info: ExitInfo | None = None
        self.started_at = clock.seconds()
        self.is_ready = ready
        # Seconds a SIGTERM takes to end it; None: it ignores SIGTERM (ended by the SIGKILL).
        self.stop_delay: float | None = 0.0
        self.terminations: list[tuple[float, float]] = []  # (clock time, grace)
        self._clock = clock
        self._journal = journal
        self._waiters: list[Deferred[ExitInfo]] = []
        self._ready_waits: list[tuple[Deferred[None], IDelayedCall]] = []
        self._end_call: IDelayedCall | None = None
        self.db_path = spec.env["LCHAT_DB"]
        self.db: sqlite3.Connection | None = sqlite3.connect(self.db_path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS messages(id INTEGER PRIMARY KEY, body TEXT)")

    def __repr__(self) -> str:
        return f"<FakeChild {self.host} pid={self.pid}>"

    # -- what the space does ---------------------------------------------------------------------

    def write(self, body: str) -> None:
        """A member's write: one committed transaction in the space's database."""
        assert self.db is not None, "the child has ended"
        self.db.execute("INSERT INTO messages(body) VALUES (?)", (body,))

    def become_ready(self) -> None:
        """``GET /api/version`` starts answering 200."""
        self.is_ready = True
        self._journal.add("ready", self.host)
        waits, self._ready_waits = self._ready_waits, []
        for d, timer in waits:
            timer.cancel()
            d.callback(None)

    def crash(self, sig: int = signal.SIGKILL) -> None:
        """The process dies on its own (OOM killer, a bug)."""
        self._journal.add("crash", self.host)
        self._end(ExitInfo(code=None, signal=sig))

    # -- RunningChild's interface ----------------------------------------------------------------

    @property
    def ended(self) -> Deferred[ExitInfo]:
        """A new Deferred per access (as RunningChild's): cancelling one leaves the others."""
        if self.exit_info is not None:
            return succeed(self.exit_info)
        d: Deferred[ExitInfo] = Deferred(self._waiters.remove)
        self._waiters.append(d)
        return d

    def wait_ready(self, timeout: float = 30.0, interval: float = 0.2) -> Deferred[None]:
        if self.exit_info is not None:
            return fail(ChildExited(self.host, self.exit_info))
        if self.is_ready:
            return succeed(None)

        def cancel(d: Deferred[None]) -> None:
            for entry in list(self._ready_waits):
                if entry[0] is d:
                    self._ready_waits.remove(entry)
                    entry[1].cancel()

        d: Deferred[None] = Deferred(cancel)

        def too_late() -> None:
            self._ready_waits[:] = [e for e in self._ready_waits if e[0] is not d]
            d.errback(ReadyTimeout(self.host, f"not ready after {timeout:g}s (no answer yet)"))

        self._ready_waits.append((d, self._clock.callLater(timeout, too_late)))
        return d

    def terminate(self, timeout: float = 20.0) -> Deferred[ExitInfo]:
        """SIGTERM now (ends it after ``stop_delay``), SIGKILL after ``timeout``."""
        self.terminations.append((self._clock.seconds(), timeout))
        self._journal.add("terminate", self.host)
        if self.exit_info is not None:
            return succeed(self.exit_info)
        delay = self.stop_delay
        if delay is not None and delay <= 0:
            self._end(ExitInfo(code=0, signal=None))
            return self.ended
        kill = delay is None or delay >= timeout
        info = ExitInfo(code=None, signal=signal.SIGKILL) if kill else ExitInfo(code=0, signal=None)
        when = timeout if kill else delay
        assert when is not None
        if self._end_call is None or self._end_call.getTime() > self._clock.seconds() + when:
            if self._end_call is not None:
                self._end_call.cancel()
            self._end_call = self._clock.callLater(when, self._end, info)
        return self.ended

    def _end(self, info: ExitInfo) -> None:
        if self.exit_info is not None:
            return
        if self._end_call is not None and self._end_call.active():
            self._end_call.cancel()
        self._end_call = None
        if self.db is not None:
            self.db.close()
            self.db = None
        self.exit_info = info
        self._journal.add("exit", self.host)
        waits, self._ready_waits = self._ready_waits, []
        for d, timer in waits:
            timer.cancel()
            d.errback(ChildExited(self.host, info))
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w.callback(info)


class Spawner:
    """``Lifecycle(spawner=...)``: makes a :class:`FakeChild` per spawn and remembers it.

    ``ready``: new children answer at once (else the test calls ``become_ready``);
    ``stop_delay``: given to each new child; ``refuse``: raise :class:`SpawnError` with it;
    ``fail_with``: raise that (a wake's own failure, say)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.children: list[FakeChild] = []
        self.ready = True
        self.stop_delay: float | None = 0.0
        self.refuse: str | None = None
        self.fail_with: Exception | None = None
        self._pids = itertools.count(40_000)

    def __call__(self, reactor: IReactorTime, spec: ChildSpec) -> FakeChild:
        self.journal.add("spawn", spec.name)
        if self.refuse is not None:
            raise SpawnError(spec.name, self.refuse)
        if self.fail_with is not None:
            raise self.fail_with
        child = FakeChild(reactor, spec, next(self._pids), self.journal, ready=self.ready)
        child.stop_delay = self.stop_delay
        self.children.append(child)
        return child

    def of(self, host: str) -> list[FakeChild]:
        return [c for c in self.children if c.host == host]

    def last(self, host: str) -> FakeChild:
        return self.of(host)[-1]

    def close(self) -> None:
        """Close what children are left running (the test is over)."""
        for child in self.children:
            if child.db is not None:
                child.db.close()
                child.db = None


class FakeContract:
    """``Lifecycle(contract=...)``: ``next_due`` answers ``due[host]`` (0 when unset); a host in
    ``hang`` never answers (the stand-down's budget ends the wait); one in ``broken`` fails."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.due: dict[str, int] = {}
        self.hang: set[str] = set()
        self.broken: set[str] = set()
        self.asked: list[tuple[str, str, float]] = []  # (host, socket, timeout)

    async def next_due(self, host: str, socket: str, timeout: float) -> int:  # noqa: ASYNC109 (a Twisted timeout)
        self.asked.append((host, socket, timeout))
        self.journal.add("next_due", host)
        if host in self.hang:
            await Deferred()
        if host in self.broken:
            raise ValueError("GET /api/next-due answered 500")
        return self.due.get(host, 0)


# --- processes on a fake reactor ---------------------------------------------------------------


class FakeProcess:
    """Enough of IProcessTransport for the supervisor."""

    def __init__(self, reactor, proto, executable, args, env, path, pid, child_fds=None):
        self.reactor, self.proto = reactor, proto
        self.executable, self.args, self.env, self.path = executable, args, env, path
        self.child_fds: dict[int, int | str] | None = child_fds
        self.pid: int | None = pid
        self.signals: list[str] = []
        self.stdin_closed = False

    def signalProcess(self, sig):
        if self.pid is None:
            raise ProcessExitedAlready()
        self.signals.append(sig)

    def closeStdin(self):
        self.stdin_closed = True

    def loseConnection(self):
        pass

    def exit(self, code: int | None = 0, sig: int | None = None, stderr: bytes = b""):
        if stderr:
            self.proto.errReceived(stderr)
        if code == 0 and sig is None:
            f = Failure(ProcessDone(0))
        else:
            f = Failure(ProcessTerminated(exitCode=code, signal=sig))
        self.pid = None
        self.proto.processExited(f)
        self.proto.processEnded(f)


@implementer(IReactorProcess)
class FakeReactor(MemoryReactorClock):
    def __init__(self):
        super().__init__()
        self.processes: list[FakeProcess] = []
        self._pid = 40000

    def spawnProcess(
        self, proto, executable, args, env=None, path=None, uid=None, gid=None, usePTY=False,
        childFDs=None,
    ):  # fmt: skip
        self._pid += 1
        p = FakeProcess(self, proto, executable, args, env, path, self._pid, childFDs)
        proto.makeConnection(p)
        self.processes.append(p)
        return p

    def answer_probe(self, status: int = 200) -> None:
        """Complete the newest pending unix connection with an HTTP answer."""
        _path, factory, *_ = self.unixClients[-1]
        proto = factory.buildProtocol(None)
        proto.makeConnection(StringTransport())
        proto.dataReceived(b"HTTP/1.1 %d X\r\nContent-Length: 2\r\n\r\n{}" % status)

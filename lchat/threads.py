"""The one way the router runs blocking work (SQLite, the filesystem, botocore): a *thread
runner*, ``run(f, *args) -> Deferred`` firing on the reactor thread with ``f(*args)``'s result.

Every service that blocks takes one in its constructor; :mod:`lchat.tap` builds the real one on
the reactor's thread pool, and tests pass one that runs at once, on a fake clock with no threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

RunInThread = Callable[..., Deferred[Any]]  # (f, *args) -> Deferred of f(*args)


def thread_runner(reactor: IReactorThreads) -> RunInThread:
    """Run in ``reactor``'s thread pool."""

    def run(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)

    return run


class DaemonThreadPool(ThreadPool):
    """A pool of a component's own whose threads never hold the process up at exit.

    Twisted's pool threads are not daemons: a pool its owner never stopped (a stop that waited
    on a store that stopped answering; before Replicator.stop joined a stop under way, a test's
    cleanup that found it "already stopping") keeps
    the interpreter in its exit's join forever, a process that logged its last line and never
    ends (seen: a replica's pool after its lease was lost, a test module that hung at exit). The
    work these pools run is SQLite's and the filesystem's, safe to cut off at any instant like a
    crash; a stopped pool ends its threads as before."""

    def threadFactory(self, *args: Any, **kwargs: Any) -> threading.Thread:  # type: ignore[override]
        return threading.Thread(*args, daemon=True, **kwargs)

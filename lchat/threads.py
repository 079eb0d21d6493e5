"""The one way the router runs blocking work (SQLite, the filesystem, botocore): a *thread
runner*, ``run(f, *args) -> Deferred`` firing on the reactor thread with ``f(*args)``'s result.

Every service that blocks takes one in its constructor; :mod:`lchat.tap` builds the real one on
the reactor's thread pool, and tests pass one that runs at once, on a fake clock with no threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool

RunInThread = Callable[..., Deferred[Any]]  # (f, *args) -> Deferred of f(*args)


def thread_runner(reactor: IReactorThreads) -> RunInThread:
    """Run in ``reactor``'s thread pool."""

    def run(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)

    return run

"""The one way a CLI command runs async work: :func:`run`, on a reactor of its own per call.

``lchat`` stays a plain synchronous program. A command that talks to a bucket, a peer or a feed
hands ``main(reactor)`` to :func:`run`, which starts a fresh reactor, runs it to completion and
stops it. Not the global reactor: that one runs once per process, and tests call commands while
it runs in another thread. Nothing a command does needs the global reactor (S3 and mesh request
bodies are written at once, not paced by the global cooperator; threads and timeouts are the
given reactor's), so a command may run any number of times, from any thread.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from lchat.reactors import Reactor, whole

_T = TypeVar("_T")

# What stops a command from outside, as Twisted's own handlers would on the global reactor.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run(
    main: Callable[[Reactor], Coroutine[Any, Any, _T]],
    budget: float | None = None,
    *,
    on_signal: Callable[[], None] | None = None,
) -> _T:
    """Run ``main(reactor)`` on a fresh reactor; its result, or its exception raised here.

    At most ``budget`` seconds (None: no bound): then ``main`` is cancelled (its ``finally``
    blocks run) and this raises :class:`TimeoutError`. On the main thread, SIGINT or SIGTERM stops
    the reactor and this raises :class:`KeyboardInterrupt` (``lchat`` says "interrupted"); ``main``
    is then abandoned where it was. With ``on_signal`` (a long-running command that winds down by
    itself: ``lchat backup replicate``'s final sync), the first such signal calls it on the
    reactor's thread instead, and only a second one stops the reactor. Callers map the other
    errors to their own.
    """
    from twisted.internet.pollreactor import PollReactor

    poll = PollReactor()
    reactor = whole(poll)
    outcome: list[Any] = []

    def start() -> None:
        d = Deferred.fromCoroutine(main(reactor))
        if budget is not None:
            d.addTimeout(budget, reactor)

        def done(value: object) -> None:
            outcome.append(value)
            reactor.callLater(0, reactor.stop)

        d.addBoth(done)

    reactor.callWhenRunning(start)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous: dict[signal.Signals, Any] = {}
    signalled: list[int] = []

    def stop_signal(number: int, frame: object) -> None:
        signalled.append(number)
        if on_signal is not None and len(signalled) == 1:
            reactor.callFromThread(on_signal)
        else:
            reactor.callFromThread(reactor.stop)

    if on_main_thread:
        for number in STOP_SIGNALS:
            previous[number] = signal.signal(number, stop_signal)
    try:
        poll.run(installSignalHandlers=False)  # IReactorCore.run takes no arguments
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if not outcome:
        raise KeyboardInterrupt
    value = outcome[0]
    if isinstance(value, Failure):
        if budget is not None and value.check(defer.TimeoutError):
            raise TimeoutError(f"not finished within {budget:g}s")
        value.raiseException()
    result: _T = value
    return result

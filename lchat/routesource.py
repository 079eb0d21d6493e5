"""The router's live view of the registry: the current :class:`lchat.registry.RouteTable`,
swapped atomically on SIGHUP, on ``POST /reload``, after a mesh API write and when the database's
fingerprint changes (polled), its listeners told what changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.deferutil import fire
from lchat.registry import EMPTY, Registry, RouteTable, changed_hosts
from lchat.threads import RunInThread

Listener = Callable[[RouteTable, RouteTable], object]  # its result is ignored
_R = TypeVar("_R")

_reloads = Counter("lchat_registry_reloads_total", "Registry reloads by outcome", ["outcome"])
_routes_gauge = Gauge("lchat_routes", "Registry rows by status", ["status"])

_log = Logger(namespace="lchat.registry")


class RouteSource(Service):
    """Holds the current :class:`RouteTable` and replaces it when the registry changes.

    Reloads run in a thread (the reactor never waits on SQLite), are serialised, and coalesce: a
    reload asked for while one runs causes exactly one more afterwards. A failed reload keeps the
    table we had — a broken write must never empty the router.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        registry: Registry,
        initial: RouteTable = EMPTY,
        *,
        run_in_thread: RunInThread,
        poll_interval: float = 2.0,
    ) -> None:
        self._reactor = reactor
        self.registry = registry
        self.table = initial
        self.run_in_thread = run_in_thread
        self._poll_interval = poll_interval
        self._listeners: list[Listener] = []
        # Called with (host, due) after record_next_due changed a row (lchat.mesh.due pushes it).
        self._due_listeners: list[Callable[[str, int], object]] = []
        self._recording: set[Deferred[bool]] = set()  # record_next_due writes not done yet
        self._running: Deferred[RouteTable] | None = None
        # Reloads asked for while one runs: all served by one more load afterwards.
        self._again: list[tuple[str, Deferred[RouteTable]]] = []
        self._poller: LoopingCall | None = None
        # A fingerprint whose reload failed: not retried (and not logged again) until it changes.
        self._polled: tuple[Any, ...] | None = None
        self._broken: tuple[Any, ...] | None = None
        _publish_gauge(initial)

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(old, new)`` after every swap (and never with equal tables)."""
        self._listeners.append(listener)

    def startService(self) -> None:
        super().startService()
        self._poller = LoopingCall(self._poll)
        self._poller.clock = self._reactor
        self._poller.start(self._poll_interval, now=False).addErrback(
            lambda f: _log.failure("registry poll loop died", f)
        )

    def stopService(self) -> Deferred[None] | None:
        if self._poller is not None and self._poller.running:
            self._poller.stop()
        return super().stopService()

    def subscribe_next_due(self, listener: Callable[[str, int], object]) -> None:
        """Call ``listener(host, due)`` after every :meth:`record_next_due` that changed a row
        (a sleep recording a due time, a due wake clearing it); never for other writes."""
        self._due_listeners.append(listener)

    def recorded(self) -> Deferred[None]:
        """Fires once every :meth:`record_next_due` asked for so far is written and its
        listeners called (the drain waits for this before its due pushes). Never fails."""
        pending = list(self._recording)
        done: Deferred[Any] = DeferredList(pending, consumeErrors=True)
        return done.addCallback(lambda _: None)

    def reload(self, reason: str) -> Deferred[RouteTable]:
        """Re-read the registry now. Fires with the table in force afterwards.

        Asked while a load runs, the request waits for exactly one more load after it, shared with
        every other request made meanwhile (that load starts after each of them was made).
        """
        waiter: Deferred[RouteTable] = Deferred()
        if self._running is not None:
            self._again.append((reason, waiter))
        else:
            self._start([(reason, waiter)])
        return waiter

    def record_next_due(self, host: str, due: int, only_if: int | None = None) -> Deferred[bool]:
        """Store ``host``'s next due time (unix seconds, 0: none) in its row, in a thread, and
        reload if it changed; fires with whether it did. ``only_if``: only while the row still
        holds that value (a due wake clears the time it honoured, not a newer one). Never
        fails: an error is logged."""
        registry = self.registry

        def write() -> bool:
            row = registry.get(host)
            if row is None or (only_if is not None and row.next_due != only_if):
                return False
            if row.next_due != due:
                registry.update(host, next_due=due)
                return True
            return False

        d: Deferred[bool] = self.run_in_thread(write)

        def written(changed: bool) -> bool:
            if changed:
                self.reload(f"{host} next due")
                for listener in list(self._due_listeners):
                    try:
                        listener(host, due)
                    except Exception:
                        _log.failure("next-due listener failed for {host}", host=host)
            return changed

        def failed(f: Failure) -> bool:
            _log.failure("could not record next due of {host}", f, host=host)
            return False

        d.addCallbacks(written, failed)
        self._recording.add(d)
        d.addBoth(_forget, self._recording, d)
        return d

    def _start(self, batch: list[tuple[str, Deferred[RouteTable]]]) -> None:
        reason = ", ".join(dict.fromkeys(r for r, _ in batch))
        d: Deferred[RouteTable] = self.run_in_thread(self.registry.load)
        d.addCallbacks(self._swap, self._failed, callbackArgs=(reason,), errbackArgs=(reason,))
        self._running = d
        d.addBoth(self._done, batch)

    def _done(
        self, result: RouteTable | Failure, batch: list[tuple[str, Deferred[RouteTable]]]
    ) -> None:
        self._running = None
        if self._again:
            again, self._again = self._again, []
            self._start(again)
        fire([waiter for _, waiter in batch], result)

    def _swap(self, new: RouteTable, reason: str) -> RouteTable:
        self._broken = None
        old, self.table = self.table, new
        _reloads.labels("ok").inc()
        _publish_gauge(new)
        changed = list(changed_hosts(old, new))
        if changed:
            _log.info(
                "registry reloaded ({reason}): {count} routes, changed: {changed}",
                reason=reason,
                count=len(new),
                changed=", ".join(changed[:10]) + (" ..." if len(changed) > 10 else ""),
            )
            for listener in list(self._listeners):
                try:
                    listener(old, new)
                except Exception:
                    _log.failure("registry listener failed")
        return new

    def _failed(self, failure: Failure, reason: str) -> RouteTable:
        self._broken = self._polled
        _reloads.labels("error").inc()
        _log.error(
            "registry reload ({reason}) failed, keeping {count} routes: {error}",
            reason=reason,
            count=len(self.table),
            error=failure.getErrorMessage(),
        )
        return self.table

    def _poll(self) -> Deferred[Any] | None:
        if self._running is not None:
            return None
        d = self.run_in_thread(self.registry.fingerprint)

        def compare(fingerprint: tuple[Any, ...]) -> Deferred[RouteTable] | None:
            if fingerprint != self.table.fingerprint and fingerprint != self._broken:
                self._polled = fingerprint
                return self.reload("file changed")
            return None

        d.addCallback(compare)
        d.addErrback(lambda f: _log.error("registry poll failed: {e}", e=f.getErrorMessage()))
        return d


def _forget(result: _R, pending: set[Deferred[bool]], d: Deferred[bool]) -> _R:
    pending.discard(d)
    return result


def _publish_gauge(table: RouteTable) -> None:
    for status, count in table.count_by_status().items():
        _routes_gauge.labels(status).set(count)

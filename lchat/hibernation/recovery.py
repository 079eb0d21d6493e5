"""Local copies that may hold writes the bucket lacks, and their recovery (docs/lease.md, "The
newest copy wins"; issue 28).

A hibernating space's database on this box is *dirty* when it is present, not running here, and
has no clean-sleep marker (lchat.hibernation.localdb): this box ran it last and did not see its
final flush through — a crash, a stand-down of a box that was not alive any more, a flush that
failed while the bucket was out of reach. It may hold acknowledged writes nobody else has.

Two things follow. While any copy here is dirty, this box's beats say it holds writes the bucket
lacks (lchat.mesh.witness), so no peer takes its spaces over by its silence alone: the newest
copy must not lose to the bucket's. And the box *recovers* them: for each dirty copy whose lease
still names this box (or names nobody), a wake here takes the lease back (``own``), starts from
that copy and ships it (a snapshot) before the wake is over, and the idle sweep sleeps it later
like any space (the clean-sleep marker); a copy whose
lease names another box is older than that box's (it took the space over) and only stops
counting (its next wake here moves it aside). Recovery runs once the box can take leases: at
start (off a mesh), and each time a mesh box becomes alive (its first landed heartbeat, or back
from a lapse). One space at a time; a failure is logged and tried again at the next recovery.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from prometheus_client import Counter, Gauge
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from lchat.hibernation import localdb
from lchat.hibernation.space import WakeFailed
from lchat.objstore import ObjectStoreError
from lchat.registry import Route
from lchat.routesource import RouteSource
from lchat.threads import RunInThread

_log = Logger(namespace="lchat.activator")

DIRTY = Gauge(
    "lchat_local_copies_dirty",
    "Hibernating spaces whose local copy on this box may hold writes the bucket lacks (not "
    "running here, no clean-sleep marker): while any is, this box's spaces are not taken over "
    "by its silence alone",
)
RECOVERIES = Counter(
    "lchat_local_copy_recoveries_total",
    "Dirty local copies handled by the recovery, by outcome: shipped (woken here and slept: the "
    "bucket has it now), stale (its lease names another box), failed (tried again later)",
    ["outcome"],
)
for _outcome in ("shipped", "stale", "failed"):
    RECOVERIES.labels(_outcome)


class Waker(Protocol):
    """What the recovery needs of the activator."""

    def holds(self, host: str) -> bool: ...

    def wake(self, route: Route, reason: str) -> Deferred[None]: ...

    @property
    def stopping(self) -> bool: ...


class LocalCopies:
    """The dirty local copies of one box (see the module docstring)."""

    def __init__(
        self,
        routes: RouteSource,
        run_in_thread: RunInThread,
        data_dir: str,
        box_id: str,
        lease_owner: Callable[[str], Deferred[str | None]],
    ) -> None:
        """``lease_owner(host)``: who the space's lease names now (None: no lease), from the
        bucket; fails when the bucket cannot be read."""
        self._routes = routes
        self._run = run_in_thread
        self._data_dir = data_dir
        self._box_id = box_id
        self._lease_owner = lease_owner
        self.dirty: set[str] = set()
        self._sweeping = False
        self._again = False

    def __bool__(self) -> bool:
        return bool(self.dirty)

    def _set(self, host: str, dirty: bool) -> None:
        if dirty:
            self.dirty.add(host)
        else:
            self.dirty.discard(host)
        DIRTY.set(len(self.dirty))

    def _db(self, route: Route) -> str:
        return route.database(self._data_dir)

    async def scan(self, running: Callable[[str], bool]) -> None:
        """At start: every hibernating space's copy here, checked (one stat each, in a thread)."""
        routes = [r for r in self._routes.table.routes.values() if r.hibernate]
        dbs = {r.host: self._db(r) for r in routes if r.kind == "instance"}

        def check() -> list[str]:
            return [h for h, db in dbs.items() if _dirty(db)]

        found = await self._run(check)
        for host in found:
            if not running(host):
                self._set(host, True)
        if found:
            _log.warn(
                "activator: {n} local copies may hold writes the bucket lacks (not cleanly slept: "
                "{hosts}); they are recovered once this box can take leases",
                n=len(found),
                hosts=", ".join(sorted(found)[:10]) + (" ..." if len(found) > 10 else ""),
            )

    def awake(self, host: str) -> None:
        """``host`` runs here now: its replicator's lag says what it has not shipped."""
        self._set(host, False)

    def stood_down(self, host: str, db: str, running: Callable[[str], bool]) -> Deferred[None]:
        """``host`` stood down here: dirty unless its final flush wrote the marker (or its copy
        was moved aside). ``running(host)``: it woke here again meanwhile (then it is not)."""

        def done(dirty: bool) -> None:
            self._set(host, dirty and not running(host))

        d: Deferred[None] = self._run(_dirty, db).addCallback(done)
        d.addErrback(
            lambda f: _log.failure("activator: checking {host}'s copy failed", f, host=host)
        )
        return d

    async def recover(self, waker: Waker) -> None:
        """Ship every dirty copy whose lease is still this box's (see the module docstring).
        Never raises; a recovery asked for while one runs runs again after it."""
        if self._sweeping:
            self._again = True
            return
        self._sweeping = True
        try:
            while True:
                self._again = False
                for host in sorted(self.dirty):
                    if waker.stopping:
                        return
                    if not waker.holds(host):
                        await self._recover_one(waker, host)
                if not self._again:
                    return
        except Exception:
            _log.failure("activator: recovering local copies failed")
        finally:
            self._sweeping = False

    async def _recover_one(self, waker: Waker, host: str) -> None:
        route = self._routes.table.get(host)
        if route is None or not route.hibernating:
            self._set(host, False)  # not a hibernating space any more: not ours to ship
            return
        try:
            owner = await self._lease_owner(host)
        except (ObjectStoreError, OSError) as e:
            RECOVERIES.labels("failed").inc()
            _log.warn(
                "activator: {host}: cannot read its lease to recover its local copy ({error}); "
                "trying again later",
                host=host,
                error=e,
            )
            return
        if owner is not None and owner != self._box_id:
            RECOVERIES.labels("stale").inc()
            self._set(host, False)
            _log.info(
                "activator: {host}: its local copy is older than the space's: {owner} took it "
                "over (the copy is moved aside at its next wake here)",
                host=host,
                owner=owner,
            )
            return
        _log.warn(
            "activator: {host}: recovering its local copy, which may hold writes the bucket "
            "lacks: waking it here to ship them",
            host=host,
        )
        try:
            await waker.wake(route, "recover")
        except WakeFailed as e:
            RECOVERIES.labels("failed").inc()
            _log.warn(
                "activator: {host}: recovery wake failed ({reason}); tried again at the next "
                "recovery",
                host=host,
                reason=e.reason,
            )
            return
        # Shipped: the wake started replication with a snapshot of that copy. The idle sweep
        # sleeps it like any other (a request may be using it already).
        RECOVERIES.labels("shipped").inc()


def _dirty(db: str) -> bool:
    """Blocking: is the copy at ``db`` present with no valid clean-sleep marker?"""
    if not os.path.exists(db):
        return False
    return localdb.local_state(db).marker_txid is None

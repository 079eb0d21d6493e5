"""One database's backup replicator in a process of its own: ``lchat backup replicate``.

The router's backup (:mod:`lchat.backup.service`) runs inside the router, so a database another
process keeps writing while the router is down (a space run by its ``lchat@<host>`` unit,
``lchat-home``'s ``home.db``) would have no RPO until the router is back. The units
``lchat-backup@<host>`` and ``lchat-backup-home`` run this beside their writer instead: the
same :class:`~lchat.replica.replicator.Replicator` on the same backup bucket, at the same replica
path (:class:`~lchat.backup.layout.Layout`) and interval (``LCHAT_BACKUP_INTERVAL``) as the
router would use, so either may ship the database and a restore reads one replica.

Invariants:

- **One replicator per database, enforced.** The replicator runs only while this process holds
  the database's :class:`~lchat.backup.lock.ReplicaLock`. Held by the router, this waits
  (polling with backoff, at most :data:`WAIT_CAP` seconds apart) and takes over once the router
  lets go (its stop's final sync releases it); a router that starts later finds it held and
  leaves the database to this one; once this one stops, the router's next rescan takes it.
- **A bounded final sync at stop.** :meth:`UnitReplicator.stop` (SIGTERM: ``systemctl stop``, a
  ``BindsTo=`` writer stopping) ends the wait, or ships what is committed (at most
  ``release_budget`` seconds), closes the database, then releases the lock.
- **Never beside the activator.** The activator replicates a hibernating space's database (to the
  hibernation bucket) without this lock; ``hibernate --on`` stops this unit (bound to the space's
  unit) before the activator takes it. In case something starts it anyway, ``hibernating`` (the
  space's row says so) is checked before the lock is taken and again once it is held: a
  hibernating space's database is never opened here.
- **A start that fails is retried** (backoff 1 s doubling to 5 min) with the lock kept: the
  bucket being down is not a reason to hand the database to another replicator.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from lchat.backoff import Backoff
from lchat.backup.layout import Layout
from lchat.backup.lock import ReplicaLock, lock_path
from lchat.config import BackupConfig
from lchat.objstore import ObjectStore
from lchat.replica.replicator import Replicator
from lchat.threads import RunInThread

_log = Logger(namespace="lchat.backup.unit")

ROLE = "lchat backup replicate"  # what the lock file says of us
WAIT = Backoff(0.5, 5.0)  # polling a lock held elsewhere (or a database not there yet)
WAIT_CAP = WAIT.cap
START_BACKOFF = Backoff(1.0, 300.0)
RELEASE_BUDGET = 30.0  # the longest the final sync may take (the units' TimeoutStopSec is above)

ReplicatorFactory = Callable[[ObjectStore, str, str], Replicator]  # (store, db path, replica path)


class UnitReplicator:
    """Replicates ``db_path`` as ``name`` to the backup bucket until :meth:`stop` (see the module
    docstring). :meth:`run` returns True when everything committed was in the backup at the end
    (or nothing was ever started), False when the final sync could not finish."""

    def __init__(
        self,
        reactor: IReactorTime,
        store: ObjectStore,
        cfg: BackupConfig,
        *,
        data_dir: str,
        db_path: str,
        name: str,
        run_in_thread: RunInThread,
        replicator: ReplicatorFactory | None = None,
        release_budget: float = RELEASE_BUDGET,
        hibernating: Callable[[], bool] | None = None,  # blocking: run in a thread
    ) -> None:
        self._reactor = reactor
        self._store = store
        self._cfg = cfg
        self.db_path = os.path.abspath(db_path)
        self.name = name
        self.replica = Layout(cfg.prefix, cfg.box).replica_path(name)
        self.lock = ReplicaLock(lock_path(data_dir, name), ROLE)
        self._run = run_in_thread
        self._make = replicator or self._replicator
        self._release_budget = release_budget
        self._hibernating = hibernating
        self.replicator: Replicator | None = None
        self.state = "waiting"  # waiting, starting, running, stopping, stopped
        self._stop_asked = False
        self._wake: Deferred[None] | None = None
        self._timer: IDelayedCall | None = None

    def _replicator(self, store: ObjectStore, db: str, replica: str) -> Replicator:
        return Replicator(self._reactor, store, db, replica, interval=self._cfg.interval)

    def stop(self) -> None:
        """Wind down (SIGTERM): :meth:`run` ends after the final sync. Idempotent."""
        if not self._stop_asked:
            _log.info("backup: {name}: asked to stop", name=self.name)
        self._stop_asked = True
        self._wake_up()

    def _wake_up(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.callback(None)

    async def _pause(self, delay: float | None) -> None:
        """``delay`` seconds (None: until :meth:`stop`), cut short by :meth:`stop`."""
        if self._stop_asked:
            return
        self._wake = Deferred()
        if delay is not None:
            self._timer = self._reactor.callLater(delay, self._wake_up)
        await self._wake

    async def run(self) -> bool:
        try:
            if not await self._take_lock():
                return True
            if not await self._start():
                return True
            await self._pause(None)
            return await self._final_sync()
        finally:
            self.state = "stopped"
            await self._run(self.lock.release)

    async def _take_lock(self) -> bool:
        """Wait for the database and its lock; False: stopped before both were there."""
        said = ""
        attempt = 0
        while not self._stop_asked:
            if await self._hibernates():
                why = "its space hibernates: the activator replicates it"
            elif not await self._run(os.path.isfile, self.db_path):
                why = f"{self.db_path} does not exist yet"
            elif await self._run(self.lock.acquire):
                if await self._hibernates():  # flipped meanwhile: never opened here
                    await self._run(self.lock.release)
                    continue
                if said:
                    _log.info(
                        "backup: {name}: {why} no longer: taking it over",
                        name=self.name,
                        why=said,
                    )
                return True
            else:
                holder = await self._run(self.lock.holder) or "another process"
                why = f"replicated by {holder} (lock {self.lock.path})"
            if why != said:
                _log.info(
                    "backup: {name}: {why}; waiting (checked every {cap:g}s at most)",
                    name=self.name,
                    why=why,
                    cap=WAIT_CAP,
                )
                said = why
            attempt += 1
            await self._pause(WAIT.delay(attempt))
        return False

    async def _hibernates(self) -> bool:
        return self._hibernating is not None and bool(await self._run(self._hibernating))

    async def _start(self) -> bool:
        """Start the replicator (retried while the bucket fails); False: stopped first."""
        failures = 0
        self.state = "starting"
        while not self._stop_asked:
            replicator = self._make(self._store, self.db_path, self.replica)
            try:
                await replicator.start()
            except Exception as e:
                await replicator.stop()
                failures += 1
                delay = START_BACKOFF.delay(failures)
                _log.error(
                    "backup: {name} cannot start replicating to {replica}: {error} (retry in "
                    "{delay:.0f}s)",
                    name=self.name,
                    replica=self.replica,
                    error=e,
                    delay=delay,
                )
                await self._pause(delay)
                continue
            self.replicator, self.state = replicator, "running"
            _log.info(
                "backup: {name} ({path}) replicating to {replica} every {interval:g}s, txid "
                "{txid:016x} (lchat backup replicate: the router leaves it to this process)",
                name=self.name,
                path=self.db_path,
                replica=self.replica,
                interval=self._cfg.interval,
                txid=replicator.txid,
            )
            return True
        return False

    async def _final_sync(self) -> bool:
        replicator = self.replicator
        assert replicator is not None
        self.state = "stopping"
        flush = Deferred.fromCoroutine(replicator.flush())
        flush.addTimeout(self._release_budget, self._reactor)
        synced = True
        try:
            await flush
        except Exception as e:
            synced = False
            _log.warn("backup: the final sync of {name} failed: {error}", name=self.name, error=e)
        await replicator.stop()
        self.replicator = None
        _log.info(
            "backup: {name} stopped; {synced}",
            name=self.name,
            synced=f"in the backup up to txid {replicator.txid:016x}"
            if synced
            else "its last commits may not be in the backup",
        )
        return synced

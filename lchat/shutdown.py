"""The order the router stops in: the services ``lchat.tap`` wires whose only job is to stop
their children in an order that loses nothing.

``twistd`` stops a MultiService's children all at once; each service here (:class:`InOrder`,
:class:`BackupService`, :class:`HibernationService`, :class:`FrontDoor`) waits instead, in the
order its docstring gives.

Beside them, the small services of the composition root: a bucket's boot probe
(:class:`BucketCheck`), SIGHUP's reload (:class:`SignalReload`), a line said at start
(:class:`SayOnce`). Every clock arrives through a constructor (``task.Clock`` in tests).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorCore, IReactorFromThreads, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import objstore
from lchat.deferutil import settled
from lchat.proxy.downstream import ProxyFactory
from lchat.proxy.serve import FrontListener, FrontPort
from lchat.proxy.upstream import UpstreamPool

if TYPE_CHECKING:  # (types only: a worker process (lchat.worker_tap) imports no control plane)
    from lchat.backup.service import Backup
    from lchat.buckets import RegionBuckets
    from lchat.hibernation.activator import Activator
    from lchat.hibernation.sweeper import Sweeper
    from lchat.mesh.due import DuePush
    from lchat.mesh.membership import Membership
    from lchat.mesh.routing import MeshRouter

_log = Logger(namespace="lchat.tap")


class InOrder(MultiService):
    """Children stopped one after the other, last added first, each waited for."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.setName(name)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return Deferred.fromCoroutine(self._stop_each())

    async def _stop_each(self) -> None:
        for child in reversed(list(self)):
            try:
                await maybeDeferred(child.stopService)
            except Exception:
                _log.failure("{name} did not stop cleanly", name=getattr(child, "name", child))


class BackupService(MultiService):
    """The backup bucket's probe, then the backup (which closes the bucket when it stops)."""

    def __init__(self, check: BucketCheck, backup: Backup, clock: IReactorTime) -> None:
        super().__init__()
        self.setName("backup")
        self._clock = clock
        self.check = check
        self.backup = backup
        check.setServiceParent(self)
        backup.setServiceParent(self)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        # A boot probe still in flight finishes before the backup closes its bucket (bounded).
        await probe_done(self.check, self._clock)
        self.check.stopService()
        await self.backup.stopService()


class HibernationService(MultiService):
    """The bucket, the activator, its sweeps and the mesh's membership, stopped in order: sweeps,
    then a "draining" heartbeat (peers drop us from placement and take our spaces over as we
    release them), the bucket's other users, the activator's drain (flush and release every awake
    space), the heartbeat's deletion, and only then the bucket clients."""

    def __init__(
        self,
        clock: IReactorTime,
        store: objstore.ObjectStore,
        check: BucketCheck,
        activator: Activator,
        sweeper: Sweeper,
        membership: Membership | None,
        mesh: MeshRouter | None,
        due_push: DuePush | None = None,
        *,
        mesh_store: objstore.ObjectStore | None = None,  # LCHAT_MESH_BUCKET's, when set
        mesh_check: BucketCheck | None = None,
        regions: RegionBuckets | None = None,  # the other regions' buckets (a failover's)
    ) -> None:
        super().__init__()
        self.setName("hibernation")
        self._clock = clock
        self.store = store
        self.check = check
        self.activator = activator
        self.sweeper = sweeper
        self.membership = membership
        self.mesh = mesh
        self.due_push = due_push
        self.mesh_store = mesh_store
        self.mesh_check = mesh_check
        self.regions = regions
        self._bucket_users: list[Service] = []
        for service in (check, mesh_check, membership, activator, sweeper, due_push):
            if service is not None:
                service.setServiceParent(self)

    def add_bucket_user(self, service: Service) -> None:
        """A service that uses the bucket (the shared certificate cache): started with the rest,
        stopped before the bucket client closes."""
        self._bucket_users.append(service)
        service.setServiceParent(self)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        self.sweeper.stopService()
        self.check.stopService()
        if self.mesh_check is not None:
            self.mesh_check.stopService()
        return Deferred.fromCoroutine(self._drain())

    async def _drain(self) -> None:
        # The bucket's other users stop alongside (each within a few seconds of its own)...
        users = [maybeDeferred(u.stopService) for u in reversed(self._bucket_users)]
        if self.membership is not None:
            # ...but our heartbeat says "draining" first: peers drop us from placement and take
            # our spaces over as we release them, while our leases stay fenced by a heartbeat
            # that goes on beating until the drain is over (docs/lease.md).
            await self.membership.begin_drain()
        for stopping in users:
            await stopping
        await self.activator.stopService()
        if self.due_push is not None:
            # The due times of the spaces the drain just slept reach the peers (bounded).
            await self.due_push.stopService()
        if self.membership is not None:
            # Every lease released (or given up): the heartbeat goes, and with it this box.
            await self.membership.stopService()
        await probe_done(self.check, self._clock)
        await self.store.close()
        if self.regions is not None:
            await self.regions.close()  # (after the drain: a space's final flush may go there)
        if self.mesh_store is not None:
            assert self.mesh_check is not None
            await probe_done(self.mesh_check, self._clock)
            await self.mesh_store.close()


async def probe_done(check: BucketCheck, clock: IReactorTime) -> None:
    """A boot probe still in flight must finish before its store closes (it is bounded by the
    store's own timeouts; this wait is bounded again, to keep shutdown bounded)."""
    probe = settled(check.checked)
    probe.addTimeout(10, clock)
    try:
        await probe
    except Exception:
        _log.warn("the bucket probe was still running at shutdown")


class BucketCheck(Service):
    """At start, prove a bucket is reachable and writable; if not, stop the router.

    twistd builds services before its reactor runs, so the probe runs at start; a failure logs
    one line naming the variables (``<stem>_BUCKET``...) and ends the process with status 1
    (systemd shows it and retries).
    """

    def __init__(
        self,
        reactor: IReactorCore,  # stopped when the probe fails
        store: objstore.ObjectStore,
        key: str,
        stem: str,
        bucket: str,
    ) -> None:
        self._reactor = reactor
        self.store = store
        self._key = key
        self._stem = stem  # LCHAT_HIBERNATE or LCHAT_BACKUP
        self._bucket = bucket
        self.checked: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        d = Deferred.fromCoroutine(objstore.probe_writable(self.store, self._key))
        d.addCallbacks(self._ok, self._failed)
        d.addBoth(lambda _: self.checked.callback(None) if not self.checked.called else None)

    def _ok(self, _: object) -> None:
        _log.info(
            "bucket {bucket} ({stem}_BUCKET) is reachable and writable",
            bucket=self.store.describe(),
            stem=self._stem,
        )

    def _failed(self, failure: Failure) -> None:
        stem = self._stem
        check = (
            # One URL carries the bucket, prefix, endpoint, region and the key pair's names.
            f"{stem}_BUCKET's URL and its credentials"
            if stem == "LCHAT_MESH"
            else f"{stem}_BUCKET, {stem}_ENDPOINT, {stem}_REGION, {stem}_PREFIX and the AWS "
            "credentials"
        )
        _log.critical(
            "{stem}_BUCKET={bucket}: the bucket is not usable: {error} (check {check})",
            stem=stem,
            check=check,
            bucket=self._bucket,
            error=failure.getErrorMessage(),
        )
        self.failed = failure
        if self._reactor.running:
            self._reactor.addSystemEventTrigger("after", "shutdown", os._exit, 1)
            self._reactor.stop()


class FrontDoor(MultiService):
    """The proxy's listeners (its children) and their connections. Stopping is the front door's
    drain, in this order, so that no request is lost to a race with the stop:

    1. every listener accepts what the kernel already queued and closes its socket (a peer that
       dials now is refused, and routes around this box);
    2. from now on every answer closes its connection; connections idle between requests close
       now, upgraded ones too (their spaces are stopping); a connection that has not sent its
       first request yet is answered (ProxyFactory.close);
    3. the rest, requests in flight (a hibernating space's are let finish before it stops), may
       take up to ``cfg.drain_grace`` seconds; then they are aborted and idle upstream
       connections closed. TLS handshakes still in progress (connections accepted from the
       queue in step 1 among them) are waited for too, within the same grace: such a client
       becomes a connection, sends its request and gets its answer (and a mesh peer that was
       refused one routes it elsewhere).

    While it runs, the figures of the pool's state (lchat.proxy.state) are reported to ``metrics``
    (Prometheus's registry: one front door runs at a time in a process).
    """

    def __init__(
        self,
        clock: IReactorTime,
        pool: UpstreamPool,
        factories: list[ProxyFactory],
        grace: float,
        metrics: CollectorRegistry | None = None,
    ) -> None:
        super().__init__()
        self.setName("front-door")
        self._clock = clock
        self._pool = pool
        self._factories = factories
        self._grace = grace
        self._metrics = metrics
        self._reporting = False  # the collector is registered with metrics

    def startService(self) -> None:
        if self._metrics is not None and not self._reporting:
            self._metrics.register(self._pool.state.collector)
            self._reporting = True
        super().startService()

    def stopService(self) -> Deferred[None]:
        ports = [s.port for s in self if isinstance(s, FrontListener) and s.port is not None]
        listeners = [maybeDeferred(s.stopService) for s in reversed(list(self))]
        Service.stopService(self)
        return Deferred.fromCoroutine(self._drain(listeners, ports))

    async def _drain(self, listeners: list[Deferred[Any]], ports: list[FrontPort]) -> None:
        for stopped in listeners:
            try:
                await stopped
            except Exception:
                _log.failure("a listener did not stop cleanly")
        deadline = self._clock.seconds() + self._grace
        for factory in self._factories:
            factory.close()
        while True:
            for factory in self._factories:
                await factory.quiesced(max(0.0, deadline - self._clock.seconds()))
            if self._clock.seconds() >= deadline:
                break
            # Quiet only when no handshake is left *and* no factory gained a connection while
            # another was being waited for (a TLS handshake that finished meanwhile: its
            # request would otherwise meet the process's exit, unanswered).
            if not any(p.handshaking for p in ports) and not any(
                f.connections for f in self._factories
            ):
                break
            await deferLater(self._clock, 0.05, lambda: None)
        await self._pool.close()
        if self._metrics is not None and self._reporting:  # (once, were it stopped twice)
            self._metrics.unregister(self._pool.state.collector)
            self._reporting = False


class SignalReload(Service):
    """SIGHUP re-reads the registry (the operator's `systemctl reload`): ``reload(reason)`` is
    called on the reactor (``RouteSource.reload``; with workers, the reload that also reaches
    every worker: lchat.workers). A failure is the callable's to log."""

    def __init__(self, reactor: IReactorFromThreads, reload: Callable[[str], object]) -> None:
        self._reactor = reactor
        self._reload = reload
        self._previous: Any = None

    def startService(self) -> None:
        super().startService()

        def handler(signum: int, frame: object) -> None:
            # Signal handlers interrupt arbitrary code; hand the work to the reactor loop.
            self._reactor.callFromThread(self._reload, "SIGHUP")

        self._previous = signal.signal(signal.SIGHUP, handler)

    def stopService(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._previous)
        super().stopService()


class SayOnce(Service):
    """Says something once, at start."""

    def __init__(self, say: Callable[[], None]) -> None:
        self._say = say

    def startService(self) -> None:
        super().startService()
        self._say()

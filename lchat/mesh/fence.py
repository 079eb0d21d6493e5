"""A mesh box's liveness fences its spaces' leases (docs/lease.md).

Two sides of one rule:

- **The holder** (this box) may write on its leases only while :meth:`Membership.alive` says so:
  from its first landed heartbeat until ``dead_after - margin`` after the last successful beat was
  *sent*, on its monotonic clock. Past that, every space stands down (the membership's
  ``on_not_alive`` hook) and no lease is taken until a beat lands again.
- **A taker** (a peer waking one of its spaces) may take over a lease that is still live by its
  TTL when the record names a holder box that is dead by the heartbeat rule — its heartbeat object
  gone, or last written more than ``dead_after`` ago on the *bucket's* clock — or that restarted
  (its heartbeat carries another epoch). :class:`HolderJudge` reads the holder's heartbeat afresh,
  right before :func:`lchat.lease.acquire` writes its conditional (``If-Match``) takeover.

:class:`BoxFence` bundles both for the activator's lifecycle.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen
from twisted.internet import defer
from twisted.logger import Logger

from lchat.hosts import normalise_member_url
from lchat.lease import LeaseRecord, NotAlive
from lchat.mesh.membership import (
    Heartbeat,
    KeyPrefix,
    Membership,
    judged_dead,
    member_key,
)
from lchat.objstore import NotFound, ObjectStore

log = Logger(namespace="lchat.mesh.fence")


def holder_deadline(sent: float, dead_after: float, margin_fraction: float) -> float:
    """The holder's rule: a box whose last successful heartbeat PUT was sent at ``sent`` (its
    monotonic clock) writes nothing on its leases from ``sent + dead_after * (1 -
    margin_fraction)`` on (lchat.mesh.membership.Membership.alive)."""
    return sent + dead_after - dead_after * margin_fraction


@frozen
class HolderJudge:
    """Judges a live lease's holder box by its heartbeat in the mesh's bucket.

    ``__call__(record)``: ``"holder dead"`` when the heartbeat named by ``record.box`` is gone or
    its ``Last-Modified`` is at least ``dead_after`` old on the bucket's clock (judged from
    ``floor(Last-Modified) + 1 s``, since stores truncate it to whole seconds: never early);
    ``"holder restarted"`` when the heartbeat carries an epoch other than the record's; None when
    the box is alive (draining included: it still writes its last flushes), or when the record or
    the heartbeat cannot be read as ours (not knowing is not dead). Store errors propagate.
    """

    store: ObjectStore  # the mesh's bucket (LCHAT_MESH_BUCKET, or the hibernation bucket)
    where: KeyPrefix
    dead_after: float

    async def __call__(self, record: LeaseRecord) -> str | None:
        try:
            url = normalise_member_url(record.box)
        except ValueError:
            return None
        key = member_key(self.where, url)
        try:
            obj = await self.store.get(key)
        except NotFound:
            # A 404 may name the bucket, not the key (S3's NoSuchBucket: the mesh's bucket was
            # deleted, or LCHAT_MESH_BUCKET names one that is not there), which says nothing about
            # the holder. A LIST fails on a missing bucket and lists nothing when only the
            # heartbeat is gone: not knowing is not dead.
            if any(info.key == key for info in await self.store.list(key)):
                return None  # it beat again between our GET and our LIST: alive
            log.info("lease {host}: holder {box} is dead (no heartbeat)", host=record.host, box=url)
            return "holder dead"
        now = await self.store.now()  # after the GET: the heartbeat is no younger than it looks
        age = (now - obj.info.last_modified).total_seconds()
        if judged_dead(obj.info.last_modified, now, self.dead_after):
            log.info(
                "lease {host}: holder {box} is dead (last heartbeat {age:.1f}s ago, dead after "
                "{dead_after:g}s)",
                host=record.host,
                box=url,
                age=age,
                dead_after=self.dead_after,
            )
            return "holder dead"
        try:
            heartbeat = Heartbeat.parse(obj.body)
        except ValueError:
            return None
        newer = record.epoch_started is None or heartbeat.started_at > record.epoch_started
        if record.epoch and heartbeat.epoch and heartbeat.epoch != record.epoch and newer:
            # (Only a *newer* epoch: a late beat of an older process — sent before it died,
            # landing after its successor's — says nothing about the successor.)
            log.info(
                "lease {host}: holder {box} restarted (epoch {epoch} took the lease, {now} beats)",
                host=record.host,
                box=url,
                epoch=record.epoch[:8],
                now=heartbeat.epoch[:8],
            )
            return "holder restarted"
        return None


@frozen
class BoxFence:
    """What the lifecycle needs from the mesh to take and keep leases (docs/lease.md)."""

    membership: Membership
    judge: HolderJudge

    @property
    def box(self) -> str:
        return self.membership.url

    @property
    def epoch(self) -> str:
        return self.membership.epoch

    @property
    def epoch_started(self) -> float:
        return self.membership.body.started_at

    def alive(self) -> bool:
        return self.membership.alive()

    async def holder_check(self, record: LeaseRecord) -> str | None:
        return await self.judge(record)

    async def ready(self, reactor: Any, budget: float) -> None:
        """Return once this box may take a lease: at once while alive; after the first beat
        lands at boot (at most ``budget`` seconds); :class:`NotAlive` when a beat that landed
        before is too old now (the box is cut off from its bucket)."""
        if self.alive():
            return
        first = self.membership.first_beat()
        if first.called:
            raise NotAlive(
                f"no heartbeat of {self.box} has landed for {self.membership.dead_after * 0.9:g}s"
            )
        first.addTimeout(budget, reactor)
        try:
            await first
        except defer.TimeoutError as e:
            raise NotAlive(f"no heartbeat of {self.box} has landed within {budget:g}s") from e
        # (A CancelledError is the caller calling the wait off, a drain: passed on as it is.)
        if not self.alive():
            raise NotAlive(f"the first heartbeat of {self.box} is already too old")

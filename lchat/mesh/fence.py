"""A mesh box's liveness fences its spaces' leases (docs/lease.md): two sides of one rule.

- **The holder** (this box) writes on its leases only while :meth:`Membership.alive` says so (the
  deadline :class:`lchat.mesh.liveness.Liveness` keeps); past it, every space stands down and no
  lease is taken until a beat lands again.
- **A taker** (a peer waking one of its spaces) may take over a lease that is still live by its
  TTL only when :class:`HolderJudge` finds the holder box dead, reading its heartbeat afresh right
  before :func:`lchat.lease.acquire` writes its conditional (``If-Match``) takeover. A holder that
  restarted or came back from a lapse is alive: it takes its own leases back itself, from its own
  copy, which may be newer than the bucket's (the newest copy wins).

:class:`BoxFence` bundles both for the activator's lifecycle.
"""

from __future__ import annotations

from attrs import frozen
from prometheus_client import Counter
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.hosts import normalise_member_url
from lchat.lease import LeaseRecord, NotAlive
from lchat.mesh.heartbeat import Heartbeat
from lchat.mesh.members import KeyPrefix, judged_dead, member_key
from lchat.mesh.membership import Membership
from lchat.objstore import NotFound, ObjectStore

log = Logger(namespace="lchat.mesh.fence")

JUDGEMENTS = Counter(
    "lchat_lease_holder_judgements_total",
    "Judgements of a live lease's holder box before a takeover, by outcome: alive (its heartbeat "
    "is fresh), witnessed (stale, but heard within dead_after, holding writes the bucket lacks, or "
    "never answered here), answers (stale, but it answered a probe), dead (taken over)",
    ["outcome"],
)
for _outcome in ("alive", "witnessed", "answers", "dead"):
    JUDGEMENTS.labels(_outcome)


@frozen
class HolderJudge:
    """Judges a live lease's holder box by its heartbeat in the mesh's bucket and, with a
    ``witness`` (this box's membership), by what the peers told this box.

    ``__call__(record)``: ``"holder dead"`` when the heartbeat named by ``record.box`` is gone or
    :func:`judged_dead` on the bucket's clock, and — with a witness, and a holder running an
    lchat that takes part — its silence is witnessed here (:meth:`Witnesses.silent`) or its
    heartbeat is older than any holder lives on its peers' word (:meth:`Witnesses.slow_after`),
    and a probe of it fails. None otherwise (not knowing is not dead; a record naming this box
    is its own to take back). Store errors propagate.
    """

    store: ObjectStore  # the mesh's bucket (LCHAT_MESH_BUCKET, or the hibernation bucket)
    where: KeyPrefix
    dead_after: float
    witness: Membership | None = None

    async def __call__(self, record: LeaseRecord) -> str | None:
        try:
            url = normalise_member_url(record.box)
        except ValueError:
            return None
        witness = self.witness
        if witness is not None and url == witness.url:
            return None  # our own box's: acquire's reclaim_own takes it back
        key = member_key(self.where, url)
        heartbeat: Heartbeat | None = None
        age = float("inf")
        try:
            obj = await self.store.get(key)
        except NotFound:
            # A 404 may name the bucket, not the key (S3's NoSuchBucket: the mesh's bucket was
            # deleted, or LCHAT_MESH_BUCKET names one that is not there), which says nothing about
            # the holder. A LIST fails on a missing bucket and lists nothing when only the
            # heartbeat is gone: not knowing is not dead.
            if any(info.key == key for info in await self.store.list(key)):
                JUDGEMENTS.labels("alive").inc()
                return None  # it beat again between our GET and our LIST: alive
            gone = True
        else:
            gone = False
            now = await self.store.now()  # after the GET: no younger than it looks
            age = (now - obj.info.last_modified).total_seconds()
            if not judged_dead(obj.info.last_modified, now, self.dead_after):
                JUDGEMENTS.labels("alive").inc()
                return None
            try:
                heartbeat = Heartbeat.parse(obj.body)
            except ValueError:
                return None
        said = "no heartbeat" if gone else f"last heartbeat {age:.1f}s ago"
        if witness is not None and (heartbeat is None or heartbeat.process):
            witnesses = witness.witnesses
            slow = gone or age >= witnesses.slow_after()
            why_not = (
                None
                if slow
                else witnesses.silent(
                    url,
                    heartbeat.process if heartbeat is not None else None,
                    witness.epoch,
                    witness.now(),
                )
            )
            if why_not is not None:
                JUDGEMENTS.labels("witnessed").inc()
                log.info(
                    "lease {host}: holder {box} is not judged dead ({said}, dead after "
                    "{dead_after:g}s): {why}",
                    host=record.host,
                    box=url,
                    said=said,
                    dead_after=self.dead_after,
                    why=why_not,
                )
                return None
            if await witness.probe(url):
                JUDGEMENTS.labels("answers").inc()
                log.info(
                    "lease {host}: holder {box} is not judged dead ({said}): it answers this box",
                    host=record.host,
                    box=url,
                    said=said,
                )
                return None
        JUDGEMENTS.labels("dead").inc()
        log.info(
            "lease {host}: holder {box} is dead ({said}, dead after {dead_after:g}s)",
            host=record.host,
            box=url,
            said=said,
            age=age,
            dead_after=self.dead_after,
        )
        return "holder dead"


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

    def bucket_reachable(self) -> bool:
        return self.membership.bucket_reachable()

    async def holder_check(self, record: LeaseRecord) -> str | None:
        return await self.judge(record)

    async def ready(self, reactor: IReactorTime, budget: float) -> None:
        """Return once this box may take a lease: at once while alive; after the first beat
        lands at boot (at most ``budget`` seconds); :class:`NotAlive` when a beat that landed
        before is too old now (the box is cut off from its bucket)."""
        if self.alive():
            return
        first = self.membership.first_beat()
        if first.called:
            raise NotAlive(
                f"{self.box} is not alive: no heartbeat of it lands in the bucket, and its "
                "peers' word does not cover it"
            )
        first.addTimeout(budget, reactor)
        try:
            await first
        except defer.TimeoutError as e:
            raise NotAlive(f"no heartbeat of {self.box} has landed within {budget:g}s") from e
        # (A CancelledError is the caller calling the wait off, a drain: passed on as it is.)
        if not self.alive():
            raise NotAlive(f"the first heartbeat of {self.box} is already too old")

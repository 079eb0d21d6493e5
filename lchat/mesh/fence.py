"""A mesh box's liveness fences its spaces' leases (docs/lease.md).

Two sides of one rule:

- **The holder** (this box) may write on its leases only while :meth:`Membership.alive` says so:
  from its first landed heartbeat until its deadline — ``dead_after - margin`` after the last
  heartbeat that landed in the bucket was *sent* (W1), or for as long as its peers' word covers it
  (W2, lchat.mesh.witness), on its monotonic clock. Past that, every space stands down (the
  membership's ``on_not_alive`` hook) and no lease is taken until a beat lands again.
- **A taker** (a peer waking one of its spaces) may take over a lease that is still live by its
  TTL when the record names a holder box that is dead: its heartbeat in the bucket is gone or too
  old on the *bucket's* clock, **and** its silence is witnessed — this box holds an answer of the
  holder's process, has not heard from it for ``dead_after`` and was not told it holds writes the
  bucket lacks (or the heartbeat is older than any holder can live on its peers' word) — **and** a
  direct probe of it fails. :class:`HolderJudge` reads the heartbeat afresh, right before
  :func:`lchat.lease.acquire` writes its conditional (``If-Match``) takeover. A holder that
  restarted or came back from a lapse is alive: it takes its own leases back itself, from its own
  copy, which may be newer than the bucket's (the newest copy wins).

:class:`BoxFence` bundles both for the activator's lifecycle.
"""

from __future__ import annotations

from typing import Protocol

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
from lchat.mesh.witness import Witnesses
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


def holder_deadline(sent: float, dead_after: float, margin_fraction: float) -> float:
    """The holder's rule: a box whose last successful heartbeat PUT was sent at ``sent`` (its
    monotonic clock) writes nothing on its leases from ``sent + dead_after * (1 -
    margin_fraction)`` on (lchat.mesh.membership.Membership.alive), unless its peers' word
    keeps it alive longer (lchat.mesh.witness)."""
    return sent + dead_after - dead_after * margin_fraction


class Witness(Protocol):
    """What a taker needs of this box's own membership (lchat.mesh.membership.Membership)."""

    url: str
    witnesses: Witnesses

    @property
    def epoch(self) -> str: ...

    def now(self) -> float: ...

    async def probe(self, url: str) -> bool: ...


@frozen
class HolderJudge:
    """Judges a live lease's holder box by its heartbeat in the mesh's bucket and, with a
    ``witness`` (this box's membership), by what the peers told this box.

    ``__call__(record)``: ``"holder dead"`` when the heartbeat named by ``record.box`` is gone or
    its ``Last-Modified`` is at least ``dead_after`` old on the bucket's clock (judged from
    ``floor(Last-Modified) + 1 s``, since stores truncate it to whole seconds: never early), and —
    with a witness, and a holder running an lchat that takes part — its silence is witnessed here
    (:meth:`Witnesses.silent`) or its heartbeat is older than any holder lives on its peers' word
    (:meth:`Witnesses.slow_after`), and a probe of it fails. None otherwise (not knowing is not
    dead; a record naming this box is its own to take back). Store errors propagate.
    """

    store: ObjectStore  # the mesh's bucket (LCHAT_MESH_BUCKET, or the hibernation bucket)
    where: KeyPrefix
    dead_after: float
    witness: Witness | None = None

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
        """Did this box's last heartbeat PUT succeed? A wake needs the bucket: while not, it is
        refused at once (a 503 within a second, not after the store's timeouts)."""
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

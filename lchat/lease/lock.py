"""The lock object ``<prefix>/<host>/lock.json`` (see :mod:`lchat.lease`): its record, its key,
the expiry rule, and taking it (:func:`acquire`) and giving it back (:func:`release`)."""

from __future__ import annotations

import datetime
import json
import math
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from attrs import asdict, evolve, frozen
from prometheus_client import Counter
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

import lchat
from lchat import hosts
from lchat.objstore import (
    NotFound,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
    PutResult,
    StoredObject,
)

UTC = datetime.UTC
LOCK_NAME = "lock.json"
_MAX_TTL = 1e9  # a corrupt record's absurd TTL must not overflow the date arithmetic
# a lock that keeps vanishing between our reads and writes: give up after this many tries
_ACQUIRE_ATTEMPTS = 5
BOX_NOT_ALIVE = "this box's heartbeat was not refreshed in time"

log = Logger(namespace="lchat.lease")

OPERATIONS = Counter(
    "lchat_lease_operations_total",
    "Lease operations by outcome",
    ["operation", "outcome"],
)
for _operation, _outcomes in (
    ("acquire", ("ok", "held", "error")),
    ("takeover", ("ok", "held")),
    ("renew", ("ok", "lost", "error")),
    ("release", ("ok", "lost", "error")),
    ("retake", ("ok", "held", "error")),  # the lock vanished while held: re-created
):
    for _outcome in _outcomes:
        OPERATIONS.labels(_operation, _outcome)  # exported as 0 before the first event


TAKEOVERS = Counter(
    "lchat_lease_takeovers_total",
    "Leases taken over from another holder, by reason: expired (its TTL passed), holder_dead "
    "(its box's heartbeat is too old or gone, and its silence is witnessed), own (this box's "
    "previous process, or its liveness period before a lapse, left it)",
    ["reason"],
)
for _reason in ("expired", "holder_dead", "own"):
    TAKEOVERS.labels(_reason)


# --- values and errors --------------------------------------------------------------------------


class LeaseHeld(Exception):
    """Someone else holds a live lease. ``expires_at`` is the earliest instant (bucket clock) at
    which it could be taken over if its holder stops renewing; ``retry_after`` is how many seconds
    that was away when judged (a 503's ``Retry-After``)."""

    def __init__(
        self,
        owner: str,
        expires_at: datetime.datetime,
        retry_after: float = 0.0,
        generation: int = 0,
    ) -> None:
        super().__init__(f"lease held by {owner} until {rfc3339(expires_at)}")
        self.owner = owner
        self.expires_at = expires_at
        self.retry_after = retry_after
        self.generation = generation


class NotAlive(Exception):
    """This box's heartbeat is not fresh (a mesh box: lchat.mesh.fence): it takes no lease, and
    writes on none, until one lands."""


class LeaseLost(Exception):
    """The lease is no longer ours (taken over, gone, or not renewed in time): stand down."""


class LeaseSuspended(Exception):
    """The lock vanished from the bucket and the keeper is re-taking it: do not write now, try
    again shortly. Not a loss: the keeper reports a loss through ``lost`` as always."""


@frozen
class LeaseRecord:
    """The body of ``lock.json``. The first three names are Litestream's leaser's."""

    owner: str
    generation: int
    expires_at: str  # RFC 3339, bucket time of the write + ttl: informational only
    ttl_seconds: float | None = None  # None: not ours (judge by our TTL)
    host: str = ""
    acquired_at: str = ""  # RFC 3339, bucket time of the acquisition (kept across renewals)
    version: str = ""  # lchat version of the holder
    lease_id: str = ""  # random per acquisition; only its holder writes records carrying it
    # On a mesh box: the holder box's LCHAT_MESH_SELF and its process's heartbeat epoch. A lease
    # naming them is fenced by that box's heartbeat (docs/lease.md): a peer may take it over once
    # the box is dead (heartbeat too old or gone, and its silence witnessed), before expiry.
    box: str = ""
    epoch: str = ""
    epoch_started: float | None = None  # when that epoch began (the box's clock): orders epochs

    def to_json(self) -> bytes:
        """The fields in order; a record naming no box leaves out the box's three."""
        data = asdict(self)
        if not self.box:
            del data["box"], data["epoch"], data["epoch_started"]
        elif self.epoch_started is None:
            del data["epoch_started"]
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, body: bytes) -> LeaseRecord:
        """Tolerant: a lock we cannot read is still a lock (owner ``"?"``, judged by our TTL)."""
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return cls(owner="?", generation=0, expires_at="")
        owner, generation = data.get("owner"), data.get("generation")
        return cls(
            owner=owner if isinstance(owner, str) and owner else "?",
            generation=generation if type(generation) is int and generation >= 0 else 0,
            expires_at=_text(data.get("expires_at")),
            ttl_seconds=_number(data.get("ttl_seconds")),
            host=_text(data.get("host")),
            acquired_at=_text(data.get("acquired_at")),
            version=_text(data.get("version")),
            lease_id=_text(data.get("lease_id")),
            box=_text(data.get("box")),
            epoch=_text(data.get("epoch")),
            epoch_started=_number(data.get("epoch_started")),
        )


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@frozen
class HeldLease:
    """A lease we hold, as of our last successful write of it."""

    key: str
    host: str
    owner: str
    generation: int
    ttl: float  # the TTL written in the record: the holder stands down by this one
    lease_id: str
    etag: str  # of our last successful write
    acquired_at: datetime.datetime  # bucket clock (estimate) when we acquired it
    bucket_time: datetime.datetime  # bucket clock read shortly before the last successful write
    written_at: float  # local monotonic time just before the last successful write was sent
    took_over_from: str | None = None  # the expired holder we replaced, if any
    took_over_because: str = ""  # expired | holder dead | own
    box: str = ""  # the holder box and its epoch, written in the record (mesh boxes)
    epoch: str = ""
    epoch_started: float | None = None

    def bucket_now(self, at: float) -> datetime.datetime:
        """The bucket's clock at local monotonic ``at``, estimated from the last reading (for
        the informational ``expires_at``)."""
        return self.bucket_time + datetime.timedelta(seconds=max(0.0, at - self.written_at))

    def record(self, now: datetime.datetime) -> LeaseRecord:
        """The body to write at bucket time ``now`` (an estimate is fine: informational)."""
        return LeaseRecord(
            owner=self.owner,
            generation=self.generation,
            expires_at=rfc3339(now + datetime.timedelta(seconds=self.ttl)),
            ttl_seconds=self.ttl,
            host=self.host,
            acquired_at=rfc3339(self.acquired_at),
            version=lchat.__version__,
            lease_id=self.lease_id,
            box=self.box,
            epoch=self.epoch,
            epoch_started=self.epoch_started,
        )


# A judge of a live lease's holder box (lchat.mesh.fence): why it may be taken over before its
# expiry ("holder dead"), or None while the holder box is alive. Called right
# before the conditional takeover write; a store error propagates (not knowing is not dead).
HolderCheck = Callable[[LeaseRecord], Coroutine[Any, Any, str | None]]


# --- keys, times and the expiry rule ------------------------------------------------------------


def lease_key(prefix: str, host: str) -> str:
    """``<prefix>/<host>/lock.json``; the host is normalised (raises ``hosts.InvalidHost``)."""
    return "/".join(p for p in (prefix.strip("/"), hosts.normalise(host), LOCK_NAME) if p)


def rfc3339(when: datetime.datetime) -> str:
    when = when.astimezone(UTC)
    spec = "milliseconds" if when.microsecond else "seconds"
    return when.isoformat(timespec=spec).replace("+00:00", "Z")


def lease_expiry(
    last_modified: datetime.datetime, record_ttl: float | None, ttl: float
) -> datetime.datetime:
    """When a version written at ``last_modified`` (bucket clock) may be taken over.

    ``floor(last_modified) + 1 s`` bounds the real write from above whether the store truncates to
    whole seconds (S3, moto) or not; the larger TTL is the conservative one. Never early.
    """
    effective = min(max(ttl, record_ttl or 0.0), _MAX_TTL)
    written_by = last_modified.astimezone(UTC).replace(microsecond=0) + datetime.timedelta(
        seconds=1
    )
    return written_by + datetime.timedelta(seconds=math.ceil(effective))


# --- acquire ------------------------------------------------------------------------------------


async def acquire(
    store: ObjectStore,
    key: str,
    owner: str,
    ttl: float,
    *,
    host: str = "",
    monotonic: Callable[[], float],
    reclaim_own: bool = False,
    box: str = "",
    epoch: str = "",
    epoch_started: float | None = None,
    holder_check: HolderCheck | None = None,
) -> HeldLease:
    """Take the lease at ``key`` for ``owner`` or raise :class:`LeaseHeld`.

    ``reclaim_own``: a live lease whose owner is ``owner`` is taken over as if it had expired.
    Only for a caller that knows no other process writes as ``owner`` (the router: one per box,
    whose previous process crashed or stood down without releasing).

    ``box``/``epoch``: written in the record (a mesh box: its URL and heartbeat epoch).
    ``holder_check``: asked about a live lease whose record names a box other than ours (or
    ours with another epoch); a reason it returns lets the lease be taken over at once, with the
    same conditional write (``If-Match`` on the version judged) as an expired one, so two takers
    can never both win. It must read the holder's heartbeat afresh (docs/lease.md).

    Store errors (``StoreUnavailable``, ``AccessDenied`` ...) propagate: not knowing is not
    holding. ``monotonic`` is the local clock the holder's deadline is measured on.
    """
    if ttl <= 0:
        raise ValueError("lease ttl must be positive")
    segments = key.split("/")
    host = host or (segments[-2] if len(segments) >= 2 else key)
    lease_id = uuid.uuid4().hex

    def new_lease(bucket_now: datetime.datetime, sent: float) -> HeldLease:
        return HeldLease(
            key=key,
            host=host,
            owner=owner,
            generation=1,
            ttl=ttl,
            lease_id=lease_id,
            etag="",
            acquired_at=bucket_now,
            bucket_time=bucket_now,
            written_at=sent,
            box=box,
            epoch=epoch,
            epoch_started=epoch_started,
        )

    create = True  # False after losing a takeover race: read the winner, do not PUT again
    raced = False
    # Any of our writes may land unseen (lost answer): none was sent before this instant.
    first_sent = monotonic()
    try:
        for _ in range(_ACQUIRE_ATTEMPTS):
            if create:
                # The bucket's clock, for the informational expires_at/acquired_at only.
                bucket_now = await store.now()
                lease = new_lease(bucket_now, monotonic())
                try:
                    put = await put_lock(store, lease, bucket_now, if_match=None)
                except PreconditionFailed:
                    pass
                else:
                    log.info(
                        "lease {host}: acquired (generation {generation})",
                        host=host,
                        generation=lease.generation,
                    )
                    OPERATIONS.labels("acquire", "ok").inc()
                    return evolve(lease, etag=put.etag)

            current = await read_lock(store, key)
            if current is None:
                create = True  # released between our write and our read: create again
                continue
            record = LeaseRecord.parse(current.body)
            bucket_now = await store.now()  # read after the version: judged at or after it
            if record.lease_id == lease_id:
                # Our own write landed but its answer was lost (a store-level retry got 412).
                # Which of our attempts landed is unknown: date it from the first one (never
                # too late).
                log.info(
                    "lease {host}: acquired (generation {generation}; confirmed by re-reading)",
                    host=host,
                    generation=record.generation,
                )
                OPERATIONS.labels("acquire", "ok").inc()
                return evolve(
                    new_lease(bucket_now, first_sent),
                    etag=current.info.etag,
                    generation=record.generation,
                )
            expiry = lease_expiry(current.info.last_modified, record.ttl_seconds, ttl)
            why = "expired"
            if bucket_now < expiry and reclaim_own and record.owner == owner:
                why = "own"
            elif bucket_now < expiry and holder_check is not None and record.box:
                # Fenced by its box's liveness: a dead box writes nothing more.
                judged = await holder_check(record)
                if judged is not None:
                    why = judged
            if bucket_now < expiry and why == "expired":
                log.info(
                    "lease {host}: held by {owner} until {expires_at}",
                    host=host,
                    owner=record.owner,
                    expires_at=rfc3339(expiry),
                )
                OPERATIONS.labels("takeover" if raced else "acquire", "held").inc()
                retry_after = (expiry - bucket_now).total_seconds()
                raise LeaseHeld(record.owner, expiry, retry_after, record.generation)

            # Expired on the bucket's clock: replace exactly the version we judged.
            lease = evolve(
                new_lease(bucket_now, monotonic()),
                generation=record.generation + 1,
                took_over_from=record.owner,
                took_over_because=why,
            )
            try:
                put = await put_lock(store, lease, bucket_now, if_match=current.info.etag)
            except PreconditionFailed:
                create, raced = False, True  # someone else wrote first: read the winner
                continue
            log.info(
                "lease {host}: taken over from {owner} ({why}), generation {generation}",
                host=host,
                owner=record.owner,
                why=_TAKEOVER_WORDS.get(why, why),
                reason=why,
                generation=lease.generation,
            )
            OPERATIONS.labels("takeover", "ok").inc()
            TAKEOVERS.labels(why.replace(" ", "_")).inc()
            return evolve(lease, etag=put.etag)
    except (LeaseHeld, CancelledError):
        raise
    except Exception:
        OPERATIONS.labels("acquire", "error").inc()
        raise
    # The lock kept changing under us: somebody is busy with it. Report what is there now.
    OPERATIONS.labels("acquire", "held").inc()
    current = await read_lock(store, key)
    if current is None:
        raise LeaseHeld("?", await store.now(), 1.0)
    record = LeaseRecord.parse(current.body)
    expiry = lease_expiry(current.info.last_modified, record.ttl_seconds, ttl)
    raise LeaseHeld(record.owner, expiry, float(ttl), record.generation)


_TAKEOVER_WORDS = {
    "expired": "expired",
    "own": "our own, left by a previous process",
    "holder dead": "holder dead: its box's heartbeat is too old or gone, and it is silent",
}


def put_lock(
    store: ObjectStore, lease: HeldLease, now: datetime.datetime, *, if_match: str | None
) -> Coroutine[Any, Any, PutResult]:
    """Write ``lease``'s record (bucket time ``now``): created (``If-None-Match: *``) when
    ``if_match`` is None, else replacing exactly that version. A failed condition raises
    ``PreconditionFailed``."""
    return store.put(
        lease.key,
        lease.record(now).to_json(),
        if_match=if_match,
        if_none_match=if_match is None,
        content_type="application/json",
    )


async def read_lock(store: ObjectStore, key: str) -> StoredObject | None:
    try:
        return await store.get(key)
    except NotFound:
        return None


# --- release ------------------------------------------------------------------------------------


async def release(
    reactor: IReactorTime, store: ObjectStore, lease: HeldLease, budget: float
) -> bool:
    """Delete our version of the lock (``If-Match``) within ``budget`` seconds.

    True if the lock is free now (we deleted it, or it was already gone); False if someone else
    holds it now, or the store did not answer in time. Never deletes anybody else's: if the
    version changed, the lock is read once and deleted only if the record is still ours
    (``lease_id``: a renewal whose answer we never saw). Timeouts and store errors are logged and
    swallowed: the lease then expires on its own, which is safe, only slower.
    """
    attempt = Deferred.fromCoroutine(_release(store, lease))
    attempt.addTimeout(budget, reactor)
    try:
        outcome = await attempt
    except (defer.TimeoutError, CancelledError):
        log.warn(
            "lease {host}: release did not finish within {budget}s; it expires on its own",
            host=lease.host,
            budget=budget,
        )
        OPERATIONS.labels("release", "error").inc()
        return False
    except ObjectStoreError as e:
        log.warn(
            "lease {host}: release failed ({error}); it expires on its own",
            host=lease.host,
            error=str(e),
        )
        OPERATIONS.labels("release", "error").inc()
        return False
    if outcome == "theirs":
        log.info(
            "lease {host}: not released: someone else holds it now (we had generation "
            "{generation})",
            host=lease.host,
            generation=lease.generation,
        )
        OPERATIONS.labels("release", "lost").inc()
        return False
    log.info(
        "lease {host}: released" + (" (it was already gone)" if outcome == "gone" else ""),
        host=lease.host,
    )
    OPERATIONS.labels("release", "ok").inc()
    return True


async def _release(store: ObjectStore, lease: HeldLease) -> Literal["deleted", "gone", "theirs"]:
    try:
        await store.delete(lease.key, if_match=lease.etag)
        return "deleted"
    except (PreconditionFailed, NotFound):
        pass
    current = await read_lock(store, lease.key)
    if current is None:
        return "gone"
    if LeaseRecord.parse(current.body).lease_id != lease.lease_id:
        return "theirs"  # leave it alone
    try:
        await store.delete(lease.key, if_match=current.info.etag)
        return "deleted"
    except (PreconditionFailed, NotFound):
        return "theirs"  # changed again since we read it: not ours to judge

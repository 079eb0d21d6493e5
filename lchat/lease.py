"""The per-space single-writer lease: ``<prefix>/<host>/lock.json`` in the bucket (docs/design.md §5).

Whoever holds a space's lease is its one writer (docs/design.md §10, invariant 1); everyone else fails
loudly with :class:`LeaseHeld`. The bucket's conditional writes are the only arbiter:

- :func:`acquire` creates the object with ``If-None-Match: *``; if it exists and has expired it
  takes it over with ``If-Match: <etag>`` and ``generation + 1``; a lease that is still live raises
  :class:`LeaseHeld`; losing a 412 race re-reads and reports the winner.
- :class:`LeaseKeeper` renews with ``If-Match`` every TTL/3 and calls ``lost`` exactly once, at the
  latest when the lease could expire as measured on the *local monotonic clock* since the last
  successful renewal was sent, minus a safety margin. After that it never writes again.
- :func:`release` deletes with ``If-Match`` under its own time budget and never deletes anybody
  else's lease.
- A keeper given ``verify_retake`` that finds its lock *gone* (deleted rather than replaced: the
  bucket forgot it, or someone deleted it by hand) does not give up: nobody has taken the lease
  over (a takeover replaces the object, it never deletes it), so it re-creates the lock with
  ``If-None-Match: *`` and ``generation + 1`` (writes on its behalf wait meanwhile:
  :class:`LeaseSuspended`), then asks ``verify_retake`` whether the bucket still shows only its own
  writes. Someone else creating the lock first, or a "no", is a takeover: the keeper releases what
  it re-took (if anything) and reports the loss.

Expiry rule (:func:`lease_expiry`): a version of ``lock.json`` may be taken over once the bucket's
clock (``store.now()``, its ``Date``) reaches ``floor(Last-Modified) + 1 s + ceil(TTL)``, where TTL
is the larger of the record's ``ttl_seconds`` and the judging box's own TTL. Both clocks are the
bucket's, so a box whose clock is wrong can neither steal nor keep a lease. Stores report
``Last-Modified`` truncated to whole seconds, so the real write happened before ``floor + 1 s``:
judging from there is never early (a truncated ``Date`` only makes "now" earlier: later still).
The larger TTL wins because the holder stands down by its *own* TTL (written in the record); a
record without ``ttl_seconds`` (a Litestream leaser wrote it, or it is corrupt) is judged by ours.
``expires_at`` in the body is informational (for humans and tools): it is computed from the
bucket's clock, never ours, but judgement never reads it. A live lock naming our own ``owner`` is
held too: a wedged earlier process of this box may still be writing.

The holder's side is safe by construction: its deadline counts from the local monotonic time *before*
the successful write was sent, which precedes the real write, which precedes ``Last-Modified``'s
upper bound above. So the holder stops believing before anyone else may start.

Each acquisition writes a random ``lease_id``. Only its holder ever writes a record carrying it,
so when a conditional write fails because a store-level retry already applied our own write (the
response was lost), re-reading and finding our ``lease_id`` proves the write was ours.
"""

from __future__ import annotations

import datetime
import heapq
import itertools
import json
import math
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Literal, cast

from attrs import evolve, frozen
from prometheus_client import Counter
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

import lchat
from lchat import hosts
from lchat.backoff import Backoff
from lchat.objstore import (
    NotFound,
    ObjectInfo,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
    StoredObject,
)

UTC = datetime.UTC
LOCK_NAME = "lock.json"
_MAX_TTL = 1e9  # a corrupt record's absurd TTL must not overflow the date arithmetic
_ACQUIRE_ATTEMPTS = 5
BOX_NOT_ALIVE = "this box's heartbeat was not refreshed in time"  # a lock that keeps vanishing between our reads and writes: give up

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
        data: dict[str, Any] = {
            "owner": self.owner,
            "generation": self.generation,
            "expires_at": self.expires_at,
            "ttl_seconds": self.ttl_seconds,
            "host": self.host,
            "acquired_at": self.acquired_at,
            "version": self.version,
            "lease_id": self.lease_id,
        }
        if self.box:
            data["box"], data["epoch"] = self.box, self.epoch
            if self.epoch_started is not None:
                data["epoch_started"] = self.epoch_started
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
        owner, generation, ttl = data.get("owner"), data.get("generation"), data.get("ttl_seconds")
        return cls(
            owner=owner if isinstance(owner, str) and owner else "?",
            generation=generation if type(generation) is int and generation >= 0 else 0,
            expires_at=_text(data.get("expires_at")),
            ttl_seconds=float(ttl)
            if isinstance(ttl, int | float) and not isinstance(ttl, bool) and math.isfinite(ttl)
            else None,
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


def _expiry_of(info: ObjectInfo, record: LeaseRecord, ttl: float) -> datetime.datetime:
    return lease_expiry(info.last_modified, record.ttl_seconds, ttl)


def _host_of(key: str) -> str:
    parts = key.split("/")
    return parts[-2] if len(parts) >= 2 else key


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
    host = host or _host_of(key)
    lease_id = uuid.uuid4().hex
    create = True  # False after losing a takeover race: read the winner, do not PUT again
    raced = False
    # Any of our writes may land unseen (lost answer): none was sent before this instant.
    first_sent = monotonic()
    try:
        for _ in range(_ACQUIRE_ATTEMPTS):
            if create:
                # The bucket's clock, for the informational expires_at/acquired_at only.
                bucket_now = await store.now()
                lease = evolve(
                    _new_lease(key, host, owner, ttl, lease_id, bucket_now, monotonic()),
                    box=box,
                    epoch=epoch,
                    epoch_started=epoch_started,
                )
                try:
                    put = await store.put(
                        key,
                        lease.record(bucket_now).to_json(),
                        if_none_match=True,
                        content_type="application/json",
                    )
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

            current = await _read(store, key)
            if current is None:
                create = True  # released between our write and our read: create again
                continue
            record = LeaseRecord.parse(current.body)
            bucket_now = await store.now()  # read after the version: judged at or after it
            if record.lease_id == lease_id:
                # Our own write landed but its answer was lost (a store-level retry got 412).
                return evolve(
                    _ours(key, host, owner, ttl, current, record, bucket_now, first_sent),
                    box=box,
                    epoch=epoch,
                    epoch_started=epoch_started,
                )
            expiry = _expiry_of(current.info, record, ttl)
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
                _new_lease(key, host, owner, ttl, lease_id, bucket_now, monotonic()),
                generation=record.generation + 1,
                took_over_from=record.owner,
                took_over_because=why,
                box=box,
                epoch=epoch,
                epoch_started=epoch_started,
            )
            try:
                put = await store.put(
                    key,
                    lease.record(bucket_now).to_json(),
                    if_match=current.info.etag,
                    content_type="application/json",
                )
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
    current = await _read(store, key)
    if current is None:
        raise LeaseHeld("?", await store.now(), 1.0)
    record = LeaseRecord.parse(current.body)
    raise LeaseHeld(
        record.owner, _expiry_of(current.info, record, ttl), float(ttl), record.generation
    )


_TAKEOVER_WORDS = {
    "expired": "expired",
    "own": "our own, left by a previous process",
    "holder dead": "holder dead: its box's heartbeat is too old or gone, and it is silent",
}


def _new_lease(
    key: str,
    host: str,
    owner: str,
    ttl: float,
    lease_id: str,
    bucket_now: datetime.datetime,
    sent: float,
) -> HeldLease:
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
    )


async def _read(store: ObjectStore, key: str) -> StoredObject | None:
    try:
        return await store.get(key)
    except NotFound:
        return None


def _ours(
    key: str,
    host: str,
    owner: str,
    ttl: float,
    current: StoredObject,
    record: LeaseRecord,
    bucket_now: datetime.datetime,
    first_sent: float,
) -> HeldLease:
    # Which of our attempts landed is unknown: date it from the first one (never too late).
    lease = evolve(
        _new_lease(key, host, owner, ttl, record.lease_id, bucket_now, first_sent),
        etag=current.info.etag,
        generation=record.generation,
    )
    log.info(
        "lease {host}: acquired (generation {generation}; confirmed by re-reading)",
        host=host,
        generation=lease.generation,
    )
    OPERATIONS.labels("acquire", "ok").inc()
    return lease


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
    current = await _read(store, lease.key)
    if current is None:
        return "gone"
    if LeaseRecord.parse(current.body).lease_id != lease.lease_id:
        return "theirs"  # leave it alone
    try:
        await store.delete(lease.key, if_match=current.info.etag)
        return "deleted"
    except (PreconditionFailed, NotFound):
        return "theirs"  # changed again since we read it: not ours to judge


# --- keeping it ---------------------------------------------------------------------------------


class LeaseKeeper:
    """Renews a held lease every ``renew_every`` seconds with ``If-Match``; reports its loss once.

    ``lost(reason)`` is called exactly once, and the keeper never writes again after it, when:

    - a renewal finds the lock replaced by someone else (``"taken over by <owner>"``) or gone
      (``"gone"``; with ``verify_retake``, see below, only when re-taking it fails that way);
    - no renewal has succeeded for ``ttl - safety_margin`` seconds of the local monotonic clock
      since the last successful write was *sent* (``"could not renew before expiry"``): others
      may take it over from ``ttl`` (plus Last-Modified rounding) after the write, never sooner.

    ``monotonic`` must be the clock :func:`acquire` was given (``lease.written_at`` is on it).
    Store errors are retried with a short capped backoff until that deadline. The TTL is the
    lease's own (the one in the record) on purpose: a keeper with a longer TTL than the record it
    renews would keep believing after others may take over.

    Timers use ``reactor.callLater``; Twisted's reactor clock is the wall clock, so a wall-clock
    step backwards would delay them. With ``monotonic=time.monotonic`` (the router's) and a reactor
    that provides ``IReactorFromThreads``, a watchdog thread sleeping on the monotonic clock also wakes the
    reactor at the deadline, so ``lost`` fires in time even then. :meth:`holds` checks the deadline
    itself, so a caller asking before each write is never told a stale yes. A renewal already sent
    when the loss is declared may still land: it only extends a lease nobody acts on any more.

    ``verify_retake``: a lock found *gone* at a renewal (deleted, not replaced) is re-taken instead
    of lost. A takeover replaces the object (``If-Match`` on an expired version); only a release,
    a person or a bucket that forgot deletes it, so while our deadline has not passed nobody else
    holds the lease. The keeper re-creates the lock (``If-None-Match: *``, ``generation + 1``, a
    new ``lease_id``, dated from the first attempt) and then awaits ``verify_retake(new_lease)``:
    the owner checks that the bucket shows nothing written by anyone else meanwhile (and re-seeds
    what the bucket lost). From the moment the lock is found gone until that check says yes,
    :meth:`holds` stays true but :meth:`ensure_held` raises :class:`LeaseSuspended`: writers wait.
    The check saying no (someone took the lock while it was missing, wrote, and released it), or
    the lock re-created by someone else first, is a takeover: the keeper releases what it re-took
    and reports ``"taken over ..."``. A check that fails (store error) is asked again after the
    next renewal, sooner than the usual period.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        store: ObjectStore,
        lease: HeldLease,
        lost: Callable[[str], None],
        *,
        renew_every: float | None = None,
        safety_margin: float | None = None,
        monotonic: Callable[[], float],
        watchdog: bool | None = None,
        verify_retake: Callable[[HeldLease], Coroutine[Any, Any, bool]] | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """``alive``: this box's liveness on a mesh (lchat.mesh.membership.Membership.alive):
        once it says no, the lease is lost as if its deadline had passed — peers may judge the
        box dead and take it over soon (docs/lease.md)."""
        ttl = lease.ttl
        self.renew_every = ttl / 3 if renew_every is None else renew_every
        self.safety_margin = ttl / 10 if safety_margin is None else safety_margin
        if self.safety_margin <= 0 or self.safety_margin >= ttl:
            raise ValueError("safety_margin must be within (0, ttl)")
        if not 0 < self.renew_every < ttl - self.safety_margin:
            raise ValueError("renew_every must be positive and shorter than ttl - safety_margin")
        self._reactor = reactor
        self._store = store
        self._lease = lease
        self._on_lost = lost
        self._monotonic = monotonic
        if watchdog is None:
            watchdog = monotonic is time.monotonic and IReactorFromThreads.providedBy(reactor)
        self._watchdog = watchdog
        # Store errors: retried after min(1 s, a tenth of the period), doubling to a tenth of
        # the period (at most 30 s); a confirmed write starts the series again.
        first_retry = min(1.0, self.renew_every / 10)
        self._retries = Backoff(first_retry, max(first_retry, min(30.0, self.renew_every / 10)))
        self._retry_delays = self._retries.delays()
        self._renew_call: IDelayedCall | None = None
        self._deadline_call: IDelayedCall | None = None
        self._alarm: _Alarm | None = None
        self._inflight: Deferred[bool] | None = None
        # Send time of the first renewal since the last confirmed one: an attempt that failed or
        # timed out may still have landed, and adopting it must not date it later than this.
        self._first_unconfirmed: float | None = None
        self._verify_retake = verify_retake
        self._alive = alive
        self._retaking: HeldLease | None = None  # the lock being re-created after it vanished
        self._unverified = False  # re-taken; verify_retake has not said yes yet
        self._started = False
        self._stopped = False
        self.lost_reason: str | None = None

    # -- state ---------------------------------------------------------------------------------

    @property
    def lease(self) -> HeldLease:
        """The lease as of our last successful write (its etag is what release needs)."""
        return self._lease

    @property
    def deadline(self) -> float:
        """Local monotonic time at which we stop believing we hold the lease."""
        return self._lease.written_at + self._lease.ttl - self.safety_margin

    @property
    def renewing(self) -> bool:
        """A renewal is in flight."""
        return self._inflight is not None

    @property
    def suspended(self) -> bool:
        """The lock vanished and is being re-taken (or the bucket checked): writes must wait."""
        return self._retaking is not None or self._unverified

    def holds(self) -> bool:
        """True while the lease is ours: not lost, not stopped, and before the deadline."""
        if self.lost_reason is not None or self._stopped:
            return False
        if self._monotonic() >= self.deadline:
            self._lose("could not renew before expiry")
            return False
        if self._alive is not None and not self._alive():
            self._lose(BOX_NOT_ALIVE)
            return False
        return True

    def ensure_held(self) -> None:
        """Raise :class:`LeaseLost` unless :meth:`holds`, :class:`LeaseSuspended` while the lock is
        being re-taken. Call before writing on the lease's behalf."""
        if not self.holds():
            raise LeaseLost(self.lost_reason or "lease keeper stopped")
        if self.suspended:
            raise LeaseSuspended(f"lease {self._lease.host}: being re-taken after it vanished")

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        if not self.holds():
            return
        self._arm_deadline()
        self._schedule_renew(self._lease.written_at + self.renew_every - self._monotonic())

    def stop(self) -> None:
        """Stop renewing (the lease is left as it is: :meth:`release` it, or let it expire).

        A renewal in flight is cancelled; if it landed anyway, :func:`release` still recognises the
        version as ours by its ``lease_id``.
        """
        self._stopped = True
        self._cancel_timers()
        if self._inflight is not None:
            self._inflight.cancel()

    async def release(self, budget: float) -> bool:
        """Stop, then delete our lock within ``budget`` seconds. After ``lost``, does nothing:
        the keeper never writes once it has reported the lease gone."""
        lost = self.lost_reason is not None
        self.stop()
        if lost:
            return False
        return await release(self._reactor, self._store, self._lease, budget)

    async def renew_now(self) -> bool:
        """One renewal attempt now (the timers' work; also for tests). True if it succeeded."""
        if self._inflight is not None:
            return await _observe(self._inflight)
        self._cancel_renew()
        attempt = Deferred.fromCoroutine(self._renew())
        self._inflight = attempt
        try:
            return await _observe(attempt)
        finally:
            if self._inflight is attempt:
                self._inflight = None

    # -- internals -----------------------------------------------------------------------------

    async def _renew(self) -> bool:
        if not self.holds():
            return False
        if self._retaking is not None:
            return await self._retake()
        lease = self._lease
        sent = self._monotonic()
        if self._first_unconfirmed is None:
            self._first_unconfirmed = sent
        # The bucket's clock now, estimated from the last reading: expires_at is informational.
        now = lease.bucket_time + datetime.timedelta(seconds=max(0.0, sent - lease.written_at))
        attempt = Deferred.fromCoroutine(
            self._store.put(
                lease.key,
                lease.record(now).to_json(),
                if_match=lease.etag,
                content_type="application/json",
            )
        )
        # A hung request must not hold up the retries; the deadline fires regardless.
        attempt.addTimeout(self.renew_every / 2, self._reactor)
        try:
            put = await attempt
        except PreconditionFailed:
            return await self._after_precondition_failed(lease, now)
        except NotFound:
            return await self._gone(lease)
        except defer.TimeoutError:
            return self._retry_later(lease, f"no answer within {self.renew_every / 2:.1f}s")
        except ObjectStoreError as e:
            return self._retry_later(lease, f"{type(e).__name__}: {e}")
        except CancelledError:
            return False  # stopped
        if self._lease is not lease or not self.holds():
            return False  # lost meanwhile: we do not get to believe this write
        self._renewed(evolve(lease, etag=put.etag, bucket_time=now, written_at=sent))
        if self._unverified:
            return await self._verify(self._lease)
        return True

    async def _after_precondition_failed(self, lease: HeldLease, now: datetime.datetime) -> bool:
        try:
            current = await _read(self._store, lease.key)
        except ObjectStoreError as e:
            # Cannot tell whose version it is: a failed If-Match is reason enough to stand down.
            return self._fail_for_good(lease, f"replaced (unreadable: {type(e).__name__})")
        except CancelledError:
            return False
        if current is None:
            return await self._gone(lease)
        record = LeaseRecord.parse(current.body)
        if record.lease_id != lease.lease_id:
            return self._fail_for_good(lease, f"taken over by {record.owner}")
        # One of our own writes landed unseen (a retry, or an attempt we gave up on): ours.
        sent = self._first_unconfirmed
        if self._lease is not lease or sent is None or not self.holds():
            return False
        self._renewed(evolve(lease, etag=current.info.etag, bucket_time=now, written_at=sent))
        if self._unverified:
            return await self._verify(self._lease)
        return True

    def _renewed(self, lease: HeldLease) -> None:
        log.debug("lease {host}: renewed", host=lease.host)
        OPERATIONS.labels("renew", "ok").inc()
        self._adopt(lease)

    def _adopt(self, lease: HeldLease) -> None:
        """``lease`` is what we hold now, as of a confirmed write: the deadline counts from it."""
        self._lease = lease
        self._first_unconfirmed = None
        self._retry_delays.reset()
        if self._stopped:
            return
        self._arm_deadline()
        self._schedule_renew(lease.written_at + self.renew_every - self._monotonic())

    # -- the lock vanished (verify_retake) -----------------------------------------------------

    async def _gone(self, lease: HeldLease) -> bool:
        """Our lock is not there any more (not replaced: deleted). Re-take it, or report it."""
        if self._verify_retake is None:
            return self._fail_for_good(lease, "gone")
        if self._lease is not lease or not self.holds():
            return False
        sent = self._monotonic()
        now = lease.bucket_time + datetime.timedelta(seconds=max(0.0, sent - lease.written_at))
        # One lease_id for every attempt: a create whose answer was lost is recognised as ours.
        # Dated from this first attempt: whichever attempt lands, none was sent before it.
        self._retaking = evolve(
            lease,
            generation=lease.generation + 1,
            lease_id=uuid.uuid4().hex,
            etag="",
            acquired_at=now,
            bucket_time=now,
            written_at=sent,
            took_over_from=None,
        )
        log.error(
            "lease {host}: the lock vanished from the bucket while this box held it (generation "
            "{generation}); a takeover replaces it, never deletes it, so nobody else holds the "
            "lease: re-taking it. Did the bucket lose data? Writes wait meanwhile.",
            host=lease.host,
            generation=lease.generation,
        )
        return await self._retake()

    async def _retake(self) -> bool:
        new, old = self._retaking, self._lease
        assert new is not None
        if not self.holds():
            return False
        now = new.bucket_time + datetime.timedelta(
            seconds=max(0.0, self._monotonic() - new.written_at)
        )
        attempt = Deferred.fromCoroutine(
            self._store.put(
                new.key,
                new.record(now).to_json(),
                if_none_match=True,
                content_type="application/json",
            )
        )
        attempt.addTimeout(self.renew_every / 2, self._reactor)
        try:
            etag = (await attempt).etag
        except PreconditionFailed:
            try:
                current = await _read(self._store, new.key)
            except ObjectStoreError as e:
                return self._retry_later(old, f"{type(e).__name__}: {e}", "retake")
            except CancelledError:
                return False
            if current is None:
                return self._retry_later(old, "the lock vanished again", "retake")
            record = LeaseRecord.parse(current.body)
            if record.lease_id != new.lease_id:
                OPERATIONS.labels("retake", "held").inc()
                self._retaking = None
                return self._fail_for_good(
                    old, f"taken over by {record.owner} (it took the lock after ours vanished)"
                )
            etag = current.info.etag  # one of our attempts landed unseen
        except defer.TimeoutError:
            return self._retry_later(old, f"no answer within {self.renew_every / 2:.1f}s", "retake")
        except ObjectStoreError as e:
            return self._retry_later(old, f"{type(e).__name__}: {e}", "retake")
        except CancelledError:
            return False  # stopped
        if self._lease is not old or self._retaking is not new or not self.holds():
            return False
        self._retaking = None
        self._unverified = True
        OPERATIONS.labels("retake", "ok").inc()
        log.error(
            "lease {host}: re-taken after it vanished (generation {generation}); checking the "
            "bucket before writing again",
            host=new.host,
            generation=new.generation,
        )
        self._adopt(evolve(new, etag=etag))
        return await self._verify(self._lease)

    async def _verify(self, lease: HeldLease) -> bool:
        """Ask ``verify_retake`` about the lease we re-took; see the class docstring."""
        assert self._verify_retake is not None
        check: Deferred[bool] = Deferred.fromCoroutine(self._verify_retake(lease))
        check.addTimeout(self.renew_every / 2, self._reactor)
        try:
            ok = await check
        except Exception as e:
            if self._stopped or self.lost_reason is not None:
                return False
            why = "no answer in time" if isinstance(e, defer.TimeoutError | CancelledError) else e
            delay = self._retry_delays.next()
            log.warn(
                "lease {host}: re-taken, but checking the bucket failed ({error}); asking again "
                "in {delay:.1f}s (writes wait)",
                host=lease.host,
                error=why,
                delay=delay,
            )
            # The next renewal asks again (a failed check must not wait a whole period).
            self._schedule_renew(delay)
            return False
        if self._lease is not lease or not self.holds():
            return False
        if ok:
            self._unverified = False
            log.warn(
                "lease {host}: re-taken and the bucket checked: writing again", host=lease.host
            )
            return True
        # Someone else wrote while the lock was missing: the space is theirs. Give the lock back.
        OPERATIONS.labels("retake", "held").inc()
        await release(self._reactor, self._store, lease, min(10.0, self.renew_every / 2))
        return self._fail_for_good(
            lease, "taken over (another writer wrote the replica while the lock was missing)"
        )

    def _fail_for_good(self, lease: HeldLease, why: str) -> bool:
        if self._lease is lease:
            self._lose(why)
        return False

    def _retry_later(self, lease: HeldLease, error: str, operation: str = "renew") -> bool:
        OPERATIONS.labels(operation, "error").inc()
        if self._lease is not lease or not self.holds():
            return False
        delay = min(self._retry_delays.next(), max(0.0, self.deadline - self._monotonic()))
        log.warn(
            "lease {host}: {what} failed ({error}); retrying in {delay:.1f}s, "
            "{left:.1f}s before standing down",
            host=lease.host,
            what="renewal" if operation == "renew" else "re-taking the vanished lock",
            error=error,
            delay=delay,
            left=self.deadline - self._monotonic(),
        )
        self._schedule_renew(delay)
        return False

    def _lose(self, why: str) -> None:
        if self.lost_reason is not None:
            return
        self.lost_reason = why
        self._cancel_timers()
        log.warn("lease {host}: LOST ({why})", host=self._lease.host, why=why)
        OPERATIONS.labels("renew", "lost").inc()
        try:
            self._on_lost(why)
        except Exception:
            log.failure("lease {host}: lost callback failed", host=self._lease.host)

    def _schedule_renew(self, delay: float) -> None:
        self._cancel_renew()
        if self._stopped or self.lost_reason is not None:
            return
        self._renew_call = self._reactor.callLater(max(0.0, delay), self._renew_due)

    def _renew_due(self) -> None:
        self._renew_call = None
        Deferred.fromCoroutine(self.renew_now()).addErrback(self._unexpected)

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        deadline = self.deadline
        self._deadline_call = self._reactor.callLater(
            max(0.0, deadline - self._monotonic()), self._deadline_due
        )
        if self._watchdog:
            threads = cast(IReactorFromThreads, self._reactor)
            self._alarm = _WATCHDOG.arm(threads, deadline, self._alarm_due)

    def _deadline_due(self) -> None:
        self._deadline_call = None
        if not self.holds():  # past the deadline: holds() reports the loss
            return
        # Woken early (the wall clock stepped forward): sleep for what is really left.
        self._deadline_call = self._reactor.callLater(
            max(0.0, self.deadline - self._monotonic()), self._deadline_due
        )

    def _alarm_due(self) -> None:
        self._alarm = None
        self.holds()  # past the deadline (the watchdog only fires then): reports the loss

    def _unexpected(self, failure: Failure) -> None:
        if failure.check(CancelledError):
            return  # stopped mid-renewal
        log.failure("lease {host}: renewal crashed", failure, host=self._lease.host)

    def _cancel_renew(self) -> None:
        if self._renew_call is not None and self._renew_call.active():
            self._renew_call.cancel()
        self._renew_call = None

    def _cancel_deadline(self) -> None:
        if self._deadline_call is not None and self._deadline_call.active():
            self._deadline_call.cancel()
        self._deadline_call = None
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None

    def _cancel_timers(self) -> None:
        self._cancel_renew()
        self._cancel_deadline()


async def _observe(d: Deferred[bool]) -> bool:
    """Await ``d`` without taking its result away from its other waiters."""
    waiter: Deferred[bool] = Deferred()

    def passthrough(result: Any) -> Any:
        if isinstance(result, Failure):
            waiter.errback(result)
            return None  # handed on: do not leave it unhandled on ``d``
        waiter.callback(result)
        return result

    d.addBoth(passthrough)
    return await waiter


# --- the monotonic watchdog ---------------------------------------------------------------------


class _Alarm:
    def __init__(self, reactor: IReactorFromThreads, fire: Callable[[], None]) -> None:
        self.reactor = reactor
        self._fire = fire
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # read by the watchdog thread too; a stale read only costs a wakeup

    def fire(self) -> None:  # in the reactor thread
        if not self.cancelled:
            self.cancelled = True
            self._fire()


class _Watchdog:
    """One daemon thread for every keeper: sleeps on the monotonic clock (``Condition.wait`` does)
    and hands due alarms to their reactor with ``callFromThread``, which does not depend on the
    reactor's wall-clock timers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, reactor: IReactorFromThreads, when: float, fire: Callable[[], None]) -> _Alarm:
        alarm = _Alarm(reactor, fire)
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), alarm))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lchat-lease-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return alarm

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                alarm = heapq.heappop(self._heap)[2]
                alarm.reactor.callFromThread(alarm.fire)


_WATCHDOG = _Watchdog()

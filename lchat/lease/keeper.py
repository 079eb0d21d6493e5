"""Keeping a held lease (:class:`LeaseKeeper`, see :mod:`lchat.lease`): renewal every TTL/3, the
local monotonic deadline and its watchdog thread, and re-taking a lock the bucket lost."""

from __future__ import annotations

import datetime
import heapq
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from attrs import evolve
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.backoff import Backoff
from lchat.deferutil import observe
from lchat.lease.lock import (
    BOX_NOT_ALIVE,
    OPERATIONS,
    HeldLease,
    LeaseLost,
    LeaseRecord,
    LeaseSuspended,
    put_lock,
    read_lock,
    release,
)
from lchat.objstore import (
    NotFound,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
)

log = Logger(namespace="lchat.lease")
_T = TypeVar("_T")


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
            return await observe(self._inflight)
        self._cancel_renew()
        attempt = Deferred.fromCoroutine(self._renew())
        self._inflight = attempt
        try:
            return await observe(attempt)
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
        now = lease.bucket_now(sent)
        try:
            put = await self._bounded(put_lock(self._store, lease, now, if_match=lease.etag))
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
        return await self._renewed(lease, put.etag, now, sent)

    async def _after_precondition_failed(self, lease: HeldLease, now: datetime.datetime) -> bool:
        try:
            current = await read_lock(self._store, lease.key)
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
        if sent is None:
            return False
        return await self._renewed(lease, current.info.etag, now, sent)

    async def _renewed(
        self, lease: HeldLease, etag: str, now: datetime.datetime, sent: float
    ) -> bool:
        """A renewal of ``lease`` landed (``etag``, sent at ``sent``): adopt it, unless the
        lease was lost meanwhile (we do not get to believe this write)."""
        if self._lease is not lease or not self.holds():
            return False
        log.debug("lease {host}: renewed", host=lease.host)
        OPERATIONS.labels("renew", "ok").inc()
        self._adopt(evolve(lease, etag=etag, bucket_time=now, written_at=sent))
        if self._unverified:
            return await self._verify(self._lease)
        return True

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
        now = lease.bucket_now(sent)
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
        now = new.bucket_now(self._monotonic())
        try:
            etag = (await self._bounded(put_lock(self._store, new, now, if_match=None))).etag
        except PreconditionFailed:
            try:
                current = await read_lock(self._store, new.key)
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
        try:
            ok = await self._bounded(self._verify_retake(lease))
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

    def _bounded(self, work: Coroutine[Any, Any, _T]) -> Deferred[_T]:
        """``work``, given up after half a renewal period: a hung request must not hold up the
        retries (the deadline fires regardless)."""
        attempt = Deferred.fromCoroutine(work)
        attempt.addTimeout(self.renew_every / 2, self._reactor)
        return attempt

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
            self._alarm = _WATCHDOG.arm(
                IReactorFromThreads(self._reactor), deadline, self._alarm_due
            )

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

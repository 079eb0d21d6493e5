"""Which link tokens a home process trusts without a store request, and the feed that makes it
forget them when they are revoked anywhere (docs/home.md, "The one thing a process remembers").

- :class:`TokenCache`: a link token (its SHA-256) that passed the full check (its pointer and
  ``users/<uid>`` still listing it, lchat.home.store.resolve_checked) is trusted for **the rest
  of the UTC day** it was checked on — the day the daily ``last_seen`` uses, so the first check
  of a day pays the store reads and the one ``last_seen`` write, and every later authenticated
  request that day costs no store request at all. Bounded: at :data:`CACHE_CAPACITY` entries
  the least recently used one is evicted (one at a time, never the whole cache).
- :class:`RevocationFeed`: every revoking operation updates ``users/<uid>`` first (the
  authority), then publishes a marker (``revoked/<sha256>``, :meth:`VaultStore.mark_revoked
  <lchat.home.store.VaultStore.mark_revoked>`) and drops the token from this process's cache at
  once. Every process polls the markers every ``LCHAT_HOME_REVOCATION_POLL`` seconds with one
  store request and drops each listed token: that period is the revocation window across
  replicas.

Invariants:

- **A revoked token is trusted nowhere for longer than the window.** A poll that lists the
  marker drops the entry; a check that read the user document before the revocation but
  finishes after the poll cannot re-add it, because digests seen revoked are remembered (as long
  as a marker lives) and never cached again.
- **A feed that cannot be read does not keep a revoked token alive.** The cache answers only
  until :data:`STALE_PERIODS` poll periods after the start of the last poll that succeeded; past
  that every request pays the store reads again (logged once, ``lchat_home_revocation_feed_ok``
  0) until a poll succeeds, which lists every marker the outage hid.
- A marker that cannot be written (the store failing right after the revocation) is retried at
  every poll until it lands; the token is denied at once on this process and by every fresh
  check, and only another process's cache may still hold it meanwhile.
"""

from __future__ import annotations

import datetime
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from attrs import define, field
from prometheus_client import Counter, Gauge
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.home.store import MARKER_LIFETIME, HomeStoreError, VaultStore

_log = Logger(namespace="lchat.home")

CACHE_CAPACITY = 100_000  # trusted tokens per process (~200 bytes each)
DEFAULT_POLL = 5.0  # LCHAT_HOME_REVOCATION_POLL: seconds between two reads of the feed
STALE_PERIODS = 3  # the cache stops answering this many poll periods after the last good poll

CACHE_LOOKUPS = Counter(
    "lchat_home_token_cache_lookups_total",
    "Link token look-ups in the process's cache: hit (no store request), miss, expired (checked "
    "on an earlier UTC day), untrusted (the revocation feed is stale: the store is asked)",
    ["outcome"],
)
CACHE_EVICTIONS = Counter(
    "lchat_home_token_cache_evictions_total",
    "Trusted link tokens dropped because the cache was full (least recently used first); a "
    "steady rise means more active devices per process than the cache holds",
)
REVOCATIONS_APPLIED = Counter(
    "lchat_home_revocations_applied_total",
    "Trusted link tokens dropped because they were revoked (here, or listed by the feed)",
)
FEED_OK = Gauge(
    "lchat_home_revocation_feed_ok",
    "1 while the revocation feed was read within its window (the token cache answers); 0 while "
    "it cannot be read (every authenticated request reads the store)",
)
FEED_POLLS = Counter(
    "lchat_home_revocation_polls_total",
    "Reads of the revocation feed, by outcome (ok, error)",
    ["outcome"],
)
MARKS = Counter(
    "lchat_home_revocation_marks_total",
    "Revocation markers written, by outcome (ok; deferred: the store failed, retried at the "
    "next poll)",
    ["outcome"],
)


def utc_day(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).date().isoformat()


@define
class TokenCache:
    """sha256(token) -> (uid, device id), each entry trusted for the UTC day it was checked on,
    and only while the feed is fresh (:meth:`trust_until`). LRU-bounded at ``capacity``."""

    clock: Callable[[], float]
    capacity: int = CACHE_CAPACITY
    # digest -> (uid, device, the UTC day it was checked); least recently used first.
    _entries: OrderedDict[str, tuple[str, str, str]] = field(factory=OrderedDict)
    # digests seen revoked -> when (our clock); never cached again while their marker lives.
    _revoked: OrderedDict[str, float] = field(factory=OrderedDict)
    _trusted_until: float = float("-inf")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def trusted(self) -> bool:
        return self.clock() < self._trusted_until

    def trust_until(self, deadline: float) -> None:
        """Answer until ``deadline`` (our clock): the feed was read and applied."""
        self._trusted_until = max(self._trusted_until, deadline)

    def get(self, digest: str) -> tuple[str, str] | None:
        now = self.clock()
        if now >= self._trusted_until:
            CACHE_LOOKUPS.labels("untrusted").inc()
            return None
        entry = self._entries.get(digest)
        if entry is None:
            CACHE_LOOKUPS.labels("miss").inc()
            return None
        if entry[2] != utc_day(now):
            del self._entries[digest]
            CACHE_LOOKUPS.labels("expired").inc()
            return None
        self._entries.move_to_end(digest)
        CACHE_LOOKUPS.labels("hit").inc()
        return entry[0], entry[1]

    def put(self, digest: str, uid: str, device: str) -> None:
        """Trust ``digest`` for the rest of today (a full check just passed), unless it was seen
        revoked: a check that raced a revocation must not outlive it."""
        if digest in self._revoked:
            return
        self._entries[digest] = (uid, device, utc_day(self.clock()))
        self._entries.move_to_end(digest)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            CACHE_EVICTIONS.inc()

    def revoke(self, digest: str) -> None:
        """Forget ``digest`` now and never trust it again while its marker lives."""
        now = self.clock()
        if self._entries.pop(digest, None) is not None:
            REVOCATIONS_APPLIED.inc()
        self._revoked[digest] = now
        self._revoked.move_to_end(digest)
        while self._revoked and (
            len(self._revoked) > self.capacity
            or now - next(iter(self._revoked.values())) > MARKER_LIFETIME
        ):
            self._revoked.popitem(last=False)


@define
class RevocationFeed:
    """Publishes this process's revocations and polls everyone's (see the module docstring).
    :meth:`start` polls at once, then every ``period`` seconds on ``clock``."""

    store: VaultStore
    cache: TokenCache
    clock: IReactorTime
    period: float = DEFAULT_POLL
    _cursor: str = ""
    _pending: dict[str, tuple[str, str]] = field(factory=dict)  # digest -> (uid, device)
    _readable: bool = True  # as last logged
    _loop: LoopingCall | None = None
    _done: Deferred[Any] | None = None

    @property
    def stale_after(self) -> float:
        return STALE_PERIODS * self.period

    async def publish(self, digest: str, uid: str, device: str) -> None:
        """After the user document stopped listing the token: drop it here, tell the others.
        Never raises for the store: a marker that cannot be written now is retried by
        :meth:`poll` (the revocation itself is done)."""
        self.cache.revoke(digest)
        self._pending[digest] = (uid, device)
        await self._flush()

    async def _flush(self) -> None:
        for digest, (uid, device) in list(self._pending.items()):
            try:
                await self.store.mark_revoked(digest, uid, device)
            except HomeStoreError as e:
                MARKS.labels("deferred").inc()
                _log.warn(
                    "home: a revocation marker could not be written ({error}); the token is "
                    "denied here and by every fresh check, other replicas may trust it until "
                    "the marker lands (retried every {period:g} s)",
                    error=e,
                    period=self.period,
                )
                return
            del self._pending[digest]
            MARKS.labels("ok").inc()

    async def poll(self) -> None:
        """One read of the feed: apply every marker listed, then trust the cache for
        :data:`STALE_PERIODS` periods from when this read began."""
        started = self.clock.seconds()
        if self._pending:
            await self._flush()
        try:
            found = await self.store.revoked_since(self._cursor)
        except HomeStoreError as e:
            FEED_POLLS.labels("error").inc()
            self._check_stale(str(e))
            return
        FEED_POLLS.labels("ok").inc()
        for marker in found.markers:
            self.cache.revoke(marker.digest)
        self._cursor = found.cursor
        self.cache.trust_until(started + self.stale_after)
        FEED_OK.set(1)
        if not self._readable:
            self._readable = True
            _log.info(
                "home: the revocation feed is readable again; cached link tokens are trusted again"
            )

    def _check_stale(self, error: str) -> None:
        if self.cache.trusted or not self._readable:
            return
        self._readable = False
        FEED_OK.set(0)
        _log.error(
            "home: the revocation feed has not been readable for over {stale:g} s ({error}): "
            "every authenticated request now reads the store (no cached link tokens) until it "
            "is; check the store",
            stale=self.stale_after,
            error=error,
        )

    def _tick(self) -> Deferred[None]:
        d = Deferred.fromCoroutine(self.poll())

        def failed(f: Failure) -> None:  # a bug: keep polling, the cache goes stale by itself
            FEED_POLLS.labels("error").inc()
            _log.failure("home: reading the revocation feed failed", f)
            self._check_stale(f.getErrorMessage())

        d.addErrback(failed)
        return d

    def start(self) -> None:
        loop = LoopingCall(self._tick)
        loop.clock = self.clock
        self._loop = loop
        self._done = loop.start(self.period, now=True)

    async def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self._done is not None:
            await self._done
        self._loop = None

"""The heartbeat janitor: it deletes what crashed boxes leave behind, so the members LIST stays
small. A member key whose beat is older than ``janitor_after`` (10 x ``dead_after``, bucket
clock) is deleted by the rule of :meth:`Janitor.sweep`, a step of the membership's beat.
Outcomes count in ``lchat_mesh_janitor_deletes_total{outcome}``.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from attrs import define, field, frozen
from prometheus_client import Counter
from twisted.internet.defer import CancelledError

from lchat.mesh.members import Member, describe_failure, log, member_of_key
from lchat.objstore import ObjectInfo, ObjectStore, PreconditionFailed

# The heartbeat janitor: a member key older than this many ``dead_after`` is deleted.
JANITOR_DEAD_AFTERS = 10.0
JANITOR_DELETES = Counter(
    "lchat_mesh_janitor_deletes_total",
    "Conditional DELETEs of long-dead members' heartbeats by this box's janitor: deleted, "
    "changed (the key changed or vanished since the LIST: left alone), failed (tried again)",
    ["outcome"],
)
for _outcome in ("deleted", "changed", "failed"):
    JANITOR_DELETES.labels(_outcome)  # exported as 0 before the first delete


@frozen
class StaleKey:
    """A key under the members prefix whose last write is older than the janitor's threshold."""

    key: str
    etag: str  # as listed: the janitor's DELETE is conditional on it
    age: float  # seconds since its Last-Modified, bucket clock, at the read
    url: str | None  # the member the key names; None: not a well-formed member key (garbage)


def stale_keys(
    listed: Sequence[ObjectInfo], now: datetime.datetime, prefix: str, *, older_than: float
) -> list[StaleKey]:
    """The listed keys whose ``now - last_modified > older_than`` (bucket clock), oldest first.

    Judged on the key's name and age only: a dead member's body is never read. A key is a
    well-formed member key when its name (below ``prefix``, no ``/``) is what
    :func:`encode_member_name` writes for a normalised URL; anything else has ``url=None``.
    """
    stale: list[StaleKey] = []
    for info in listed:
        age = (now - info.last_modified).total_seconds()
        if age <= older_than or not info.key.startswith(prefix):
            continue
        url = member_of_key(info.key, prefix)
        stale.append(StaleKey(key=info.key, etag=info.etag, age=age, url=url))
    stale.sort(key=lambda k: (-k.age, k.key))
    return stale


def _ago(seconds: float) -> str:
    """``2d 5h``, ``3h 2m``, ``12m 5s``, ``48s``: a dead box's age for a log line."""
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


@define
class Janitor:
    """One box's janitor: what it deletes, and the garbage keys it has logged about (once each)."""

    _store: ObjectStore
    _prefix: str  # the members prefix
    _own_key: str  # this box's heartbeat: never deleted
    older_than: float  # a member key older than this (bucket clock, seconds) is deleted
    # Each DELETE, bounded by the beat's timeout (``timeout``, for the log line).
    _bounded: Callable[[Coroutine[Any, Any, None]], Awaitable[None]]
    _timeout: float
    _garbage_left: set[str] = field(factory=set)

    async def sweep(
        self, view: Sequence[Member], listing: Sequence[ObjectInfo], now: datetime.datetime
    ) -> None:
        """The heartbeat janitor's step of one beat. Never raises (but a drain's cancel).

        Only the *janitor* acts: the live member with the lowest URL in our ``view``, when that
        is us. Views can differ for a beat, so two boxes may both act: harmless, because every
        DELETE is conditional on the listed ETag, and the loser gets PreconditionFailed (a box
        that beat again in between changed the ETag or, when it came back with the same body,
        at worst loses that one beat). One
        janitor (rather than every box) saves the fleet N-1 doomed DELETEs per dead key and keeps
        the log on one box. If the janitor dies, its own key goes stale and the next-lowest URL
        takes over within ``dead_after``.

        At most one DELETE per beat (bounded work, oldest key first); a key that fails stays in
        the LIST and is tried again next beat. Our own key is never deleted, even when it is old
        (our PUTs failing for long: then we are not the janitor anyway, see the caller). A key that
        is not a well-formed member key is never deleted: it may be an operator's or a future
        format's, and garbage does not accumulate with crashes, so it is logged once and left.
        """
        if not view or not view[0].self:
            return
        stale = stale_keys(listing, now, self._prefix, older_than=self.older_than)
        listed = {info.key for info in listing}
        self._garbage_left &= listed  # forget garbage that someone removed
        victim: StaleKey | None = None
        for candidate in stale:
            if candidate.key == self._own_key:
                continue
            if candidate.url is None:
                if candidate.key not in self._garbage_left:
                    self._garbage_left.add(candidate.key)
                    log.warn(
                        "mesh: janitor leaves {key!r} under the members prefix (last written "
                        "{ago} ago): it is not a member key; delete it by hand if nobody "
                        "needs it",
                        key=candidate.key,
                        ago=_ago(candidate.age),
                        age=candidate.age,
                    )
                continue
            if victim is None:
                victim = candidate
        if victim is None:
            return
        try:
            await self._bounded(self._store.delete(victim.key, if_match=victim.etag))
        except CancelledError:
            raise  # the drain: not a failure
        except PreconditionFailed:
            JANITOR_DELETES.labels("changed").inc()
            log.info(
                "mesh: janitor left the heartbeat of {url}: it changed since the listing (the "
                "box beat again, or a peer deleted it first)",
                url=victim.url,
                key=victim.key,
                age=victim.age,
            )
            return
        except Exception as e:
            JANITOR_DELETES.labels("failed").inc()
            log.warn(
                "mesh: janitor could not delete the heartbeat of {url}, dead for {ago} "
                "({error}); trying again at the next beat",
                url=victim.url,
                ago=_ago(victim.age),
                age=victim.age,
                key=victim.key,
                error=describe_failure(e, self._timeout),
            )
            return
        JANITOR_DELETES.labels("deleted").inc()
        log.info(
            "mesh: janitor deleted the heartbeat of {url}, dead for {ago} (key {key})",
            url=victim.url,
            ago=_ago(victim.age),
            age=victim.age,
            key=victim.key,
        )

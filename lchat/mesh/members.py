"""The mesh's members as the bucket shows them (docs/design.md §9): one LIST gives the fleet.

Every mesh box PUTs one object every ``LCHAT_MESH_HEARTBEAT`` seconds (15 s)::

    <prefix>/mesh/members/<base64url(normalised LCHAT_MESH_SELF), no padding>

in the hibernation bucket, or in ``LCHAT_MESH_BUCKET`` when the fleet's regions keep their replicas
in different buckets (every member of one mesh must name the same place). The key is the record:
it names the box, so one LIST of the prefix is the whole membership, and the ``Last-Modified`` of
each object is that box's last beat. The body is small JSON that stays the same across beats (so
its ETag does not change and peers read it once per process of the box)::

    {"mac": "…", "region": "ie", "started_at": 1789000000.123, "url": "https://box-1.example.net", "version": "0.1.0"}

**Only authenticated heartbeats make members**: a body whose ``mac`` does not verify
(:mod:`lchat.mesh.heartbeat`) — planted by someone who can write to the bucket but holds no token,
or written by an lchat older than this check — is no member: it is in no view, so no beat, route
push, forward, placement share, janitor or publisher election, probe or fleet call ever goes to
its URL. Every path that contacts peers picks them from :func:`read_members` or the
:class:`Membership` view, so that one check covers them all.

Liveness is judged on the *bucket's* clock only (:func:`judged_dead`, ``dead_after`` 45 s, three
missed beats): no box's own clock takes part, so a box with a wrong clock cannot poison anyone's
view.

:func:`read_members` is one read of the view; the router's
:class:`~lchat.mesh.membership.Membership` refreshes its view once per beat, and the CLI calls
:func:`read_members` directly. Garbage under the prefix (a key that is not canonical base64url of
a normalised member URL, a body that is not the JSON above, a body whose URL is not the key's) is
skipped with a log line, never fatal.

**The janitor** deletes what crashed boxes leave behind, so the LIST stays small: a member key
whose beat is older than ``janitor_after`` (10 x ``dead_after``, bucket clock) goes by the rule of
:meth:`Janitor.sweep`, a step of the membership's beat (``lchat_mesh_janitor_deletes_total``).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import re
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol

from attrs import define, evolve, field, frozen
from prometheus_client import Counter
from twisted.internet import defer
from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.placement import normalise_member_url
from lchat.objstore import NotFound, ObjectInfo, ObjectStore, ObjectStoreError, PreconditionFailed

# (The membership's log: what it reads and what it does are read in one namespace.)
log = Logger(namespace="lchat.mesh.membership")

MAX_BODY = 4096  # a heartbeat body is ~100 bytes; anything much larger is not one (not read)
_NAME = re.compile(r"[A-Za-z0-9_-]+")
FAILURES = Counter(
    "lchat_mesh_heartbeat_failures_total",
    "Failed bucket operations of mesh membership (heartbeat PUT, LIST, body GET, drain DELETE)",
    ["op"],
)
for _op in ("put", "list", "get", "delete"):
    FAILURES.labels(_op)  # exported as 0 before the first failure
UNAUTHENTICATED = Counter(
    "lchat_mesh_unauthenticated_heartbeats_total",
    "Heartbeats under the members prefix whose MAC does not verify under the mesh token (planted "
    "by a bucket writer, or written by an older lchat): no member's. Once per key and version",
)


def judged_dead(
    last_modified: datetime.datetime, now: datetime.datetime, dead_after: float
) -> bool:
    """A heartbeat whose ``Last-Modified`` is ``last_modified`` is dead at the bucket time ``now``
    once ``now >= floor(last_modified) + 1 s + dead_after``. Stores truncate ``Last-Modified`` to
    whole seconds, so ``floor + 1 s`` bounds the real write from above: never early
    (docs/lease.md, "The timing argument"). The membership's view and a taker of leases
    (lchat.mesh.fence) use this one rule, so a box drops out of the view exactly when its leases
    may be taken over."""
    written_by = last_modified.replace(microsecond=0) + datetime.timedelta(seconds=1)
    return now >= written_by + datetime.timedelta(seconds=dead_after)


# --- keys and bodies ----------------------------------------------------------------------------


class KeyPrefix(Protocol):
    """Where the heartbeats live: the hibernation bucket's config or ``LCHAT_MESH_BUCKET``'s entry
    (:func:`lchat.config.mesh_bucket`); only its key prefix matters here."""

    def key(self, *parts: str) -> str: ...


def members_prefix(hib: KeyPrefix) -> str:
    """``<prefix>/mesh/members/``: what one LIST reads."""
    return hib.key("mesh", "members") + "/"


def encode_member_name(url: str) -> str:
    """The key's last segment for a *normalised* member URL: base64url, no padding."""
    return base64.urlsafe_b64encode(url.encode("utf-8")).rstrip(b"=").decode("ascii")


def decode_member_name(name: str) -> str | None:
    """The member URL a key segment names, or None unless it is exactly what we would write:
    canonical unpadded base64url of a normalised ``http(s)://host[:port]`` URL."""
    if not _NAME.fullmatch(name) or len(name) % 4 == 1:
        return None
    try:
        url = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    if encode_member_name(url) != name:
        return None  # non-canonical encoding (stray low bits): not a name any box wrote
    try:
        if normalise_member_url(url) != url:
            return None
    except ValueError:
        return None
    return url


def member_of_key(key: str, prefix: str) -> str | None:
    """The member a key under the members ``prefix`` names, or None (not a member key)."""
    name = key[len(prefix) :] if key.startswith(prefix) else "/"
    return decode_member_name(name) if "/" not in name else None


def member_key(hib: KeyPrefix, url: str) -> str:
    """The heartbeat key of the member ``url`` (normalised here; ValueError if it is no URL)."""
    return hib.key("mesh", "members", encode_member_name(normalise_member_url(url)))


@frozen
class Member:
    """A mesh member as seen in one read of the bucket.

    Satisfies :class:`lchat.mesh.placement.Candidate` (``url``, ``region``).
    """

    url: str  # normalised LCHAT_MESH_SELF (what the key encodes)
    region: str
    version: str
    started_at: float  # unix seconds, the member's own clock (informational)
    last_modified: datetime.datetime  # its last beat, bucket clock
    age: float  # seconds since its last beat, bucket clock, at the read
    key: str
    # ``self`` cannot be an __init__ parameter name: construct with ``is_self=``.
    self: bool = field(default=False, alias="is_self")
    process: str = ""  # its process (Heartbeat.process; "": an older lchat)


# Per key: the ETag of the version we parsed and what it held (None: garbage, already logged).
BodyCache = dict[str, tuple[str, Heartbeat | None]]


# --- reading the view ---------------------------------------------------------------------------


async def read_members(
    store: ObjectStore,
    hib: KeyPrefix,
    *,
    dead_after: float = 45.0,
    bodies: BodyCache | None = None,
    self_url: str = "",
    include_dead: bool = False,
    keys: HeartbeatKeys,
) -> list[Member]:
    """The live members (sorted by URL): one LIST of the members prefix and ``store.now()``.

    A member is live until :func:`judged_dead` on the bucket's clock. Bodies are fetched (GET)
    only for live keys whose ETag is not already in ``bodies`` (``key -> (etag, parsed)``, a
    cache the caller may keep across reads; entries for keys no longer listed are dropped).
    Garbage is skipped with one log line per version (with a cache; each read without).
    ``self_url`` marks this box's own entry (``Member.self``); ``include_dead`` also returns the
    members whose beat is too old (the caller can tell them by ``age``). ``keys``: the mesh's
    heartbeat keys; a body whose MAC does not verify under them is no member (logged once per
    version, counted in ``lchat_mesh_unauthenticated_heartbeats_total``).

    Store errors propagate (typed :class:`~lchat.objstore.ObjectStoreError`) after being counted
    in ``lchat_mesh_heartbeat_failures_total``, except a body GET that fails while an older body
    of the same key is cached: that one is used (bodies change only when a box restarts).
    """
    phase = ["list"]
    try:
        _, members = await read_view(
            store, hib, dead_after, bodies, self_url, include_dead, phase, keys=keys
        )
    except (ObjectStoreError, CancelledError):
        FAILURES.labels(phase[0]).inc()
        raise
    return members


async def read_view(
    store: ObjectStore,
    hib: KeyPrefix,
    dead_after: float,
    bodies: BodyCache | None,
    self_url: str,
    include_dead: bool,
    phase: list[str],
    listing: list[ObjectInfo] | None = None,
    draining: set[str] | None = None,
    *,
    keys: HeartbeatKeys,
    read_within: float = 0.0,
) -> tuple[datetime.datetime, list[Member]]:
    """The read itself; ``phase[0]`` says which operation is under way ("list", "get"), so
    that the caller can count a failure or a timeout against it. ``listing``, when given, receives
    the raw LIST (for the janitor, which needs the dead keys and their ETags). ``read_within``:
    the bodies of dead keys younger than this many seconds are read (and authenticated, cached
    in ``bodies``) too, though they are not members: the witness's roster knows only the URLs
    whose heartbeat authenticates."""
    prefix = members_prefix(hib)
    cache: BodyCache = {} if bodies is None else bodies
    me = normalise_member_url(self_url) if self_url else ""
    phase[0] = "list"
    listed = await store.list(prefix)
    if listing is not None:
        listing.extend(listed)
    now = await store.now()  # after the LIST: no listed beat is younger than it looks
    phase[0] = "get"
    for gone in set(cache) - {info.key for info in listed}:
        del cache[gone]
    members: list[Member] = []
    for info in listed:
        age = (now - info.last_modified).total_seconds()
        if judged_dead(info.last_modified, now, dead_after) and not include_dead:
            if age < read_within:
                try:
                    await _heartbeat(store, cache, prefix, info.key, info.etag, info.size, keys)
                except ObjectStoreError:
                    pass  # only what the roster knows of a dead key: tried at the next read
            continue  # dead: no member
        heartbeat = await _heartbeat(store, cache, prefix, info.key, info.etag, info.size, keys)
        if heartbeat is None:
            continue
        if heartbeat.draining and not include_dead:
            # Leaving: out of placement now (its leases stay fenced until it is gone).
            if draining is not None:
                draining.add(heartbeat.url)
            continue
        members.append(
            Member(
                url=heartbeat.url,
                region=heartbeat.region,
                version=heartbeat.version,
                started_at=heartbeat.started_at,
                last_modified=info.last_modified,
                age=age,
                key=info.key,
                is_self=heartbeat.url == me,
                process=heartbeat.process,
            )
        )
    members.sort(key=lambda m: m.url)
    return now, members


async def _heartbeat(
    store: ObjectStore,
    cache: BodyCache,
    prefix: str,
    key: str,
    etag: str,
    size: int,
    keys: HeartbeatKeys,
) -> Heartbeat | None:
    """The parsed, authenticated body of ``key`` at ``etag`` (cached), or None for garbage or a
    body whose MAC does not verify (logged once per version)."""
    cached = cache.get(key)
    if cached is not None and cached[0] == etag:
        return cached[1]
    url = member_of_key(key, prefix)
    if url is None:
        _garbage(cache, key, etag, "the key does not name a member URL")
        return None
    if size > MAX_BODY:
        _garbage(cache, key, etag, f"the body is {size} bytes, not a heartbeat")
        return None
    try:
        obj = await store.get(key)
    except NotFound:
        return None  # deleted since the LIST: that box has just drained
    except ObjectStoreError as e:
        if cached is None or cached[1] is None:
            raise
        FAILURES.labels("get").inc()
        log.warn(
            "mesh: could not read the heartbeat of {url} ({error}); using the one read before",
            url=url,
            key=key,
            error=f"{type(e).__name__}: {e}",
        )
        return cached[1]
    etag = obj.info.etag  # it may have changed since the LIST: cache what we parsed
    try:
        heartbeat = Heartbeat.parse(obj.body)
    except ValueError as e:
        _garbage(cache, key, etag, str(e))
        return None
    try:
        body_url = normalise_member_url(heartbeat.url)
    except ValueError:
        body_url = ""
    if body_url != url:
        _garbage(cache, key, etag, f"the body names {heartbeat.url!r}, the key {url!r}")
        return None
    if keys.check(heartbeat) is None:
        if cache.get(key) != (etag, None):
            UNAUTHENTICATED.inc()
            log.warn(
                "mesh: ignoring the heartbeat of {url} ({key!r}): {why}; it is no member (no "
                "token, route, forward or share of the spaces goes to it)",
                url=url,
                key=key,
                why="it carries no MAC (written by an lchat older than heartbeat MACs, or planted)"
                if not heartbeat.mac
                else "its MAC does not verify under LCHAT_MESH_TOKEN (planted, or another "
                "mesh's token)",
            )
            cache[key] = (etag, None)
        return None
    heartbeat = evolve(heartbeat, url=url)
    cache[key] = (etag, heartbeat)
    return heartbeat


def _garbage(cache: BodyCache, key: str, etag: str, why: str) -> None:
    if cache.get(key) != (etag, None):
        log.warn("mesh: skipping {key!r} under the members prefix: {why}", key=key, why=why)
        cache[key] = (etag, None)


def describe_failure(e: BaseException | None, timeout: float) -> str:
    """A failed bucket or peer operation, for a log line (a timeout says how long it waited)."""
    if isinstance(e, defer.TimeoutError):
        return f"no answer within {timeout:g}s"
    return f"{type(e).__name__}: {e}"


def call_hooks(hooks: Iterable[Callable[..., object]], what: str, *args: object) -> None:
    """``fn(*args)`` for each of ``hooks`` (a copy of the list: a hook may unsubscribe); one that
    raises is logged as ``mesh: <what> <fn> failed`` and the others still run."""
    for fn in list(hooks):
        try:
            fn(*args)
        except Exception:
            log.failure(f"mesh: {what} {{fn!r}} failed", fn=fn)


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

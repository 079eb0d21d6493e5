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
"""

from __future__ import annotations

import base64
import binascii
import datetime
import re
from collections.abc import Callable, Iterable
from typing import Protocol

from attrs import evolve, field, frozen
from prometheus_client import Counter
from twisted.internet import defer
from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.placement import normalise_member_url
from lchat.objstore import NotFound, ObjectInfo, ObjectStore, ObjectStoreError

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

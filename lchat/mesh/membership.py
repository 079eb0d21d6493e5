"""Membership (docs/design.md §9): heartbeats in the bucket, one LIST gives the fleet.

Every mesh box PUTs one object every ``LCHAT_MESH_HEARTBEAT`` seconds (15 s)::

    <prefix>/mesh/members/<base64url(normalised LCHAT_MESH_SELF), no padding>

in the hibernation bucket, or in ``LCHAT_MESH_BUCKET`` when the fleet's regions keep their replicas
in different buckets (every member of one mesh must name the same place). The key is the record: it names the box, so one LIST of the prefix is the whole membership, and
the ``Last-Modified`` of each object is that box's last beat. The body is small JSON that stays the
same across beats (so its ETag does not change and peers read it once per process of the box)::

    {"mac": "…", "region": "ie", "started_at": 1789000000.123, "url": "https://box-1.example.net", "version": "0.1.0"}

**Only authenticated heartbeats make members** (issue 29): ``mac`` is an HMAC of the rest of the
body under a key derived from ``LCHAT_MESH_TOKEN`` (:class:`lchat.mesh.heartbeat.HeartbeatKeys`;
``LCHAT_MESH_TOKEN_ACCEPT``'s verifies too, during a rotation). A body without a MAC that
verifies — planted by someone who can write to the bucket but holds no token, or written by an
lchat older than this check — is no member: it is in no view, so no beat, route push, forward,
placement share, janitor or publisher election, probe or fleet call ever goes to its URL. It is
logged once per key and version and counted in
``lchat_mesh_unauthenticated_heartbeats_total``. Every path that contacts peers picks them from
:func:`read_members` or the :class:`Membership` view, so that one check covers them all.

Liveness is judged on the *bucket's* clock only: a member is live while ``store.now() -
Last-Modified <= dead_after`` (45 s, three missed beats). No box's own clock takes part, so a box
with a wrong clock cannot poison anyone's view. Stores that truncate ``Last-Modified`` and ``Date``
to whole seconds (S3, moto) make an age wrong by up to a second either way; ``dead_after`` is
meant to be several beats long, so that does not matter.

:func:`read_members` is one read of the view (one LIST, ``now()``, and a GET only for bodies whose
ETag is not cached); the router's :class:`Membership` service beats and refreshes its view once
per beat, and the CLI calls :func:`read_members` directly. Garbage under the prefix (a key that is
not canonical base64url of a normalised member URL, a body that is not the JSON above, a body whose
URL is not the key's) is skipped with a log line, never fatal.

Failures are soft (they are logged and counted in ``lchat_mesh_heartbeat_failures_total{op}``): a
failed PUT leaves our beat to age (peers take over our hosts after ``dead_after``, the lease
arbitrates any overlap), a failed read keeps the last view. Draining deletes our heartbeat first
(:meth:`Membership.stopService`), so peers drop this box at their next read instead of after
``dead_after``.

The heartbeat janitor (:meth:`Membership._sweep`) deletes what crashed boxes leave behind, so the
LIST stays small: a member key whose beat is older than ``janitor_after`` (10 x ``dead_after``,
bucket clock) is deleted by the *janitor*, the live box with the lowest URL in its own view, at
most one key per beat, oldest first, conditional on the ETag it listed (a box that beat again in
between changed the ETag or, when it came back with the same body, at worst loses that one beat).
Never our own key; never a key under the prefix that is not a well-formed member key (left, and
logged once). Outcomes count in ``lchat_mesh_janitor_deletes_total{outcome}``; a failure is soft
and the key is tried again at the next beat.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import math
import re
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from attrs import evolve, field, frozen
from prometheus_client import Counter, Gauge
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

import lchat
from lchat.config import MeshConfig
from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.placement import normalise_member_url
from lchat.mesh.witness import (
    BeatMessage,
    BeatReply,
    MessageError,
    Peer,
    PeerCallError,
    PeerChannel,
    Witnesses,
    normal_holds,
)
from lchat.objstore import (
    UTC,
    NotFound,
    ObjectInfo,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
)

log = Logger(namespace="lchat.mesh.membership")

_T = TypeVar("_T")

MAX_BODY = 4096  # a heartbeat body is ~100 bytes; anything much larger is not one (not read)
STOP_TIMEOUT = 5.0  # stopService's delete of our heartbeat gives up after this (seconds)
# This box stops writing on its leases at dead_after * (1 - LIVENESS_MARGIN) after its last
# successful beat was sent: a tenth of dead_after covers a monotonic clock running up to ~10 %
# slower than the bucket's (docs/lease.md, "The timing argument").
LIVENESS_MARGIN = 0.1
STAND_DOWNS = Counter(
    "lchat_mesh_stand_downs_total",
    "Times this box stood every space down because no heartbeat landed within dead_after - margin",
)
_NAME = re.compile(r"[A-Za-z0-9_-]+")

# The witness (lchat.mesh.witness, docs/lease.md): seconds a beat to a peer may take (at most;
# never more than the heartbeat, at least 1 s), a peer's relay of our heartbeat inside it, a
# probe of a holder about to be judged dead, and the fast rounds a write waits for while the
# bucket is out of reach.
PEER_TIMEOUT = 5.0
RELAY_TIMEOUT = 2.0
PROBE_TIMEOUT = 1.0
FAST_ROUND = 0.25
FAST_WANTED = 2.0
_BUCKET = Gauge(
    "lchat_mesh_bucket_reachable",
    "1 while this box's last heartbeat PUT succeeded, 0 after one failed (the bucket is out of "
    "reach: wakes are refused at once, the peers are asked to relay the heartbeat)",
)
_LIVENESS = Counter(
    "lchat_mesh_liveness_changes_total",
    "What keeps this box alive, each time it changes: bucket (its own landed heartbeat), peers "
    "(its peers' word alone: the bucket is out of reach), none (it stood every space down)",
    ["via"],
)
for _via in ("bucket", "peers", "none"):
    _LIVENESS.labels(_via)
_PEER_BEATS = Counter(
    "lchat_mesh_peer_beats_total",
    "Beats this box sent its peers, by outcome: ok (answered), failed (no usable answer), "
    "relayed (answered, and the peer wrote this box's heartbeat into the bucket for it)",
    ["outcome"],
)
_PROBES = Counter(
    "lchat_mesh_probes_total",
    "Probes of a lease holder about to be judged dead, by outcome: answered (alive: not taken "
    "over), silent (no answer within the probe timeout), known_silent (its last two beats went "
    "unanswered within a heartbeat: not asked again)",
    ["outcome"],
)
for _outcome in ("answered", "silent", "known_silent"):
    _PROBES.labels(_outcome)
_RELAYS = Counter(
    "lchat_mesh_relays_total",
    "Heartbeats of peers this box wrote into the bucket for them, by outcome",
    ["outcome"],
)
for _outcome in ("ok", "failed", "relayed"):
    _PEER_BEATS.labels(_outcome)
for _outcome in ("ok", "failed"):
    _RELAYS.labels(_outcome)

MEMBERS_LIVE = Gauge(
    "lchat_mesh_members_live", "Live mesh members in this box's view (self included)"
)
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
CHANGES = Counter(
    "lchat_mesh_membership_changes_total",
    "Changes of the set of live mesh members (URL and region) seen by this box",
)

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
    epoch: str = ""  # the beating process's epoch (Heartbeat.epoch)
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

    A member is live until :func:`judged_dead` on the bucket's clock (``now >= floor(last_modified)
    + 1 s + dead_after``: the rule a taker of its leases applies, lchat.mesh.fence). Bodies are
    fetched (GET) only for live keys whose ETag is not already in ``bodies`` (``key -> (etag,
    parsed)``, a cache the caller may keep across reads; entries for keys no longer listed are
    dropped). Garbage is skipped with one log line per version (with a cache; each read without).
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
        _, members = await _read(
            store, hib, dead_after, bodies, self_url, include_dead, phase, keys=keys
        )
    except (ObjectStoreError, CancelledError):
        FAILURES.labels(phase[0]).inc()
        raise
    return members


async def _read(
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
                epoch=heartbeat.epoch,
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
    name = key[len(prefix) :]
    url = decode_member_name(name) if "/" not in name else None
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


# --- the heartbeat janitor ----------------------------------------------------------------------


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
        name = info.key[len(prefix) :]
        url = decode_member_name(name) if "/" not in name else None
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


# --- the service --------------------------------------------------------------------------------


def _urls(members: Sequence[Member]) -> frozenset[tuple[str, str]]:
    return frozenset((m.url, m.region) for m in members)


class Membership(Service):
    """This box's heartbeat, its peers' witness, and its view of the mesh (docs/mesh.md).

    On start it beats at once, then every ``mesh.heartbeat`` seconds: PUT our heartbeat, then one
    :func:`read_members` (bodies cached by ETag). Each operation is bounded by
    ``max(mesh.heartbeat, 1 s)``. :attr:`members` is the last view: live members, this box
    included. It is never empty: until a read shows anybody, and whenever our latest PUT succeeded
    but the listing does not show it yet, this box is in it (so placement always has a fleet).

    With a peer channel (``peers``; the router always has one), it also sends its heartbeat to
    every peer it knows once per beat, on a loop of its own that no bucket operation holds up, and
    answers theirs (:meth:`receive_beat`): the witness (lchat.mesh.witness, docs/lease.md). A peer
    heard within ``dead_after`` is in the view even when its heartbeat in the bucket is too old,
    and this box's liveness is ``W1`` (its last landed heartbeat, written by itself or relayed
    into the bucket by a peer) or ``W2`` (its required peers' word, at most
    ``LCHAT_MESH_OUTAGE_TOLERANCE`` after the last landed heartbeat). Without one, liveness is the
    bucket's alone (``W1``).

    ``subscribe(fn)``: ``fn(old, new)`` (lists of :class:`Member`) whenever the set of live
    (URL, region) pairs changes. ``stopService`` (the drain) deletes our heartbeat *first* and
    returns a Deferred that fires when the delete is done or failed, within :attr:`stop_timeout`.

    After the view is updated, a beat runs the heartbeat janitor (:meth:`_sweep`): when our PUT
    landed and we are the lowest URL of the new view, at most one conditional DELETE of the oldest
    member key older than :attr:`janitor_after`, never our own key, never a garbage key.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        store: ObjectStore,
        hib: KeyPrefix,
        mesh: MeshConfig,
        *,
        started_at: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        epoch: str | None = None,
        peers: PeerChannel | None = None,
        process: str | None = None,
    ) -> None:
        """``monotonic``: the clock this box's liveness deadline is kept on (the one the lease
        keepers use). ``epoch``: this process's first heartbeat epoch (random when not given);
        ``process``: its process id (random when not given). ``peers``: how beats reach the
        peers' mesh API (None: no witness, the bucket alone)."""
        self._reactor = reactor
        self._store = store
        self._hib = hib
        self._monotonic = monotonic
        self._peers = peers
        self.url = normalise_member_url(mesh.self_url)
        self.region = mesh.region
        self.key = member_key(hib, self.url)
        self.heartbeat = mesh.heartbeat
        self.dead_after = mesh.dead_after
        self.timeout = max(mesh.heartbeat, 1.0)  # per store operation of a beat
        self.stop_timeout = STOP_TIMEOUT
        # A beat to a peer: long enough for its relay (RELAY_TIMEOUT) and a round trip.
        self.peer_timeout = min(max(mesh.heartbeat, 1.0), PEER_TIMEOUT)
        self.relay_timeout = min(RELAY_TIMEOUT, self.peer_timeout / 2)
        self.probe_timeout = min(PROBE_TIMEOUT, mesh.dead_after / 4)
        self.keys = HeartbeatKeys.of(mesh.token, mesh.accept_token)
        self.body = Heartbeat(
            url=self.url,
            region=mesh.region,
            version=lchat.__version__,
            # Informational: when this router started (it builds its membership at start).
            started_at=round(reactor.seconds() if started_at is None else started_at, 3),
            epoch=uuid.uuid4().hex if epoch is None else epoch,
            process=(uuid.uuid4().hex if process is None else process) if peers else "",
        )
        self.body = self.keys.sign(self.body)
        self._payload = self.body.to_json()
        # Liveness (docs/lease.md): this box may write on its leases until ``_alive_until``: the
        # later of W1 (the monotonic time the last landed beat was *sent* + dead_after - margin)
        # and W2 (its required peers' word); peers may judge it dead only after that.
        self.margin = mesh.dead_after * LIVENESS_MARGIN
        self.witnesses = Witnesses(
            self.url,
            mesh.dead_after,
            self.margin,
            mesh.outage_tolerance,
            mesh.heartbeat,
            started=monotonic(),
        )
        self._landed: float | None = None  # when the last landed beat of this epoch was sent
        self._alive_until: float | None = None  # None: no beat has landed yet (or we left)
        self._alive_timer: Any = None
        self._not_alive = False  # the deadline passed (logged, subscribers told) until a beat lands
        self._first_beat: Deferred[None] = Deferred()
        self._on_not_alive: list[Callable[[], object]] = []
        self._on_alive: list[Callable[[], object]] = []
        self._on_unreachable: list[Callable[[str], object]] = []
        self._draining: frozenset[str] = frozenset()  # peers whose heartbeat says "draining"
        self._bodies: BodyCache = {}
        self._bucket_members: list[Member] = []  # the last listing's live members
        self._listed_at: float | None = None  # when that listing was read (monotonic)
        self._members: list[Member] = [self._self_member(None)]
        self._subscribers: list[Callable[[list[Member], list[Member]], object]] = []
        self._loop = LoopingCall(self._tick)
        self._loop.clock = reactor
        self._peer_loop = LoopingCall(self._peer_round)
        self._peer_loop.clock = reactor
        self._fast_loop = LoopingCall(self._fast_round)
        self._fast_loop.clock = reactor
        self._fast_until = -math.inf  # fast witness rounds wanted until then (monotonic)
        self._beat: Deferred[None] | None = None
        self._putting: Deferred[Any] | None = None
        self._put_failed = False  # our last heartbeat PUT failed: the bucket is out of reach
        self._stopping = False
        self._leaving = False
        self._etag = ""  # of our last landed PUT: the drain deletes only that version
        self._left: Deferred[None] | None = None
        self.beats = 0  # completed beats (PUT and read attempted), for tests and the admin API
        self.rounds = 0  # completed rounds of beats to the peers
        # The janitor deletes member keys older than this (bucket clock). Ten dead_afters, and
        # never before a holder could have lived on its peers' word (the slow path's age,
        # lchat.mesh.witness): a box that is only cut off or frozen for a while keeps its key
        # (and ``lchat mesh`` shows it as dead meanwhile); only what a crash left for good is
        # cleaned up.
        self.janitor_after = JANITOR_DEAD_AFTERS * mesh.dead_after
        if peers is not None:
            self.janitor_after = max(
                self.janitor_after, self.witnesses.slow_after() + mesh.dead_after
            )
        self.janitor_beats = 0  # beats whose janitor step is over (whatever it did), for tests
        self._garbage_left: set[str] = set()  # garbage keys the janitor has logged about
        # What the activator tells the witness: whether this box holds writes older than their
        # class promises, not in the bucket yet; which hosts are awake here.
        self._backlog: Callable[[], bool] = _no_backlog
        self._holds: Callable[[], Iterable[str]] = tuple
        self._backlog_seen: float | None = None  # when _backlog() last said yes (monotonic)
        self._witness_waiters: list[Deferred[bool]] = []
        self._relayed_by: str | None = None  # the peer whose relay landed our last beat (logged)
        self._witnessed_by_peers = False  # alive on W2 alone (logged when it changes)

    # -- the view ------------------------------------------------------------------------------

    @property
    def members(self) -> list[Member]:
        """The last view: the live members, this box included (never empty)."""
        return list(self._members)

    def live(self) -> list[Member]:
        """Same as :attr:`members`."""
        return list(self._members)

    @property
    def epoch(self) -> str:
        """This liveness period's heartbeat epoch (written into the leases it takes)."""
        return self.body.epoch

    @property
    def process(self) -> str:
        return self.body.process

    def now(self) -> float:
        """This box's monotonic clock (the one its deadline and its witness records are on)."""
        return self._monotonic()

    def alive(self) -> bool:
        """May this box write on its leases now? True from the first landed beat until its
        deadline (W1 or W2, monotonic clock), while the heartbeat exists. Peers cannot judge this
        box dead before that (docs/lease.md)."""
        return self._alive_until is not None and self._monotonic() < self._alive_until

    def bucket_reachable(self) -> bool:
        """Did our last heartbeat PUT succeed? (False: the bucket is out of reach: a wake, which
        needs it, is refused at once rather than after the store's timeouts.)"""
        return not self._put_failed

    def draining(self) -> frozenset[str]:
        """The peers whose heartbeat said "draining" at the last read (out of :meth:`live`, but
        alive: they release their leases within moments)."""
        return self._draining

    def lapsed(self) -> bool:
        """A beat landed once, and this box is not alive now: it serves and writes nothing until
        it is again (before the first beat a wake waits for it instead)."""
        return self._first_beat.called and not self.alive()

    def first_beat(self) -> Deferred[None]:
        """Fires once a beat has landed (at once if one has): a mesh box takes no lease before."""
        return _observe(self._first_beat)

    def on_alive(self, fn: Callable[[], object]) -> None:
        """``fn()`` each time this box becomes alive: its first landed heartbeat, and every time
        it is alive again after a lapse (the activator recovers its local copies then)."""
        self._on_alive.append(fn)

    def on_unreachable(self, fn: Callable[[str], object]) -> None:
        """``fn(url)`` when a peer that answered this box's last beat does not answer the next
        (the proxy aborts its connections to it: a request waiting on it would wait for TCP)."""
        self._on_unreachable.append(fn)

    def on_not_alive(self, fn: Callable[[], object]) -> None:
        """``fn()`` when this box's liveness deadline passes: every space it runs must stand down
        now (the activator's hook)."""
        self._on_not_alive.append(fn)

    def peers(self) -> list[Member]:
        """The live members other than this box."""
        return [m for m in self._members if not m.self]

    def subscribe(self, fn: Callable[[list[Member], list[Member]], object]) -> Callable[[], None]:
        """Call ``fn(old, new)`` on every change of the live set; returns an unsubscribe."""
        self._subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return unsubscribe

    def report(self, backlog: Callable[[], bool], holds: Callable[[], Iterable[str]]) -> None:
        """What this box's beats tell its peers: ``backlog()``, whether it holds writes older
        than their class promises that are not in the bucket yet; ``holds()``, the hosts awake
        here."""
        self._backlog = backlog
        self._holds = holds

    def holding(self, host: str) -> str | None:
        """The peer that said, within ``dead_after``, that ``host`` is awake on it (a routing
        hint that needs no bucket read)."""
        return self.witnesses.holding(host, self._monotonic())

    def peer_unreachable(self, url: str) -> bool:
        """Did our last beat to ``url`` go unanswered, silently? (One its port refused is not
        out of reach but stopping or dead: nothing of it serves a space, so a request for one
        of its spaces goes to the activator, which meets its lease, released or judged.)"""
        peer = self.witnesses.peers.get(url)
        return peer is not None and peer.failed >= 1 and not peer.refused

    def witness_status(self) -> dict[str, Any]:
        """What ``GET /status`` shows of the witness: what keeps this box alive, and each peer's
        part (seconds are ages on this box's monotonic clock)."""
        now = self._monotonic()
        w1 = self._landed is not None and now < self._landed + self.dead_after - self.margin
        alive = self.alive()
        peers = []
        for peer in sorted(self.witnesses.peers.values(), key=lambda p: p.url):
            peers.append(
                {
                    "url": peer.url,
                    "required": peer.required,
                    "heard": None if peer.heard is None else round(now - peer.heard, 1),
                    "accepted": None
                    if math.isinf(peer.accepted)
                    else round(now - peer.accepted, 1),
                    "knows_backlog": self.witnesses.knows_backlog(peer),
                    "says_backlog": peer.backlog,
                    "unanswered": peer.failed,
                    "older_lchat": peer.legacy,
                }
            )
        return {
            "alive_by": ("bucket" if w1 else "peers") if alive else None,
            "bucket_reachable": not self._put_failed,
            "backlog": self._backlog_flag(),
            "writes_safe": self.writes_safe(),
            "peers": peers,
        }

    def kick(self, url: str) -> None:
        """Beat ``url`` now, unless a kick is on its way to it already (a request found it out
        of reach: it is back in reach as soon as it answers, not at the next round)."""
        peer = self.witnesses.peers.get(url)
        if self._peers is None or self._stopping or peer is None or peer.kicked:
            return
        peer.kicked = True

        def done(_: object) -> None:
            peer.kicked = False

        sending = self._send(peer, self._message(), self.probe_timeout, track=False)
        Deferred.fromCoroutine(sending).addBoth(done)

    def known(self, url: str) -> bool:
        """Is ``url`` a mesh box's, as far as this box can tell: a live member, or a peer of the
        witness's roster (its heartbeat's MAC verified within the janitor's age, or it beat this
        box with the mesh token)? Only such a URL is sent the mesh token, a forward or a route
        (a ``lives_at`` naming anything else is refused: lchat.mesh.api)."""
        return (
            url == self.url
            or url in self.witnesses.peers
            or any(m.url == url for m in self._members)
        )

    def fresh_in_bucket(self, url: str) -> bool:
        """Is ``url``'s heartbeat younger than ``dead_after`` in the bucket, as the last listing
        showed it and aged by the time since (this box's clock)?"""
        if self._listed_at is None:
            return False
        since = self._monotonic() - self._listed_at
        return any(m.url == url and m.age + since < self.dead_after for m in self._bucket_members)

    def silent_for(self, url: str) -> float:
        """Seconds since ``url`` was last heard (this box's monotonic clock; since this process
        started when never)."""
        peer = self.witnesses.peers.get(url)
        heard = peer.heard if peer is not None and peer.heard is not None else None
        return self._monotonic() - (heard if heard is not None else self.witnesses.started)

    def answered_since(self, url: str, since: float) -> bool:
        """Has ``url`` answered a beat of ours since ``since`` (our monotonic clock), and the
        last one?"""
        peer = self.witnesses.peers.get(url)
        return peer is not None and peer.failed == 0 and (peer.heard or -math.inf) > since

    # -- writes while the bucket is out of reach ---------------------------------------------

    def writes_safe(self) -> bool:
        """May a write be acknowledged that cannot ship now (its space's backlog is older than its
        class promises)? Only while every required peer knows this box holds such writes and has
        heard from it lately (then none takes it over by its silence: docs/lease.md, "Writes
        during an outage"); with no required peer (none may judge it by silence), while its own
        heartbeat lands (the bucket is slow, not out of reach)."""
        if not self.alive():
            return False
        if not self.witnesses.required():
            return not self._put_failed and self._landed is not None
        return self.witnesses.all_know_backlog(self._monotonic())

    def want_witness(self, seconds: float = FAST_WANTED) -> None:
        """Send beats to the peers every :data:`FAST_ROUND` for the next ``seconds``: a write
        waits for them to know about the backlog (:meth:`writes_known`)."""
        if self._peers is None or self._stopping:
            return
        self._fast_until = max(self._fast_until, self._monotonic() + seconds)
        if not self._fast_loop.running:
            self._fast_loop.start(min(FAST_ROUND, self.heartbeat), now=True).addErrback(
                lambda f: log.failure("mesh: fast witness loop crashed", f)
            )

    def writes_known(self, timeout: float) -> Deferred[bool]:
        """Fires True as soon as :meth:`writes_safe`, False after ``timeout`` seconds."""
        if self.writes_safe():
            return defer.succeed(True)
        self.want_witness()
        waiter: Deferred[bool] = Deferred()
        self._witness_waiters.append(waiter)

        def expire() -> None:
            if waiter in self._witness_waiters:
                self._witness_waiters.remove(waiter)
                waiter.callback(False)

        self._reactor.callLater(timeout, expire)
        return waiter

    def _backlog_flag(self) -> bool:
        """What our beats say of the backlog: yes while there is one, and after it ended until a
        heartbeat sent since has landed, unless our own landed heartbeat covers us now (a peer
        told "no more" may judge this box by its silence from then on: only W1 makes that safe
        at once)."""
        now = self._monotonic()
        if self._backlog():
            self._backlog_seen = now
            return True
        seen = self._backlog_seen
        if seen is None or (self._landed is not None and self._landed > seen):
            return False
        w1 = self._landed is not None and now < self._landed + self.dead_after - self.margin
        return not w1

    # -- lifecycle -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        log.info(
            "mesh: beating as {url} (region {region}) every {heartbeat:g}s, dead after "
            "{dead_after:g}s, key {key}{witness}",
            url=self.url,
            region=self.region or "-",
            heartbeat=self.heartbeat,
            dead_after=self.dead_after,
            key=self.key,
            witness=(
                f"; witnessed by its peers for up to {self.witnesses.tolerance:g}s of bucket outage"
                if self._peers is not None
                else ""
            ),
        )
        self._loop.start(self.heartbeat, now=True).addErrback(
            lambda f: log.failure("mesh: heartbeat loop crashed", f)
        )
        if self._peers is not None:
            self._peer_loop.start(self.heartbeat, now=False).addErrback(
                lambda f: log.failure("mesh: peer beat loop crashed", f)
            )

    def stopService(self) -> Deferred[None]:
        """Stop beating and delete our heartbeat first; fires when the delete is done or failed
        (at most :attr:`stop_timeout` seconds), then tells the peers it left. Never fails."""
        super().stopService()
        self._stopping = True
        for loop in (self._loop, self._peer_loop, self._fast_loop):
            if loop.running:
                loop.stop()
        if self._left is None or self._left.called:
            left = Deferred.fromCoroutine(self._leave())
            left.addTimeout(self.stop_timeout, self._reactor)
            left.addErrback(self._leave_failed)
            left.addCallback(lambda _: Deferred.fromCoroutine(self._goodbye()))
            self._left = left
        return _observe(self._left)

    async def _leave(self) -> None:
        self._leaving = True
        self._alive_until = None  # nothing is written on our leases once the heartbeat goes
        if self._alive_timer is not None and self._alive_timer.active():
            self._alive_timer.cancel()
        putting = self._putting
        if putting is not None:
            # A PUT landing after our DELETE would bring the beat back: let it finish first.
            wait = _observe(putting)
            wait.addTimeout(self.stop_timeout / 2, self._reactor)
            try:
                await wait
            except defer.TimeoutError:
                pass  # cut it short below
            except CancelledError:
                raise  # our own budget is spent
            except Exception:  # noqa: S110 -- its own failure was logged by the beat
                pass
            if not putting.called:
                putting.cancel()
        if self._beat is not None:
            self._beat.cancel()  # the read part, if any: nobody needs the view any more
        try:
            # Only our own last body: a successor process of this box (another epoch, another
            # ETag) may beat already; a late delete of ours must never remove its heartbeat.
            await self._store.delete(self.key, if_match=self._etag or None)
        except (PreconditionFailed, NotFound):
            log.info(
                "mesh: heartbeat {key} is no longer ours (another process of {url} beats, or it "
                "is gone): left alone",
                key=self.key,
                url=self.url,
            )
            return
        except CancelledError:
            raise
        except Exception:
            FAILURES.labels("delete").inc()
            raise
        log.info("mesh: heartbeat {key} deleted: peers drop {url} now", key=self.key, url=self.url)

    async def _goodbye(self) -> None:
        """The drain is over (every lease released or left to expire, the heartbeat deleted or
        left to age): tell the peers this process writes nothing more, so that whatever lease
        it could not release is taken over at once rather than after ``dead_after``. Best
        effort, bounded; never fails."""
        if self._peers is None:
            return
        message = self._message(leaving=True)
        calls = [
            Deferred.fromCoroutine(self._send(peer, message, min(1.0, self.peer_timeout)))
            for peer in self.witnesses.roster()
        ]
        if calls:
            await defer.DeferredList(calls, consumeErrors=True)
        close = getattr(self._peers, "close", None)
        if close is not None:
            await close()

    def _leave_failed(self, failure: Failure) -> None:
        if failure.check(CancelledError, defer.TimeoutError):
            FAILURES.labels("delete").inc()
            error = f"no answer within {self.stop_timeout:g}s"
        else:
            error = _describe(failure.value, self.stop_timeout)
        log.warn(
            "mesh: could not delete heartbeat {key} ({error}); peers drop {url} after "
            "{dead_after:g}s",
            key=self.key,
            url=self.url,
            error=error,
            dead_after=self.dead_after,
        )

    # -- beating into the bucket -----------------------------------------------------------------

    def _tick(self) -> Deferred[None]:
        beat = Deferred.fromCoroutine(self._beat_once())
        self._beat = beat

        def done(result: object) -> None:
            if self._beat is beat:
                self._beat = None
            if isinstance(result, Failure) and not result.check(CancelledError):
                log.failure("mesh: heartbeat crashed", result)
            return None

        beat.addBoth(done)
        return _observe(beat)

    async def _beat_once(self) -> None:
        put_ok = await self._put()
        if self._stopping:
            return
        phase = ["list"]
        listing: list[ObjectInfo] = []
        draining: set[str] = set()
        try:
            now, view = await self._bounded(
                _read(
                    self._store,
                    self._hib,
                    self.dead_after,
                    self._bodies,
                    self.url,
                    False,
                    phase,
                    listing,
                    draining,
                    keys=self.keys,
                    read_within=self.janitor_after,
                )
            )
        except CancelledError:
            raise  # the drain: not a failure
        except Exception as e:
            if isinstance(e, ObjectStoreError | defer.TimeoutError):
                FAILURES.labels(phase[0]).inc()
            log.warn(
                "mesh: could not read the membership ({error}); keeping the last view of "
                "{count} member(s)",
                error=_describe(e, self.timeout),
                count=len(self._members),
            )
            self._update(self._view(None), None)
            return
        finally:
            self.beats += 1
        self._draining = frozenset(draining)
        self._bucket_members = view
        self._listed_at = self._monotonic()
        self._listed(listing, view, now)
        members = self._view(view)
        if not any(m.self for m in members) and (put_ok or not members):
            members = sorted([*members, self._self_member(now)], key=lambda m: m.url)
        self._update(members, now)
        if put_ok and not self._stopping:
            await self._sweep(listing, now)
        self.janitor_beats += 1

    def _listed(
        self, listing: Sequence[ObjectInfo], view: list[Member], now: datetime.datetime
    ) -> None:
        """What a listing tells the witness: the peers to beat, the older lchats among the live
        ones (judged by the bucket alone, as they judge us), and the required peers that lapsed
        (:meth:`Witnesses.retire`)."""
        if self._peers is None:
            return
        prefix = members_prefix(self._hib)
        ages: dict[str, float | None] = {}
        authentic: set[str] = set()
        for info in listing:
            name = info.key[len(prefix) :] if info.key.startswith(prefix) else "/"
            url = decode_member_name(name) if "/" not in name else None
            if url is not None and url != self.url:
                ages[url] = (now - info.last_modified).total_seconds()
                cached = self._bodies.get(info.key)
                if cached is not None and cached[0] == info.etag and cached[1] is not None:
                    authentic.add(url)  # its body's MAC verified (_heartbeat)
        # Only a URL whose heartbeat authenticates is beaten (with the mesh token): a key planted
        # by a bucket writer, whatever its name, is never contacted.
        new = self.witnesses.know(
            u
            for u, age in ages.items()
            if u in authentic and age is not None and age < self.janitor_after
        )
        if new and not self._stopping and self._peer_loop.running:
            # Beat them now rather than at the next round: until a peer has answered a beat of
            # ours, its silence proves nothing here (no permission yet: lchat.mesh.witness).
            self._reactor.callLater(0, self._peer_round)
        older = {m.url for m in view if not m.self and not m.process}
        for url, peer in self.witnesses.peers.items():
            peer.legacy = url in older or (peer.legacy and peer.process == "" and url in ages)
        retired = self.witnesses.retire(ages, self._monotonic())
        for peer in retired:
            log.info(
                "mesh: {peer} no longer witnesses {url}: silent for {dead_after:g}s and its "
                "heartbeat is stale (its own liveness lapsed)",
                peer=peer.url,
                url=self.url,
                dead_after=self.dead_after,
            )
        self._recheck()  # (a retired peer, or an older lchat among the live ones, moves it)
        self.witnesses.forget(
            u for u, p in list(self.witnesses.peers.items()) if u not in ages and not p.required
        )

    def _view(self, bucket: list[Member] | None) -> list[Member]:
        """The live members: those the bucket shows live (the last listing's when ``bucket`` is
        None), and the peers heard within ``dead_after`` (their word counts as much as the
        bucket's: a box cut off from it, or every box during its outage, stays in the view)."""
        base = self._bucket_members if bucket is None else bucket
        if bucket is None and not base:
            base = [m for m in self._members if m.self]
        members = {m.url: m for m in base}
        now = self._monotonic()
        for peer in self.witnesses.heard_within(self.dead_after, now):
            if peer.url not in members and peer.url not in self._draining and peer.process:
                members[peer.url] = Member(
                    url=peer.url,
                    region=peer.region,
                    version=peer.version,
                    started_at=0.0,
                    last_modified=datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC),
                    age=now - (peer.heard or now),
                    key=member_key(self._hib, peer.url),
                    epoch="",
                    process=peer.process,
                )
        return sorted(members.values(), key=lambda m: m.url)

    async def _sweep(self, listing: Sequence[ObjectInfo], now: datetime.datetime) -> None:
        """The heartbeat janitor's step of one beat. Never raises (but a drain's cancel).

        Only the *janitor* acts: the live member with the lowest URL in our view, when that is
        us. Views can differ for a beat, so two boxes may both act: harmless, because every
        DELETE is conditional on the listed ETag, and the loser gets PreconditionFailed. One
        janitor (rather than every box) saves the fleet N-1 doomed DELETEs per dead key and keeps
        the log on one box. If the janitor dies, its own key goes stale and the next-lowest URL
        takes over within ``dead_after``.

        At most one DELETE per beat (bounded work, oldest key first); a key that fails stays in
        the LIST and is tried again next beat. Our own key is never deleted, even when it is old
        (our PUTs failing for long: then we are not the janitor anyway, see the caller). A key that
        is not a well-formed member key is never deleted: it may be an operator's or a future
        format's, and garbage does not accumulate with crashes, so it is logged once and left.
        """
        if not self._members or not self._members[0].self:
            return
        prefix = members_prefix(self._hib)
        stale = stale_keys(listing, now, prefix, older_than=self.janitor_after)
        listed = {info.key for info in listing}
        self._garbage_left &= listed  # forget garbage that someone removed
        victim: StaleKey | None = None
        for candidate in stale:
            if candidate.key == self.key:
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
                error=_describe(e, self.timeout),
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

    async def _put(self) -> bool:
        sent = self._monotonic()
        epoch = self.body.epoch  # the body this PUT carries
        putting = Deferred.fromCoroutine(
            self._store.put(self.key, self._payload, content_type="application/json")
        )
        putting.addTimeout(self.timeout, self._reactor)
        self._putting = putting
        try:
            put = await _observe(putting)
            self._etag = getattr(put, "etag", "") or ""
        except CancelledError:
            raise
        except Exception as e:
            FAILURES.labels("put").inc()
            if not self._put_failed:
                log.warn(
                    "mesh: heartbeat PUT failed ({error}); {fallback}",
                    error=_describe(e, self.timeout),
                    fallback=(
                        "asking the peers to relay it, and to witness this box meanwhile"
                        if self._peers is not None
                        else f"peers drop {self.url} after {self.dead_after:g}s without one"
                    ),
                    url=self.url,
                    dead_after=self.dead_after,
                )
            self._put_failed = True
            _BUCKET.set(0)
            return False
        finally:
            if self._putting is putting:
                self._putting = None
        if self._put_failed:
            log.info("mesh: heartbeat {url} lands in the bucket again", url=self.url)
        self._put_failed = False
        _BUCKET.set(1)
        if self._leaving:
            return True  # the heartbeat is being deleted: no liveness from a late PUT
        self._beat_landed(sent, epoch)
        return True

    # -- liveness ------------------------------------------------------------------------------

    def _beat_landed(self, sent: float, epoch: str) -> None:
        """A heartbeat sent at ``sent`` (monotonic) with the body of ``epoch`` landed in the
        bucket (our PUT, or a peer's relay of it): W1 runs until ``sent + dead_after - margin``,
        if that epoch is still ours and had not lapsed when this answer is handled."""
        if epoch != self.body.epoch or self._leaving:
            return  # a beat of an epoch that lapsed since it was sent: it counts for nothing
        if self._missed():
            return
        if self._landed is None or sent > self._landed:
            self._landed = sent
        self._recheck()

    def _deadline(self) -> float | None:
        """W1 or W2, whichever is later (None: no beat of this epoch has landed yet)."""
        if self._landed is None:
            return None
        w1 = self._landed + self.dead_after - self.margin  # lchat.mesh.fence.holder_deadline
        if self._peers is None:
            return w1
        return max(w1, self.witnesses.holder_deadline(self._landed))

    def _missed(self) -> bool:
        """Has our deadline passed unnoticed (a freeze, a stalled loop: its timer has not run
        yet)? Then whatever is being handled now counts for nothing: peers may have judged us
        dead meanwhile. Lapses now, and says so."""
        if self._alive_until is not None and self._monotonic() >= self._alive_until:
            self._lapse()
            return True
        return False

    def _recheck(self) -> None:
        """Our deadline may have moved (a beat landed, a peer answered or was retired, a peer
        became required, our beats' word changed): re-arm its timer, or lapse if it is past."""
        now = self._monotonic()
        until = self._deadline()
        if until is None:
            return
        if until <= now:
            if self._alive_until is not None:
                self._lapse()
            return
        previous = self._alive_until
        self._alive_until = until
        if previous != until:
            if self._alive_timer is not None and self._alive_timer.active():
                self._alive_timer.cancel()
            self._alive_timer = self._reactor.callLater(until - now, self._deadline_passed)
        w1 = self._landed is not None and now < self._landed + self.dead_after - self.margin
        if self._peers is not None and w1 == self._witnessed_by_peers:
            self._witnessed_by_peers = not w1
            if not w1:
                _LIVENESS.labels("peers").inc()
                log.warn(
                    "mesh: no heartbeat of {url} has landed for {seconds:.1f}s: alive on its "
                    "peers' word ({peers}) for up to {left:.0f}s more; its spaces keep serving",
                    url=self.url,
                    seconds=now - (self._landed or now),
                    peers=", ".join(p.url for p in self.witnesses.required()) or "none",
                    left=until - now,
                )
            else:
                _LIVENESS.labels("bucket").inc()
                log.info("mesh: {url} is alive on its own heartbeat again", url=self.url)
        became = self._not_alive or not self._first_beat.called
        if self._not_alive:
            self._not_alive = False
            log.info(
                "mesh: heartbeat {url} landed again: this box takes leases again", url=self.url
            )
        if not self._first_beat.called:
            self._first_beat.callback(None)
        if became:
            for fn in list(self._on_alive):
                try:
                    fn()
                except Exception:
                    log.failure("mesh: alive hook {fn!r} failed", fn=fn)

    def _deadline_passed(self) -> None:
        self._alive_timer = None
        if self._alive_until is None:
            return
        left = self._alive_until - self._monotonic()
        if left > 0:
            # (A timer that fired early by the reactor's clock: look again at the deadline. A
            # deadline that moved was re-armed by _recheck, which cancelled this timer.)
            self._alive_timer = self._reactor.callLater(max(0.01, left), self._deadline_passed)
            return
        self._lapse()  # the new epoch at once: every beat sent from now on carries its body

    def _lapse(self) -> None:
        """Our liveness lapsed: the stand-down (once), then a new epoch, alive from its own
        first landed beat: every lease of the old one stays lost (their keepers compare epochs),
        no beat of the old body counts again, a janitor's delete listed with the old body's ETag
        cannot remove a beat that counts, and every permission to judge a peer by its silence
        that this box held is void (the peer may have stopped counting on it)."""
        if self._alive_timer is not None and self._alive_timer.active():
            self._alive_timer.cancel()
        self._alive_timer = None
        self._alive_until = None
        self._landed = None
        if not self._not_alive:
            self._declare_not_alive()
        old = self.body.epoch
        self.body = self.keys.sign(
            evolve(
                self.body,
                epoch=uuid.uuid4().hex,
                started_at=round(max(self._reactor.seconds(), self.body.started_at + 0.001), 3),
            )
        )
        self._payload = self.body.to_json()
        log.info(
            "mesh: {url} beats under a new epoch {epoch} (was {old}): nothing of the old one counts",
            url=self.url,
            epoch=self.body.epoch[:8],
            old=old[:8],
        )

    def _declare_not_alive(self) -> None:
        self._not_alive = True
        STAND_DOWNS.inc()
        _LIVENESS.labels("none").inc()
        silent = [p.url for p in self.witnesses.required() if not self.witnesses.knows_backlog(p)]
        if self._peers is None:
            why = (
                f"no heartbeat of {self.url} has landed for "
                f"{self.dead_after - self.margin:.1f}s (dead after {self.dead_after:g}s on the "
                "bucket's clock)"
            )
        elif (
            self._landed is not None
            and self._monotonic() >= self._landed + self.witnesses.tolerance
        ):
            why = (
                f"no heartbeat of {self.url} has landed for "
                f"{self.witnesses.tolerance:g}s (LCHAT_MESH_OUTAGE_TOLERANCE)"
            )
        else:
            why = (
                f"isolated: no heartbeat of {self.url} lands in the bucket, and its peers "
                f"{', '.join(silent) or '(none)'} have not answered in time"
            )
        log.critical(
            "mesh: standing down: {why}: standing every space down now, before peers may "
            "judge this box dead and take them over; no lease is taken until a beat lands again",
            why=why,
            url=self.url,
            dead_after=self.dead_after,
        )
        for fn in list(self._on_not_alive):
            try:
                fn()
            except Exception:
                log.failure("mesh: stand-down hook {fn!r} failed", fn=fn)

    async def begin_drain(self) -> None:
        """The drain's first step: beat once with ``draining`` set, so peers drop this box from
        placement at their next read, while its leases stay fenced by a live heartbeat (its last
        flushes still land). Beats go on until :meth:`stopService` deletes the heartbeat. Never
        fails (a failed beat is logged; peers then drop us after ``dead_after``)."""
        if self.body.draining:
            return
        self.body = self.keys.sign(evolve(self.body, draining=True))
        self._payload = self.body.to_json()
        putting = self._putting
        if putting is not None:
            try:
                await _observe(putting)
            except Exception:  # noqa: S110 -- logged by the beat
                pass
        try:
            await self._put()
        except CancelledError:
            return
        log.info("mesh: {url} draining: announced in its heartbeat", url=self.url)

    # -- beating to the peers ----------------------------------------------------------------

    def _message(self, leaving: bool = False) -> BeatMessage:
        return BeatMessage(
            heartbeat=self.body,
            seq=self.witnesses.next_seq(),
            relay=self._put_failed and not leaving and not self._leaving,
            backlog=self._backlog_flag(),
            holds=normal_holds(self._holds()),
            leaving=leaving,
        )

    def _peer_round(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._round(fast=False))

    def _fast_round(self) -> Deferred[None] | None:
        if self._monotonic() >= self._fast_until or self._stopping:
            if self._fast_loop.running:
                self._fast_loop.stop()
            return None
        return Deferred.fromCoroutine(self._round(fast=True))

    async def _round(self, fast: bool) -> None:
        """One beat to every peer of the roster that has none on its way (each answered or given
        up on within :attr:`peer_timeout`; the next round does not wait for a slow one)."""
        if self._stopping or self._peers is None:
            return
        message = self._message()
        calls = []
        for peer in self.witnesses.roster():
            if peer.in_flight:
                continue
            calls.append(Deferred.fromCoroutine(self._send(peer, message, self.peer_timeout)))
        if not fast:
            self.rounds += 1
        if calls and not fast:
            # The regular round waits (bounded) so that the loop never stacks rounds up; the fast
            # one does not wait at all: a slow peer is skipped until it answers.
            await defer.DeferredList(calls, consumeErrors=True)

    async def _send(
        self,
        peer: Peer,
        message: BeatMessage,
        timeout: float,  # noqa: ASYNC109 -- Twisted: the channel enforces it
        track: bool = True,
    ) -> tuple[bool, int | None]:
        """Send ``message`` to ``peer``: (answered, the HTTP status of a refusal). What an answer
        says is recorded. ``track``: a round's beat (at most one on its way to a peer); a probe
        is not."""
        assert self._peers is not None
        epoch = self.body.epoch
        sent = self._monotonic()
        # (What it is told may let it judge this box sooner: our deadline may move now.)
        self.witnesses.sent(peer, message.seq, message.backlog)
        self._recheck()
        if track:
            peer.in_flight = True
        try:
            raw = await self._peers.call(peer.url, message.to_json(), timeout)
            reply = BeatReply.parse(raw)
            if normalise_member_url(reply.heartbeat.url) != peer.url:
                raise PeerCallError(peer.url, f"answered as {reply.heartbeat.url!r}")
        except CancelledError:
            raise
        except Exception as e:
            status = getattr(e, "status", None)
            refused = bool(getattr(e, "refused", False))
            was = peer.failed
            self.witnesses.not_answered(
                peer, self._monotonic(), legacy=status == 404, refused=refused
            )
            _PEER_BEATS.labels("failed").inc()
            # Silent: what waits on it would wait for TCP, so its connections are aborted.
            # Refused: a draining router closes its port and still answers the requests it has
            # (aborting them would fail answers on their way); a dead one's kernel resets them.
            if was == 0 and status is None and not refused:
                for fn in list(self._on_unreachable):
                    try:
                        fn(peer.url)
                    except Exception:
                        log.failure("mesh: unreachable hook {fn!r} failed", fn=fn)
            if was == 1 and not message.leaving:
                log.warn(
                    "mesh: {peer} does not answer this box's beats ({error})",
                    peer=peer.url,
                    error=e if isinstance(e, MessageError) else _describe(e, timeout),
                )
            return False, status
        finally:
            if track:
                peer.in_flight = False
        _PEER_BEATS.labels("ok").inc()
        was_failing = peer.failed >= 2
        if self._missed():
            return True, None
        self.witnesses.confirmed(
            peer, reply, sent, message.seq, message.backlog, self._monotonic(), self.body.epoch
        )
        if was_failing:
            log.info("mesh: {peer} answers this box's beats again", peer=peer.url)
        if reply.relayed and message.relay:
            _PEER_BEATS.labels("relayed").inc()
            if self._relayed_by != peer.url:
                self._relayed_by = peer.url
                log.warn(
                    "mesh: {url} reachable via peer {peer}: its heartbeat landed in the bucket "
                    "through it (this box cannot reach the bucket itself)",
                    url=self.url,
                    peer=peer.url,
                )
            self._beat_landed(sent, epoch)
        else:
            self._recheck()
        self._wake_witness_waiters()
        return True, None

    def _wake_witness_waiters(self) -> None:
        if self._witness_waiters and self.writes_safe():
            waiters, self._witness_waiters = self._witness_waiters, []
            for waiter in waiters:
                waiter.callback(True)

    async def receive_beat(self, message: BeatMessage) -> BeatReply:
        """A peer's beat (the mesh API has checked its token): record it, relay its heartbeat
        into the bucket when it asks and ours lands, answer with ours."""
        url = normalise_member_url(message.heartbeat.url)
        if url == self.url:
            raise MessageError("a beat from this box itself")
        if not message.heartbeat.process:
            raise MessageError("the heartbeat names no process")
        message = evolve(message, heartbeat=evolve(message.heartbeat, url=url))
        if self._missed():
            pass  # (lapsed now; the answer still goes out)
        seq = self.witnesses.next_seq()
        backlog = self._backlog_flag()
        self.witnesses.answered(message, self._monotonic(), seq, backlog)
        if message.leaving:
            log.info("mesh: {peer} has drained: it writes nothing more", peer=url)
        self._recheck()
        relayed = False
        if message.relay and not self._put_failed and not self._stopping:
            if self.keys.check(message.heartbeat) is None:
                # (It would be no member's in the bucket: not worth a write.)
                _RELAYS.labels("failed").inc()
                log.warn(
                    "mesh: not relaying the heartbeat of {peer}: its MAC does not verify under "
                    "LCHAT_MESH_TOKEN (an older lchat, or another token)",
                    peer=url,
                )
            else:
                relayed = await self._relay(message.heartbeat)
        return BeatReply(
            heartbeat=self.body,
            seq=seq,
            backlog=backlog,
            relayed=relayed,
            holds=normal_holds(self._holds()),
        )

    async def _relay(self, heartbeat: Heartbeat) -> bool:
        """Write a peer's heartbeat into the bucket for it (it cannot: docs/lease.md). True once
        the write succeeded; bounded by :attr:`relay_timeout`."""
        putting = Deferred.fromCoroutine(
            self._store.put(
                member_key(self._hib, heartbeat.url),
                heartbeat.to_json(),
                content_type="application/json",
            )
        )
        putting.addTimeout(self.relay_timeout, self._reactor)
        try:
            await putting
        except CancelledError:
            raise
        except Exception as e:
            _RELAYS.labels("failed").inc()
            log.warn(
                "mesh: could not relay the heartbeat of {peer} ({error})",
                peer=heartbeat.url,
                error=_describe(e, self.relay_timeout),
            )
            return False
        _RELAYS.labels("ok").inc()
        return True

    async def probe(self, url: str) -> bool:
        """Is the box at ``url`` there? One beat to it, bounded by :attr:`probe_timeout`: any
        answer of its mesh API says yes (even a refusal: something runs there). When our last two
        beats to it went unanswered, the latest within a heartbeat, and nothing was heard of it
        since, that is the answer already (no second wait)."""
        if self._peers is None:
            return False
        peer = self.witnesses.peers.get(url)
        if peer is None:
            # Not a URL whose heartbeat authenticated, nor one that beat this box with the
            # token: a lease naming it was not written by a mesh box (or by one long gone).
            # The mesh token never goes to it: it does not answer.
            log.info(
                "mesh: not probing {url}: no authenticated heartbeat of it is known here", url=url
            )
            return False
        now = self._monotonic()
        if (
            peer.failed >= 2
            and peer.failed_at is not None
            and now - peer.failed_at < self.heartbeat
            and (peer.heard is None or peer.heard < peer.failed_at)
        ):
            # Our last two beats went unanswered, the latest within a heartbeat, and it said
            # nothing since (a box that reaches us beats us): one more would only time out.
            _PROBES.labels("known_silent").inc()
            return False
        answered, status = await self._send(peer, self._message(), self.probe_timeout, track=False)
        _PROBES.labels("answered" if answered or status is not None else "silent").inc()
        return answered or status is not None

    async def _bounded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        d = Deferred.fromCoroutine(coro)
        d.addTimeout(self.timeout, self._reactor)
        return await d

    def _self_member(self, now: datetime.datetime | None) -> Member:
        if now is None:
            now = datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC)
        return Member(
            url=self.url,
            region=self.region,
            version=self.body.version,
            started_at=self.body.started_at,
            last_modified=now,
            age=0.0,
            key=self.key,
            is_self=True,
            process=self.body.process,
        )

    def _update(self, members: list[Member], now: datetime.datetime | None) -> None:
        if now is None:
            now = datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC)
        old = self._members
        self._members = members
        MEMBERS_LIVE.set(len(members))
        if _urls(old) == _urls(members):
            return
        CHANGES.inc()
        before = {m.url: m for m in old}
        after = {m.url: m for m in members}
        for url, m in after.items():
            was = before.get(url)
            if was is None:
                log.info(
                    "mesh: member joined {url} (region {region})",
                    url=url,
                    region=m.region or "-",
                    version=m.version,
                    started_at=m.started_at,
                )
            elif was.region != m.region:
                log.info(
                    "mesh: member {url} changed region {old_region} -> {region}",
                    url=url,
                    old_region=was.region or "-",
                    region=m.region or "-",
                )
        for url, was in before.items():
            if url not in after:
                ago = (now - was.last_modified).total_seconds()
                log.info(
                    "mesh: member gone {url} (last beat {ago:.0f}s ago)",
                    url=url,
                    region=was.region or "-",
                    ago=ago,
                )
        for fn in list(self._subscribers):
            try:
                fn(list(old), list(members))
            except Exception:
                log.failure("mesh: membership subscriber {fn!r} failed", fn=fn)


def _no_backlog() -> bool:
    return False


def _describe(e: BaseException | None, timeout: float) -> str:
    if isinstance(e, defer.TimeoutError):
        return f"no answer within {timeout:g}s"
    return f"{type(e).__name__}: {e}"


def _observe(d: Deferred[Any]) -> Deferred[Any]:
    """A new Deferred with ``d``'s result, leaving the result on ``d`` for its other waiters.
    Cancelling the new one does not cancel ``d``."""
    waiter: Deferred[Any] = Deferred()

    def passthrough(result: Any) -> Any:
        if not waiter.called:
            if isinstance(result, Failure):
                waiter.errback(result)
                return None  # handed on: not left unhandled on ``d``
            waiter.callback(result)
        return result

    d.addBoth(passthrough)
    return waiter

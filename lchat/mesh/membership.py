"""Membership (DESIGN.md §9): heartbeats in the bucket, one LIST gives the fleet.

Every mesh box PUTs one object every ``LCHAT_MESH_HEARTBEAT`` seconds (15 s)::

    <prefix>/mesh/members/<base64url(normalised LCHAT_MESH_SELF), no padding>

in the hibernation bucket, or in ``LCHAT_MESH_BUCKET`` when the fleet's regions keep their replicas
in different buckets (every member of one mesh must name the same place). The key is the record: it names the box, so one LIST of the prefix is the whole membership, and
the ``Last-Modified`` of each object is that box's last beat. The body is small JSON that stays the
same across beats (so its ETag does not change and peers read it once per process of the box)::

    {"region": "ie", "started_at": 1789000000.123, "url": "https://box-1.example.net", "version": "0.1.0"}

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
import json
import math
import re
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
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
from lchat.mesh.placement import normalise_member_url
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
class Heartbeat:
    """The body of a heartbeat object."""

    url: str  # normalised LCHAT_MESH_SELF
    region: str  # LCHAT_MESH_REGION ("" = region-agnostic)
    version: str  # lchat.__version__ of the beating process
    started_at: float  # unix seconds (the box's clock, informational) of that process's start
    # Random per router process: the leases it takes name it (docs/lease.md), so a peer can tell
    # a restarted box (another epoch) from the process that took them. "" in older bodies.
    epoch: str = ""
    # The box is draining: out of placement at once, but alive (it still writes its last
    # flushes) until the drain deletes the heartbeat.
    draining: bool = False

    def to_json(self) -> bytes:
        """Deterministic: the same heartbeat always gives the same bytes (and ETag)."""
        data: dict[str, Any] = {
            "url": self.url,
            "region": self.region,
            "version": self.version,
            "started_at": self.started_at,
        }
        if self.epoch:
            data["epoch"] = self.epoch
        if self.draining:
            data["draining"] = True
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, body: bytes) -> Heartbeat:
        """Strict (ValueError says why): every field present with its type; extra fields ignored."""
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("body is not JSON") from None
        if not isinstance(data, dict):
            raise ValueError("body is not a JSON object")
        url, region, version, started = (
            data.get("url"),
            data.get("region"),
            data.get("version"),
            data.get("started_at"),
        )
        if not (isinstance(url, str) and isinstance(region, str) and isinstance(version, str)):
            raise ValueError("url, region and version must be strings")
        if (
            not isinstance(started, int | float)
            or isinstance(started, bool)
            or not math.isfinite(started)
        ):
            raise ValueError("started_at must be a number")
        epoch, draining = data.get("epoch", ""), data.get("draining", False)
        if not isinstance(epoch, str) or not isinstance(draining, bool):
            raise ValueError("epoch must be a string and draining a boolean")
        return cls(
            url=url,
            region=region,
            version=version,
            started_at=float(started),
            epoch=epoch,
            draining=draining,
        )


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
) -> list[Member]:
    """The live members (sorted by URL): one LIST of the members prefix and ``store.now()``.

    A member is live until :func:`judged_dead` on the bucket's clock (``now >= floor(last_modified)
    + 1 s + dead_after``: the rule a taker of its leases applies, lchat.mesh.fence). Bodies are
    fetched (GET) only for live keys whose ETag is not already in ``bodies`` (``key -> (etag,
    parsed)``, a cache the caller may keep across reads; entries for keys no longer listed are
    dropped). Garbage is skipped with one log line per version (with a cache; each read without).
    ``self_url`` marks this box's own entry (``Member.self``); ``include_dead`` also returns the
    members whose beat is too old (the caller can tell them by ``age``).

    Store errors propagate (typed :class:`~lchat.objstore.ObjectStoreError`) after being counted
    in ``lchat_mesh_heartbeat_failures_total``, except a body GET that fails while an older body
    of the same key is cached: that one is used (bodies change only when a box restarts).
    """
    phase = ["list"]
    try:
        _, members = await _read(store, hib, dead_after, bodies, self_url, include_dead, phase)
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
) -> tuple[datetime.datetime, list[Member]]:
    """The read itself; ``phase[0]`` says which operation is under way ("list", "get"), so
    that the caller can count a failure or a timeout against it. ``listing``, when given, receives
    the raw LIST (for the janitor, which needs the dead keys and their ETags)."""
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
            continue  # dead: its body does not matter
        heartbeat = await _heartbeat(store, cache, prefix, info.key, info.etag, info.size)
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
            )
        )
    members.sort(key=lambda m: m.url)
    return now, members


async def _heartbeat(
    store: ObjectStore, cache: BodyCache, prefix: str, key: str, etag: str, size: int
) -> Heartbeat | None:
    """The parsed body of ``key`` at ``etag`` (cached), or None for garbage (logged once)."""
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
    """This box's heartbeat and its view of the mesh (DESIGN.md §9).

    On start it beats at once, then every ``mesh.heartbeat`` seconds: PUT our heartbeat, then one
    :func:`read_members` (bodies cached by ETag). Each operation is bounded by
    ``max(mesh.heartbeat, 1 s)``. :attr:`members` is the last view: live members, this box
    included. It is never empty: until a read shows anybody, and whenever our latest PUT succeeded
    but the listing does not show it yet, this box is in it (so placement always has a fleet).

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
    ) -> None:
        """``monotonic``: the clock this box's liveness deadline is kept on (the one the lease
        keepers use). ``epoch``: this process's heartbeat epoch (random when not given)."""
        self._reactor = reactor
        self._store = store
        self._hib = hib
        self._monotonic = monotonic
        self.url = normalise_member_url(mesh.self_url)
        self.region = mesh.region
        self.key = member_key(hib, self.url)
        self.heartbeat = mesh.heartbeat
        self.dead_after = mesh.dead_after
        self.timeout = max(mesh.heartbeat, 1.0)  # per store operation of a beat
        self.stop_timeout = STOP_TIMEOUT
        self.body = Heartbeat(
            url=self.url,
            region=mesh.region,
            version=lchat.__version__,
            # Informational: when this router started (it builds its membership at start).
            started_at=round(reactor.seconds() if started_at is None else started_at, 3),
            epoch=uuid.uuid4().hex if epoch is None else epoch,
        )
        self._payload = self.body.to_json()
        # Liveness (docs/lease.md): this box may write on its leases until ``_alive_until`` (the
        # monotonic time the last successful beat was *sent* + dead_after - margin); peers may
        # judge it dead only dead_after after that beat landed (the bucket's clock).
        self.margin = mesh.dead_after * LIVENESS_MARGIN
        self._alive_until: float | None = None  # None: no beat has landed yet (or we left)
        self._alive_timer: Any = None
        self._not_alive = False  # the deadline passed (logged, subscribers told) until a beat lands
        self._first_beat: Deferred[None] = Deferred()
        self._on_not_alive: list[Callable[[], object]] = []
        self._draining: frozenset[str] = frozenset()  # peers whose heartbeat says "draining"
        self._bodies: BodyCache = {}
        self._members: list[Member] = [self._self_member(None)]
        self._subscribers: list[Callable[[list[Member], list[Member]], object]] = []
        self._loop = LoopingCall(self._tick)
        self._loop.clock = reactor
        self._beat: Deferred[None] | None = None
        self._putting: Deferred[Any] | None = None
        self._stopping = False
        self._leaving = False
        self._etag = ""  # of our last landed PUT: the drain deletes only that version
        self._left: Deferred[None] | None = None
        self.beats = 0  # completed beats (PUT and read attempted), for tests and the admin API
        # The janitor deletes member keys older than this (bucket clock). Ten dead_afters: a box
        # that is only cut off or frozen for a few minutes keeps its key (and ``lchat mesh`` shows
        # it as dead meanwhile); only what a crash left for good is cleaned up.
        self.janitor_after = JANITOR_DEAD_AFTERS * mesh.dead_after
        self.janitor_beats = 0  # beats whose janitor step is over (whatever it did), for tests
        self._garbage_left: set[str] = set()  # garbage keys the janitor has logged about

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
        """This process's heartbeat epoch (written into the leases it takes)."""
        return self.body.epoch

    def alive(self) -> bool:
        """May this box write on its leases now? True from the first landed beat until
        ``dead_after - margin`` after the last one was sent (monotonic clock), while the
        heartbeat exists. Peers cannot judge this box dead before that (docs/lease.md)."""
        return self._alive_until is not None and self._monotonic() < self._alive_until

    def draining(self) -> frozenset[str]:
        """The peers whose heartbeat said "draining" at the last read (out of :meth:`live`, but
        alive: they release their leases within moments)."""
        return self._draining

    def lapsed(self) -> bool:
        """A beat landed once, and none since ``dead_after - margin``: this box serves and writes
        nothing until one lands (before the first beat a wake waits for it instead)."""
        return self._first_beat.called and not self.alive()

    def first_beat(self) -> Deferred[None]:
        """Fires once a beat has landed (at once if one has): a mesh box takes no lease before."""
        return _observe(self._first_beat)

    def on_not_alive(self, fn: Callable[[], object]) -> None:
        """``fn()`` when this box's liveness deadline passes without a beat landing: every space
        it runs must stand down now (the activator's hook)."""
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

    # -- lifecycle -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        log.info(
            "mesh: beating as {url} (region {region}) every {heartbeat:g}s, dead after "
            "{dead_after:g}s, key {key}",
            url=self.url,
            region=self.region or "-",
            heartbeat=self.heartbeat,
            dead_after=self.dead_after,
            key=self.key,
        )
        self._loop.start(self.heartbeat, now=True).addErrback(
            lambda f: log.failure("mesh: heartbeat loop crashed", f)
        )

    def stopService(self) -> Deferred[None]:
        """Stop beating and delete our heartbeat first; fires when the delete is done or failed
        (at most :attr:`stop_timeout` seconds). Never fails."""
        super().stopService()
        self._stopping = True
        if self._loop.running:
            self._loop.stop()
        if self._left is None or self._left.called:
            left = Deferred.fromCoroutine(self._leave())
            left.addTimeout(self.stop_timeout, self._reactor)
            left.addErrback(self._leave_failed)
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

    # -- beating -------------------------------------------------------------------------------

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
            return
        finally:
            self.beats += 1
        members = view
        self._draining = frozenset(draining)
        if not any(m.self for m in members) and (put_ok or not members):
            members = sorted([*members, self._self_member(now)], key=lambda m: m.url)
        self._update(members, now)
        if put_ok and not self._stopping:
            await self._sweep(listing, now)
        self.janitor_beats += 1

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
            log.warn(
                "mesh: heartbeat PUT failed ({error}); peers drop {url} after {dead_after:g}s "
                "without one",
                error=_describe(e, self.timeout),
                url=self.url,
                dead_after=self.dead_after,
            )
            return False
        finally:
            if self._putting is putting:
                self._putting = None
        if self._leaving:
            return True  # the heartbeat is being deleted: no liveness from a late PUT
        self._beat_landed(sent, epoch)
        return True

    def _beat_landed(self, sent: float, epoch: str) -> None:
        """A PUT sent at ``sent`` (monotonic) with the body of ``epoch`` succeeded: alive until
        ``sent + dead_after - margin``, if that epoch is still ours and had not lapsed when this
        answer is handled."""
        if epoch != self.body.epoch:
            return  # a beat of an epoch that lapsed since it was sent: it counts for nothing
        if self._alive_until is not None and self._monotonic() >= self._alive_until:
            # The deadline passed before this answer was handled (a freeze, a stalled loop: the
            # timer has not run yet, whenever the beat was sent). Peers may have taken our spaces
            # over meanwhile, and this beat carries the lapsed epoch's body (and ETag: a
            # janitor's delete listed before may remove it): it counts for nothing.
            self._lapse()
            return
        until = sent + self.dead_after - self.margin  # lchat.mesh.fence.holder_deadline
        if self._alive_until is not None and until <= self._alive_until:
            return
        self._alive_until = until
        if self._alive_timer is not None and self._alive_timer.active():
            self._alive_timer.cancel()
        self._alive_timer = self._reactor.callLater(
            max(0.0, until - self._monotonic()), self._deadline_passed
        )
        if self._not_alive:
            self._not_alive = False
            log.info(
                "mesh: heartbeat {url} landed again: this box takes leases again", url=self.url
            )
        if not self._first_beat.called:
            self._first_beat.callback(None)

    def _deadline_passed(self) -> None:
        self._alive_timer = None
        if self.alive() or self._alive_until is None:
            if self._alive_until is not None:
                # (A timer that fired early by the reactor's clock: look again at the deadline.)
                self._alive_timer = self._reactor.callLater(
                    max(0.01, self._alive_until - self._monotonic()), self._deadline_passed
                )
            return
        self._lapse()  # the new epoch at once: every beat sent from now on carries its body

    def _lapse(self) -> None:
        """Our liveness lapsed: the stand-down (once), then a new epoch, alive from its own
        first beat: every lease of the old one stays lost (their keepers compare epochs), no
        beat of the old body counts again, and a janitor's delete listed with the old body's
        ETag cannot remove a beat that counts."""
        if self._alive_timer is not None and self._alive_timer.active():
            self._alive_timer.cancel()
        self._alive_timer = None
        self._alive_until = None
        if not self._not_alive:
            self._declare_not_alive()
        old = self.body.epoch
        self.body = evolve(
            self.body,
            epoch=uuid.uuid4().hex,
            started_at=round(max(self._reactor.seconds(), self.body.started_at + 0.001), 3),
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
        log.critical(
            "mesh: no heartbeat of {url} has landed for {seconds:.1f}s (dead after {dead_after:g}s "
            "on the bucket's clock): standing every space down now, before peers may judge this "
            "box dead and take them over; no lease is taken until a beat lands again",
            url=self.url,
            seconds=self.dead_after - self.margin,
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
        self.body = evolve(self.body, draining=True)
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
        )

    def _update(self, members: list[Member], now: datetime.datetime) -> None:
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

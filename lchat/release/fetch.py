"""Fetching builds from the signed feed: primary, mirror, anti-rollback, atomic install.

The order (docs/operations.md, "Releases"):

1. The primary (``LCHAT_RELEASE_URL``): ``feed.json`` and ``feed.json.sig``. It is used when its
   signature verifies, it parses, it has not expired (:func:`freshness`: a source cannot freeze a
   box on an old feed for longer than the feed's validity), and it is not older than the newest
   feed this box ever accepted (``<opt>/release-state.json``, :func:`staleness`).
2. Otherwise the mirror (``LCHAT_RELEASE_MIRROR_URL``), under exactly the same checks: the mirror
   adds availability, never trust.
3. Neither usable: :class:`NoUsableFeed`, naming what was wrong with each; nothing changed.

The accepted feed's version and digest are persisted (atomically) before anything is installed:
a verified feed is knowledge whatever happens to its artefacts. Artefacts are downloaded (from
the source that gave the feed, then the other one: their sha256 comes from the verified feed, so
any source will do) into ``versions/.<v>.<random>.tmp/``, checked for size and sha256, given
their mode, fsynced, and only then renamed to ``versions/<v>/``: a tampered or truncated file, or
any failure, leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Protocol

import attrs
import treq
import treq.client
from attrs import frozen
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from prometheus_client import Counter
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError, ConnectingCancelledError, DNSLookupError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss

from lchat.builds import BuildLayout
from lchat.files import fsync_directory, write_atomic
from lchat.objstore import NotFound, ObjectStore, ObjectStoreError
from lchat.reactors import TCPReactor
from lchat.release import feed as feedlib
from lchat.release.feed import Artefact, Feed, FeedError, Release
from lchat.twisted_internals import treq_reactor

FETCHES = Counter(
    "lchat_release_fetches_total",
    "Release feed reads by source and outcome: ok, down, bad (signature or manifest), expired "
    "(past its signed expires_at, or without one), stale (older than the feed this box accepted)",
    ["source", "outcome"],
)
for _source in ("primary", "mirror"):
    for _outcome in ("ok", "down", "bad", "expired", "stale"):
        FETCHES.labels(_source, _outcome)
_log = Logger(namespace="lchat.release")
HTTP_TIMEOUT = 60.0
BODY_TIMEOUT = 900.0  # a build of a few hundred MB over a slow link, with room to spare


class SourceUnavailable(FeedError):
    """A source did not answer usably (down, 404, too big, timed out)."""


class NoUsableFeed(FeedError):
    """Neither the primary nor the mirror gave a feed this box may trust."""


class ArtefactRefused(FeedError):
    """A downloaded file is not what the verified feed says (size or sha256)."""


# --- sources ---------------------------------------------------------------------------------------


class FeedSource(Protocol):
    """Where a feed and its artefacts are read from."""

    def describe(self) -> str: ...

    async def read(self, path: str, limit: int) -> bytes:
        """The object at ``path`` (relative to the feed's base), at most ``limit`` bytes."""
        ...

    async def download(self, path: str, sink: HashingFile) -> None:
        """Stream the object at ``path`` into ``sink`` (which may be rewound and refilled)."""
        ...


def http_client(reactor: TCPReactor) -> treq.client.HTTPClient:
    """A treq client whose connections close after each response: a CLI run leaves nothing open."""
    pool = HTTPConnectionPool(reactor, persistent=False)
    return treq.client.HTTPClient(Agent(reactor, connectTimeout=HTTP_TIMEOUT, pool=pool))


@frozen
class HttpSource:
    """The primary: ``<base>/<path>`` over HTTP(S), via ``_treq`` (:func:`http_client`)."""

    base: str
    _treq: treq.client.HTTPClient
    _reactor: TCPReactor
    timeout: float = HTTP_TIMEOUT  # until the response's headers
    body_timeout: float = BODY_TIMEOUT  # the whole body: a trickling server is given up on

    def describe(self) -> str:
        return self.base

    def _url(self, path: str) -> str:
        return f"{self.base.rstrip('/')}/{path}"

    async def _get(self, path: str) -> Any:
        url = self._url(path)
        try:
            # The header timeout on our reactor (treq would use the global one).
            response = await self._treq.get(
                url, timeout=self.timeout, reactor=treq_reactor(IReactorTime(self._reactor))
            )
        except (
            ConnectError,
            ConnectingCancelledError,
            DNSLookupError,
            ResponseFailed,
            CancelledError,
            TimeoutError,
        ) as e:
            raise SourceUnavailable(f"GET {url}: {type(e).__name__}: {e}") from None
        if response.code != 200:
            await response.text()  # drain it, so the connection can be reused or closed cleanly
            raise SourceUnavailable(f"GET {url}: HTTP {response.code}")
        return response

    async def read(self, path: str, limit: int) -> bytes:
        sink = _Limited(limit, self._url(path))
        await self.download(path, sink)
        return bytes(sink.data)

    async def download(self, path: str, sink: HashingFile | _Limited) -> None:
        response = await self._get(path)
        await self._collect(response, sink.write, self._url(path))

    async def _collect(self, response: Any, write: Any, url: str) -> None:
        body = _Body(write)
        response.deliverBody(body)
        collecting = body.done
        collecting.addTimeout(self.body_timeout, IReactorTime(self._reactor))
        try:
            await collecting
        except TimeoutError:
            raise SourceUnavailable(
                f"GET {url}: the body did not arrive within {self.body_timeout:g}s"
            ) from None
        except (ResponseFailed, CancelledError) as e:
            raise SourceUnavailable(f"GET {url}: the body broke off ({type(e).__name__})") from None


class _Body(TwistedProtocol):
    """Hands a response body to ``write`` as it arrives. If ``write`` raises, or the wait is
    cancelled (a timeout), the connection is aborted: nothing is left open or half read."""

    def __init__(self, write: Callable[[bytes], object]) -> None:
        self._write = write
        self.done: Deferred[None] = Deferred(lambda _: self._abort())

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        try:
            self._write(data)
        except Exception:
            self.done.errback()
            self._abort()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(None)
        else:
            self.done.errback(reason)


class _Limited:
    """A body held in memory, refused past ``limit`` bytes; a rewind (an object store's retry)
    starts it afresh."""

    def __init__(self, limit: int, where: str) -> None:
        self.data = bytearray()
        self._limit = limit
        self._where = where

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        if len(self.data) > self._limit:
            raise SourceUnavailable(f"{self._where}: larger than {self._limit} bytes")
        return len(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.data.clear()
        return 0

    def truncate(self, size: int | None = None) -> int:
        self.data.clear()
        return 0


@frozen
class BucketSource:
    """The mirror: ``<prefix>/<path>`` in an object store (S3, or ``file:``)."""

    store: ObjectStore
    prefix: str
    url: str  # as configured, for messages

    def describe(self) -> str:
        return self.url

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    async def read(self, path: str, limit: int) -> bytes:
        sink = _Limited(limit, self._key(path))
        await self.download(path, sink)
        return bytes(sink.data)

    async def download(self, path: str, sink: Any) -> None:  # HashingFile or _Limited: IO-like
        key = self._key(path)
        try:
            await self.store.get_into(key, sink)
        except NotFound:
            raise SourceUnavailable(f"{self.url}: no object {key}") from None
        except ObjectStoreError as e:
            raise SourceUnavailable(f"{self.url}: {e}") from None


class HashingFile:
    """A download's destination: writes go to ``file`` and into a running sha256, refused past
    ``limit`` bytes; a rewind (an object store's retry) starts both afresh."""

    def __init__(self, file: IO[bytes], limit: int, where: str) -> None:
        self._file = file
        self._limit = limit
        self._where = where
        self.size = 0
        self._hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > self._limit:
            raise ArtefactRefused(f"{self._where}: larger than the feed's {self._limit} bytes")
        self._hash.update(data)
        self._file.write(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._file.seek(0)
        self.size = 0
        self._hash = hashlib.sha256()
        return 0

    def truncate(self, size: int | None = None) -> int:
        self._file.truncate(0)
        return 0

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


# --- the accepted-feed state (anti-rollback) ------------------------------------------------------


@frozen
class Accepted:
    feed_version: int
    digest: str
    accepted_at: float
    source: str
    # Each version the feed listed, and its ``released_at``: the feed's order of builds, which
    # the build floor reads (lchat.builds.compare_versions). Empty in a state written before.
    released: Mapping[str, str] = attrs.field(factory=dict)


def released_order(feed: Feed) -> dict[str, str]:
    """``feed``'s versions and their ``released_at``, those with a well-formed time only."""
    order = {}
    for version, release in feed.versions.items():
        try:
            feedlib.parse_stamp(release.released_at)
        except FeedError:
            continue
        order[version] = release.released_at
    return order


def read_state(path: str) -> Accepted | None:
    """The newest feed this box accepted, or None (never fetched). A damaged file is an error:
    silently forgetting it would reopen the door to a stale feed."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        return Accepted(
            feed_version=int(doc["feed_version"]),
            digest=str(doc["digest"]),
            accepted_at=float(doc.get("accepted_at", 0)),
            source=str(doc.get("source", "")),
            released={
                str(v): str(at)
                for v, at in (doc.get("released") or {}).items()
                if isinstance(at, str)
            },
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FeedError(
            f"{path} is unreadable ({e}): it records the newest feed this box accepted; "
            "restore it, or remove it to trust the next feed that verifies"
        ) from None


def write_state(path: str, accepted: Accepted) -> None:
    doc = attrs.asdict(accepted)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n", 0o644)


def staleness(feed: Feed, accepted: Accepted | None) -> str | None:
    """Why ``feed`` must not be used given the newest accepted one, or None when it may."""
    if accepted is None or feed.feed_version > accepted.feed_version:
        return None
    if feed.feed_version == accepted.feed_version:
        if feed.digest == accepted.digest:
            return None
        return (
            f"feed_version {feed.feed_version} with other contents than the feed_version "
            f"{accepted.feed_version} this box accepted (digest {feed.digest[:12]} != "
            f"{accepted.digest[:12]})"
        )
    return (
        f"stale: feed_version {feed.feed_version}, older than the feed_version "
        f"{accepted.feed_version} this box already accepted"
    )


def freshness(feed: Feed, now: float) -> str | None:
    """Why ``feed`` must not be used at ``now`` (it expired, or it has no ``expires_at``), or
    None when it may. The time is the feed's signed ``expires_at``: nobody without the signing
    key can extend it."""
    expires = feed.expires
    if expires is None:
        return (
            f"feed_version {feed.feed_version} has no expires_at (signed before feeds expired, "
            "so it could be replayed for ever): re-sign it on the release host with "
            "`lchat release refresh`"
        )
    if now >= expires:
        return (
            f"expired: feed_version {feed.feed_version} expired at {feed.expires_at} "
            f"({_ago(now - expires)} ago): a source serving an old feed, or a release host that "
            "stopped re-signing it (`lchat release refresh`)"
        )
    return None


def _ago(seconds: float) -> str:
    if seconds >= 86400:
        days = int(seconds // 86400)
        return f"{days} day{'s' if days != 1 else ''}"
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h"
    return f"{int(seconds)} s"


# --- the fetcher -----------------------------------------------------------------------------------


@frozen
class Fetcher:
    """Reads the feed (primary, then mirror) and installs builds from it into ``layout``."""

    layout: BuildLayout
    pubkey: Ed25519PublicKey
    state_file: str
    primary: FeedSource | None
    mirror: FeedSource | None
    _clock: Callable[[], float] = time.time

    def _sources(self) -> list[tuple[str, FeedSource]]:
        named = [("primary", self.primary), ("mirror", self.mirror)]
        return [(name, source) for name, source in named if source is not None]

    async def feed(self) -> tuple[Feed, str, FeedSource]:
        """The feed to use, which source gave it ("primary"/"mirror"), and that source.
        Raises :class:`NoUsableFeed` naming what was wrong with each source."""
        if not self._sources():
            raise NoUsableFeed(
                "no release feed configured: set LCHAT_RELEASE_URL and/or LCHAT_RELEASE_MIRROR_URL"
            )
        accepted = read_state(self.state_file)
        problems = []
        for name, source in self._sources():
            try:
                feed = await self._verified(source)
            except FeedError as e:
                FETCHES.labels(name, "down" if isinstance(e, SourceUnavailable) else "bad").inc()
                problems.append(f"{name} {source.describe()}: {e}")
                continue
            refusal = freshness(feed, self._clock())
            outcome = "expired"
            if refusal is None:
                refusal, outcome = staleness(feed, accepted), "stale"
            if refusal is not None:
                FETCHES.labels(name, outcome).inc()
                _log.warn(
                    "release: refusing the feed from the {name} {source}: {why}",
                    name=name,
                    source=source.describe(),
                    why=refusal,
                )
                problems.append(f"{name} {source.describe()}: {refusal}")
                continue
            FETCHES.labels(name, "ok").inc()
            order = released_order(feed)
            # Not stale: newer, or the same (then rewritten only to add the order it lacked).
            if accepted is None or accepted.digest != feed.digest or accepted.released != order:
                write_state(
                    self.state_file,
                    Accepted(feed.feed_version, feed.digest, self._clock(), name, order),
                )
            return feed, name, source
        raise NoUsableFeed("no usable release feed, nothing changed: " + "; ".join(problems))

    async def _verified(self, source: FeedSource) -> Feed:
        # feed.json and its .sig are two objects: a publish lands between our two reads at
        # worst once, so a signature that fails is read (both files) once more before it counts.
        for again in (True, False):
            feed_bytes = await source.read(feedlib.FEED_NAME, feedlib.MAX_FEED_BYTES)
            signature = await source.read(feedlib.SIGNATURE_NAME, 4096)
            try:
                feedlib.verify(self.pubkey, feed_bytes, signature)
            except feedlib.BadSignature:
                if again:
                    continue
                raise
            break
        return feedlib.parse(feed_bytes)

    async def fetch(self, version: str) -> tuple[str, Release, str]:
        """Install ``version``: (what happened: "installed" or "already installed", its release,
        the source name the feed came from)."""
        feed, name, source = await self.feed()
        release = feed.versions.get(version)
        if release is None:
            listed = ", ".join(sorted(feed.versions)) or "none"
            raise FeedError(
                f"version {version} is not in the feed (feed_version {feed.feed_version} from "
                f"the {name}; it lists: {listed})"
            )
        others = [s for _, s in self._sources() if s is not source]
        what = await install(self.layout, release, [source, *others])
        return what, release, name


async def install(layout: BuildLayout, release: Release, sources: Sequence[FeedSource]) -> str:
    """Put ``release``'s artefacts into ``versions/<v>/`` atomically; "installed", or "already
    installed" when the directory holds exactly them. Raises :class:`FeedError` (nothing left
    behind) when a file cannot be had intact from any source."""
    target = layout.build_dir(release.version)
    if _already_there(target, release):
        return "already installed"
    # Hidden (``versions/.<v>.<random>.tmp/``): never taken for an installed build.
    os.makedirs(layout.versions_dir, 0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{release.version}.", suffix=".tmp", dir=layout.versions_dir)
    try:
        for artefact in release.artefacts.values():
            await _download(tmp, artefact, sources)
        os.chmod(tmp, 0o755)  # noqa: S103 -- a build is world-readable and -executable by design
        fsync_directory(tmp)
        os.rename(tmp, target)  # fails if a concurrent fetch won: tmp is removed below
        fsync_directory(layout.versions_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return "installed"


async def _download(directory: str, artefact: Artefact, sources: Sequence[FeedSource]) -> None:
    path = os.path.join(directory, artefact.name)
    problems = []
    for source in sources:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            sink = HashingFile(f, artefact.size, f"{artefact.path} from {source.describe()}")
            try:
                await source.download(artefact.path, sink)
            except (SourceUnavailable, ArtefactRefused) as e:
                problems.append(str(e))
                continue
            if (sink.size, sink.hexdigest()) != (artefact.size, artefact.sha256):
                problems.append(
                    f"{artefact.path} from {source.describe()} is not the feed's: "
                    f"{sink.size} bytes sha256 {sink.hexdigest()[:16]}..., the feed says "
                    f"{artefact.size} bytes sha256 {artefact.sha256[:16]}..."
                )
                continue
            f.flush()
            os.fchmod(f.fileno(), artefact.mode)
            os.fsync(f.fileno())
            return
    raise ArtefactRefused(
        f"refused {artefact.name} of the feed's build (nothing installed): " + "; ".join(problems)
    )


def _already_there(target: str, release: Release) -> bool:
    """Whether ``target`` is exactly ``release`` already; FeedError when it is something else."""
    if not os.path.lexists(target):
        return False
    differs = _differs(target, release)
    if differs:
        raise FeedError(
            f"{target} exists but is not the feed's {release.version} ({differs}): "
            "remove it (no host may point at it) and fetch again"
        )
    return True


def _differs(directory: str, release: Release) -> str:
    """Why the installed ``directory`` is not ``release`` ("" when it is exactly it)."""
    for artefact in release.artefacts.values():
        path = os.path.join(directory, artefact.name)
        try:
            with open(path, "rb") as f:
                h = hashlib.file_digest(f, "sha256")
        except OSError as e:
            return f"{artefact.name}: {e.strerror or e}"
        if h.hexdigest() != artefact.sha256:
            return f"{artefact.name} has another sha256"
    return ""

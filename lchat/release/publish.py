"""Publishing a build (the release host): add it to the feed, sign, upload.

``publish`` reads the target's current feed (which must verify against the signing key's own
public key: a publisher never extends a feed it cannot vouch for), adds the new version with the
sha256, size and mode of each file in the build directory, bumps ``feed_version`` by one, keeps
every older version listed, and writes the artefacts first, then ``feed.json``, then
``feed.json.sig``: a reader never sees a feed naming artefacts that are not there yet (and a
reader between the last two writes reads again: lchat.release.fetch).

Every feed written carries a signed ``expires_at``, ``valid_for`` after it was written (default 7
days, ``LCHAT_RELEASE_FEED_VALIDITY``): boxes refuse it afterwards, so :func:`refresh` runs on the
release host well within the validity (a daily timer), or boxes cannot fetch.

Targets: a directory a static HTTP server serves (``LCHAT_RELEASE_URL``'s), and/or the S3 mirror.
Both get the same bytes.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Protocol

from attrs import frozen
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lchat.builds import SPACE_BINARY, check_version
from lchat.files import write_atomic
from lchat.objstore import NotFound, ObjectStore
from lchat.release import feed as feedlib
from lchat.release.feed import ARTEFACT_NAMES, Artefact, Feed, FeedError, Release


class PublishTarget(Protocol):
    def describe(self) -> str: ...

    async def read(self, path: str) -> bytes | None: ...

    async def write(self, path: str, data: bytes) -> None: ...

    async def upload(self, path: str, local: str) -> None: ...


@frozen
class DirectoryTarget:
    root: str

    def describe(self) -> str:
        return self.root

    async def read(self, path: str) -> bytes | None:
        try:
            return _read(os.path.join(self.root, path))
        except FileNotFoundError:
            return None

    async def write(self, path: str, data: bytes) -> None:
        _write(os.path.join(self.root, path), data)

    async def upload(self, path: str, local: str) -> None:
        _write(os.path.join(self.root, path), _read(local))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    """Atomically, world-readable: a static HTTP server serves it."""
    os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
    write_atomic(path, data, 0o644)


@frozen
class BucketTarget:
    store: ObjectStore
    prefix: str
    url: str

    def describe(self) -> str:
        return self.url

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    async def read(self, path: str) -> bytes | None:
        try:
            return (await self.store.get(self._key(path))).body
        except NotFound:
            return None

    async def write(self, path: str, data: bytes) -> None:
        await self.store.put(self._key(path), data, content_type="application/json")

    async def upload(self, path: str, local: str) -> None:
        await self.store.put_file(self._key(path), local)


def artefacts_of(version: str, directory: str) -> dict[str, tuple[Artefact, str]]:
    """The build in ``directory`` (``space``, optionally ``space-bot``): name -> (its feed
    entry, the local file)."""
    found = {}
    for name in ARTEFACT_NAMES:
        local = os.path.join(directory, name)
        try:
            st = os.stat(local)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise FeedError(f"{local} is not a regular file")
        with open(local, "rb") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        mode = (stat.S_IMODE(st.st_mode) | 0o555) & 0o755  # readable, executable, owner-writable
        found[name] = (
            Artefact(name, f"versions/{version}/{name}", sha, st.st_size, mode),
            local,
        )
    if SPACE_BINARY not in found:
        raise FeedError(f"{directory} has no '{SPACE_BINARY}' file: nothing to publish")
    return found


async def current_feed(target: PublishTarget, key: Ed25519PrivateKey) -> Feed | None:
    data = await target.read(feedlib.FEED_NAME)
    if data is None:
        return None
    signature = await target.read(feedlib.SIGNATURE_NAME) or b""
    try:
        feedlib.verify(key.public_key(), data, signature)
    except feedlib.BadSignature as e:
        raise FeedError(
            f"{target.describe()}: its feed does not verify against this key ({e}): refusing to "
            "extend it (wrong --key, or the feed was tampered with)"
        ) from None
    return feedlib.parse(data)


def _check_validity(valid_for: datetime.timedelta) -> None:
    if valid_for <= datetime.timedelta(0):
        raise FeedError(f"a feed's validity must be positive, not {valid_for}")


async def _newest(targets: list[PublishTarget], key: Ed25519PrivateKey) -> Feed | None:
    currents = [await current_feed(t, key) for t in targets]
    return max((f for f in currents if f is not None), key=lambda f: f.feed_version, default=None)


async def publish(
    version: str,
    directory: str,
    key: Ed25519PrivateKey,
    targets: list[PublishTarget],
    now: datetime.datetime,
    valid_for: datetime.timedelta = feedlib.DEFAULT_VALIDITY,
    channel: str = "",
) -> Feed:
    """Publish ``version`` from ``directory`` to every target; returns the new feed. The new
    ``feed_version`` is one more than the highest among the targets' current feeds; it expires
    ``valid_for`` after ``now``. ``channel``: that release channel now names ``version`` (the
    others keep theirs)."""
    check_version(version)
    if channel:
        feedlib.check_channel(channel)
    _check_validity(valid_for)
    files = artefacts_of(version, directory)
    base = await _newest(targets, key)
    versions = dict(base.versions) if base is not None else {}
    if version in versions:
        raise FeedError(
            f"version {version} is already in the feed (feed_version {base.feed_version if base else 0}): "
            "a published version never changes; publish a new version name"
        )
    versions[version] = Release(version, feedlib.stamp(now), {n: a for n, (a, _) in files.items()})
    feed_version = (base.feed_version if base is not None else 0) + 1
    channels = dict(base.channels) if base is not None else {}
    if channel:
        channels[channel] = version
    return await _sign_and_write(
        feed_version, versions, now, valid_for, key, targets, files.values(), channels
    )


async def refresh(
    key: Ed25519PrivateKey,
    targets: list[PublishTarget],
    now: datetime.datetime,
    valid_for: datetime.timedelta = feedlib.DEFAULT_VALIDITY,
) -> Feed:
    """Re-sign the newest of the targets' feeds with a new ``expires_at`` (``valid_for`` after
    ``now``) and ``feed_version`` + 1, listing the same builds; written to every target. A feed
    already expired is refreshed too (the release host vouches for it again); a target without
    any feed is refused: there is nothing to refresh."""
    _check_validity(valid_for)
    base = await _newest(targets, key)
    if base is None:
        raise FeedError(
            "no feed to refresh on "
            + ", ".join(t.describe() for t in targets)
            + ": publish a build first"
        )
    return await _sign_and_write(
        base.feed_version + 1, base.versions, now, valid_for, key, targets, (), base.channels
    )


async def _sign_and_write(
    feed_version: int,
    versions: Mapping[str, Release],
    now: datetime.datetime,
    valid_for: datetime.timedelta,
    key: Ed25519PrivateKey,
    targets: list[PublishTarget],
    files: Iterable[tuple[Artefact, str]],
    channels: Mapping[str, str],
) -> Feed:
    """The feed of ``versions``, released ``now`` and expiring ``valid_for`` later, written to
    every target: artefacts first, then ``feed.json``, then its signature."""
    released_at = feedlib.stamp(now)
    expires_at = feedlib.stamp(now + valid_for)
    data = Feed(
        feed_version, released_at, versions, digest="", expires_at=expires_at, channels=channels
    ).to_bytes()
    signature = feedlib.sign(key, data)
    files = list(files)
    for target in targets:
        for artefact, local in files:
            await target.upload(artefact.path, local)
        await target.write(feedlib.FEED_NAME, data)
        await target.write(feedlib.SIGNATURE_NAME, signature)
    return feedlib.parse(data)

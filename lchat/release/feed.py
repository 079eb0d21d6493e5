"""The signed release feed: what builds exist, where their files are, and their sha256.

::

    <base>/feed.json        the manifest (UTF-8 JSON, the exact bytes that were signed)
    <base>/feed.json.sig    base64 of the Ed25519 signature of SIGNING_CONTEXT + feed.json
    <base>/<artefact path>  each build's files, e.g. versions/1.4.0/space

The manifest::

    {"feed_version": 7,                      # monotonic: every publish is the previous + 1
     "released_at": "2026-12-02T03:00:00Z",
     "expires_at": "2026-12-09T03:00:00Z",   # no box takes this feed after then
     "versions": {"1.4.0": {"released_at": "...",
                            "artefacts": {"space": {"path": "versions/1.4.0/space",
                                                    "sha256": "<64 hex>", "size": 123,
                                                    "mode": "0755"},
                                          "space-bot": {...}}}},
     "channels": {"stable": "1.3.2", "canary": "1.4.0"}}   # optional: what each channel runs

``channels`` (``lchat release publish --channel NAME``) names, per release channel, a version the
feed lists; boxes with ``LCHAT_RELEASE_CHANNEL`` follow it (lchat.cli.rollout). It is signed like
the rest; a parser that predates it ignores it (unknown top-level keys are ignored).

Invariants: a feed is trusted only when its signature verifies against the box's
``LCHAT_RELEASE_PUBKEY`` over the exact bytes fetched (no re-serialisation); the signature covers
a context prefix, so no other Ed25519 signature by the same key can pass as a feed's; an
artefact path is relative, without ``..``, so the same manifest serves from any base (the HTTP
primary and the S3 mirror alike); every artefact carries its sha256 and size, which the installer
checks before a byte reaches ``versions/``; ``expires_at`` is inside the signed bytes, so nobody
without the signing key can extend a feed's life (a box refuses a feed past it, or without it:
:func:`lchat.release.fetch.freshness`), and the release host re-signs before it passes
(``lchat release refresh``: :func:`lchat.release.publish.refresh`).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from attrs import field, frozen
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from lchat.builds import SIDECAR_BINARY, SPACE_BINARY, BadVersion, check_version

FEED_NAME = "feed.json"
SIGNATURE_NAME = "feed.json.sig"
SIGNING_CONTEXT = b"lchat release feed v1\n"
MAX_FEED_BYTES = 4 * 1024 * 1024
MAX_ARTEFACT_BYTES = 2 * 1024 * 1024 * 1024
ARTEFACT_NAMES = (SPACE_BINARY, SIDECAR_BINARY)
CHANNELS = ("stable", "canary")  # canary boxes take a channel's new build first
# A published feed's life (LCHAT_RELEASE_FEED_VALIDITY).
DEFAULT_VALIDITY = datetime.timedelta(days=7)
_STAMP = "%Y-%m-%dT%H:%M:%SZ"

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PATH_PART = re.compile(r"[0-9A-Za-z._+-]+")


class FeedError(Exception):
    """A feed (or key) that must not be trusted or used; the message says why, in one line."""


class BadSignature(FeedError):
    """The signature is missing, malformed or does not verify."""


# --- keys ----------------------------------------------------------------------------------------


def public_key_from_text(text: str) -> Ed25519PublicKey:
    """``LCHAT_RELEASE_PUBKEY``: base64 of the raw 32-byte Ed25519 public key."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise FeedError("LCHAT_RELEASE_PUBKEY is not base64") from None
    if len(raw) != 32:
        raise FeedError(
            f"LCHAT_RELEASE_PUBKEY must be 32 bytes (an Ed25519 public key), not {len(raw)}"
        )
    return Ed25519PublicKey.from_public_bytes(raw)


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    """PKCS#8 PEM, unencrypted (``openssl genpkey -algorithm ed25519`` writes the same)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_private_key(data: bytes, where: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise FeedError(f"{where}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise FeedError(f"{where}: not an Ed25519 key")
    return key


def sign(key: Ed25519PrivateKey, feed_bytes: bytes) -> bytes:
    """The ``feed.json.sig`` body for ``feed_bytes``."""
    return base64.b64encode(key.sign(SIGNING_CONTEXT + feed_bytes)) + b"\n"


def verify(key: Ed25519PublicKey, feed_bytes: bytes, signature_file: bytes) -> None:
    """Raises :class:`BadSignature` unless ``signature_file`` signs exactly ``feed_bytes``."""
    try:
        signature = base64.b64decode(signature_file.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise BadSignature("the feed's signature is not base64") from None
    if len(signature) != 64:
        raise BadSignature(f"the feed's signature is {len(signature)} bytes, not 64")
    try:
        key.verify(signature, SIGNING_CONTEXT + feed_bytes)
    except InvalidSignature:
        raise BadSignature(
            "the feed's signature does not verify against LCHAT_RELEASE_PUBKEY"
        ) from None


# --- the manifest --------------------------------------------------------------------------------


@frozen
class Artefact:
    name: str  # "space" or "space-bot": its file name in versions/<v>/
    path: str  # relative to the feed's base
    sha256: str
    size: int
    mode: int

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "size": self.size,
            "mode": f"{self.mode:04o}",
        }


@frozen
class Release:
    version: str
    released_at: str
    artefacts: Mapping[str, Artefact]

    def as_json(self) -> dict[str, Any]:
        return {
            "released_at": self.released_at,
            "artefacts": {n: a.as_json() for n, a in sorted(self.artefacts.items())},
        }


@frozen
class Feed:
    """A verified manifest, and the digest of the exact bytes it was read from."""

    feed_version: int
    released_at: str
    versions: Mapping[str, Release]
    digest: str  # sha256 hex of feed.json's bytes
    expires_at: str = ""  # RFC 3339 UTC; "" for a feed signed before feeds expired (refused)
    channels: Mapping[str, str] = field(factory=dict)  # channel -> a version in ``versions``

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "feed_version": self.feed_version,
            "released_at": self.released_at,
            "versions": {v: r.as_json() for v, r in sorted(self.versions.items())},
        }
        if self.expires_at:
            doc["expires_at"] = self.expires_at
        if self.channels:
            doc["channels"] = dict(sorted(self.channels.items()))
        return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"

    @property
    def expires(self) -> float | None:
        """``expires_at`` as a Unix time (None: the feed has none)."""
        return parse_stamp(self.expires_at) if self.expires_at else None


def stamp(when: datetime.datetime) -> str:
    """``2026-12-09T03:00:00Z``: how the feed writes times."""
    return when.astimezone(datetime.UTC).strftime(_STAMP)


def parse_stamp(text: str) -> float:
    """A feed time (``YYYY-MM-DDTHH:MM:SSZ``) as a Unix time; :class:`FeedError` otherwise."""
    try:
        when = datetime.datetime.strptime(text, _STAMP).replace(tzinfo=datetime.UTC)
    except (TypeError, ValueError):
        raise FeedError(f"{text!r} is not a time of the form 2026-12-09T03:00:00Z") from None
    return when.timestamp()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse(feed_bytes: bytes) -> Feed:
    """The manifest in ``feed_bytes`` (already verified), or :class:`FeedError` naming the first
    thing wrong with it."""
    if len(feed_bytes) > MAX_FEED_BYTES:
        raise FeedError(f"the feed is larger than {MAX_FEED_BYTES} bytes")
    try:
        doc = json.loads(feed_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FeedError(f"the feed is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise FeedError("the feed is not a JSON object")
    feed_version = doc.get("feed_version")
    if not isinstance(feed_version, int) or isinstance(feed_version, bool) or feed_version < 1:
        raise FeedError(f"feed_version {feed_version!r} is not a positive integer")
    versions = doc.get("versions")
    if not isinstance(versions, dict):
        raise FeedError("the feed has no 'versions' object")
    releases = {}
    for version, entry in versions.items():
        try:
            check_version(version)
        except BadVersion as e:
            raise FeedError(f"the feed lists a bad version: {e}") from None
        releases[version] = _release(version, entry)
    expires_at = doc.get("expires_at", "")
    if expires_at != "":
        if not isinstance(expires_at, str):
            raise FeedError(f"expires_at {expires_at!r} is not a time")
        try:
            parse_stamp(expires_at)
        except FeedError as e:
            raise FeedError(f"expires_at: {e}") from None
    return Feed(
        feed_version=feed_version,
        released_at=str(doc.get("released_at", "")),
        versions=releases,
        digest=digest(feed_bytes),
        expires_at=expires_at,
        channels=_channels(doc.get("channels", {}), releases),
    )


def check_channel(name: str) -> str:
    """``name`` if it is a release channel's name (``stable``, ``canary``), else FeedError."""
    if name not in CHANNELS:
        raise FeedError(f"{name!r} is not a release channel ({' or '.join(CHANNELS)})")
    return name


def _channels(value: object, releases: Mapping[str, Release]) -> dict[str, str]:
    if not isinstance(value, dict):
        raise FeedError("channels is not an object of channel names to versions")
    channels = {}
    for name, version in value.items():
        check_channel(name)
        if not isinstance(version, str) or version not in releases:
            raise FeedError(f"channel {name} names {version!r}, which the feed does not list")
        channels[name] = version
    return channels


def _release(version: str, entry: object) -> Release:
    if not isinstance(entry, dict) or not isinstance(entry.get("artefacts"), dict):
        raise FeedError(f"version {version}: no 'artefacts' object")
    artefacts = {}
    for name, spec in entry["artefacts"].items():
        if name not in ARTEFACT_NAMES:
            raise FeedError(f"version {version}: unknown artefact {name!r}")
        artefacts[name] = _artefact(version, name, spec)
    if SPACE_BINARY not in artefacts:
        raise FeedError(f"version {version}: no '{SPACE_BINARY}' artefact")
    return Release(version, str(entry.get("released_at", "")), artefacts)


def _artefact(version: str, name: str, spec: object) -> Artefact:
    where = f"version {version} artefact {name}"
    if not isinstance(spec, dict):
        raise FeedError(f"{where}: not an object")
    path, sha, size, mode = spec.get("path"), spec.get("sha256"), spec.get("size"), spec.get("mode")
    if not isinstance(path, str) or not check_path(path):
        raise FeedError(f"{where}: path {path!r} is not a relative path of safe names")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise FeedError(f"{where}: sha256 {sha!r} is not 64 lowercase hex digits")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_ARTEFACT_BYTES:
        raise FeedError(f"{where}: size {size!r} is not a byte count")
    try:
        mode_bits = int(mode, 8) if isinstance(mode, str) else 0o755 if mode is None else -1
    except ValueError:
        mode_bits = -1
    if not 0 <= mode_bits <= 0o777 or mode_bits & 0o022:
        raise FeedError(f"{where}: mode {mode!r} is not an octal mode without group/other write")
    return Artefact(name=name, path=path, sha256=sha, size=size, mode=mode_bits)


def check_path(path: str) -> bool:
    """A relative path of safe segments: never absolute, never ``..``, never empty parts."""
    parts = path.split("/")
    return all(_PATH_PART.fullmatch(p) and p not in (".", "..") for p in parts)

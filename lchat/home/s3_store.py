"""The home store on one S3 bucket, no database (``LCHAT_HOME_STORE=s3``).

:class:`S3VaultStore` implements :class:`lchat.home.store.VaultStore` (read its contract) on our
own S3 client, :class:`lchat.objstore.s3.S3Store`, through the
:class:`lchat.objstore.VersionedObjectStore` interface. The bucket is laid out as the seed drew it
(``/work/shared/seeds/planet-scale.txt``), under an optional prefix (``LCHAT_HOME_S3_PREFIX``)::

    <prefix>blobs/<uid>        the vault blob; S3 object versioning keeps its history
    <prefix>users/<uid>        the user document: compact JSON, every change an If-Match CAS
    <prefix>creds/<credId>     write-once pointer (If-None-Match: *), body = uid
    <prefix>tokens/<sha256>    write-once pointer (If-None-Match: *), body = uid
    <prefix>revoked/<sha256>   revocation marker of a link token (plain PUT), body = JSON
                               {uid, device, time}; deleted by any lister after 25 hours
    <prefix>used/<sha256>      single-use record of a challenge or proof (If-None-Match: *),
                               body = JSON {expires}; never read or listed: the bucket's
                               lifecycle rule expires the prefix (a day is plenty)

Decisions, and why:

- **A version is the object's ETag** (S3's MD5 of the body for a single PUT), not its version id.
  S3's conditional writes compare ETags: with the ETag as the version, a write is exactly one
  ``PUT`` with ``If-Match: <version>`` (``"0"``: ``If-None-Match: *``), and a read is exactly one
  ``GET`` whose ``ETag`` header is the version. A version id would cost a ``HEAD`` (or a listing)
  before every write to learn the ETag to condition on. A lost race costs one more request: a
  ``HEAD`` for the current version that :class:`~lchat.home.store.Conflict` carries.
  The ETag names the *content*: if a client writes back byte-identical ciphertext (a restore),
  the version string repeats. That is harmless for compare-and-swap (a writer conditioned on that
  string based its change on exactly the bytes in place) and the ciphertext of a fresh
  encryption never repeats; :meth:`~S3VaultStore.list_blob_versions` may then show one string
  twice.
- **Keep-last-5 rides S3 object versioning**, which the bucket must have enabled
  (:meth:`~S3VaultStore.check` refuses to start otherwise): every PUT keeps the version it
  replaces, at no extra request. :meth:`~S3VaultStore.list_blob_versions` is one
  ``ListObjectVersions`` capped at the 5 newest; :meth:`~S3VaultStore.get_blob_version` reads only
  those (that listing, then one ``GET ?versionId=``). Older versions stay in the bucket, unseen,
  until its lifecycle rule prunes noncurrent versions (a backstop; set one, e.g. 7 days). There
  is no degraded mode: moto and SeaweedFS (the test stores) support all of it.
- **A version string that was never ours is a conflict** (409): S3 cannot tell it from a stale
  ETag. One that could not be an ETag at all (empty, ``*``, a list, quotes or spaces: it would
  change the meaning of ``If-Match``) is not sent; it is a conflict too, answered with a ``HEAD``.
- **Errors**: a bucket that answers 5xx, times out or is unreachable (after the client's own
  retries), refuses our credentials, or does not exist raises
  :class:`~lchat.home.store.StoreError`. One blind spot: ``GET`` of a missing *bucket* and of a
  missing key are both 404 to our client, so a deleted bucket reads as "no blob" while every
  write fails; :meth:`~S3VaultStore.check` at boot catches a misnamed bucket.

Requests per operation: ``get_blob`` 1 GET; ``put_blob``/``put_user`` 1 PUT (+1 HEAD on a
conflict); ``get_user`` 1 GET; ``update_user`` 1 GET + 1 PUT per attempt; ``put_pointer`` 1 PUT
(+1 GET if it exists); ``resolve_pointer`` 1 GET; ``list_blob_versions`` 1 LIST;
``get_blob_version`` 1 LIST + 1 GET; ``mark_revoked`` 1 PUT; ``use_once`` 1 conditional PUT;
``revoked_since`` 1 LIST (ListObjectsV2 of ``revoked/``, a page of 1000 markers: 25 hours of
revocations) + 1 conditional DELETE per marker past its 25 hours.

The revocation feed lists every live marker each time (the keys are digests: their order says
nothing about age, and markers are few), so its cursor is unused; ``LastModified`` (the bucket's
clock) dates a marker, our clock decides when it is old (store.MARKER_LIFETIME: a day and an hour for skew).

The IAM policy needs, on the bucket: ``s3:GetObject``, ``s3:GetObjectVersion``, ``s3:PutObject``,
``s3:DeleteObject`` (expired revocation markers), ``s3:ListBucket``, ``s3:ListBucketVersions``,
``s3:GetBucketVersioning``. On the versioned bucket, deleting a marker leaves a delete marker and
a noncurrent version: the lifecycle rule reclaims both (noncurrent expiry plus
``ExpiredObjectDeleteMarker``).
"""

from __future__ import annotations

import datetime
import json
import random
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from attrs import define, field
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.backoff import Uniform
from lchat.home.store import (
    CAS_CONFLICTS,
    KEEP_VERSIONS,
    MARKER_LIFETIME,
    NO_VERSION,
    Blob,
    BlobVersion,
    Conflict,
    PointerKind,
    PointerTaken,
    Revocation,
    Revocations,
    StoreError,
    UserDoc,
    UserUpdate,
    check_digest,
    check_pointer,
    check_uid,
    decode_user,
    encode_user,
    measured,
    update_user_cas,
)
from lchat.objstore import (
    NotFound,
    ObjectStoreError,
    ObjectVersion,
    PreconditionFailed,
    StoredObject,
    VersionedObjectStore,
)

log = Logger()

BACKEND = "s3"
# What an ETag may look like to be sent in If-Match: no quotes, spaces, commas or "*" (each would
# change the header's meaning), and no "W/" (a weak-ETag prefix our client strips).
_SENDABLE_VERSION = re.compile(r"[A-Za-z0-9_.:+=-]{1,200}")
# A ListObjectVersions page for one key's newest history: the kept versions plus room for a few
# delete markers (we never make any; a bucket someone else wrote to may have them).
_LISTING_LIMIT = KEEP_VERSIONS + 5


def normalise_prefix(prefix: str) -> str:
    """``LCHAT_HOME_S3_PREFIX`` as a key prefix: no leading or doubled ``/``, one trailing ``/``
    (``""`` stays ``""``)."""
    parts = [part for part in prefix.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"the S3 key prefix {prefix!r} has a '.' or '..' segment")
    return "/".join(parts) + "/" if parts else ""


@define
class S3VaultStore:
    """:class:`lchat.home.store.VaultStore` on a versioned bucket (see the module docstring).

    ``objects`` is the bucket's client (owned by the caller until :meth:`close`, which closes
    it); ``prefix`` is ``LCHAT_HOME_S3_PREFIX``; ``clock`` paces :meth:`update_user`'s retries
    and times operations.
    """

    _objects: VersionedObjectStore
    _clock: IReactorTime
    _prefix: str = field(default="", converter=normalise_prefix)
    _rng: Uniform = field(factory=random.SystemRandom)

    def describe(self) -> str:
        return f"{self._objects.describe()}, prefix {self._prefix!r}"

    # -- keys ------------------------------------------------------------------------------------

    def _blob_key(self, uid: str) -> str:
        return f"{self._prefix}blobs/{check_uid(uid)}"

    def _user_key(self, uid: str) -> str:
        return f"{self._prefix}users/{check_uid(uid)}"

    def _pointer_key(self, kind: str, name: str) -> str:
        check_pointer(kind, name)
        return f"{self._prefix}{kind}/{name}"

    @contextmanager
    def _measured(self, operation: str) -> Iterator[None]:
        """Count and time ``operation``; the object store's failures become :class:`StoreError`
        (logged once, here)."""
        with measured(BACKEND, operation, self._clock):
            try:
                yield
            except ObjectStoreError as e:
                log.error(
                    "home store: S3 {operation} on {where} failed: {error} (check that the "
                    "bucket exists, answers and that the credentials may use it)",
                    operation=operation,
                    where=self.describe(),
                    error=f"{type(e).__name__}: {e}",
                )
                raise StoreError(f"S3 {operation} failed: {e}") from e

    async def _get(self, key: str) -> StoredObject | None:
        try:
            return await self._objects.get(key)
        except NotFound:
            return None

    # -- the interface ---------------------------------------------------------------------------

    async def check(self) -> None:
        with self._measured("check"):
            status = await self._objects.versioning()
        if status != "Enabled":
            raise StoreError(
                f"{self.describe()}: the bucket's versioning is {status or 'off'}, and home keeps "
                "the last 5 vault versions with it: enable it (aws s3api put-bucket-versioning "
                "--versioning-configuration Status=Enabled) and add a lifecycle rule that expires "
                "noncurrent versions after a few days"
            )

    async def get_blob(self, uid: str) -> Blob | None:
        key = self._blob_key(uid)
        with self._measured("get_blob"):
            stored = await self._get(key)
        return None if stored is None else Blob(stored.body, stored.info.etag)

    async def put_blob(self, uid: str, data: bytes, expected_version: str) -> str:
        key = self._blob_key(uid)
        if not isinstance(data, bytes):
            raise ValueError("a vault blob is bytes")
        return await self._cas_put(key, data, expected_version, "blob")

    async def _cas_put(self, key: str, body: bytes, expected_version: str, kind: str) -> str:
        content_type = "application/json" if kind == "user" else "application/octet-stream"
        with self._measured(f"put_{kind}"):
            try:
                if expected_version == NO_VERSION:
                    put = await self._objects.put(
                        key, body, if_none_match=True, content_type=content_type
                    )
                elif isinstance(expected_version, str) and _SENDABLE_VERSION.fullmatch(
                    expected_version
                ):
                    put = await self._objects.put(
                        key, body, if_match=expected_version, content_type=content_type
                    )
                else:
                    raise PreconditionFailed("not an ETag: never ours", key=key)
            except PreconditionFailed:
                CAS_CONFLICTS.labels(BACKEND, kind).inc()
                current = await self._current_version(key)
                raise Conflict(current, f"{kind} {key}") from None
        return put.etag

    async def _current_version(self, key: str) -> str:
        try:
            return (await self._objects.head(key)).etag
        except NotFound:
            return NO_VERSION

    async def _kept_versions(self, key: str) -> list[ObjectVersion]:
        """The kept versions of the blob at ``key``, newest first.

        A listing by prefix also lists longer keys (``blobs/ab`` lists ``blobs/ab-c``), which
        are filtered out. If they filled the page, the whole history is listed instead: the page
        may have been spent on them, and SeaweedFS's truncated version listings can even drop
        entries of the shorter key (see ``S3Store.list_versions``). uids are random, so one being
        a prefix of another is rare: the common case stays one request.
        """
        listed = await self._objects.list_versions(key, limit=_LISTING_LIMIT)
        history = [v for v in listed if v.key == key]
        if len(listed) >= _LISTING_LIMIT and len(history) < len(listed):
            history = [v for v in await self._objects.list_versions(key) if v.key == key]
        history = history[:_LISTING_LIMIT]
        # We never write a delete marker; a plain DELETE from outside home does. One on top means
        # the user has no blob (get_blob says so too), so no versions either. Markers further
        # down are skipped: the versions around them are the same user's, and stores disagree
        # on where within a second a marker sits among versions (see S3Store.list_versions).
        if history and history[0].delete_marker:
            return []
        return [version for version in history if not version.delete_marker][:KEEP_VERSIONS]

    async def list_blob_versions(self, uid: str) -> list[BlobVersion]:
        key = self._blob_key(uid)
        with self._measured("list_blob_versions"):
            kept = await self._kept_versions(key)
        return [BlobVersion(v.etag, v.last_modified, v.size) for v in kept]

    async def get_blob_version(self, uid: str, version: str) -> bytes | None:
        key = self._blob_key(uid)
        with self._measured("get_blob_version"):
            for kept in await self._kept_versions(key):
                if kept.etag == version:
                    try:
                        return (await self._objects.get_version(key, kept.version_id)).body
                    except NotFound:
                        return None  # pruned between the listing and the read
        return None

    async def get_user(self, uid: str) -> UserDoc | None:
        key = self._user_key(uid)
        with self._measured("get_user"):
            stored = await self._get(key)
            return (
                None if stored is None else UserDoc(decode_user(stored.body, key), stored.info.etag)
            )

    async def put_user(self, uid: str, doc: Mapping[str, Any], expected_version: str) -> str:
        key = self._user_key(uid)
        return await self._cas_put(key, encode_user(doc), expected_version, "user")

    async def update_user(self, uid: str, fn: UserUpdate) -> UserDoc | None:
        return await update_user_cas(self, BACKEND, uid, fn, clock=self._clock, rng=self._rng)

    async def put_pointer(self, kind: PointerKind, name: str, uid: str) -> None:
        key = self._pointer_key(kind, name)
        check_uid(uid)
        with self._measured("put_pointer"):
            try:
                await self._objects.put(
                    key, uid.encode(), if_none_match=True, content_type="text/plain"
                )
                return
            except PreconditionFailed:
                pass
            owner = await self._read_pointer(key)
            if owner != uid:
                raise PointerTaken(f"the {kind} pointer {name!r} already names another user")

    async def _read_pointer(self, key: str) -> str | None:
        stored = await self._get(key)
        if stored is None:
            return None
        try:
            return check_uid(stored.body.decode("ascii", "replace"))
        except ValueError:
            raise StoreError(f"{key}: the pointer does not hold a uid") from None

    async def resolve_pointer(self, kind: PointerKind, name: str) -> str | None:
        key = self._pointer_key(kind, name)
        with self._measured("resolve_pointer"):
            return await self._read_pointer(key)

    async def use_once(self, name: str, expires_at: float) -> bool:
        key = f"{self._prefix}used/{check_digest(name, 'single-use record name')}"
        body = json.dumps({"expires": round(expires_at)}).encode()
        with self._measured("use_once"):
            try:
                await self._objects.put(
                    key, body, if_none_match=True, content_type="application/json"
                )
            except PreconditionFailed:
                return False
        return True

    def _revoked_prefix(self) -> str:
        return f"{self._prefix}revoked/"

    async def mark_revoked(self, digest: str, uid: str, device: str) -> None:
        key = self._revoked_prefix() + check_digest(digest)
        check_uid(uid)
        now = datetime.datetime.fromtimestamp(self._clock.seconds(), datetime.UTC)
        body = json.dumps(
            {"uid": uid, "device": device, "time": now.isoformat(timespec="seconds")},
            sort_keys=True,
        ).encode()
        with self._measured("mark_revoked"):
            # A plain PUT: marking twice only moves the marker's date (its 25 hours restart).
            await self._objects.put(key, body, content_type="application/json")

    async def revoked_since(self, cursor: str) -> Revocations:
        prefix = self._revoked_prefix()
        with self._measured("revoked_since"):
            listed = await self._objects.list(prefix)
        now = self._clock.seconds()
        live: list[Revocation] = []
        for info in listed:
            digest = info.key[len(prefix) :]
            try:
                check_digest(digest)
            except ValueError:
                continue  # not ours (someone else's object under revoked/): never a revocation
            if now - info.last_modified.timestamp() > MARKER_LIFETIME:
                await self._expire_marker(info.key, info.etag)
                continue
            live.append(Revocation(digest, info.last_modified))
        return Revocations(live, "")

    async def _expire_marker(self, key: str, etag: str) -> None:
        """Delete a marker past its lifetime, only if it is still the one listed (If-Match: a
        marker written again meanwhile is newer and stays). Every process may race to do this;
        whoever loses, or fails, leaves it to the next listing."""
        try:
            with measured(BACKEND, "expire_revocation", self._clock):
                await self._objects.delete(key, if_match=etag)
        except PreconditionFailed:
            pass  # re-marked meanwhile, or another process deleted it first
        except ObjectStoreError as e:
            log.info(
                "home store: deleting the expired revocation marker {key} failed: {error} "
                "(harmless: the next listing tries again)",
                key=key,
                error=e,
            )

    async def close(self) -> None:
        await self._objects.close()


__all__ = ["S3VaultStore", "normalise_prefix"]

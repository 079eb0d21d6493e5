"""The bucket seam: one object-store interface, typed errors, and the stores behind it.

Everything durable that boxes share lives in a bucket: parked databases, leases, heartbeats. The
activator, the replicator and the mesh speak only this interface; ``s3`` implements it over S3's
HTTP API (AWS, or any S3-compatible store), ``file`` over a local directory (a single box, and
``make run``). Methods are coroutines (``async def``); wrap them with
``Deferred.fromCoroutine`` at a Deferred-speaking edge.

Semantics every implementation keeps (the conformance suite in ``tests/test_objstore.py`` checks
them against each store):

- keys are text (any unicode, spaces, ``+``), ETags are opaque strings without quotes;
- ``put(if_none_match=True)`` creates only; ``put(if_match=etag)`` and ``delete(if_match=etag)``
  replace or remove only that version; a failed condition raises :class:`PreconditionFailed`,
  including ``if_match`` on a missing key (stores differ here; we normalise);
- ``last_modified`` and ``now()`` are the *bucket's* clock (its ``Date`` header), never ours;
- ``list(prefix)`` returns every key under the prefix in key order, however many pages it takes;
- ``get_to_file``/``get_into``/``put_file`` stream: an object is never held whole in memory.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Protocol, TypedDict, Unpack

from attrs import field, frozen
from twisted.internet.interfaces import IReactorTime

from lchat.reactors import TCPReactor
from lchat.threads import RunInThread

if TYPE_CHECKING:
    from lchat.objstore.aws import ResolvedCredentials
    from lchat.objstore.where import Where

UTC = datetime.UTC


@frozen
class ObjectInfo:
    key: str
    size: int
    etag: str  # unquoted
    last_modified: datetime.datetime  # timezone-aware UTC, on the bucket's clock
    # User metadata (x-amz-meta-*), names lowercase.
    metadata: Mapping[str, str] = field(factory=dict)


@frozen
class StoredObject:
    info: ObjectInfo
    body: bytes


@frozen
class PutResult:
    key: str
    etag: str  # unquoted


@frozen
class ObjectVersion:
    """One entry of a versioned bucket's history (:meth:`VersionedObjectStore.list_versions`):
    a stored version of ``key`` or, with ``delete_marker``, a delete marker (no body, no ETag)."""

    key: str
    version_id: str  # the store's id for this version ("null" for one written while unversioned)
    etag: str  # unquoted; "" for a delete marker
    size: int
    last_modified: datetime.datetime  # timezone-aware UTC, whole seconds, on the bucket's clock
    is_latest: bool
    delete_marker: bool = False


class PutOptions(TypedDict, total=False):
    """:meth:`ObjectStore.put`'s keyword arguments (defaults: no condition, no metadata,
    ``application/octet-stream``)."""

    if_match: str | None
    if_none_match: bool
    metadata: Mapping[str, str] | None
    content_type: str


class ObjectStoreError(Exception):
    """Base of every store error. ``key`` and the store's ``request_id`` are kept for the log."""

    def __init__(self, message: str, key: str = "", request_id: str = "") -> None:
        detail = message
        if key:
            detail += f" (key {key!r})"
        if request_id:
            detail += f" [request {request_id}]"
        super().__init__(detail)
        self.key = key
        self.request_id = request_id


class NotFound(ObjectStoreError):
    """No such key (or no such bucket)."""


class PreconditionFailed(ObjectStoreError):
    """An ``if_match``/``if_none_match`` condition did not hold: someone else wrote first."""


class AccessDenied(ObjectStoreError):
    """The credentials may not do this."""


class StoreUnavailable(ObjectStoreError):
    """The store did not answer usably, after retries: 5xx, timeouts, refused connections."""


class ObjectStore(Protocol):
    """What every store offers. See the module docstring for the shared semantics."""

    def describe(self) -> str:
        """Where this store is, for log lines (no secrets)."""
        ...

    async def get(self, key: str) -> StoredObject: ...

    async def get_to_file(self, key: str, path: str) -> ObjectInfo:
        """Stream the object into ``path`` (written to a temp file, fsynced, renamed)."""
        ...

    async def get_into(self, key: str, sink: IO[bytes]) -> int:
        """Stream the object's body into ``sink``; return how many bytes it received.

        ``sink.write`` is called in worker threads, never on the reactor, about a megabyte at a
        time and one call at a time. ``sink`` is rewound (``seek(0)``, ``truncate()``) before
        each attempt, so a retried download starts it afresh. An exception from ``write`` fails
        the call as it is, without a retry.
        """
        ...

    async def head(self, key: str) -> ObjectInfo: ...

    async def put(self, key: str, body: bytes, **options: Unpack[PutOptions]) -> PutResult: ...

    async def put_file(
        self, key: str, path: str, *, metadata: Mapping[str, str] | None = None
    ) -> PutResult:
        """Stream ``path`` up (its size is known: S3 refuses chunked uploads)."""
        ...

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Remove ``key``. Deleting a missing key succeeds unless ``if_match`` is given."""
        ...

    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every key under ``prefix``, in key order (``metadata`` is not filled in)."""
        ...

    async def copy(self, source: str, destination: str) -> PutResult: ...

    async def now(self) -> datetime.datetime:
        """The bucket's clock: the ``Date`` of a fresh response."""
        ...

    async def close(self) -> None:
        """Release connections and threads."""
        ...


class VersionedObjectStore(ObjectStore, Protocol):
    """A store over a bucket with object versioning (S3's ``PutBucketVersioning``): every PUT
    keeps the version it replaces, a plain DELETE adds a delete marker, and these reach the
    history. Only :class:`lchat.objstore.s3.S3Store` offers it (the file store keeps no history).
    """

    async def versioning(self) -> str:
        """The bucket's versioning status: ``"Enabled"``, ``"Suspended"``, or ``""`` (never on)."""
        ...

    async def list_versions(self, prefix: str, *, limit: int | None = None) -> list[ObjectVersion]:
        """Every version and delete marker of every key under ``prefix``: keys in key order, each
        key's history newest first (the latest entry, then by ``last_modified``; within one
        second, versions keep their order but a delete marker's place among them is not
        known). ``limit`` stops after that many entries (one request for the newest history
        however long the rest is)."""
        ...

    async def get_version(self, key: str, version_id: str) -> StoredObject:
        """One stored version of ``key`` (:class:`NotFound` if there is no such version)."""
        ...

    async def delete_version(self, key: str, version_id: str) -> None:
        """Remove that version (or delete marker) for good. A missing version succeeds."""
        ...


def open_store(
    reactor: TCPReactor,
    where: Where,
    run_in_thread: RunInThread,
    credentials: ResolvedCredentials | None = None,
    *,
    monotonic: Callable[[], float],
    must_exist: bool = False,
) -> ObjectStore:
    """``where``'s store on ``reactor`` (the caller closes it).

    An S3 bucket needs ``credentials``, resolved once by the caller (:mod:`lchat.buckets`); its
    region is ``where.s3_region`` when given, else the one the credential chain names, else
    ``us-east-1``. A ``file:`` bucket needs none; its directory is made on the first write,
    unless ``must_exist`` (a backup to read: one that is not there is an error, never an empty
    bucket). ``run_in_thread`` runs the store's blocking work (disk, credential refreshes);
    ``monotonic`` is the local monotonic clock an S3 bucket dates its answers by.
    """
    if where.is_file:
        from lchat.objstore.file import FileStore

        return FileStore(
            IReactorTime(reactor), where.directory, run_in_thread, create=not must_exist
        )
    if credentials is None:
        raise ValueError(
            f"the S3 bucket {where.bucket!r} needs credentials: resolve them once (at start) "
            "with lchat.objstore.aws.resolve_credentials and pass them in"
        )
    from lchat.objstore.s3 import S3Store

    return S3Store(
        reactor,
        where.bucket,
        run_in_thread=run_in_thread,
        monotonic=monotonic,
        region=where.s3_region or credentials.region,
        endpoint=where.endpoint,
        credentials=credentials.credentials,
    )


async def probe_writable(store: ObjectStore, key: str) -> None:
    """Prove the bucket is reachable and writable under ``key``'s prefix: one PUT, one DELETE."""
    await store.put(key, b"lchat boot probe\n", content_type="text/plain")
    await store.delete(key)

"""The bucket's operations (:class:`S3Store`, an :class:`lchat.objstore.ObjectStore` and a
:class:`lchat.objstore.VersionedObjectStore`) over one :class:`~lchat.objstore.s3.exchange.Exchange`.
"""

from __future__ import annotations

import builtins
import datetime
import os
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from botocore.credentials import Credentials  # type: ignore[import-untyped]
from twisted.logger import Logger
from twisted.web.client import HTTPConnectionPool

from lchat.files import Replacement
from lchat.objstore import (
    UTC,
    NotFound,
    ObjectInfo,
    ObjectVersion,
    PutResult,
    StoredObject,
    StoreUnavailable,
)
from lchat.objstore.s3.bodies import FileBody
from lchat.objstore.s3.dates import BucketDates
from lchat.objstore.s3.exchange import Exchange
from lchat.objstore.s3.signing import BucketAddress, Signer
from lchat.objstore.s3.wire import (
    ListingPage,
    Reply,
    check_key,
    check_metadata,
    error_for,
    header_text,
    listing_page,
    local_name,
    md5_hex,
    object_info,
    quote_key,
    text,
    unquote_etag,
    xml,
)
from lchat.reactors import TCPReactor
from lchat.threads import RunInThread

log = Logger(namespace="lchat.objstore.s3")

_HASH_IN_THREAD = 1024 * 1024  # hashing more than this would stall the reactor: do it in a thread


class S3Store:
    """:class:`lchat.objstore.ObjectStore` over S3 (see :mod:`lchat.objstore.s3`).

    Keys are relative to the bucket. ``endpoint`` selects an S3-compatible store (path-style
    addressing); without it, AWS's regional endpoint with virtual-hosted addressing
    (path-style for bucket names that are not DNS-safe), in ``region`` (``us-east-1`` when empty).
    ``credentials`` is a botocore ``Credentials``, already resolved
    (:func:`lchat.objstore.aws.resolve_credentials`); ``RefreshableCredentials`` (a role's) are
    refreshed in a thread when botocore says they are about to expire. ``timeout`` bounds each
    attempt (for ``put_file`` and ``get_to_file`` it is an idle timeout: no byte moved for that
    long); ``retries`` is the number of extra attempts after a transient failure.
    """

    def __init__(
        self,
        reactor: TCPReactor,
        bucket: str,
        *,
        run_in_thread: RunInThread,
        monotonic: Callable[[], float],
        credentials: Credentials,
        region: str = "",
        endpoint: str = "",
        timeout: float = 30.0,
        retries: int = 4,
        pool: HTTPConnectionPool | None = None,
        list_page_size: int = 1000,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"bad bucket name {bucket!r}")
        if not 1 <= list_page_size <= 1000:
            raise ValueError("list_page_size must be within 1..1000 (S3's max-keys)")
        if timeout <= 0 or retries < 0:
            raise ValueError("timeout must be positive and retries non-negative")
        self._reactor = reactor
        self._run_in_thread = run_in_thread
        self.bucket = bucket
        region = region or "us-east-1"
        self._endpoint = endpoint.rstrip("/")
        if self._endpoint and "://" not in self._endpoint:
            self._endpoint = "https://" + self._endpoint
        self._page_size = list_page_size
        self.address = BucketAddress.of(bucket, self._endpoint, region)
        # The local monotonic clock: the bucket's time is estimated from its last Date plus the
        # time since, which a step of the wall clock must not skew (leases expire by it).
        self._dates = BucketDates(monotonic)
        self._exchange = Exchange(
            reactor,
            self.address,
            Signer(credentials, region, self.address.host, run_in_thread),
            self._dates,
            run_in_thread=run_in_thread,
            monotonic=monotonic,
            timeout=timeout,
            retries=retries,
            pool=pool,
            bucket=bucket,
        )
        self._send = self._exchange.send

    @property
    def signer(self) -> Signer:
        return self._exchange.signer

    def describe(self) -> str:
        where = self._endpoint or "aws"
        return f"s3://{self.bucket} at {where} (region {self.signer.region})"

    def _info(self, key: str, reply: Reply, size: int | None = None) -> ObjectInfo:
        now = datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC)
        return object_info(key, reply.headers, size, now)

    def _if_match(self, etag: str) -> str:
        # Quirk: quoted per RFC 7232 (AWS, moto, SeaweedFS accept it; the last two also accept
        # it bare).
        return f'"{unquote_etag(etag)}"'

    # -- the interface ---------------------------------------------------------------------------

    async def get(self, key: str) -> StoredObject:
        return await self._get(key)

    async def _get(self, key: str, query: Sequence[tuple[str, str]] = ()) -> StoredObject:
        check_key(key)
        reply = _ok(await self._send("GetObject", "GET", key, query=query), key)
        return StoredObject(self._info(key, reply, size=len(reply.body)), reply.body)

    async def get_to_file(self, key: str, path: str) -> ObjectInfo:
        check_key(key)
        sink = await self._run_in_thread(Replacement, path)
        try:
            reply = await self._get_streamed(key, sink.file)
            info = self._info(key, reply, size=reply.streamed)
            await self._run_in_thread(sink.commit)
            return info
        except BaseException:
            await self._run_in_thread(sink.discard)
            raise

    async def get_into(self, key: str, sink: IO[bytes]) -> int:
        return (await self._get_streamed(key, sink)).streamed

    async def _get_streamed(self, key: str, sink: IO[bytes]) -> Reply:
        """A body shorter than its Content-Length raises :class:`StoreUnavailable`."""
        check_key(key)
        reply = _ok(await self._send("GetObject", "GET", key, sink=sink), key)
        expected = header_text(reply.headers, "content-length")
        if expected and int(expected) != reply.streamed:
            raise StoreUnavailable(
                f"short body: {reply.streamed} of {int(expected)} bytes", key=key
            )
        return reply

    async def head(self, key: str) -> ObjectInfo:
        check_key(key)
        return self._info(key, _ok(await self._send("HeadObject", "HEAD", key), key))

    async def put(
        self,
        key: str,
        body: bytes | FileBody,  # a FileBody: put_file's, streamed
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
        metadata: Mapping[str, str] | None = None,
        content_type: str = "application/octet-stream",
    ) -> PutResult:
        check_key(key)
        if if_match is not None and if_none_match:
            raise ValueError("if_match and if_none_match exclude each other")
        headers = {"Content-Type": content_type, **check_metadata(metadata or {})}
        if if_match is not None:
            headers["If-Match"] = self._if_match(if_match)
        if if_none_match:
            headers["If-None-Match"] = "*"
        reply = await self._send("PutObject", "PUT", key, headers=headers, body=body)
        if reply.status == 200:
            return PutResult(key, unquote_etag(header_text(reply.headers, "etag")))
        conditional = if_match is not None or if_none_match
        if conditional and reply.condition_failed:
            if reply.ambiguous and isinstance(body, bytes):
                # The lost-response rule: an earlier attempt may have landed and this retry is
                # failing against our own write. The store's ETag for a single PUT is the MD5 of
                # the body; if the key holds exactly our bytes, that write was ours.
                ours = await self._md5(body)
                try:
                    current = await self.head(key)
                except NotFound:
                    current = None
                if current is not None and current.etag == ours:
                    log.info(
                        "S3 conditional PUT of {key!r}: the response was lost but the write "
                        "landed (ETag {etag})",
                        key=key,
                        etag=ours,
                    )
                    return PutResult(key, ours)
            raise reply.precondition_failed(key)
        raise error_for(reply, key)

    async def _md5(self, body: bytes) -> str:
        if len(body) > _HASH_IN_THREAD:
            digest: str = await self._run_in_thread(md5_hex, body)
            return digest
        return md5_hex(body)

    async def put_file(
        self, key: str, path: str, *, metadata: Mapping[str, str] | None = None
    ) -> PutResult:
        check_key(key)
        size = (await self._run_in_thread(os.stat, path)).st_size
        return await self.put(key, FileBody(path, size), metadata=metadata)

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        check_key(key)
        headers = {}
        if if_match is not None:
            headers["If-Match"] = self._if_match(if_match)
        reply = await self._send("DeleteObject", "DELETE", key, headers=headers, ok=(200, 204))
        if reply.status in (200, 204):
            return
        if if_match is not None and reply.condition_failed:
            if reply.ambiguous:
                # Lost response: our first DELETE may have removed it, and this retry is failing
                # because it is gone. Gone is what we wanted; anything else there is someone
                # else's newer version.
                try:
                    await self.head(key)
                except NotFound:
                    log.info(
                        "S3 conditional DELETE of {key!r}: the response was lost but the key "
                        "is gone",
                        key=key,
                    )
                    return
            raise reply.precondition_failed(key)
        if reply.missing_key:
            return  # deleting a missing key succeeds (AWS says 204 anyway)
        raise error_for(reply, key)

    async def _listing_page(
        self, op: str, root: str, prefix: str, query: builtins.list[tuple[str, str]]
    ) -> ListingPage:
        # Keys come back URL-encoded: XML 1.0 cannot carry every character a key may have.
        query += [("prefix", prefix), ("encoding-type", "url")]
        reply = _ok(await self._send(op, "GET", None, query=query), prefix)
        page = listing_page(reply.body, root)
        if page is None:
            what = "version listing" if op == "ListObjectVersions" else "listing"
            raise StoreUnavailable(f"S3 sent an unreadable {what}", key=prefix)
        return page

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        out: builtins.list[ObjectInfo] = []
        token = ""
        while True:
            query = [("list-type", "2"), ("max-keys", str(self._page_size))]
            if token:
                query.append(("continuation-token", token))
            page = await self._listing_page("ListObjectsV2", "ListBucketResult", prefix, query)
            out += page.objects
            if not page.truncated:
                break
            token = page.next_token
            if not token:
                raise StoreUnavailable("S3 listing truncated without a token", key=prefix)
        # Quirk (SeaweedFS walks directories): sort by code point, which is S3's UTF-8 order.
        out.sort(key=lambda info: info.key)
        return out

    async def copy(
        self, source: str, destination: str, *, source_bucket: str | None = None
    ) -> PutResult:
        """``source`` (in ``source_bucket``, this bucket by default) to ``destination`` in this
        bucket, on the server: no byte through this process. Another bucket must be on the same
        endpoint and readable with this store's credentials (the same account)."""
        check_key(source)
        check_key(destination)
        from_bucket = self.bucket if source_bucket is None else source_bucket
        if not from_bucket or "/" in from_bucket:
            raise ValueError(f"bad source bucket name {from_bucket!r}")
        headers = {"x-amz-copy-source": f"/{quote_key(from_bucket)}/{quote_key(source)}"}
        reply = await self._send(
            "CopyObject", "PUT", destination, headers=headers, body_may_hold_error=True
        )
        if reply.status != 200:
            raise error_for(reply, source if reply.code == "NoSuchKey" else destination)
        root = xml(reply.body)
        etag = text(root, "ETag") if root is not None else ""
        return PutResult(destination, unquote_etag(etag or header_text(reply.headers, "etag")))

    # -- a versioned bucket (lchat.objstore.VersionedObjectStore) ---------------------------------

    async def versioning(self) -> str:
        reply = await self._send("GetBucketVersioning", "GET", None, query=[("versioning", "")])
        root = xml(_ok(reply, "").body)
        # Quirk: AWS and SeaweedFS answer <VersioningConfiguration>, moto
        # <GetBucketVersioningResponse>; both hold an optional <Status>.
        names = ("VersioningConfiguration", "GetBucketVersioningResponse")
        if root is None or local_name(root) not in names:
            raise StoreUnavailable("S3 sent an unreadable versioning configuration")
        return text(root, "Status")

    async def list_versions(
        self, prefix: str, *, limit: int | None = None
    ) -> builtins.list[ObjectVersion]:
        if limit is not None and limit < 1:
            raise ValueError("limit must be positive")
        out: builtins.list[ObjectVersion] = []
        key_marker = version_marker = ""
        while limit is None or len(out) < limit:
            size = self._page_size if limit is None else min(self._page_size, limit - len(out))
            query = [("versions", ""), ("max-keys", str(size))]
            if key_marker:
                query.append(("key-marker", key_marker))
                query.append(("version-id-marker", version_marker))
            page = await self._listing_page(
                "ListObjectVersions", "ListVersionsResult", prefix, query
            )
            out += page.versions
            if not page.truncated:
                break
            key_marker, version_marker = page.next_key, page.next_version
            if not key_marker:
                raise StoreUnavailable("S3 version listing truncated without a marker", key=prefix)
        # Quirks: SeaweedFS walks directories, so keys are sorted by code point here (S3's
        # order); moto lists a page's versions first and its delete markers after them, where
        # AWS interleaves them newest first. So each key's history is put in order here: the
        # latest entry, then by LastModified, newest first; the sort is stable, so entries of
        # one second keep the store's order (newest first among versions, and among markers).
        out.sort(key=lambda v: (v.key, not v.is_latest, -v.last_modified.timestamp()))
        return out[:limit] if limit is not None else out

    async def get_version(self, key: str, version_id: str) -> StoredObject:
        check_key(key)
        if not version_id:
            raise ValueError("a version id cannot be empty")
        return await self._get(key, [("versionId", version_id)])

    async def delete_version(self, key: str, version_id: str) -> None:
        check_key(key)
        if not version_id:
            raise ValueError("a version id cannot be empty")
        reply = await self._send(
            "DeleteObject", "DELETE", key, query=[("versionId", version_id)], ok=(200, 204)
        )
        if reply.status in (200, 204) or reply.missing_key:
            return  # done, or already gone
        raise error_for(reply, key)

    async def now(self) -> datetime.datetime:
        """The bucket's clock, never ahead of it (:mod:`lchat.objstore.s3.dates`). A HeadBucket
        fetches a Date when none came lately."""
        if not self._dates.fresh:
            # Any non-transient answer carries the bucket's Date, even a 403 for a policy that
            # does not grant s3:ListBucket (which HeadBucket needs).
            await self._send("HeadBucket", "HEAD", None, ok=(200, 403, 404))
        best = self._dates.now()
        if best is None:
            raise StoreUnavailable("S3 sent no usable Date header")
        return best

    async def close(self) -> None:
        await self._exchange.close()


def _ok(reply: Reply, key: str) -> Reply:
    """``reply`` if it is a 200, else its typed error raised."""
    if reply.status != 200:
        raise error_for(reply, key)
    return reply

"""Where a bucket's requests go and how they are signed: the bucket's base URL (path-style or
virtual-hosted), each request's URL, and SigV4 over the credentials the store was given
(botocore's ``S3SigV4Auth``; a role's credentials are refreshed in a thread)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from attrs import frozen
from botocore.auth import UNSIGNED_PAYLOAD, S3SigV4Auth  # type: ignore[import-untyped]
from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
from botocore.credentials import (  # type: ignore[import-untyped]
    Credentials,
    ReadOnlyCredentials,
    RefreshableCredentials,
)
from twisted.internet.defer import DeferredLock
from twisted.web.http_headers import Headers

from lchat.objstore import StoreUnavailable
from lchat.objstore.s3.bodies import FileBody
from lchat.objstore.s3.wire import quote_key, quote_query
from lchat.threads import RunInThread

_SIGN_BODY_MAX = 64 * 1024  # bodies up to this are SHA-256 signed; larger ones go UNSIGNED-PAYLOAD


@frozen
class BucketAddress:
    """``base_url`` (``scheme://host[:port][/bucket]``) and ``host`` (the signed Host header) of
    ``bucket``: ``endpoint`` selects an S3-compatible store (path-style); without it, AWS's
    endpoint in ``region``, virtual-hosted unless the name is not DNS-safe."""

    base_url: str
    host: str

    @classmethod
    def of(cls, bucket: str, endpoint: str, region: str) -> BucketAddress:
        if endpoint:
            # S3-compatible stores (MinIO, SeaweedFS, ...) speak path-style.
            scheme, netloc, path, _, _ = urlsplit(endpoint)
            return cls(f"{scheme}://{netloc}{path.rstrip('/')}/{quote_key(bucket)}", netloc)
        suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
        netloc = f"s3.{region}.{suffix}"
        # Dots break TLS name checks on the wildcard certificate; upper case and underscores are
        # not valid host names.
        if bucket == bucket.lower() and all(c.isalnum() or c == "-" for c in bucket):
            return cls(f"https://{bucket}.{netloc}", f"{bucket}.{netloc}")
        return cls(f"https://{netloc}/{quote_key(bucket)}", netloc)

    def url(self, key: str | None, query: Sequence[tuple[str, str]]) -> str:
        url = self.base_url
        if key is not None:
            url += "/" + quote_key(key)
        elif not url.endswith("/") and "/" not in url.split("://", 1)[1]:
            url += "/"  # virtual-hosted bucket requests are on "/"
        if query:
            # Sorted and encoded the way SigV4 canonicalises them, so the query we send is the
            # one botocore signs.
            url += "?" + "&".join(f"{quote_query(k)}={quote_query(v)}" for k, v in sorted(query))
        return url


def payload_hash(body: bytes | FileBody | None) -> str:
    """What a request's signature says of its body: the SHA-256 of a small one."""
    if body is None:
        return hashlib.sha256(b"").hexdigest()
    if isinstance(body, bytes) and len(body) <= _SIGN_BODY_MAX:
        return hashlib.sha256(body).hexdigest()
    # Large bodies and files are not hashed for the signature (UNSIGNED-PAYLOAD): reading a
    # file twice per attempt is the cost it would add; the TCP/TLS layer and S3's MD5 ETag
    # (checked by callers who care) cover integrity.
    return UNSIGNED_PAYLOAD


class _Auth(S3SigV4Auth):
    """S3 SigV4 with the payload hash we choose (the body's SHA-256, or UNSIGNED-PAYLOAD)."""

    def __init__(self, credentials: ReadOnlyCredentials, region: str, payload_hash: str) -> None:
        super().__init__(credentials, "s3", region)
        self._payload_hash = payload_hash

    def payload(self, request: AWSRequest) -> str:
        return self._payload_hash


class Signer:
    """Signs requests to ``host`` in ``region`` with ``credentials`` (as
    :class:`~lchat.objstore.s3.S3Store` takes them; one refresh at a time)."""

    def __init__(
        self, credentials: Credentials, region: str, host: str, run_in_thread: RunInThread
    ) -> None:
        self.credentials = credentials
        self.region = region
        self._host = host
        self._run_in_thread = run_in_thread
        self._lock = DeferredLock()  # serialises credential refreshes

    async def _frozen_credentials(self) -> ReadOnlyCredentials:
        creds = self.credentials
        if isinstance(creds, RefreshableCredentials) and creds.refresh_needed():
            async with self._lock:
                # A refresh fetches over the network (STS, IMDS, the container agent): a thread.
                try:
                    frozen: ReadOnlyCredentials = await self._run_in_thread(
                        creds.get_frozen_credentials
                    )
                except Exception as e:
                    raise StoreUnavailable(f"could not refresh AWS credentials: {e}") from e
                return frozen
        return creds.get_frozen_credentials()

    async def sign(
        self, method: str, url: str, headers: Mapping[str, str], payload_hash: str
    ) -> Headers:
        """The request's headers with its ``Authorization`` (and ``x-amz-*``) added."""
        creds = await self._frozen_credentials()
        request = AWSRequest(method=method, url=url, headers={"Host": self._host, **headers})
        _Auth(creds, self.region, payload_hash).add_auth(request)
        out = Headers()
        for name, value in request.headers.items():
            out.addRawHeader(name.encode("ascii"), value.encode("utf-8"))
        return out

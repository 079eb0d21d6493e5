"""The bucket over S3's HTTP API: AWS, or any S3-compatible store (``LCHAT_HIBERNATE_ENDPOINT``).

:class:`S3Store` (``store``) is the bucket's operations over one exchange (``exchange``: sending,
timeouts, retries, the metrics), which signs with ``signing``, streams file bodies through
``bodies`` and reads the bucket's clock off its answers' Dates (``dates``); ``wire`` reads and
writes what S3 says, without I/O.

botocore is used for two things only: SigV4 signing (``S3SigV4Auth``) and the credentials the
store is given (resolved once, by the caller, with :func:`lchat.objstore.aws.resolve_credentials`).
Refreshing a role's credentials can do blocking I/O (STS, the instance metadata service), so it
always runs in a thread, never on the reactor, and so does file I/O (``put_file``'s reads,
``get_to_file``'s writes). The transport is treq over one persistent connection pool.

Every request has a known ``Content-Length`` (S3 refuses chunked uploads); retries, timeouts and
the request metrics are ``exchange``'s.

Store quirks we normalise (each is handled, and commented, where it bites):

- ``If-Match`` on a missing key: AWS and moto answer 404 ``NoSuchKey``, SeaweedFS answers 412.
  The interface says :class:`PreconditionFailed` for both (see ``Reply.condition_failed``).
- ``Last-Modified``: HTTP dates have whole seconds, moto's listing has whole seconds (``.000Z``),
  AWS's listing has milliseconds. We truncate every timestamp to whole seconds so ``head`` and
  ``list`` agree with each other and with the ``Date`` clock they are compared against.
- ETags in ``If-Match``: RFC 7232 and AWS want them quoted; moto and SeaweedFS accept either
  form. We send them quoted.
- ``CopyObject`` can answer 200 with an ``<Error>`` body (AWS documents this): treated as that error.
- Listing order: S3 lists in UTF-8 byte order (= code point order); SeaweedFS walks directories,
  so we sort each listing rather than trust the store's order.
- SeaweedFS creates a missing bucket on PUT for admin identities (``-s3.autoCreateBucket``); AWS
  answers ``NoSuchBucket``. Nothing to do here; the test fixture turns that off.
- Key shapes: SeaweedFS refuses ``.``/``..`` segments and collapses empty ones (``a//b`` is stored
  as ``a/b``); AWS keeps them. Such keys are refused with ``ValueError`` (``wire.check_key``).
- ``ListObjectVersions`` (SeaweedFS 4.48): a *truncated* page can skip entries when one key
  extends another with a character that sorts before ``.`` (``a`` and ``a b``, ``a`` and ``a-b``):
  its directory walk meets them in another order than S3's. Untruncated listings are right, so
  are pages over keys without that shape; callers that page over such keys must not trust a
  limited listing on SeaweedFS (``lchat.home.s3_store`` lists in full when siblings show up).
- A failed DELETE on a reused keep-alive connection is silently re-sent by Twisted's pool when it
  has no body; DELETEs get an explicit empty body so every retry is ours (``Exchange._attempt``).
"""

from lchat.objstore.s3.store import S3Store

__all__ = ["S3Store"]

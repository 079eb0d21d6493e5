"""What S3 says on the wire, read and written without I/O: keys and queries as they go into a
URL, ETags, dates, metadata headers, the XML of errors and listings, and the typed error a reply
stands for (:func:`error_for`). Every quirk of a store's answers that does not need a request is
normalised here."""

from __future__ import annotations

import datetime
import email.utils
import hashlib
import xml.etree.ElementTree as ET
from collections.abc import Container, Mapping
from urllib.parse import quote, unquote_plus

from attrs import define
from twisted.web.http_headers import Headers

from lchat.objstore import (
    UTC,
    AccessDenied,
    NotFound,
    ObjectInfo,
    ObjectStoreError,
    ObjectVersion,
    PreconditionFailed,
)

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"

# S3 error codes that mean "try again" whatever their status (RequestTimeout is a 400, SlowDown a 503,
# OperationAborted a 409 about a conflicting bucket operation in progress).
TRANSIENT_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "OperationAborted"}
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "RequestTimeTooSkewed",
        "AllAccessDisabled",
        "AccountProblem",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchVersion"})
# 409 ConditionalRequestConflict: AWS's answer to two conditional writes racing on one key.
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})


@define
class Reply:
    """One non-transient answer of the store, its error (if any) read from the XML body."""

    status: int
    headers: Headers
    body: bytes
    code: str = ""  # S3 error code, from the XML body (or derived from the status for HEAD)
    message: str = ""
    request_id: str = ""
    streamed: int = 0  # bytes written to the sink
    # An earlier attempt failed after the request may have reached the store: a mutation may
    # already have happened (the "lost response" case).
    ambiguous: bool = False

    def read_error(self) -> bool:
        """Take ``code``, ``message`` and ``request_id`` from an ``<Error>`` body; False when the
        body is no such document."""
        root = xml(self.body) if self.body else None
        if root is None or local_name(root) != "Error":
            return False
        self.code = text(root, "Code")
        self.message = text(root, "Message")
        self.request_id = text(root, "RequestId") or self.request_id
        return True

    @property
    def transient(self) -> bool:
        return self.status >= 500 or self.status == 429 or self.code in TRANSIENT_CODES

    def outcome(self, ok: Container[int]) -> str:
        """The ``outcome`` label of ``lchat_s3_requests_total``."""
        status, code = self.status, self.code
        if status in ok:
            return "ok"
        if status == 404 or code in _NOT_FOUND_CODES:
            return "not_found"
        if status == 412 or code in _PRECONDITION_CODES:
            return "precondition"
        if status == 403 or code in _DENIED_CODES:
            return "denied"
        return "error"

    @property
    def condition_failed(self) -> bool:
        # Quirk: a conditional write to a missing key is 412 on SeaweedFS but 404 NoSuchKey on
        # AWS and moto. Both mean "the version you named is not there": PreconditionFailed. A
        # missing *bucket* stays NotFound.
        if self.status == 412 or self.code in _PRECONDITION_CODES:
            return True
        return self.status == 404 and self.code in ("NoSuchKey", "")

    def precondition_failed(self, key: str) -> PreconditionFailed:
        return PreconditionFailed(
            f"S3 answered {self.status} {self.code}".strip(), key=key, request_id=self.request_id
        )

    @property
    def missing_key(self) -> bool:
        """A 404 for the key, not the bucket: what a DELETE counts as done."""
        return self.status == 404 and self.code != "NoSuchBucket"


def error_for(reply: Reply, key: str) -> ObjectStoreError:
    """The typed error for a non-transient error reply."""
    status, code = reply.status, reply.code
    detail = f"S3 answered {status}" + (f" {code}" if code else "")
    if reply.message:
        detail += f": {reply.message}"
    rid = reply.request_id
    if code in _NOT_FOUND_CODES or (status == 404 and not code):
        return NotFound(detail, key=key, request_id=rid)
    if status == 412 or code in _PRECONDITION_CODES:
        return PreconditionFailed(detail, key=key, request_id=rid)
    if status == 403 or code in _DENIED_CODES:
        return AccessDenied(detail, key=key, request_id=rid)
    if status == 404:
        return NotFound(detail, key=key, request_id=rid)
    if status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
        region = header_text(reply.headers, "x-amz-bucket-region")
        detail += f" (the bucket is in region {region!r}?)" if region else " (wrong region?)"
    return ObjectStoreError(detail, key=key, request_id=rid)


def quote_key(key: str) -> str:
    """A key as it goes into the request path: UTF-8, every byte but unreserved ones and ``/``
    percent-encoded. This is also the canonical form SigV4 signs for S3 (which does not normalise
    paths), so what we sign and what we send are the same string."""
    return quote(key, safe="/~")


def quote_query(value: str) -> str:
    return quote(value, safe="~")


def unquote_etag(value: str) -> str:
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


def _whole_seconds(when: datetime.datetime) -> datetime.datetime:
    # Quirk: moto's Last-Modified has whole seconds (HTTP dates always do), AWS's listing has
    # milliseconds. Whole seconds everywhere, so head() and list() agree and match Date.
    return when.astimezone(UTC).replace(microsecond=0)


def http_date(value: bytes | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value.decode("latin-1"))
    except (TypeError, ValueError):
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return _whole_seconds(parsed)


def _iso_date(value: str) -> datetime.datetime:
    parsed = datetime.datetime.fromisoformat(value.strip())
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return _whole_seconds(parsed)


def xml(body: bytes) -> ET.Element | None:
    # The body comes from the bucket we were configured with; expat (>= 2.4, bundled with 3.11)
    # bounds entity expansion, and S3 bodies carry no DTD.
    try:
        return ET.fromstring(body)  # noqa: S314
    except ET.ParseError:
        return None


def _find(element: ET.Element, name: str) -> ET.Element | None:
    found = element.find(_NS + name)
    return found if found is not None else element.find(name)


def text(element: ET.Element, name: str, default: str = "") -> str:
    found = _find(element, name)
    if found is None or found.text is None:
        return default
    return found.text


def local_name(element: ET.Element) -> str:
    return element.tag.rsplit("}", 1)[-1]


def header(headers: Headers, name: str) -> bytes | None:
    values = headers.getRawHeaders(name.encode("ascii"))
    return values[-1] if values else None


def header_text(headers: Headers, name: str) -> str:
    value = header(headers, name)
    return value.decode("latin-1") if value is not None else ""


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    # S3 metadata travels as HTTP headers: ASCII only (AWS RFC-2047-encodes anything else and
    # stores differ on it), names must be header tokens.
    out = {}
    for name, value in metadata.items():
        lname = name.lower()
        if not lname or not all(c.isalnum() or c in "-_" for c in lname) or not lname.isascii():
            raise ValueError(f"metadata name {name!r} is not a plain ASCII token")
        if not value.isascii() or any(ord(c) < 0x20 or c == "\x7f" for c in value):
            raise ValueError(f"metadata value for {name!r} must be printable ASCII")
        out[f"x-amz-meta-{lname}"] = value
    return out


def check_key(key: str) -> None:
    if not key:
        raise ValueError("an object key cannot be empty")
    if len(key.encode("utf-8")) > 1024:
        raise ValueError("an object key is at most 1024 bytes of UTF-8")
    parts = key.split("/")
    # Keys every store can hold the same way. SeaweedFS refuses "." and ".." segments (400
    # InvalidRequest) and silently collapses empty ones ("a//b" and "/a" become "a/b" and "a"),
    # while AWS keeps both: a key with such segments would not be the same key everywhere.
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"key {key!r} has a '.' or '..' segment")
    if any(part == "" for part in parts[:-1]):
        raise ValueError(f"key {key!r} has an empty segment (a leading or doubled '/')")


def object_info(
    key: str, headers: Headers, size: int | None, otherwise: datetime.datetime
) -> ObjectInfo:
    """The object a GET's or HEAD's headers describe; ``otherwise`` is its Last-Modified when
    neither that nor a Date came."""
    metadata = {}
    for name, values in headers.getAllRawHeaders():
        lname = name.decode("latin-1").lower()
        if lname.startswith("x-amz-meta-") and values:
            metadata[lname[len("x-amz-meta-") :]] = values[-1].decode("utf-8", "replace")
    if size is None:
        size = int(header_text(headers, "content-length") or 0)
    modified = http_date(header(headers, "last-modified")) or http_date(header(headers, "date"))
    return ObjectInfo(
        key=key,
        size=size,
        etag=unquote_etag(header_text(headers, "etag")),
        last_modified=modified or otherwise,
        metadata=metadata,
    )


@define
class ListingPage:
    """One page of ``ListObjectsV2`` or ``ListObjectVersions``, keys already URL-decoded."""

    objects: list[ObjectInfo]
    versions: list[ObjectVersion]
    truncated: bool
    next_token: str  # ListObjectsV2's continuation token
    next_key: str  # ListObjectVersions' markers
    next_version: str


def listing_page(body: bytes, root_name: str) -> ListingPage | None:
    """The page in ``body`` (whose root element must be ``root_name``), or None if unreadable."""
    root = xml(body)
    if root is None or local_name(root) != root_name:
        return None
    encoded = text(root, "EncodingType").lower() == "url"

    def decoded(value: str) -> str:
        return unquote_plus(value) if encoded else value

    page = ListingPage([], [], text(root, "IsTruncated").lower() == "true", "", "", "")
    for item in root:
        kind = local_name(item)
        if kind not in ("Contents", "Version", "DeleteMarker"):
            continue
        key = decoded(text(item, "Key"))
        etag = unquote_etag(text(item, "ETag"))
        size = int(text(item, "Size", "0"))
        modified = _iso_date(text(item, "LastModified"))
        if kind == "Contents":
            page.objects.append(ObjectInfo(key=key, size=size, etag=etag, last_modified=modified))
        else:
            page.versions.append(
                ObjectVersion(
                    key=key,
                    version_id=text(item, "VersionId"),
                    etag=etag,
                    size=size,
                    last_modified=modified,
                    is_latest=text(item, "IsLatest").lower() == "true",
                    delete_marker=kind == "DeleteMarker",
                )
            )
    page.next_token = text(root, "NextContinuationToken")
    page.next_key = decoded(text(root, "NextKeyMarker"))
    page.next_version = text(root, "NextVersionIdMarker")
    return page

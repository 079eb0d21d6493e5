"""The bucket over S3's HTTP API: AWS, or any S3-compatible store (``LCHAT_HIBERNATE_ENDPOINT``).

botocore is used for two things only: SigV4 signing (``S3SigV4Auth``) and the credentials the
store is given (resolved once, by the caller, with :func:`lchat.objstore.aws.resolve_credentials`).
Refreshing a role's credentials can do blocking I/O (STS, the instance metadata service), so it
always runs in a thread, never on the reactor, and so does file I/O (``put_file``'s reads,
``get_to_file``'s writes). The transport is treq over one persistent connection pool.

Every request has a known ``Content-Length`` (S3 refuses chunked uploads), a per-attempt timeout
and up to ``retries`` retries with jittered exponential backoff on 5xx, throttling, timeouts and
connection errors. Each attempt is counted in ``lchat_s3_requests_total{operation,outcome}``:
S3 requests are the bill.

Store quirks we normalise (each is handled, and commented, where it bites):

- ``If-Match`` on a missing key: AWS and moto answer 404 ``NoSuchKey``, SeaweedFS answers 412.
  The interface says :class:`PreconditionFailed` for both (see ``_condition_failed``).
- ``Last-Modified``: HTTP dates have whole seconds, moto's listing has whole seconds (``.000Z``),
  AWS's listing has milliseconds. We truncate every timestamp to whole seconds so ``head`` and
  ``list`` agree with each other and with the ``Date`` clock they are compared against.
- ETags in ``If-Match``: RFC 7232 and AWS want them quoted; some S3-compatible stores compare the
  header literally against an unquoted ETag. Both moto and SeaweedFS accept either form; we send
  quoted, and ``quote_etags=False`` sends them bare for a store that needs it.
- ``CopyObject`` can answer 200 with an ``<Error>`` body (AWS documents this): treated as that error.
- Listing order: S3 lists in UTF-8 byte order (= code point order); SeaweedFS walks directories,
  so we sort each listing rather than trust the store's order.
- SeaweedFS creates a missing bucket on PUT for admin identities (``-s3.autoCreateBucket``); AWS
  answers ``NoSuchBucket``. Nothing to do here; the test fixture turns that off.
- Key shapes: SeaweedFS refuses ``.``/``..`` segments and collapses empty ones (``a//b`` is stored
  as ``a/b``); AWS keeps them. Such keys are refused with ``ValueError`` (``_check_key``).
- ``ListObjectVersions`` (SeaweedFS 4.48): a *truncated* page can skip entries when one key
  extends another with a character that sorts before ``.`` (``a`` and ``a b``, ``a`` and ``a-b``):
  its directory walk meets them in another order than S3's. Untruncated listings are right, so
  are pages over keys without that shape; callers that page over such keys must not trust a
  limited listing on SeaweedFS (``lchat.home.s3_store`` lists in full when siblings show up).
- A failed DELETE on a reused keep-alive connection is silently re-sent by Twisted's pool when it
  has no body; we give DELETEs an explicit empty body so every retry is ours (see ``_exchange``).
"""

from __future__ import annotations

import builtins
import datetime
import email.utils
import hashlib
import os
import secrets
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Container, Mapping, Sequence
from typing import IO, Any, Literal
from urllib.parse import quote, unquote_plus, urlsplit

import treq.client
from attrs import define, frozen
from botocore.auth import UNSIGNED_PAYLOAD, S3SigV4Auth  # type: ignore[import-untyped]
from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
from botocore.credentials import (  # type: ignore[import-untyped]
    Credentials,
    ReadOnlyCredentials,
    RefreshableCredentials,
)
from prometheus_client import Counter, Histogram
from twisted.internet import error
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, Deferred, DeferredLock
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.interfaces import IConsumer, IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    RequestGenerationFailed,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from lchat.backoff import Backoff
from lchat.files import fsync_directory
from lchat.objstore import (
    UTC,
    AccessDenied,
    NotFound,
    ObjectInfo,
    ObjectStoreError,
    ObjectVersion,
    PreconditionFailed,
    PutResult,
    StoredObject,
    StoreUnavailable,
)
from lchat.threads import RunInThread
from lchat.twisted_internals import RequestNotSent, WrongBodyLength, quiet_pool
from lchat.webutil import BytesProducer

log = Logger()

REQUESTS = Counter(
    "lchat_s3_requests_total",
    "S3 requests sent, each attempt counted (S3 bills per request), by operation and outcome",
    ["operation", "outcome"],
)
LATENCY = Histogram(
    "lchat_s3_request_seconds",
    "S3 request latency per attempt, from sending to the end of the response body",
    ["operation"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)

AddressingStyle = Literal["auto", "path", "virtual"]

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_SIGN_BODY_MAX = 64 * 1024  # bodies up to this are SHA-256 signed; larger ones go UNSIGNED-PAYLOAD
_HASH_IN_THREAD = 1024 * 1024  # hashing more than this would stall the reactor: do it in a thread
_WRITE_CHUNK = 1024 * 1024  # get_to_file hands the writer thread this much at a time
_WRITE_HIGH_WATER = 4 * 1024 * 1024  # and pauses the socket when this much is waiting
# put_file reads its file in the thread pool this much at a time. Each chunk costs the reactor a
# round trip to the pool (tens of microseconds): FileBodyProducer's 64 KiB would be 16k of them
# per GiB, 256 KiB is 4k. Larger buys little (the transport sends at most 128 KiB per send()) and
# costs memory: an upload holds about two chunks (one being sent, one read ahead).
_READ_CHUNK = 256 * 1024
# Between retries: 0.1 s doubling to 2 s, "equal jitter" (half the step fixed, half random), so
# retries from many boxes spread out but never collapse to zero.
_BACKOFF = Backoff(0.1, 2.0, jitter=(0.5, 1.0))
_DATE_FRESH = 1.0  # now() reuses the Date of a response younger than this (seconds)
# now() bounds the bucket's clock from below by every Date seen within this long (seconds): a Date
# is truncated to the second, so one alone is up to 1 s behind, and the latest bound of several
# taken at different phases of the second is much closer. Short: each is carried forward on this
# box's monotonic clock, whose rate error it adds to (the lease's margin covers rate errors over
# dead_after, docs/lease.md).
_DATE_WINDOW = 2.0

# S3 error codes that mean "try again" whatever their status (RequestTimeout is a 400, SlowDown a 503,
# OperationAborted a 409 about a conflicting bucket operation in progress).
_TRANSIENT_CODES = frozenset(
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

_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    error.ConnectError,  # refused, DNS, connect timeout, ...
    error.ConnectionLost,
    error.ConnectionDone,
    error.TimeoutError,
    builtins.TimeoutError,
    ResponseFailed,  # includes ResponseNeverReceived
    RequestTransmissionFailed,
    RequestNotSent,
    WrongBodyLength,
)
# Not OSError at large: a local disk error (ENOSPC while writing get_to_file's temp file) is ours
# to raise as it is, not a reason to retry against the store.
# These failed before a byte reached the server: the request cannot have been applied.
_NOT_SENT_ERRORS: tuple[type[BaseException], ...] = (
    error.ConnectionRefusedError,
    error.DNSLookupError,
    error.ConnectingCancelledError,
    RequestNotSent,
)
# Twisted's errors that carry their causes in ``reasons`` (a list of Failures): the public
# subclasses of the private twisted.web._newclient._WrapperException.
_WRAPPERS = (RequestGenerationFailed, RequestTransmissionFailed, ResponseFailed)


def quote_key(key: str) -> str:
    """A key as it goes into the request path: UTF-8, every byte but unreserved ones and ``/``
    percent-encoded. This is also the canonical form SigV4 signs for S3 (which does not normalise
    paths), so what we sign and what we send are the same string."""
    return quote(key, safe="/~")


def _quote_query(value: str) -> str:
    return quote(value, safe="~")


def _unquote_etag(value: str) -> str:
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


def _whole_seconds(when: datetime.datetime) -> datetime.datetime:
    # Quirk: moto's Last-Modified has whole seconds (HTTP dates always do), AWS's listing has
    # milliseconds. Whole seconds everywhere, so head() and list() agree and match Date.
    return when.astimezone(UTC).replace(microsecond=0)


def _http_date(value: bytes | None) -> datetime.datetime | None:
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


def _xml(body: bytes) -> ET.Element | None:
    # The body comes from the bucket we were configured with; expat (>= 2.4, bundled with 3.11)
    # bounds entity expansion, and S3 bodies carry no DTD.
    try:
        return ET.fromstring(body)  # noqa: S314
    except ET.ParseError:
        return None


def _find(element: ET.Element, name: str) -> ET.Element | None:
    found = element.find(_NS + name)
    return found if found is not None else element.find(name)


def _text(element: ET.Element, name: str, default: str = "") -> str:
    found = _find(element, name)
    if found is None or found.text is None:
        return default
    return found.text


def _findall(element: ET.Element, name: str) -> list[ET.Element]:
    return element.findall(_NS + name) or element.findall(name)


def _local_name(element: ET.Element) -> str:
    return element.tag.rsplit("}", 1)[-1]


def _header(headers: Headers, name: str) -> bytes | None:
    values = headers.getRawHeaders(name.encode("ascii"))
    return values[-1] if values else None


def _header_text(headers: Headers, name: str) -> str:
    value = _header(headers, name)
    return value.decode("latin-1") if value is not None else ""


def _md5_hex(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
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


def _check_key(key: str) -> None:
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


class _Signer(S3SigV4Auth):
    """S3 SigV4 with the payload hash we choose (the body's SHA-256, or UNSIGNED-PAYLOAD)."""

    def __init__(self, credentials: ReadOnlyCredentials, region: str, payload_hash: str) -> None:
        super().__init__(credentials, "s3", region)
        self._payload_hash = payload_hash

    def payload(self, request: AWSRequest) -> str:
        return self._payload_hash


@frozen
class _FileBody:
    path: str
    size: int


@define
class _Reply:
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


class _Watchdog:
    """Cancels ``d`` when ``timeout`` seconds pass without ``touch()`` (streams: idle, not total)."""

    def __init__(self, reactor: IReactorTime, timeout: float, d: Deferred[Any]) -> None:
        self.fired = False
        self._timeout = timeout
        self._d = d
        self._call: IDelayedCall = reactor.callLater(timeout, self._fire)

    def touch(self) -> None:
        if self._call.active():
            self._call.reset(self._timeout)

    def stop(self) -> None:
        if self._call.active():
            self._call.cancel()

    def _fire(self) -> None:
        self.fired = True
        self._d.cancel()


@implementer(IBodyProducer)
class _FileProducer:
    """``put_file``'s request body: the file, read in a worker thread a chunk at a time.

    Nothing touches the disk on the reactor thread: the descriptor is opened (``_open_for_upload``),
    read (``_read_chunk``) and closed in the pool. At most one read is in flight and at most one
    chunk waits for the consumer (one chunk of read-ahead), so an upload holds about two chunks
    whatever the file's size; the transport pauses us while its buffer is full.

    Reads are positional (``pread``), so there is no shared file offset and every
    ``startProducing`` starts again at byte 0 on the same descriptor: a restart abandons the
    earlier run (a read still in flight for it is dropped when it lands). ``pauseProducing``,
    ``resumeProducing`` and ``stopProducing`` act on the current run.

    ``startProducing``'s Deferred fires once exactly ``length`` bytes are written; it fails with
    :class:`ObjectStoreError` if the file turns out shorter or longer than ``length`` (it changed
    under us), or with the read's ``OSError``. As IBodyProducer requires, it never fires after
    ``stopProducing``; cancelling it stops the run. The owner awaits ``close()``, which fails a run
    still going (with ``CancelledError``), waits for a read in flight and closes the descriptor.
    """

    def __init__(
        self,
        run_in_thread: RunInThread,
        fd: int,
        path: str,
        size: int,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.length = size
        self.path = path
        # Called on the reactor thread before each chunk is written (feeds an upload's watchdog).
        self.progress = progress
        self._run_in_thread = run_in_thread
        self._fd = fd
        self._closing = False
        self._run = 0  # bumped by every start and stop: a result for an older run is dropped
        self._consumer: IConsumer | None = None
        self._done: Deferred[None] | None = None
        self._paused = False
        self._offset = 0  # the next byte to read
        self._written = 0
        self._ahead: bytes | None = None  # read, waiting for the consumer
        self._reading = False
        self._idle_waiters: list[Deferred[None]] = []

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        if self._closing:
            raise RuntimeError(f"the upload body for {self.path} is closed")
        self.stopProducing()  # a restart (a retried request) begins again at byte 0
        self._consumer = consumer
        self._done = done = Deferred[None](self._cancel)
        self._paused = False
        self._offset = self._written = 0
        self._pump()
        return done

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._pump()

    def stopProducing(self) -> None:
        self._run += 1
        self._consumer = None
        self._done = None
        self._ahead = None

    async def close(self) -> None:
        """Stop, let a read in flight land, and close the file (in a thread)."""
        self._closing = True
        done = self._done
        self.stopProducing()
        if done is not None:
            # Abandoned mid-run: the store answered before the body was all sent. Fail the run,
            # so the HTTP client lets go of us and can finish closing that connection.
            done.errback(CancelledError(f"the upload of {self.path} was abandoned"))
        while self._reading:
            waiter = Deferred[None]()
            self._idle_waiters.append(waiter)
            await waiter
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            await self._run_in_thread(os.close, fd)

    def _cancel(self, done: Deferred[None]) -> None:
        if done is self._done:
            self.stopProducing()

    def _pump(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return  # stopped, finished or failed
        if self._ahead is not None and not self._paused:
            chunk, self._ahead = self._ahead, None
            self._written += len(chunk)
            run = self._run
            if self.progress is not None:
                self.progress()
            try:
                consumer.write(chunk)  # the transport may pause (or even stop) us from in here
            except BaseException:
                if run == self._run:
                    self._fail(Failure())
                return
            if run != self._run:
                return
        if self._written == self.length:
            done = self._done
            self.stopProducing()
            assert done is not None
            done.callback(None)
        elif self._ahead is None and not self._reading:
            self._read()  # read ahead even while paused: the next chunk is ready on resume

    def _read(self) -> None:
        want = min(_READ_CHUNK, self.length - self._offset)
        # The last read asks for one byte more: getting it means the file grew under us.
        ask = want + 1 if self._offset + want == self.length else want
        self._reading = True
        d = self._run_in_thread(_read_chunk, self._fd, self._offset, ask)
        d.addBoth(self._got, self._run, want)

    def _got(self, result: bytes | Failure, run: int, want: int) -> None:
        self._reading = False
        if run != self._run:
            # A stopped or restarted run's read: drop it (the current run may be waiting to read).
            pass
        elif isinstance(result, Failure):
            self._fail(result)
        elif len(result) != want:
            self._fail(Failure(ObjectStoreError(f"{self.path} changed size while being uploaded")))
        else:
            self._offset += want
            self._ahead = result
        self._pump()
        if not self._reading:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def _fail(self, failure: Failure) -> None:
        done = self._done
        self.stopProducing()
        if done is not None:
            done.errback(failure)


class _BodyReader(Protocol):
    """Reads a response body into memory, or into a file through a writer thread.

    File mode never holds more than about ``_WRITE_HIGH_WATER`` bytes: past that the socket is
    paused until the thread has caught up. ``done`` fires with the body (memory mode) or ``b""``
    once everything is written; cancelling it aborts the connection.
    """

    def __init__(
        self,
        run_in_thread: RunInThread,
        sink: IO[bytes] | None,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.done: Deferred[bytes] = Deferred(lambda _: self._abort())
        self.received = 0
        self._run_in_thread = run_in_thread
        self._sink = sink
        self._progress = progress
        self._chunks: list[bytes] = []
        self._pending = 0
        self._writing = False
        self._idle_waiters: list[Deferred[None]] = []
        self._paused = False
        self._open = True
        self._failure: Failure | None = None
        self._aborted = False

    def dataReceived(self, data: bytes) -> None:
        self.received += len(data)
        if self._progress is not None:
            self._progress()
        self._chunks.append(data)
        self._pending += len(data)
        if self._sink is None:
            return
        if self._pending >= _WRITE_CHUNK:
            self._flush()
        if self._pending >= _WRITE_HIGH_WATER and not self._paused and self.transport:
            self._paused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = Failure(error.ConnectionDone())) -> None:  # noqa: B008
        self._open = False
        if reason.check(ResponseDone, PotentialDataLoss) is None:
            self._failure = reason
            self._chunks = []
            self._pending = 0
        if self._sink is None:
            self._finish(self._failure or b"".join(self._chunks))
            self._chunks = []
            return
        self._flush()

    def _flush(self) -> None:
        if self._writing:
            return  # _written() calls us again
        if self._chunks and not self._aborted:
            data = b"".join(self._chunks)
            self._chunks = []
            self._pending = 0
            assert self._sink is not None
            self._writing = True
            d = self._run_in_thread(_write, self._sink, data)
            d.addCallbacks(self._written, self._write_failed)
            return
        if not self._open or self._aborted:
            self._finish(self._failure or b"")

    def _written(self, _: object) -> None:
        self._writing = False
        if self._paused and self._open and not self._aborted and self.transport:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[attr-defined]
        if self._pending >= _WRITE_CHUNK or not self._open or self._aborted:
            self._flush()
        self._notify_idle()

    def _write_failed(self, failure: Failure) -> None:
        self._writing = False
        self._chunks = []
        self._abort()
        self._finish(failure)
        self._notify_idle()

    def _notify_idle(self) -> None:
        if not self._writing:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def _finish(self, result: bytes | Failure) -> None:
        if not self.done.called:
            if isinstance(result, Failure):
                self.done.errback(result)
            else:
                self.done.callback(result)

    def _abort(self) -> None:
        self._aborted = True
        if self._open and self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    async def quiesce(self) -> None:
        """Wait until no write to the sink is in flight (before closing it)."""
        while self._writing:
            waiter = Deferred[None]()
            self._idle_waiters.append(waiter)
            await waiter


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """Agent's endpoints, except that an IP-literal host is dialled directly.

    HostnameEndpoint resolves even literals and only notices every address failed on its next
    0.3 s happy-eyeballs tick: a refused connection to an IP endpoint would cost 0.3 s per attempt.
    TLS is verified exactly as Agent does by default (``BrowserLikePolicyForHTTPS``).
    """

    def __init__(self, reactor: Any, timeout: float) -> None:
        self._reactor = reactor
        self._timeout = timeout
        self._tls = BrowserLikePolicyForHTTPS()

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        host = uri.host.decode("ascii")
        endpoint: IStreamClientEndpoint
        if isIPAddress(host):
            endpoint = TCP4ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        elif isIPv6Address(host.strip("[]")):
            endpoint = TCP6ClientEndpoint(
                self._reactor, host.strip("[]"), uri.port, timeout=self._timeout
            )
        else:
            endpoint = HostnameEndpoint(self._reactor, uri.host, uri.port, timeout=self._timeout)
        if uri.scheme == b"https":
            endpoint = wrapClientTLS(self._tls.creatorForNetloc(uri.host, uri.port), endpoint)
        return endpoint


class S3Store:
    """:class:`lchat.objstore.ObjectStore` over S3 (see the module docstring).

    Keys are relative to the bucket. ``endpoint`` selects an S3-compatible store (then path-style
    addressing by default); without it, AWS's regional endpoint with virtual-hosted addressing
    (path-style for bucket names that are not DNS-safe), in ``region`` (``us-east-1`` when empty).
    ``credentials`` is a botocore ``Credentials``, already resolved
    (:func:`lchat.objstore.aws.resolve_credentials`); ``RefreshableCredentials`` (a role's) are
    refreshed in a thread when botocore says they are about to expire. ``timeout`` bounds each
    attempt (for ``put_file`` and ``get_to_file`` it is an idle timeout: no byte moved for that
    long); ``retries`` is the number of extra attempts after a transient failure.
    """

    def __init__(
        self,
        reactor: Any,
        bucket: str,
        *,
        run_in_thread: RunInThread,
        monotonic: Callable[[], float],
        credentials: Credentials,
        region: str = "",
        endpoint: str = "",
        prefix_style: AddressingStyle = "auto",
        timeout: float = 30.0,
        retries: int = 4,
        pool: HTTPConnectionPool | None = None,
        quote_etags: bool = True,
        list_page_size: int = 1000,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"bad bucket name {bucket!r}")
        if prefix_style not in ("auto", "path", "virtual"):
            raise ValueError(f"prefix_style must be auto, path or virtual, not {prefix_style!r}")
        if not 1 <= list_page_size <= 1000:
            raise ValueError("list_page_size must be within 1..1000 (S3's max-keys)")
        if timeout <= 0 or retries < 0:
            raise ValueError("timeout must be positive and retries non-negative")
        self._reactor = reactor
        self._run_in_thread = run_in_thread
        # The local monotonic clock: the bucket's time is estimated from its last Date plus the
        # time since, which a step of the wall clock must not skew (leases expire by it).
        self._monotonic = monotonic
        self.bucket = bucket
        self._region = region or "us-east-1"
        self._endpoint = endpoint.rstrip("/")
        if self._endpoint and "://" not in self._endpoint:
            self._endpoint = "https://" + self._endpoint
        self._style = prefix_style
        self._credentials = credentials
        self._timeout = timeout
        self._retries = retries
        self._quote_etags = quote_etags
        self._page_size = list_page_size
        self._own_pool = pool is None
        if pool is None:
            pool = quiet_pool(reactor, persistent=True)
            pool.maxPersistentPerHost = 8
            # AWS drops idle keep-alive connections after ~20 s; don't reuse one older than that.
            pool.cachedConnectionTimeout = 15
        self._pool = pool
        self._http = treq.client.HTTPClient(
            Agent.usingEndpointFactory(reactor, _Endpoints(reactor, timeout), pool=pool)
        )
        self._lock = DeferredLock()  # serialises credential refreshes
        self._base_url, self._host = self._address()  # scheme://host[:port][/bucket], host
        self._last_date: tuple[bytes, float] | None = None
        self._dates: list[tuple[bytes, float]] = []  # (Date, monotonic when it came), oldest first
        self._rng = secrets.SystemRandom()

    def describe(self) -> str:
        where = self._endpoint or "aws"
        return f"s3://{self.bucket} at {where} (region {self._region})"

    # -- setup -----------------------------------------------------------------------------------

    def _address(self) -> tuple[str, str]:
        style = self._style
        if self._endpoint:
            scheme, netloc, path, _, _ = urlsplit(self._endpoint)
            if style == "auto":
                style = "path"  # S3-compatible stores (MinIO, SeaweedFS, ...) speak path-style
        else:
            scheme, path = "https", ""
            suffix = "amazonaws.com.cn" if self._region.startswith("cn-") else "amazonaws.com"
            netloc = f"s3.{self._region}.{suffix}"
            if style == "auto":
                # Dots break TLS name checks on the wildcard certificate; upper case and
                # underscores are not valid host names.
                dns_safe = self.bucket == self.bucket.lower() and all(
                    c.isalnum() or c == "-" for c in self.bucket
                )
                style = "virtual" if dns_safe else "path"
        path = path.rstrip("/")
        if style == "virtual":
            netloc = f"{self.bucket}.{netloc}"
        else:
            path = f"{path}/{quote_key(self.bucket)}"
        return f"{scheme}://{netloc}{path}", netloc

    async def _frozen_credentials(self) -> ReadOnlyCredentials:
        creds = self._credentials
        if isinstance(creds, RefreshableCredentials) and creds.refresh_needed():
            async with self._lock:
                # A refresh fetches over the network (STS, IMDS, the container agent): a thread.
                try:
                    frozen: ReadOnlyCredentials = await self._in_thread(
                        creds.get_frozen_credentials
                    )
                except Exception as e:
                    raise StoreUnavailable(f"could not refresh AWS credentials: {e}") from e
                return frozen
        return creds.get_frozen_credentials()

    async def _in_thread(self, f: Callable[..., Any], *args: Any) -> Any:
        return await self._run_in_thread(f, *args)

    # -- the request engine ----------------------------------------------------------------------

    def _url(self, key: str | None, query: Sequence[tuple[str, str]]) -> str:
        url = self._base_url
        if key is not None:
            url += "/" + quote_key(key)
        elif not url.endswith("/") and "/" not in url.split("://", 1)[1]:
            url += "/"  # virtual-hosted bucket requests are on "/"
        if query:
            # Sorted and encoded the way SigV4 canonicalises them, so the query we send is the
            # one botocore signs.
            url += "?" + "&".join(f"{_quote_query(k)}={_quote_query(v)}" for k, v in sorted(query))
        return url

    @staticmethod
    def _payload_hash(body: bytes | _FileBody | None) -> str:
        if body is None:
            return hashlib.sha256(b"").hexdigest()
        if isinstance(body, bytes) and len(body) <= _SIGN_BODY_MAX:
            return hashlib.sha256(body).hexdigest()
        # Large bodies and files are not hashed for the signature (UNSIGNED-PAYLOAD): reading a
        # file twice per attempt is the cost it would add; the TCP/TLS layer and S3's MD5 ETag
        # (checked by callers who care) cover integrity.
        return UNSIGNED_PAYLOAD

    def _sign(
        self,
        creds: ReadOnlyCredentials,
        method: str,
        url: str,
        headers: Mapping[str, str],
        payload_hash: str,
    ) -> Headers:
        request = AWSRequest(method=method, url=url, headers={"Host": self._host, **headers})
        _Signer(creds, self._region, payload_hash).add_auth(request)
        out = Headers()
        for name, value in request.headers.items():
            out.addRawHeader(name.encode("ascii"), value.encode("utf-8"))
        return out

    def _producer(
        self,
        body: bytes | _FileBody | None,
        file_body: _FileProducer | None,
        progress: Callable[[], None],
    ) -> IBodyProducer | None:
        if body is None:
            return None
        if isinstance(body, bytes):
            # Written at once, by whichever reactor this store runs on: a cooperator would be the
            # global reactor's, which a CLI command's own reactor never runs (the body never went).
            return BytesProducer(body)
        assert file_body is not None
        file_body.progress = progress
        return file_body

    async def _send(
        self,
        op: str,
        method: str,
        key: str | None,
        *,
        query: Sequence[tuple[str, str]] = (),
        headers: Mapping[str, str] | None = None,
        body: bytes | _FileBody | None = None,
        sink: IO[bytes] | None = None,
        ok: Container[int] = (200,),
        body_may_hold_error: bool = False,
    ) -> _Reply:
        """Sign, send and retry one S3 request; return the first non-transient reply.

        A transient failure on the last attempt raises :class:`StoreUnavailable`. Other error
        statuses are returned, not raised, so callers can normalise them (see ``_fail``).
        """
        url = self._url(key, query)
        payload_hash = self._payload_hash(body)
        headers = dict(headers or {})
        streaming = sink is not None or isinstance(body, _FileBody)
        ambiguous = False
        attempts = self._retries + 1
        for attempt in range(1, attempts + 1):
            creds = await self._frozen_credentials()
            signed = self._sign(creds, method, url, headers, payload_hash)
            started = self._monotonic()
            reason = ""
            sent_nothing = False
            try:
                reply = await self._attempt(op, method, url, signed, body, sink, ok, streaming)
            except _Timeout:
                reason = f"no answer within {self._timeout:g}s"
            except _TRANSPORT_ERRORS as e:
                reason = _describe(e)
                sent_nothing = isinstance(e, _NOT_SENT_ERRORS)
            except BaseException:
                REQUESTS.labels(op, "error").inc()  # cancelled by the caller, or a local fault
                raise
            finally:
                LATENCY.labels(op).observe(self._monotonic() - started)
            if not reason:
                if body_may_hold_error and reply.status == 200:
                    # Quirk (AWS): CopyObject may fail after sending 200; the error is the body.
                    root = _xml(reply.body)
                    if root is not None and _local_name(root) == "Error":
                        reply.code = _text(root, "Code")
                        reply.message = _text(root, "Message")
                        reply.request_id = _text(root, "RequestId") or reply.request_id
                        reply.status = 500 if reply.code in _TRANSIENT_CODES else 400
                reply.ambiguous = ambiguous
                if not self._transient(reply):
                    REQUESTS.labels(op, self._outcome(reply.status, reply.code, ok)).inc()
                    return reply
                reason = f"HTTP {reply.status} {reply.code or ''}".strip()
                if reply.request_id:
                    reason += f" [request {reply.request_id}]"
            ambiguous = ambiguous or not sent_nothing
            if attempt == attempts:
                REQUESTS.labels(op, "error").inc()
                raise StoreUnavailable(
                    f"S3 {op} failed after {attempts} attempts: {reason}", key=key or ""
                )
            REQUESTS.labels(op, "retry").inc()
            delay = self._backoff(attempt)
            log.warn(
                "S3 {operation} of {key!r} failed (attempt {attempt}/{attempts}): {reason}; "
                "retrying in {delay:.2f}s",
                operation=op,
                key=key or "",
                bucket=self.bucket,
                attempt=attempt,
                attempts=attempts,
                reason=reason,
                delay=delay,
            )
            await deferLater(self._reactor, delay)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> float:
        return _BACKOFF.jittered(_BACKOFF.delay(attempt), self._rng)

    @staticmethod
    def _transient(reply: _Reply) -> bool:
        return reply.status >= 500 or reply.status == 429 or reply.code in _TRANSIENT_CODES

    @staticmethod
    def _outcome(status: int, code: str, ok: Container[int]) -> str:
        if status in ok:
            return "ok"
        if status == 404 or code in _NOT_FOUND_CODES:
            return "not_found"
        if status == 412 or code in _PRECONDITION_CODES:
            return "precondition"
        if status == 403 or code in _DENIED_CODES:
            return "denied"
        return "error"

    async def _attempt(
        self,
        op: str,
        method: str,
        url: str,
        headers: Headers,
        body: bytes | _FileBody | None,
        sink: IO[bytes] | None,
        ok: Container[int],
        streaming: bool,
    ) -> _Reply:
        if sink is not None:
            await self._in_thread(_rewind, sink)
        file_body: _FileProducer | None = None
        if isinstance(body, _FileBody):
            # A fresh producer per attempt: each has its own consumer, watchdog and lifetime, so
            # a late pause or stop from a dead attempt's transport cannot touch the next one.
            fd: int = await self._in_thread(_open_for_upload, body.path, body.size)
            file_body = _FileProducer(self._run_in_thread, fd, body.path, body.size)
        readers: list[_BodyReader] = []
        watchdog: _Watchdog | None = None
        d = Deferred.fromCoroutine(
            self._exchange(
                method, url, headers, body, file_body, sink, ok, readers, lambda: watchdog
            )
        )
        if streaming:
            watchdog = _Watchdog(self._reactor, self._timeout, d)
        else:
            d.addTimeout(self._timeout, self._reactor, onTimeoutCancel=_timed_out)
        try:
            return await d
        except _Timeout:
            self._forget_dates()
            raise
        except BaseException as e:
            # The store just failed us: a remembered Date must not make now() look healthy.
            self._forget_dates()
            if watchdog is not None and watchdog.fired:
                raise _Timeout() from e
            if _is_cancellation(e):
                # Our caller cancelled the operation (treq reports it as a connect or response
                # failure wrapping CancelledError): stop, do not retry.
                raise CancelledError() from e
            if isinstance(e, RequestGenerationFailed) and e.reasons:
                # The body failed, not the store: put_file's file could not be read or changed
                # size mid-upload. A local fault, raised as it is and not retried.
                raise e.reasons[0].value from e
            raise
        finally:
            if watchdog is not None:
                watchdog.stop()
            for reader in readers:
                await reader.quiesce()  # the sink must not be touched by a late write
            if file_body is not None:
                await file_body.close()  # waits for a read in flight before closing the file

    async def _exchange(
        self,
        method: str,
        url: str,
        headers: Headers,
        body: bytes | _FileBody | None,
        file_body: _FileProducer | None,
        sink: IO[bytes] | None,
        ok: Container[int],
        readers: list[_BodyReader],
        watchdog: Callable[[], _Watchdog | None],
    ) -> _Reply:
        def progress() -> None:
            w = watchdog()
            if w is not None:
                w.touch()

        producer = self._producer(body, file_body, progress)
        if producer is None and method == "DELETE":
            # An explicit empty body: Twisted silently re-sends body-less DELETEs that fail on a
            # reused connection, which would hide a lost response from the conditional-delete
            # check below. With a producer it leaves retrying to us.
            producer = BytesProducer(b"")
        response: IResponse = await self._http.request(
            method,
            url,
            headers=headers,
            data=producer,
            allow_redirects=False,
            unbuffered=True,
            reactor=self._reactor,
        )
        progress()
        status = response.code
        date = _header(response.headers, "date")
        if date:
            self._note_date(date)
        request_id = _header_text(response.headers, "x-amz-request-id") or _header_text(
            response.headers, "x-amzn-requestid"
        )
        to_file = sink is not None and status in ok
        reader = _BodyReader(self._run_in_thread, sink if to_file else None, progress)
        readers.append(reader)
        response.deliverBody(reader)  # HEAD: ends at once, and the connection can be reused
        data = await reader.done
        reply = _Reply(
            status=status,
            headers=response.headers,
            body=b"" if to_file else data,
            request_id=request_id,
            streamed=reader.received if to_file else 0,
        )
        if status not in ok and status >= 300:
            root = _xml(reply.body) if reply.body else None
            if root is not None and _local_name(root) == "Error":
                reply.code = _text(root, "Code")
                reply.message = _text(root, "Message")
                reply.request_id = _text(root, "RequestId") or request_id
        return reply

    def _fail(self, reply: _Reply, key: str) -> ObjectStoreError:
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
            region = _header_text(reply.headers, "x-amz-bucket-region")
            detail += f" (the bucket is in region {region!r}?)" if region else " (wrong region?)"
        return ObjectStoreError(detail, key=key, request_id=rid)

    def _info(self, key: str, headers: Headers, size: int | None = None) -> ObjectInfo:
        metadata = {}
        for name, values in headers.getAllRawHeaders():
            lname = name.decode("latin-1").lower()
            if lname.startswith("x-amz-meta-") and values:
                metadata[lname[len("x-amz-meta-") :]] = values[-1].decode("utf-8", "replace")
        if size is None:
            size = int(_header_text(headers, "content-length") or 0)
        modified = _http_date(_header(headers, "last-modified")) or _http_date(
            _header(headers, "date")
        )
        return ObjectInfo(
            key=key,
            size=size,
            etag=_unquote_etag(_header_text(headers, "etag")),
            last_modified=modified or datetime.datetime.fromtimestamp(self._reactor.seconds(), UTC),
            metadata=metadata,
        )

    def _if_match(self, etag: str) -> str:
        etag = _unquote_etag(etag)
        # Quirk: quoted per RFC 7232 (AWS, moto, SeaweedFS accept it; the last two also accept
        # it bare). A store that compares the raw header to a bare ETag needs quote_etags=False.
        return f'"{etag}"' if self._quote_etags else etag

    # -- the interface ---------------------------------------------------------------------------

    async def get(self, key: str) -> StoredObject:
        _check_key(key)
        reply = await self._send("GetObject", "GET", key)
        if reply.status != 200:
            raise self._fail(reply, key)
        return StoredObject(self._info(key, reply.headers, size=len(reply.body)), reply.body)

    async def get_to_file(self, key: str, path: str) -> ObjectInfo:
        _check_key(key)
        sink, tmp, path = await self._in_thread(_mkstemp_beside, path)
        try:
            reply = await self._send("GetObject", "GET", key, sink=sink)
            if reply.status != 200:
                raise self._fail(reply, key)
            info = self._info(key, reply.headers, size=reply.streamed)
            expected = _header_text(reply.headers, "content-length")
            if expected and int(expected) != reply.streamed:
                raise StoreUnavailable(f"short body: {reply.streamed} of {expected} bytes", key=key)
            await self._in_thread(_commit, sink, tmp, path)
            return info
        except BaseException:
            await self._in_thread(_discard, sink, tmp)
            raise

    async def get_into(self, key: str, sink: IO[bytes]) -> int:
        """GET ``key`` streaming its body into ``sink`` (its ``write`` is called from the store's
        worker threads, a megabyte or more at a time); returns the bytes received.

        A retried attempt first rewinds the sink (``seek(0)``, ``truncate()``); an exception from
        ``write`` fails the GET without a retry. A body shorter than its Content-Length raises
        :class:`StoreUnavailable`.
        """
        _check_key(key)
        reply = await self._send("GetObject", "GET", key, sink=sink)
        if reply.status != 200:
            raise self._fail(reply, key)
        expected = _header_text(reply.headers, "content-length")
        if expected and int(expected) != reply.streamed:
            raise StoreUnavailable(f"short body: {reply.streamed} of {expected} bytes", key=key)
        return reply.streamed

    async def head(self, key: str) -> ObjectInfo:
        _check_key(key)
        reply = await self._send("HeadObject", "HEAD", key)
        if reply.status != 200:
            raise self._fail(reply, key)
        return self._info(key, reply.headers)

    async def put(
        self,
        key: str,
        body: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
        metadata: Mapping[str, str] | None = None,
        content_type: str = "application/octet-stream",
    ) -> PutResult:
        _check_key(key)
        if if_match is not None and if_none_match:
            raise ValueError("if_match and if_none_match exclude each other")
        headers = {"Content-Type": content_type, **_check_metadata(metadata or {})}
        if if_match is not None:
            headers["If-Match"] = self._if_match(if_match)
        if if_none_match:
            headers["If-None-Match"] = "*"
        reply = await self._send("PutObject", "PUT", key, headers=headers, body=body)
        if reply.status == 200:
            return PutResult(key, _unquote_etag(_header_text(reply.headers, "etag")))
        conditional = if_match is not None or if_none_match
        if conditional and self._condition_failed(reply):
            if reply.ambiguous:
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
            raise PreconditionFailed(
                f"S3 answered {reply.status} {reply.code}".strip(),
                key=key,
                request_id=reply.request_id,
            )
        raise self._fail(reply, key)

    def _condition_failed(self, reply: _Reply) -> bool:
        # Quirk: a conditional write to a missing key is 412 on SeaweedFS but 404 NoSuchKey on
        # AWS and moto. Both mean "the version you named is not there": PreconditionFailed. A
        # missing *bucket* stays NotFound.
        if reply.status == 412 or reply.code in _PRECONDITION_CODES:
            return True
        return reply.status == 404 and reply.code in ("NoSuchKey", "")

    async def _md5(self, body: bytes) -> str:
        if len(body) > _HASH_IN_THREAD:
            digest: str = await self._in_thread(_md5_hex, body)
            return digest
        return _md5_hex(body)

    async def put_file(
        self, key: str, path: str, *, metadata: Mapping[str, str] | None = None
    ) -> PutResult:
        _check_key(key)
        size = (await self._in_thread(os.stat, path)).st_size
        headers = {"Content-Type": "application/octet-stream", **_check_metadata(metadata or {})}
        reply = await self._send(
            "PutObject", "PUT", key, headers=headers, body=_FileBody(path, size)
        )
        if reply.status != 200:
            raise self._fail(reply, key)
        return PutResult(key, _unquote_etag(_header_text(reply.headers, "etag")))

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        _check_key(key)
        headers = {}
        if if_match is not None:
            headers["If-Match"] = self._if_match(if_match)
        reply = await self._send("DeleteObject", "DELETE", key, headers=headers, ok=(200, 204))
        if reply.status in (200, 204):
            return
        if if_match is not None and self._condition_failed(reply):
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
            raise PreconditionFailed(
                f"S3 answered {reply.status} {reply.code}".strip(),
                key=key,
                request_id=reply.request_id,
            )
        if reply.status == 404 and reply.code not in ("NoSuchBucket",):
            return  # deleting a missing key succeeds (AWS says 204 anyway)
        raise self._fail(reply, key)

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        out: builtins.list[ObjectInfo] = []
        token = ""
        while True:
            query = [
                ("list-type", "2"),
                ("prefix", prefix),
                ("max-keys", str(self._page_size)),
                # Keys come back URL-encoded: XML 1.0 cannot carry every character a key may have.
                ("encoding-type", "url"),
            ]
            if token:
                query.append(("continuation-token", token))
            reply = await self._send("ListObjectsV2", "GET", None, query=query)
            if reply.status != 200:
                raise self._fail(reply, prefix)
            root = _xml(reply.body)
            if root is None or _local_name(root) != "ListBucketResult":
                raise StoreUnavailable("S3 sent an unreadable listing", key=prefix)
            encoded = _text(root, "EncodingType").lower() == "url"
            for item in _findall(root, "Contents"):
                key = _text(item, "Key")
                out.append(
                    ObjectInfo(
                        key=unquote_plus(key) if encoded else key,
                        size=int(_text(item, "Size", "0")),
                        etag=_unquote_etag(_text(item, "ETag")),
                        last_modified=_iso_date(_text(item, "LastModified")),
                    )
                )
            if _text(root, "IsTruncated").lower() != "true":
                break
            token = _text(root, "NextContinuationToken")
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
        _check_key(source)
        _check_key(destination)
        from_bucket = self.bucket if source_bucket is None else source_bucket
        if not from_bucket or "/" in from_bucket:
            raise ValueError(f"bad source bucket name {from_bucket!r}")
        headers = {"x-amz-copy-source": f"/{quote_key(from_bucket)}/{quote_key(source)}"}
        reply = await self._send(
            "CopyObject", "PUT", destination, headers=headers, body_may_hold_error=True
        )
        if reply.status != 200:
            raise self._fail(reply, source if reply.code == "NoSuchKey" else destination)
        root = _xml(reply.body)
        etag = _text(root, "ETag") if root is not None else ""
        return PutResult(destination, _unquote_etag(etag or _header_text(reply.headers, "etag")))

    # -- a versioned bucket (lchat.objstore.VersionedObjectStore) ---------------------------------

    async def versioning(self) -> str:
        reply = await self._send("GetBucketVersioning", "GET", None, query=[("versioning", "")])
        if reply.status != 200:
            raise self._fail(reply, "")
        root = _xml(reply.body)
        # Quirk: AWS and SeaweedFS answer <VersioningConfiguration>, moto
        # <GetBucketVersioningResponse>; both hold an optional <Status>.
        names = ("VersioningConfiguration", "GetBucketVersioningResponse")
        if root is None or _local_name(root) not in names:
            raise StoreUnavailable("S3 sent an unreadable versioning configuration")
        return _text(root, "Status")

    async def list_versions(
        self, prefix: str, *, limit: int | None = None
    ) -> builtins.list[ObjectVersion]:
        if limit is not None and limit < 1:
            raise ValueError("limit must be positive")
        out: builtins.list[ObjectVersion] = []
        key_marker = version_marker = ""
        while limit is None or len(out) < limit:
            page = self._page_size if limit is None else min(self._page_size, limit - len(out))
            query = [
                ("versions", ""),
                ("prefix", prefix),
                ("max-keys", str(page)),
                ("encoding-type", "url"),
            ]
            if key_marker:
                query.append(("key-marker", key_marker))
                query.append(("version-id-marker", version_marker))
            reply = await self._send("ListObjectVersions", "GET", None, query=query)
            if reply.status != 200:
                raise self._fail(reply, prefix)
            root = _xml(reply.body)
            if root is None or _local_name(root) != "ListVersionsResult":
                raise StoreUnavailable("S3 sent an unreadable version listing", key=prefix)
            encoded = _text(root, "EncodingType").lower() == "url"
            for item in root:
                kind = _local_name(item)
                if kind not in ("Version", "DeleteMarker"):
                    continue
                key = _text(item, "Key")
                out.append(
                    ObjectVersion(
                        key=unquote_plus(key) if encoded else key,
                        version_id=_text(item, "VersionId"),
                        etag=_unquote_etag(_text(item, "ETag")),
                        size=int(_text(item, "Size", "0")),
                        last_modified=_iso_date(_text(item, "LastModified")),
                        is_latest=_text(item, "IsLatest").lower() == "true",
                        delete_marker=kind == "DeleteMarker",
                    )
                )
            if _text(root, "IsTruncated").lower() != "true":
                break
            key_marker = _text(root, "NextKeyMarker")
            if encoded:
                key_marker = unquote_plus(key_marker)
            version_marker = _text(root, "NextVersionIdMarker")
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
        _check_key(key)
        if not version_id:
            raise ValueError("a version id cannot be empty")
        reply = await self._send("GetObject", "GET", key, query=[("versionId", version_id)])
        if reply.status != 200:
            raise self._fail(reply, key)
        return StoredObject(self._info(key, reply.headers, size=len(reply.body)), reply.body)

    async def delete_version(self, key: str, version_id: str) -> None:
        _check_key(key)
        if not version_id:
            raise ValueError("a version id cannot be empty")
        reply = await self._send(
            "DeleteObject", "DELETE", key, query=[("versionId", version_id)], ok=(200, 204)
        )
        if reply.status in (200, 204):
            return
        if reply.status == 404 and reply.code not in ("NoSuchBucket",):
            return  # already gone
        raise self._fail(reply, key)

    def _note_date(self, date: bytes) -> None:
        at = self._monotonic()
        self._last_date = (date, at)
        dates = self._dates
        if dates and dates[-1][0] == date:
            return  # the same second again, later: the earlier bound is the tighter
        dates.append((date, at))
        while dates[0][1] < at - _DATE_WINDOW:
            del dates[0]

    def _forget_dates(self) -> None:
        self._last_date = None
        self._dates.clear()

    async def now(self) -> datetime.datetime:
        """The bucket's clock, never ahead of it: a Date (truncated to the second, so no later
        than the bucket's time when it was sent) plus the time since it came, the latest such
        bound over the Dates of the last :data:`_DATE_WINDOW` seconds. A HeadBucket fetches a
        Date when none is younger than :data:`_DATE_FRESH`."""
        last = self._last_date
        if last is None or self._monotonic() - last[1] >= _DATE_FRESH:
            # Any non-transient answer carries the bucket's Date, even a 403 for a policy that
            # does not grant s3:ListBucket (which HeadBucket needs).
            await self._send("HeadBucket", "HEAD", None, ok=(200, 403, 404))
            last = self._last_date
        assert last is not None
        at = self._monotonic()
        best: datetime.datetime | None = None
        # The last Date always counts (a Date seen again keeps its first arrival in the window,
        # which a slow answer can push out of it).
        for raw, came in [*self._dates, last]:
            date = _http_date(raw)
            if date is None or (came < at - _DATE_WINDOW and (raw, came) != last):
                continue
            bound = date + datetime.timedelta(seconds=at - came)
            if best is None or bound > best:
                best = bound
        if best is None:
            raise StoreUnavailable("S3 sent no usable Date header")
        return best

    async def close(self) -> None:
        if self._own_pool:
            await self._pool.closeCachedConnections()


class _Timeout(Exception):
    """One attempt saw no answer (or no progress) within the timeout."""


def _timed_out(result: object, timeout: float) -> object:
    # addTimeout's hook: whatever the cancelled request failed with (CancelledError, or treq's
    # ConnectingCancelledError / ResponseNeverReceived wrapping it), it was our timeout.
    if isinstance(result, Failure):
        raise _Timeout()
    return result


def _is_cancellation(e: BaseException) -> bool:
    if isinstance(e, CancelledError | error.ConnectingCancelledError):
        return True
    if isinstance(e, _WRAPPERS):
        return any(r.check(CancelledError) for r in e.reasons)
    return False


def _describe(e: BaseException) -> str:
    if isinstance(e, _WRAPPERS) and e.reasons:
        inner = "; ".join(r.getErrorMessage() or r.type.__name__ for r in e.reasons)
        return f"{type(e).__name__}: {inner}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _write(f: IO[bytes], data: bytes) -> None:
    f.write(data)


def _open_for_upload(path: str, size: int) -> int:
    """A descriptor for positional reads of ``path``, still ``size`` bytes long. Thread only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != size:
            raise ObjectStoreError(f"{path} changed size while being uploaded")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_chunk(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset``, fewer only at the end of the file. Thread only."""
    parts: list[bytes] = []
    while size > 0:
        data = os.pread(fd, size, offset)
        if not data:
            break
        parts.append(data)
        offset += len(data)
        size -= len(data)
    return b"".join(parts)


def _mkstemp_beside(path: str) -> tuple[IO[bytes], str, str]:
    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path))
    return os.fdopen(fd, "wb"), tmp, path


def _rewind(f: IO[bytes]) -> None:
    f.seek(0)
    f.truncate()


def _commit(f: IO[bytes], tmp: str, path: str) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()
    os.replace(tmp, path)
    fsync_directory(os.path.dirname(path))


def _discard(f: IO[bytes], tmp: str) -> None:
    if not f.closed:
        f.close()
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


__all__ = ["REQUESTS", "S3Store", "quote_key"]

"""One S3 request, signed, sent and retried (:class:`Exchange`): treq over one persistent
connection pool, a per-attempt timeout (an idle one for streamed bodies), and up to ``retries``
retries with jittered exponential backoff on 5xx, throttling, timeouts and connection errors.
Each attempt is counted in ``lchat_s3_requests_total{operation,outcome}``: S3 requests are the
bill."""

from __future__ import annotations

import builtins
import secrets
from collections.abc import Callable, Container, Mapping, Sequence
from typing import IO, Any

import treq.client
from prometheus_client import Counter, Histogram
from twisted.internet import error
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.interfaces import (
    IDelayedCall,
    IReactorTCP,
    IReactorTime,
    IStreamClientEndpoint,
)
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
    ResponseFailed,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from lchat.backoff import Backoff
from lchat.objstore import StoreUnavailable
from lchat.objstore.s3.bodies import BodyReader, FileBody, FileProducer, rewind
from lchat.objstore.s3.dates import BucketDates
from lchat.objstore.s3.signing import BucketAddress, Signer, payload_hash
from lchat.objstore.s3.wire import TRANSIENT_CODES, Reply, header, header_text
from lchat.reactors import TCPReactor
from lchat.threads import RunInThread
from lchat.twisted_internals import RequestNotSent, WrongBodyLength, quiet_pool, treq_reactor
from lchat.webutil import BytesProducer

log = Logger(namespace="lchat.objstore.s3")

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

# Between retries: 0.1 s doubling to 2 s, "equal jitter" (half the step fixed, half random), so
# retries from many boxes spread out but never collapse to zero.
_BACKOFF = Backoff(0.1, 2.0, jitter=(0.5, 1.0))

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
WRAPPERS = (RequestGenerationFailed, RequestTransmissionFailed, ResponseFailed)


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """Agent's endpoints, except that an IP-literal host is dialled directly.

    HostnameEndpoint resolves even literals and only notices every address failed on its next
    0.3 s happy-eyeballs tick: a refused connection to an IP endpoint would cost 0.3 s per attempt.
    TLS is verified exactly as Agent does by default (``BrowserLikePolicyForHTTPS``).
    """

    def __init__(self, reactor: TCPReactor, timeout: float) -> None:
        self._reactor = reactor  # HostnameEndpoint's: it connects, and races its attempts in time
        self._tcp = IReactorTCP(reactor)
        self._timeout = timeout
        self._tls = BrowserLikePolicyForHTTPS()

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        host = uri.host.decode("ascii")
        endpoint: IStreamClientEndpoint
        if isIPAddress(host):
            endpoint = TCP4ClientEndpoint(self._tcp, host, uri.port, timeout=self._timeout)
        elif isIPv6Address(host.strip("[]")):
            endpoint = TCP6ClientEndpoint(
                self._tcp, host.strip("[]"), uri.port, timeout=self._timeout
            )
        else:
            endpoint = HostnameEndpoint(self._reactor, uri.host, uri.port, timeout=self._timeout)
        if uri.scheme == b"https":
            endpoint = wrapClientTLS(self._tls.creatorForNetloc(uri.host, uri.port), endpoint)
        return endpoint


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
    if isinstance(e, WRAPPERS):
        return any(r.check(CancelledError) for r in e.reasons)
    return False


def _describe(e: BaseException) -> str:
    if isinstance(e, WRAPPERS) and e.reasons:
        inner = "; ".join(r.getErrorMessage() or r.type.__name__ for r in e.reasons)
        return f"{type(e).__name__}: {inner}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Exchange:
    """Sends a bucket's requests (see the module docstring; ``timeout`` and ``retries`` as
    :class:`~lchat.objstore.s3.S3Store` takes them) and notes each answer's Date in ``dates``."""

    def __init__(
        self,
        reactor: TCPReactor,
        address: BucketAddress,
        signer: Signer,
        dates: BucketDates,
        *,
        run_in_thread: RunInThread,
        monotonic: Callable[[], float],
        timeout: float,
        retries: int,
        pool: HTTPConnectionPool | None,
        bucket: str,
    ) -> None:
        self._clock = IReactorTime(reactor)
        self.address = address
        self.signer = signer
        self.dates = dates
        self._run_in_thread = run_in_thread
        self._monotonic = monotonic
        self.timeout = timeout
        self._retries = retries
        self._bucket = bucket
        self._own_pool = pool is None
        if pool is None:
            pool = quiet_pool(self._clock, persistent=True)
            pool.maxPersistentPerHost = 8
            # AWS drops idle keep-alive connections after ~20 s; don't reuse one older than that.
            pool.cachedConnectionTimeout = 15
        self._pool = pool
        self._http = treq.client.HTTPClient(
            Agent.usingEndpointFactory(reactor, _Endpoints(reactor, timeout), pool=pool)
        )
        self._rng = secrets.SystemRandom()

    async def close(self) -> None:
        if self._own_pool:
            await self._pool.closeCachedConnections()

    async def send(
        self,
        op: str,
        method: str,
        key: str | None,
        *,
        query: Sequence[tuple[str, str]] = (),
        headers: Mapping[str, str] | None = None,
        body: bytes | FileBody | None = None,
        sink: IO[bytes] | None = None,
        ok: Container[int] = (200,),
        body_may_hold_error: bool = False,
    ) -> Reply:
        """Sign, send and retry one S3 request; return the first non-transient reply.

        A transient failure on the last attempt raises :class:`StoreUnavailable`. Other error
        statuses are returned, not raised, so callers can normalise them
        (:func:`lchat.objstore.s3.wire.error_for`).
        """
        url = self.address.url(key, query)
        body_hash = payload_hash(body)
        headers = dict(headers or {})
        ambiguous = False
        attempts = self._retries + 1
        for attempt in range(1, attempts + 1):
            signed = await self.signer.sign(method, url, headers, body_hash)
            started = self._monotonic()
            reason = ""
            sent_nothing = False
            try:
                reply = await self._attempt(method, url, signed, body, sink, ok)
            except _Timeout:
                reason = f"no answer within {self.timeout:g}s"
            except _TRANSPORT_ERRORS as e:
                reason = _describe(e)
                sent_nothing = isinstance(e, _NOT_SENT_ERRORS)
            except BaseException:
                REQUESTS.labels(op, "error").inc()  # cancelled by the caller, or a local fault
                raise
            finally:
                LATENCY.labels(op).observe(self._monotonic() - started)
            if not reason:
                # Quirk (AWS): CopyObject may fail after sending 200; the error is the body.
                if body_may_hold_error and reply.status == 200 and reply.read_error():
                    reply.status = 500 if reply.code in TRANSIENT_CODES else 400
                reply.ambiguous = ambiguous
                if not reply.transient:
                    REQUESTS.labels(op, reply.outcome(ok)).inc()
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
            delay = _BACKOFF.jittered(_BACKOFF.delay(attempt), self._rng)
            log.warn(
                "S3 {operation} of {key!r} failed (attempt {attempt}/{attempts}): {reason}; "
                "retrying in {delay:.2f}s",
                operation=op,
                key=key or "",
                bucket=self._bucket,
                attempt=attempt,
                attempts=attempts,
                reason=reason,
                delay=delay,
            )
            await deferLater(self._clock, delay)
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        method: str,
        url: str,
        headers: Headers,
        body: bytes | FileBody | None,
        sink: IO[bytes] | None,
        ok: Container[int],
    ) -> Reply:
        if sink is not None:
            await self._run_in_thread(rewind, sink)
        watchdog: _Watchdog | None = None

        def progress() -> None:
            if watchdog is not None:
                watchdog.touch()

        file_body: FileProducer | None = None
        producer: IBodyProducer | None = None
        if isinstance(body, FileBody):
            # A fresh producer per attempt: each has its own consumer, watchdog and lifetime, so
            # a late pause or stop from a dead attempt's transport cannot touch the next one.
            producer = file_body = await FileProducer.open(self._run_in_thread, body)
            file_body.progress = progress
        elif isinstance(body, bytes):
            # Written at once, by whichever reactor this store runs on: a cooperator would be the
            # global reactor's, which a CLI command's own reactor never runs (the body never went).
            producer = BytesProducer(body)
        elif method == "DELETE":
            # An explicit empty body: Twisted silently re-sends body-less DELETEs that fail on a
            # reused connection, which would hide a lost response from a conditional DELETE's
            # check (S3Store.delete). With a producer it leaves retrying to us.
            producer = BytesProducer(b"")
        readers: list[BodyReader] = []
        d = Deferred.fromCoroutine(
            self._exchange(method, url, headers, producer, sink, ok, readers, progress)
        )
        if sink is not None or file_body is not None:  # streaming: an idle timeout
            watchdog = _Watchdog(self._clock, self.timeout, d)
        else:
            d.addTimeout(self.timeout, self._clock, onTimeoutCancel=_timed_out)
        try:
            return await d
        except BaseException as e:
            # The store just failed us: a remembered Date must not make now() look healthy.
            self.dates.forget()
            if isinstance(e, _Timeout):
                raise
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
        producer: IBodyProducer | None,
        sink: IO[bytes] | None,
        ok: Container[int],
        readers: list[BodyReader],
        progress: Callable[[], None],
    ) -> Reply:
        response: IResponse = await self._http.request(
            method,
            url,
            headers=headers,
            data=producer,
            allow_redirects=False,
            unbuffered=True,
            reactor=treq_reactor(self._clock),
        )
        progress()
        status = response.code
        date = header(response.headers, "date")
        if date:
            self.dates.note(date)
        request_id = header_text(response.headers, "x-amz-request-id") or header_text(
            response.headers, "x-amzn-requestid"
        )
        to_file = sink is not None and status in ok
        reader = BodyReader(self._run_in_thread, sink if to_file else None, progress)
        readers.append(reader)
        response.deliverBody(reader)  # HEAD: ends at once, and the connection can be reused
        data = await reader.done
        reply = Reply(
            status=status,
            headers=response.headers,
            body=b"" if to_file else data,
            request_id=request_id,
            streamed=reader.received if to_file else 0,
        )
        if status not in ok and status >= 300:
            reply.read_error()
        return reply

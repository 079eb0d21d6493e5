"""The downstream side: one client connection, parsed with httptools, streamed to its target.

Requests on a connection are served one at a time, in order (pipelined ones wait, paused). For each:
validate the head (no ambiguity ever reaches a space), ask the router for a target, dial (with the
pool's retry window), write the head, stream the body with backpressure both ways, relay the response,
and on ``101`` splice raw bytes until either side closes. Every failure ends in a clear status or a
closed connection, never a stuck handler or a leaked upstream connection.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, cast

import httptools
from attrs import frozen
from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import hosts
from lchat.config import ProxyConfig
from lchat.proxy import oneread
from lchat.proxy.bulk import BUFFERS, MIN_BULK, BulkReader
from lchat.proxy.http import (
    FORWARDING,
    HOP_BY_HOP,
    INTERNAL,
    LAST_CHUNK,
    REFUSED,
    Header,
    Valve,
    chunk,
    connection_tokens,
    end_to_end,
    head_bytes,
    simple_response,
    status_line,
)
from lchat.proxy.upstream import PEER_UNREACHABLE, DialFailed, UpstreamConnection, UpstreamPool
from lchat.router import LocalResponse, LocalSocket, RemotePeer, RequestHead, Routes, Target, plain

_log = Logger(namespace="lchat.proxy")

_SAFE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS"})  # RFC 9110 §9.2.1: no side effects
# Request headers never passed on as they came (we frame each hop and set these ourselves).
_NOT_PASSED = HOP_BY_HOP | {b"content-length"}
_NO_TOKENS: frozenset[bytes] = frozenset()
# The most request body kept after it went upstream (until the response starts), so that a request
# an upstream never processed can be sent again from its first byte: one a mesh peer refused
# because it is stopping, or one a kept-alive connection closed unanswered. Bigger bodies are
# never sent twice (the peer's 503, or a 502, is the answer then).
REPLAY_LIMIT = 64 * 1024
# After refusing a request whose client may still be sending, how long what it sends is read and
# dropped before the connection closes (Downstream._closing).
LINGER = 2.0
# Unsent output on a client connection beyond which nothing more is made for it (pause_writing);
# it resumes at a quarter of it (asyncio's default low-water mark).
HIGH_WATER = 64 * 1024


class _HotStats:
    """The figures every request changes, kept as plain numbers and read at scrape time: a
    Prometheus counter takes a lock per change, a few of which per request would cost more than
    the rest of a small request's path (docs/performance.md)."""

    __slots__ = ("bytes_down", "bytes_up", "connections", "in_flight", "requests", "upgraded")

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self.upgraded = 0

    def count(self, host_class: str, status: int) -> None:
        key = (host_class, status)
        self.requests[key] = self.requests.get(key, 0) + 1


class _HotCollector(Collector):
    def __init__(self, stats: _HotStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stats
        requests = CounterMetricFamily(
            "lchat_http_requests",
            "Requests answered, by host class and status",
            labels=["host_class", "code"],
        )
        for (host_class, status), count in sorted(stats.requests.items()):
            requests.add_metric([host_class, str(status)], count)
        yield requests
        yield GaugeMetricFamily(
            "lchat_http_in_flight", "Requests being served right now", value=stats.in_flight
        )
        relayed = CounterMetricFamily(
            "lchat_proxy_bytes", "Body bytes relayed", labels=["direction"]
        )
        relayed.add_metric(["up"], stats.bytes_up)
        relayed.add_metric(["down"], stats.bytes_down)
        yield relayed
        yield GaugeMetricFamily(
            "lchat_upgraded_connections",
            "Open upgraded (WebSocket) connections",
            value=stats.upgraded,
        )
        yield GaugeMetricFamily(
            "lchat_http_connections", "Open client connections", value=stats.connections
        )


STATS = _HotStats()
REGISTRY.register(_HotCollector(STATS))

_rejected = Counter("lchat_http_rejected_total", "Requests refused before routing", ["reason"])
_output_paused = Gauge(
    "lchat_http_output_paused_connections",
    "Client connections neither read nor answered because their unsent output is over the"
    " high-water mark (a client that reads slowly, or not at all)",
)
_output_pauses = Counter(
    "lchat_http_output_pauses_total",
    "Times a client connection was paused because its unsent output passed the high-water mark",
)
_send_timeouts = Counter(
    "lchat_http_send_timeouts_total",
    "Client connections aborted because their unsent output did not move for LCHAT_SEND_TIMEOUT",
)
_tunnel_idle_closes = Counter(
    "lchat_http_tunnel_idle_closes_total",
    "Upgraded tunnels closed after LCHAT_TUNNEL_IDLE_TIMEOUT without a byte either way",
)
_pipeline_limited = Counter(
    "lchat_http_pipeline_limit_total",
    "Client connections closed after the most pipelined requests one may queue",
)
_reroutes = Counter(
    "lchat_proxy_reroutes_total",
    "Requests routed again without a mesh peer that could not take them, by why",
    # unreachable, closed (a safe request closed unanswered), stopping (refused by a drain)
    ["why"],
)


@frozen
class _Reject(Exception):
    """Raised inside a parser callback: answer ``status`` and close."""

    status: int
    reason: str


class _StopReading(Exception):
    """Raised from a parser callback when nothing more on this connection may be parsed: after a
    request that closes it (RFC 9112 §9.6; llhttp would fail on what follows, turning the answer into
    a 400), or when we are already closing."""


class Exchange:
    """One request and its response.

    A plain class: one is made per request, and with the immutable defaults on the class only the
    mutable fields are set per instance (a third of what an attrs ``__init__`` of all 30 costs).
    """

    url: bytearray
    headers: list[Header]
    header_bytes = 0
    version = "1.1"
    head: RequestHead | None = None
    target: Target | None = None
    keep_alive = True  # what the client asked for
    length: int | None = None
    body_size = 0  # request body bytes received so far
    chunked = False
    upgrade = False
    body: list[bytes]  # buffered until the upstream is ready
    body_complete = False
    streaming = False  # body goes straight upstream
    upgrade_tail = b""  # bytes after an upgrade request's head
    upstream_lines = b""  # the client's headers that go upstream, as "name: value" lines
    forwarded_for: list[bytes]  # the client's own X-Forwarded-For values
    upstream: UpstreamConnection | None = None
    response_started = False
    response_chunked = False
    response_complete = False
    close_after = False
    status = 0
    bytes_out = 0
    observed = False
    retried = False
    rerouted = False  # sent elsewhere once already (a mesh peer failed it)
    # The body already written upstream, kept until the response starts so that the request can
    # be sent again (REPLAY_LIMIT); None once it outgrew the limit, or the response started.
    replay: list[bytes] | None
    replay_size = 0
    # A draining peer that refused the request before its body was all here: sent elsewhere
    # once it is (on_message_complete).
    refused_by: RemotePeer | None = None

    def __init__(self, started: float, method: bytes = b"") -> None:
        self.started = started
        self.method = method
        self.url = bytearray()
        self.headers = []
        self.body = []
        self.forwarded_for = []
        self.replay = []

    def sent(self, data: bytes) -> None:
        """``data`` of the body went upstream: keep it while the request may be sent again."""
        if self.replay is None:
            return
        self.replay_size += len(data)
        if self.replay_size > REPLAY_LIMIT:
            self.replay = None
        else:
            self.replay.append(data)

    def at_hand(self) -> bool:
        """The whole request can be sent again from its first byte: all of its body arrived,
        and what already went upstream was kept."""
        return self.body_complete and self.replay is not None

    def rewind(self) -> None:
        """Put what went upstream back in front of ``body``, to be sent again from its first
        byte (only while it is kept; what is still to arrive is buffered behind it)."""
        assert self.replay is not None
        self.body[:0] = self.replay
        self.replay, self.replay_size = [], 0
        self.streaming = False


class Downstream(asyncio.Protocol):
    """One client connection (an asyncio Protocol on the reactor's uvloop loop).

    Its transport pauses it (``pause_writing``) when more than the high-water mark (64 KiB) is
    unsent, and resumes it (``resume_writing``) once the output drained to the low-water mark.
    While paused nothing more is made for the client: it is not read, no queued request is
    served, and the upstream of the response (or tunnel) is not read either. The factory's sweep
    aborts a connection whose unsent output has not moved for ``send_timeout``, paused or closing.

    What one upstream read makes for the client (a response head and its body, often the whole
    response) goes out in one write: between ``begin_batch`` and ``flush`` writes are gathered.
    """

    def __init__(self, factory: ProxyFactory) -> None:
        self.proxy = factory
        self.cfg = factory.cfg
        self.transport: asyncio.Transport | None = None
        self.valve: Valve | None = None
        self._batch: list[bytes] | None = None  # writes gathered during an upstream read
        self._tunnel_moved = 0.0  # an upgraded tunnel's last byte, either way
        self._parser: httptools.HttpRequestParser | None = None
        self._parsing: Exchange | None = None  # the request the parser is inside
        self._active: Exchange | None = None  # the request being served
        self._waiting: deque[Exchange] = deque()  # pipelined requests not yet served
        # Deadlines, checked by the factory's sweep: cheaper than a callLater per request.
        self._deadline: float | None = None
        self._timer_action: Callable[[Downstream], None] | None = None
        self._body_deadline: float | None = None
        self._completed: Exchange | None = None  # the last request whose message ended
        self._progress = False  # a parser callback ran during the current read
        self._unreported = 0  # bytes read since the parser last reported anything
        self._spliced = False
        self._closed = False  # closing (or closed): nothing more is read or answered
        self._served = 0  # requests answered on this connection
        self._client = ""
        self._client_bytes = b""
        self._last_whole: oneread.WholeRequest | None = None  # (oneread.request's previous)
        self._last_head: RequestHead | None = None  # its head, once made (_serve_whole)
        self._last_request: bytes | None = None  # and the request written upstream for it
        self._body_left = 0  # bytes of a Content-Length body still to come, past the parser
        self._output_paused = False  # the transport paused us: its unsent output is over the mark
        self._serving_queue = False  # _serve_waiting's loop is on the stack
        # The send timeout: when the unsent output last moved, and how much there was then.
        self._send_moved_at = 0.0
        self._send_buffered: int | None = None
        self._lost = False
        self._linger_until: float | None = None  # reading and dropping after a refusal
        self._bulk: BulkReader | None = None  # the transport's protocol while a body streams
        self.bulk_written = 0  # bytes written to the client from BUFFERS (lchat.proxy.bulk)

    # -- connection -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TLS transport has a Transport's methods without being a subclass.)
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        # The high-water mark, set explicitly: uvloop's TLS transport defaults to 512 KiB.
        transport.set_write_buffer_limits(high=HIGH_WATER)
        STATS.connections += 1
        self.proxy.add_connection(self)
        self.valve = Valve(transport)
        self._parser = httptools.HttpRequestParser(self)
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "unix"
        self._client_bytes = self._client.encode("latin-1")
        # A fresh connection must send a request head promptly: the slowloris guard.
        self._arm(self.cfg.header_timeout, Downstream._header_timed_out)

    @property
    def closed(self) -> bool:
        """The connection is gone (connection_lost ran)."""
        return self._lost

    def eof_received(self) -> bool:
        # A client that shuts its sending side down has gone, as far as HTTP/1.1 is concerned
        # (nginx: "client prematurely closed connection"): what it asked is cancelled.
        if self.transport is not None:
            self.transport.abort()
        return False  # (closing already; True would be a warning under TLS)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._batch = None
        STATS.connections -= 1
        self.proxy.remove_connection(self)
        self._closed = True
        self._disarm()
        self._disarm_body_timer()
        for ex in [self._active, *self._waiting]:
            if ex is None:
                continue
            if ex.upstream is not None:
                ex.upstream.abort()
                ex.upstream = None
            self._end_observed(ex)
            if ex is self._active and not ex.response_complete:
                STATS.in_flight -= 1
        if self._spliced:
            STATS.upgraded -= 1
        if self._output_paused:
            self._output_paused = False
            _output_paused.dec()
        self._active = None
        self._waiting.clear()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._spliced:
            ex = self._active
            if ex is not None and ex.upstream is not None:
                STATS.bytes_up += len(data)
                self._tunnel_moved = self.proxy.reactor.seconds()
                ex.upstream.write(data)
            return
        if self._parser is None:
            return  # parsing stopped after a bad pipelined request; closing after the current one
        if self._body_left:
            self._body_read(data)
            return
        if (
            self._parsing is None
            and self._active is None
            and not self._waiting
            and not self._output_paused
            and data.endswith(b"\r\n\r\n")
            and self._serve_whole(data)
        ):
            return  # (the common request: a head without a body, all in this read)
        self._progress = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            offset = int(e.args[0]) if e.args else len(data)
            ex = self._completed  # the upgrade request, whether served now or pipelined
            if ex is not None:
                ex.upgrade_tail = data[offset:]
                self._upgrade_ready(ex)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _StopReading):
                self._parser = None  # the connection closes after the current response
            elif isinstance(cause, _Reject):
                self._reject(cause.status, cause.reason)
            else:
                _log.failure("proxy request handler failed", Failure(cause or e))
                self._reject(500, "internal error")
        except httptools.HttpParserError as e:
            self._reject(400, str(e))
        else:
            parsing = self._parsing
            if parsing is None:
                self._unreported = 0  # (the common case, without a call)
                return
            if (
                parsing.head is None
                and self._active is None
                and self._timer_action is not Downstream._header_timed_out
            ):
                # From idle keep-alive (or a fresh connection) to a head begun and not complete:
                # it must be within header_timeout; a running head deadline is not extended.
                self._arm(self.cfg.header_timeout, Downstream._header_timed_out)
            if self._progress:
                self._unreported = 0
            else:
                self._bound_unreported(len(data))
            if (
                parsing.head is not None
                and parsing.length
                and not parsing.chunked
                and self._parser is not None
                and not self._closed
            ):
                # A Content-Length body under way: its bytes need no parsing (_body_read).
                self._body_left = parsing.length - parsing.body_size

    def _body_read(self, data: bytes) -> None:
        """A read while a ``Content-Length`` body is under way: its bytes go to ``on_body`` as
        they came, past the parser (it would copy each read into a new object, and call back per
        read all the same); at the body's end, what the parser would have done at the message's
        end, with a fresh parser for what follows (the old one still counts the body)."""
        left = self._body_left
        if len(data) <= left:
            body, rest = data, b""
        else:
            body, rest = data[:left], data[left:]
        self._body_left = left - len(body)
        try:
            self.on_body(body)
            if not self._body_left:
                self._parser = httptools.HttpRequestParser(self)
                self.on_message_complete()
        except _StopReading:
            self._parser = None  # the connection closes after the current response
            return
        except _Reject as e:
            self._reject(e.status, e.reason)
            return
        except Exception:
            _log.failure("proxy request handler failed")
            self._reject(500, "internal error")
            return
        if rest:
            self.data_received(rest)
        elif self._body_left >= MIN_BULK and self._bulk is None:
            ex = self._parsing
            if (
                ex is not None
                and ex.streaming
                and ex.upstream is not None
                and ex.replay is None
                and not self._closed
                and self.transport is not None
            ):
                # The middle of a big body: read it into our own buffers (lchat.proxy.bulk).
                self._bulk = BulkReader(self)
                self.transport.set_protocol(self._bulk)

    def bulk_received(self, nbytes: int) -> None:
        """A read into ``BUFFERS.view`` while a big request body streams (BulkReader): the middle
        of the body goes upstream as a slice of the buffer, as ``_body_read`` would have sent it;
        anything else goes the general way, as ``bytes``, with this object the protocol again."""
        view = BUFFERS.view
        ex = self._parsing
        if nbytes < self._body_left and ex is not None and not self._closed:
            upstream = ex.upstream
            size = ex.body_size + nbytes
            max_body = self.cfg.max_body
            if (
                ex.streaming
                and upstream is not None
                and ex.replay is None
                and (not max_body or size <= max_body)
            ):
                transport = upstream.transport
                if transport is not None:
                    self._body_left -= nbytes
                    ex.body_size = size
                    STATS.bytes_up += nbytes
                    self._body_deadline = self.proxy.reactor.seconds() + self.cfg.keepalive_timeout
                    transport.write(view[:nbytes])
                    upstream.bulk_written += nbytes
                    if transport.get_write_buffer_size():
                        BUFFERS.lend(transport, upstream)  # uvloop kept a view of the unsent rest
                    return
        self._bulk = None
        if self.transport is not None:
            self.transport.set_protocol(self)
        self.data_received(bytes(view[:nbytes]))

    def _serve_whole(self, data: bytes) -> bool:
        """Serve ``data`` if it is one whole request without a body (:mod:`oneread`), as the
        parser's callbacks would have, and return True; else False, having done nothing."""
        cfg = self.cfg
        whole = oneread.request(data, cfg.max_header_bytes, cfg.max_headers, self._last_whole)
        if whole is None:
            return False
        proxy = self.proxy
        head = self._last_head
        if whole is not self._last_whole or head is None:
            self._last_whole = whole
            self._last_head = self._last_request = None
            host = proxy.host_names.get(whole.host)
            if host is None:
                try:
                    host = proxy.parse_host(whole.host)
                except _Reject:
                    return False  # the general path refuses it, as it would any malformed Host
            head = RequestHead(whole.method, whole.target, host, self._client, proxy.secure)
            self._last_head = head
        # (else the same request as the last one served here: its head, an immutable value, again)
        now = proxy.reactor.seconds()
        ex = Exchange(now, whole.method)
        ex.upstream_lines = whole.lines
        ex.body_complete = True
        ex.head = head
        self._completed = ex
        self._unreported = 0
        self._deadline = self._timer_action = None  # (_disarm, inline)
        # _serve, _routed and _connected, inline for a space on this box with a pooled
        # connection to it (the common case; anything else continues the general way).
        self._active = ex
        STATS.in_flight += 1
        try:
            target = proxy.router.route(head)
        except Exception:
            self._route_failed(Failure(), ex)
            return True
        if type(target) is LocalSocket and target.inflight is None:
            upstream = proxy.pool.take_idle(target)
            if upstream is not None:
                ex.target = target
                ex.upstream = upstream
                upstream.begin(self, whole.method)
                upstream.request_sent = True
                upstream_transport = upstream.transport
                assert upstream_transport is not None
                request = self._last_request
                if request is None:
                    request = self._last_request = (
                        b"%s %s HTTP/1.1\r\n%sX-Forwarded-For: %s\r\nX-Forwarded-Proto: %s\r\n\r\n"
                        % (
                            whole.method,
                            whole.target,
                            whole.lines,
                            self._client_bytes,
                            proxy.scheme,
                        )
                    )
                upstream_transport.write(request)
                self._deadline = now + self.cfg.upstream_timeout
                self._timer_action = Downstream._upstream_timed_out
                if self.valve is not None and self.valve.reasons:
                    self.valve.open("routing")
                return True
        self._dispatch(target, ex)
        return True

    def _bound_unreported(self, size: int) -> None:
        """httptools reports a header (or trailer) line only once it ends, holding the partial line
        until then; url and body bytes are reported read by read. So reads that make the parser
        report nothing are such a line (or chunk framing): bound them like a head (max_header_bytes,
        give or take the read in which the line began)."""
        if self._progress or self._parsing is None:
            self._unreported = 0
            return
        self._unreported += size
        if self._unreported > self.cfg.max_header_bytes and not self._closed:
            self._reject(431, "request header or trailer line too large")

    # -- parser callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._progress = True
        if self._closed:
            raise _StopReading()  # we already answered with "Connection: close" in this read
        self._parsing = Exchange(self.proxy.reactor.seconds())
        # (The head's deadline is armed at the end of the read, if the head is not complete by
        # then: most heads arrive whole, and need none.)

    def on_url(self, url: bytes) -> None:
        self._progress = True
        ex = self._parsing
        assert ex is not None
        ex.url += url
        ex.header_bytes += len(url)
        if ex.header_bytes > self.cfg.max_header_bytes:
            raise _Reject(414, "request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._progress = True
        ex = self._parsing
        if ex is None or ex.head is not None:
            return  # trailers of a chunked body: dropped
        ex.headers.append((name, value))
        ex.header_bytes += len(name) + len(value) + 4
        if ex.header_bytes > self.cfg.max_header_bytes:
            raise _Reject(431, "request headers too large")
        if len(ex.headers) > self.cfg.max_headers:
            raise _Reject(431, "too many request headers")

    def on_headers_complete(self) -> None:
        self._progress = True
        ex = self._parsing
        assert ex is not None and self._parser is not None
        ex.method = self._parser.get_method()
        ex.version = self._parser.get_http_version()
        ex.keep_alive = bool(self._parser.should_keep_alive())
        ex.head = self._validate(ex)
        if ex.chunked or (ex.length or 0) > 0:
            self._arm_body_timer()
        if self._active is None and not self._waiting and not self._output_paused:
            self._disarm()
            self._serve(ex)
        else:
            # Pipelined behind the request being served, or behind output the client has not
            # read yet (the rest of this read is parsed all the same): hold the line.
            if self._active is None:
                self._disarm()  # nothing is being served: the send timeout governs now
            self._waiting.append(ex)
            assert self.valve is not None
            self.valve.close("pipelined")
            if len(self._waiting) >= self.cfg.max_pipelined:
                # The last one we take: it is answered with "Connection: close" and nothing
                # after it is read (RFC 9112 §9.3.2: a pipelining client retries the rest).
                ex.keep_alive = False
                _pipeline_limited.inc()
                _log.info(
                    "client {client} pipelined {count} requests: closing after them",
                    client=self._client,
                    count=len(self._waiting) + (self._active is not None),
                )

    def on_body(self, data: bytes) -> None:
        self._progress = True
        ex = self._parsing
        if ex is None:
            return
        self._arm_body_timer()
        ex.body_size += len(data)
        if self.cfg.max_body and ex.body_size > self.cfg.max_body:
            raise _Reject(413, f"request body over {self.cfg.max_body} bytes (LCHAT_MAX_BODY)")
        STATS.bytes_up += len(data)
        if ex.streaming and ex.upstream is not None:
            ex.upstream.write(chunk(data) if ex.chunked else data)
            ex.sent(data)
        elif not ex.response_complete:
            ex.body.append(data)

    def on_message_complete(self) -> None:
        self._progress = True
        ex = self._parsing
        self._parsing = None
        self._completed = ex
        self._disarm_body_timer()
        if ex is None:
            return
        ex.body_complete = True
        if ex.upgrade:
            return  # the upgrade exception follows; _upgrade_ready takes it from there
        if ex.streaming and ex.upstream is not None:
            if ex.chunked:
                ex.upstream.write(LAST_CHUNK)
            ex.upstream.backpressure = None
            assert self.valve is not None
            self.valve.open(Valve.PEER_FULL)  # the space's side being full no longer matters
            self._request_sent(ex, ex.upstream)
        elif ex.refused_by is not None and ex is self._active:
            # A draining peer refused it before its body was all here: now it is.
            self._reroute(ex, ex.refused_by, "stopping", "refused it unprocessed (stopping)")
        if ex is self._active and ex.response_complete:
            self._finish(ex)
        elif self._active is None and not self._waiting and not self._closed:
            # Answered before its (empty) message ended, e.g. locally: now it is idle keep-alive.
            self._arm(self.cfg.keepalive_timeout, Downstream._idle_timed_out)
        if not ex.keep_alive:
            raise _StopReading()

    # -- validation -----------------------------------------------------------------------------

    def _validate(self, ex: Exchange) -> RequestHead:
        """Refuse anything two parsers could read differently: no ambiguity reaches a space."""
        if ex.version not in ("1.0", "1.1"):
            # llhttp reads "GET /" (no version) as HTTP/0.9 and accepts "HTTP/2.0": not HTTP/1.x.
            raise _Reject(400 if ex.version == "0.9" else 505, "unsupported HTTP version")
        if ex.method == b"CONNECT":
            raise _Reject(405, "CONNECT is not supported")
        url = bytes(ex.url)
        if not url.startswith(b"/") and not (url == b"*" and ex.method == b"OPTIONS"):
            raise _Reject(400, "request target must be origin-form")
        host_values: list[bytes] = []
        lengths: set[bytes] = set()
        internal: dict[bytes, bytes] = {}
        kept: list[Header] = []
        # What goes upstream as it came, one "name: value" line each (end_to_end, in one pass
        # with the checks: this is every request's path): no hop-by-hop or framing header, no
        # Proxy-*, none we set ourselves. Connection's own tokens are applied below.
        lines: list[bytes] = []
        connection = False
        for name, value in ex.headers:
            lower = name.lower()
            if lower == b"host":
                host_values.append(value)
            elif lower == b"content-length":
                lengths.add(value.strip())
            elif lower == b"transfer-encoding":
                if value.strip().lower() != b"chunked":
                    raise _Reject(501, "only chunked transfer coding is supported")
                ex.chunked = True
            elif lower == b"expect":
                if value.strip().lower() != b"100-continue":
                    raise _Reject(417, "unsupported expectation")
            elif lower == b"connection":
                connection = True
            elif lower == b"x-forwarded-for":
                ex.forwarded_for.append(value)
            if lower in INTERNAL:
                internal[lower] = value
            elif b"_" not in name:
                # A name with an underscore is dropped, as nginx does (underscores_in_headers
                # off): a CGI/WSGI-style server would fold it onto the dashed name.
                kept.append((name, value))
                if not (lower in _NOT_PASSED or lower in FORWARDING or lower.startswith(b"proxy-")):
                    lines.append(b"%s: %s\r\n" % (name, value))
        if ex.chunked and ex.version == "1.0":
            # HTTP/1.0 has no chunked coding: a server reading it as 1.0 would take the chunks
            # for the body's bytes (RFC 9112 §6.1; nginx answers 400 too).
            raise _Reject(400, "Transfer-Encoding in an HTTP/1.0 request")
        if len(host_values) != 1:
            raise _Reject(400, "exactly one Host header is required")
        host = self.proxy.parse_host(host_values[0])
        if lengths:
            if len(lengths) > 1 or ex.chunked:
                raise _Reject(400, "conflicting message framing")
            (text,) = lengths
            if not text.isdigit() or len(text) > 18:
                raise _Reject(400, "malformed Content-Length")
            ex.length = int(text)
            if self.cfg.max_body and ex.length > self.cfg.max_body:
                raise _Reject(413, f"request body over {self.cfg.max_body} bytes (LCHAT_MAX_BODY)")
        tokens = connection_tokens(ex.headers) if connection else _NO_TOKENS
        if tokens and not tokens <= HOP_BY_HOP:
            # Connection names headers of its own to drop (rare): filter the slow way.
            lines = [b"%s: %s\r\n" % h for h in end_to_end(kept, drop=FORWARDING)]
        ex.upstream_lines = b"".join(lines)
        if b"host" in tokens:
            raise _Reject(400, "Connection may not name Host")  # it would strip Host upstream
        ex.upgrade = b"upgrade" in tokens and any(n.lower() == b"upgrade" for n, _ in ex.headers)
        if ex.upgrade and (ex.chunked or ex.length):
            # llhttp takes every byte after an upgrade request's head as the new protocol: the
            # body its head announces would never follow it upstream.
            raise _Reject(400, "an upgrade request cannot carry a body")
        return RequestHead(
            method=ex.method,
            target=url,
            host=host,
            client=self._client,
            secure=self.proxy.secure,
            sidecar=b"x-lchat-sidecar" in internal,
            forwarded=internal.get(b"x-lchat-mesh-forwarded"),
            upgrade=ex.upgrade,
        )

    # -- serving --------------------------------------------------------------------------------

    def _serve(self, ex: Exchange) -> None:
        assert self.valve is not None and ex.head is not None
        self._active = ex
        STATS.in_flight += 1
        # Straight calls when the answer is at hand (the hot path); Deferreds only when it is not.
        try:
            target = self.proxy.router.route(ex.head)
        except Exception:
            self._route_failed(Failure(), ex)
        else:
            self._dispatch(target, ex)

    def _dispatch(self, target: Target | Deferred[Target], ex: Exchange) -> None:
        """Go on with ``ex`` once the router answered (at once, or with a Deferred)."""
        kind = type(target)  # (isinstance on a Deferred is an ABC's check: slower)
        if kind is LocalSocket or kind is RemotePeer or kind is LocalResponse:
            self._routed(cast(Target, target), ex)
        else:
            cast(Deferred[Target], target).addCallbacks(
                self._routed, self._route_failed, callbackArgs=(ex,), errbackArgs=(ex,)
            )
        if ex.upstream is None and not ex.response_started and not self._closed:
            # Routing or dialing goes on asynchronously: stop reading until it is done. (The
            # common case, a pooled connection to a known host, completes above without it.)
            assert self.valve is not None
            self.valve.close("routing")

    def _route_failed(self, failure: Failure, ex: Exchange) -> None:
        _log.failure("routing {host} failed", failure, host=ex.head.host if ex.head else "?")
        self._routed(plain(500, "500 Internal Server Error", label="error"), ex)

    def _routed(self, target: Target, ex: Exchange) -> None:
        if self._closed or ex is not self._active:
            return
        ex.target = target
        if isinstance(target, LocalResponse):
            self._answer_locally(ex, target)
            return
        if type(target) is LocalSocket and target.inflight is not None:
            self._observe(ex)
        pooled = self.proxy.pool.take_idle(target)
        if pooled is not None:
            self._connected(pooled, ex)
            return
        d = self.proxy.pool.dial(target)
        d.addCallbacks(self._connected, self._dial_failed, callbackArgs=(ex,), errbackArgs=(ex,))

    def _dial_failed(self, failure: Failure, ex: Exchange) -> None:
        if self._closed or ex is not self._active:
            return
        why = failure.value.why if isinstance(failure.value, DialFailed) else str(failure.value)
        target = ex.target
        if isinstance(target, RemotePeer) and target.fallback is not None:
            # A mesh peer that does not answer (stopping, or gone before its heartbeat aged
            # out): route again without it. Nothing was sent, so this is safe.
            refused = isinstance(failure.value, DialFailed) and failure.value.refused
            self._reroute(
                ex, target, "refused" if refused else "unreachable", f"unreachable ({why})"
            )
            return
        _log.warn(
            "upstream for {host} unreachable: {why}", host=ex.head.host if ex.head else "?", why=why
        )
        self._answer_locally(
            ex, plain(502, "502 Bad Gateway: the space is not answering", label="unreachable")
        )

    def _reroute(self, ex: Exchange, target: RemotePeer, why: str, detail: str) -> None:
        """Route ``ex`` again without the peer ``target`` (the mesh leaves it out a while).
        ``why`` (unreachable, closed, stopping) is what the fallback is told."""
        assert target.fallback is not None
        _reroutes.labels(why).inc()
        # A drain's refusals are expected (a few per peer connection): not a warning.
        emit = _log.info if why == "stopping" else _log.warn
        emit(
            "peer {peer} {why} for {host}: routing without it",
            peer=f"{target.address}:{target.port}",
            host=target.host,
            why=detail,
        )
        self._disarm()  # an upstream deadline armed for the peer is not this routing's
        self._end_observed(ex)
        try:
            again = target.fallback(why)
        except Exception:
            self._route_failed(Failure(), ex)
            return
        if isinstance(again, Deferred):
            again.addCallbacks(
                self._routed, self._route_failed, callbackArgs=(ex,), errbackArgs=(ex,)
            )
        else:
            self._routed(again, ex)

    def _connected(self, upstream: UpstreamConnection, ex: Exchange) -> None:
        if self._closed or ex is not self._active:
            upstream.abort()
            return
        assert ex.head is not None and ex.target is not None and self.valve is not None
        ex.upstream = upstream
        upstream.begin(self, ex.method)
        upstream.write(self._request_head(ex))
        if ex.body:
            for piece in ex.body:
                upstream.write(chunk(piece) if ex.chunked else piece)
                ex.sent(piece)
            ex.body.clear()
        if not ex.upgrade and (ex.body_complete or (not ex.chunked and not ex.length)):
            # All of it is here and now upstream (a request without a body is whole at its head:
            # its message ends in this very parse, with nothing to stream). _request_sent, inline:
            # this is every small request's path.
            if ex.chunked:
                upstream.write(LAST_CHUNK)
            upstream.request_sent = True
            if not ex.response_started:
                self._deadline = self.proxy.reactor.seconds() + self.cfg.upstream_timeout
                self._timer_action = Downstream._upstream_timed_out
        elif not ex.upgrade:
            # The client's body now flows straight through; a full upstream pauses the client.
            ex.streaming = True
            upstream.backpressure = self
            if upstream.write_paused:
                self.valve.close(Valve.PEER_FULL)
        else:
            self._request_sent(ex, upstream)
        if self.valve.reasons:
            self.valve.open("routing")

    def _request_sent(self, ex: Exchange, upstream: UpstreamConnection) -> None:
        """The whole request is upstream: now the space has ``upstream_timeout`` to answer."""
        upstream.request_sent = not ex.upgrade
        if not ex.response_started:
            self._arm(self.cfg.upstream_timeout, Downstream._upstream_timed_out)

    def _request_head(self, ex: Exchange) -> bytes:
        assert ex.head is not None and ex.target is not None
        if (
            not ex.forwarded_for
            and ex.length is None
            and not ex.chunked
            and not ex.upgrade
            and type(ex.target) is LocalSocket
        ):
            # The common head: no body, no client-sent X-Forwarded-For, to this box's space.
            return b"%s %s HTTP/1.1\r\n%sX-Forwarded-For: %s\r\nX-Forwarded-Proto: %s\r\n\r\n" % (
                ex.method,
                ex.head.target,
                ex.upstream_lines,
                self._client_bytes,
                self.proxy.scheme,
            )
        client = self._client_bytes
        prior = ex.forwarded_for
        forwarded_for = b", ".join([*prior, client]) if prior else client
        headers: list[Header] = [
            (b"X-Forwarded-For", forwarded_for),
            (b"X-Forwarded-Proto", self.proxy.scheme),
        ]
        if isinstance(ex.target, RemotePeer):
            headers.extend(ex.target.add_headers)
        if ex.chunked:
            headers.append((b"Transfer-Encoding", b"chunked"))
        elif ex.length is not None and (ex.length > 0 or ex.method in (b"POST", b"PUT", b"PATCH")):
            headers.append((b"Content-Length", str(ex.length).encode()))
        if ex.upgrade:
            upgrade = [v for n, v in ex.headers if n.lower() == b"upgrade"]
            headers += [(b"Connection", b"Upgrade"), (b"Upgrade", upgrade[0])]
        parts = [b"%s %s HTTP/1.1\r\n" % (ex.method, ex.head.target), ex.upstream_lines]
        for name, value in headers:
            parts += [name, b": ", value, b"\r\n"]
        parts.append(b"\r\n")
        return b"".join(parts)

    def _upgrade_ready(self, ex: Exchange) -> None:
        """The upgrade request's head is parsed; the bytes after it wait for the 101."""
        # Nothing more is read until the upstream decides: either 101 (splice) or a normal answer.
        assert self.valve is not None
        self.valve.close("upgrade")

    # -- the response (UpstreamConnection's handler interface) -----------------------------------

    def informational(self, status: int, reason: bytes, headers: list[Header]) -> None:
        ex = self._active
        if ex is None or ex.version != "1.1":
            return  # HTTP/1.0 clients do not understand 1xx
        assert self.transport is not None
        # Stripped of the router's internal markers as a final head is (_response_head): a 100
        # or 103 is the space's word too. (The one-read paths never take a 1xx: oneread.response
        # and its C twin accept 2xx-5xx only, so every 1xx head comes through here.)
        self._send(head_bytes(status_line(status, reason), end_to_end(headers, drop=INTERNAL)))

    def response_head(
        self,
        status: int,
        reason: bytes,
        headers: list[Header],
        length: int | None,
        chunked: bool,
        raw_head: bytes | None = None,
    ) -> None:
        ex = self._active
        if ex is None or self.transport is None:
            return
        if status == 503 and self._refused_unprocessed(ex, headers):
            return
        ex.replay = None  # answered: never sent again
        self._disarm()
        ex.status = status
        ex.response_started = True
        # A body the client has not finished sending cannot be skipped in step: close afterwards.
        ex.close_after = (
            ex.close_after  # a bad request pipelined behind this one: nothing more is read
            or not ex.keep_alive
            or not self._body_done(ex)
            or ex.upgrade
            or self.proxy.draining
        )
        target = ex.target
        extra = target.response_headers if isinstance(target, LocalSocket) else ()
        if raw_head is not None and not ex.close_after and ex.version == "1.1" and not extra:
            # Nothing in it to drop or rewrite (UpstreamConnection checked): as it came.
            self._send(raw_head)
        else:
            self._send(self._response_head(ex, status, reason, headers, length, extra))
        if self._output_paused:
            self._pause_upstream(ex)  # the client has not read what came before yet

    def _response_head(
        self,
        ex: Exchange,
        status: int,
        reason: bytes,
        headers: list[Header],
        length: int | None,
        extra: tuple[Header, ...],
    ) -> bytes:
        out = end_to_end(headers, drop=INTERNAL)
        out.extend(extra)
        no_body = ex.method == b"HEAD" or status in (204, 304)
        if length is not None:
            out.append((b"Content-Length", str(length).encode()))
        elif not no_body:
            if ex.version == "1.1":
                ex.response_chunked = True
                out.append((b"Transfer-Encoding", b"chunked"))
            else:
                ex.close_after = True  # HTTP/1.0: the close delimits the body
        if ex.close_after:
            out.append((b"Connection", b"close"))
        elif ex.version == "1.0":
            out.append((b"Connection", b"keep-alive"))
        return head_bytes(status_line(status, reason), out)

    def _refused_unprocessed(self, ex: Exchange, headers: list[Header]) -> bool:
        """A mesh peer's 503 marked ``X-Lchat-Refused: stopping``: it refused the request without
        processing it because it is draining (only a peer router's own answer can carry the
        marker: lchat.mesh.routing; every space's response has it dropped). Send the request
        elsewhere, once, if all of it is at hand (or, refused before the client finished
        sending it, will be: then once it is), and return True. Otherwise the 503 is relayed
        like any other (its marker dropped with every internal header)."""
        target = ex.target
        if not isinstance(target, RemotePeer) or target.fallback is None or ex.rerouted:
            return False
        if not any(n.lower() == REFUSED and v.strip() == b"stopping" for n, v in headers):
            return False  # a 503 of the space itself: the client's to see
        coming = (
            not ex.body_complete
            and ex.replay is not None
            and not ex.chunked
            and (ex.length or 0) <= REPLAY_LIMIT
        )
        if not ex.at_hand() and not coming:
            _log.info(
                "peer {peer} refused {host} unprocessed (stopping), but the request's body is "
                "not kept (over {limit} bytes, or chunked and still arriving): relaying its 503",
                peer=f"{target.address}:{target.port}",
                host=target.host,
                limit=REPLAY_LIMIT,
            )
            return False
        upstream, ex.upstream = ex.upstream, None
        if upstream is not None:
            upstream.abort()  # the rest of this answer is not wanted, nor is the connection
        ex.rerouted = True
        ex.rewind()  # what went upstream is back in ex.body; the rest is buffered behind it
        if coming:
            ex.refused_by = target  # on_message_complete sends it on (the body timer runs)
        else:
            self._reroute(ex, target, "stopping", "refused it unprocessed (stopping)")
        return True

    def response_whole(self, status: int, data: bytes, length: int) -> bool:
        """The whole response in one read, ``length`` bytes of body after its head, and a head
        that may go as it came (:func:`oneread.response`): relay it in one write and complete the
        request, as response_head, response_body and response_complete would, and return True.
        False, having done nothing, when this request needs more than that (its answer closes
        the connection, gets headers added, or may be a mesh peer's refusal): the general way."""
        ex = self._active
        if (
            ex is None
            or self.transport is None
            or not ex.body_complete
            or ex.close_after
            or not ex.keep_alive
            or ex.upgrade
            or ex.version != "1.1"
            or self.proxy.draining
        ):
            return False
        target = ex.target
        if type(target) is LocalSocket:
            if target.response_headers:
                return False
        elif status == 503:
            return False  # perhaps a draining peer's refusal (_refused_unprocessed)
        ex.replay = None
        ex.status = status
        ex.response_started = ex.response_complete = True
        ex.bytes_out = length
        STATS.bytes_down += length
        self.transport.write(data)
        upstream, ex.upstream = ex.upstream, None
        if upstream is not None:
            self.proxy.pool.release(upstream)
        if (
            type(target) is LocalSocket
            and not ex.observed
            and not self._waiting
            and self._parsing is None
            and not self._closed
            and not self.cfg.access_log
            and self.valve is not None
            and not self.valve.reasons
        ):
            # _finish, inline for the common case: nothing pipelined, nothing to tell.
            self._active = None
            self._served += 1
            STATS.in_flight -= 1
            key = (target.kind, status)
            STATS.requests[key] = STATS.requests.get(key, 0) + 1
            self._deadline = self.proxy.reactor.seconds() + self.cfg.keepalive_timeout
            self._timer_action = Downstream._idle_timed_out
        else:
            self._finish(ex)
        return True

    def response_body(self, data: bytes) -> None:
        ex = self._active
        if ex is None or self.transport is None or not data:
            return
        ex.bytes_out += len(data)
        STATS.bytes_down += len(data)
        self._send(chunk(data) if ex.response_chunked else data)

    def response_view(self, view: memoryview, nbytes: int) -> bool:
        """``response_body`` of ``view[:nbytes]`` (a read into our own buffer, lchat.proxy.bulk),
        written at once; False, having done nothing, when it cannot go that way."""
        ex = self._active
        transport = self.transport
        if ex is None or transport is None or ex.response_chunked or self._batch is not None:
            return False
        ex.bytes_out += nbytes
        STATS.bytes_down += nbytes
        transport.write(view[:nbytes])
        self.bulk_written += nbytes
        if transport.get_write_buffer_size():
            BUFFERS.lend(transport, self)  # uvloop kept a view of the unsent rest
        return True

    def response_complete(self) -> None:
        ex = self._active
        if ex is None or self.transport is None:
            return
        if ex.response_chunked:
            self._send(LAST_CHUNK)
        ex.response_complete = True
        upstream, ex.upstream = ex.upstream, None
        if upstream is not None:
            if upstream.valve is not None:
                upstream.valve.open(Valve.PEER_FULL)  # an idle pooled connection must read
            if upstream.request_sent and upstream.reusable:
                self.proxy.pool.release(upstream)
            else:
                upstream.abort()
        if ex.body_complete or ex.close_after:
            self._finish(ex)

    def switched(self, reason: bytes, headers: list[Header], tail: bytes) -> None:
        """The upstream answered 101: relay it and splice raw bytes both ways from now on."""
        ex = self._active
        if ex is None or self.transport is None or ex.upstream is None or not ex.upgrade:
            if ex is not None and ex.upstream is not None:
                ex.upstream.abort()
            return
        self._disarm()
        ex.status = 101
        ex.response_started = True
        kept = end_to_end(headers, drop=INTERNAL)
        if isinstance(ex.target, LocalSocket) and ex.target.response_headers:
            kept.extend(ex.target.response_headers)
        upgrade = [v for n, v in headers if n.lower() == b"upgrade"][:1]
        kept += [(b"Connection", b"Upgrade"), *((b"Upgrade", v) for v in upgrade)]
        self._send(head_bytes(status_line(101, reason), kept))
        if tail:
            self._send(tail)
        self._spliced = True
        STATS.upgraded += 1
        upstream = ex.upstream
        upstream.request_sent = True
        if ex.upgrade_tail:
            upstream.write(ex.upgrade_tail)
            ex.upgrade_tail = b""
        # Backpressure both ways for the life of the tunnel (the client's side: see
        # pause_writing).
        assert self.valve is not None and upstream.valve is not None
        if self._output_paused:
            self._pause_upstream(ex)
        upstream.backpressure = self
        if upstream.write_paused:
            self.valve.close(Valve.PEER_FULL)
        self._tunnel_moved = self.proxy.reactor.seconds()
        self.valve.open("upgrade")
        self.valve.open("routing")
        self._log_access(ex)

    def upstream_data(self, data: bytes) -> None:
        if self.transport is not None:
            STATS.bytes_down += len(data)
            self._tunnel_moved = self.proxy.reactor.seconds()
            self._send(data)

    def upstream_failed(self, why: str, started: bool) -> None:
        ex = self._active
        if ex is None or self.transport is None:
            return
        upstream, ex.upstream = ex.upstream, None
        if upstream is not None:
            upstream.abort()
        if self._spliced:
            # The space closed the tunnel (or died): close the client's side too. (It ends
            # the request, and its in-flight ticket, when the client's connection is gone.)
            self._closing()
            return
        if not started and not ex.response_started:
            # Can the request be sent again? All of it must still be here (Exchange.replay).
            resendable = not ex.upgrade and ex.at_hand()
            # A reused keep-alive connection the space (or peer) had just closed: the close
            # crossed our request, which was never read. One try on a *new* connection (another
            # idle one may have been closed in the same breath).
            if (
                why == "closed before responding"
                and upstream is not None
                and upstream.reused
                and not ex.retried
                and resendable
                and isinstance(ex.target, LocalSocket | RemotePeer)
            ):
                ex.retried = True
                ex.rewind()
                d = self.proxy.pool.dial(ex.target)
                d.addCallbacks(
                    self._connected, self._dial_failed, callbackArgs=(ex,), errbackArgs=(ex,)
                )
                return
            target = ex.target
            if (
                why in ("closed before responding", PEER_UNREACHABLE)
                and isinstance(target, RemotePeer)
                and target.fallback is not None
                and not ex.rerouted
                and resendable
                and ex.method in _SAFE_METHODS
            ):
                # A peer that closed a forwarded request unanswered is stopping: a safe method
                # can be sent again, elsewhere (an unsafe one may have been acted on).
                ex.rerouted = True
                ex.rewind()
                self._reroute(ex, target, "closed", "closed before responding")
                return
            to = "a peer" if isinstance(target, RemotePeer) else "its space"
            conn = "reused" if upstream is not None and upstream.reused else "new"
            _log.warn(
                "upstream for {host} failed: {why} ({method} to {to} on a {conn} connection"
                "{retry}{resend})",
                host=ex.head.host if ex.head else "?",
                why=why,
                method=ex.method.decode("latin-1"),
                to=to,
                conn=conn,
                retry=", a retry" if ex.retried else "",
                resend="" if resendable else ", not resendable",
            )
            self._answer_locally(
                ex,
                plain(502, "502 Bad Gateway: the space failed to answer", label="upstream-error"),
            )
            return
        _log.warn(
            "upstream for {host} broke off mid-response: {why}",
            host=ex.head.host if ex.head else "?",
            why=why,
        )
        self._abort()

    # -- endings --------------------------------------------------------------------------------

    def _answer_locally(self, ex: Exchange, response: LocalResponse) -> None:
        assert self.transport is not None
        self._disarm()
        ex.status = response.status
        ex.response_started = ex.response_complete = True
        if ex.upstream is not None:
            ex.upstream.abort()
            ex.upstream = None
        # Unless the request is complete we cannot find where the next one starts in step.
        ex.close_after = (
            ex.close_after  # a bad request pipelined behind this one: nothing more is read
            or not ex.keep_alive
            or not self._body_done(ex)
            or ex.upgrade
            or self.proxy.draining
        )
        body = b"" if ex.method == b"HEAD" else response.body
        raw = simple_response(response.status, body, response.headers, close=ex.close_after)
        ex.bytes_out = len(body)
        self._send(raw)
        self._finish(ex)

    @staticmethod
    def _body_done(ex: Exchange) -> bool:
        """All of the request body has arrived (a request without one is done at its head)."""
        return ex.body_complete or (not ex.chunked and not ex.length)

    def _arm_body_timer(self) -> None:
        """A body must keep arriving: no more than ``keepalive_timeout`` between reads."""
        self._body_deadline = self.proxy.reactor.seconds() + self.cfg.keepalive_timeout

    def _disarm_body_timer(self) -> None:
        self._body_deadline = None

    def _body_timed_out(self) -> None:
        if self._closed:
            return
        if self.valve is not None and self.valve.closed:
            self._arm_body_timer()  # we paused the client ourselves (backpressure): not its fault
            return
        _rejected.labels("408").inc()
        _log.info("request body from {client} stalled: closing", client=self._client)
        ex = self._active
        assert self.transport is not None
        if ex is not None and ex.upstream is not None:
            ex.upstream.abort()
            ex.upstream = None
        if ex is not None and not ex.response_started:
            self._send(simple_response(408, b"408 Request Timeout\n", close=True))
        self._closing()

    def _finish(self, ex: Exchange) -> None:
        if ex is not self._active:
            return
        self._active = None
        self._served += 1
        STATS.in_flight -= 1
        target = ex.target
        if type(target) is LocalSocket and not self.cfg.access_log:
            # _log_access, inline (every request's path): only the count.
            key = (target.kind, ex.status)
            STATS.requests[key] = STATS.requests.get(key, 0) + 1
        else:
            self._log_access(ex)
        if ex.observed:
            self._end_observed(ex)
        assert self.transport is not None and self.valve is not None
        if ex.close_after:
            self._closing()
            return
        valve = self.valve
        if not self._waiting and not self._closed:
            # Nothing pipelined (the common case): idle keep-alive, or the next head arriving.
            if valve.reasons:
                valve.open("routing")
                valve.open("pipelined")
            if self._parsing is None:
                self._arm(self.cfg.keepalive_timeout, Downstream._idle_timed_out)
            else:
                self._arm(self.cfg.header_timeout, Downstream._header_timed_out)
            return
        valve.open("routing")
        self._serve_waiting()

    def _serve_waiting(self) -> None:
        """Serve the pipelined requests in order while the client's output has room (else
        resume_writing continues); once none waits, read the client again. A loop, not
        recursion: answers that complete at once (local ones) would nest a few stack frames per
        queued request."""
        if self._serving_queue:
            return  # an answer completed inside the loop below: it goes on from there
        assert self.valve is not None
        self._serving_queue = True
        try:
            while (
                self._active is None
                and self._waiting
                and not self._output_paused
                and not self._closed
            ):
                nxt = self._waiting.popleft()
                if not self._waiting:
                    self.valve.open("pipelined")
                self._serve(nxt)
        finally:
            self._serving_queue = False
        if self._active is None and not self._waiting and not self._closed:
            self.valve.open("pipelined")
            if self._parsing is None:
                self._arm(self.cfg.keepalive_timeout, Downstream._idle_timed_out)
            else:
                self._arm(self.cfg.header_timeout, Downstream._header_timed_out)

    def drain(self) -> None:
        """The router is stopping (ProxyFactory.close): close this connection now if it sits idle
        between requests, or is an upgraded tunnel (its space is stopping; its client
        reconnects). One that has not carried a request yet is left to send its first: it was
        opened a moment ago, and its request may be on the wire now (a mesh peer's pool dials
        just before writing). Cutting it would leave a POST's fate unknown to its sender;
        answered, it is refused (marked for a peer, which sends it elsewhere) and closed. Its
        header timeout still bounds it."""
        if self._closed:
            return
        if self._spliced or (self._active is None and self._parsing is None and self._served):
            self._closing()

    def _closing(self, linger: bool = False) -> None:
        """Close once the unsent output is out (what a batch gathered goes first). The transport
        stops reading (TLS still reads the client's answer to its close, inside the transport).
        The sweep aborts a close that does not finish (output that does not move, or a TLS peer
        that never answers the close) within ``send_timeout``.

        ``linger`` (after a refusal, when the client may still be sending): only our sending
        side closes, and what the client still sends is read and dropped for up to
        :data:`LINGER` seconds. Closing with unread bytes would reset the connection, and a
        reset can destroy our answer before the client read it (nginx: lingering_close)."""
        assert self.transport is not None
        first = not self._closed
        self._closed = True
        self._disarm()
        self._write_batch()
        if linger and self.transport.can_write_eof() and not self._lost:
            self.transport.write_eof()
            self._linger_until = self.proxy.reactor.seconds() + LINGER
            if self.valve is not None:
                self.valve.open_all()
        else:
            self.transport.close()
        if first and not self._output_paused:
            self._watch_send()  # (a paused client's clock is already running)

    # -- writing to the client --------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        """Write ``data`` to the client, or gather it while an upstream read is being relayed."""
        batch = self._batch
        if batch is not None:
            batch.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def begin_batch(self) -> None:
        """An upstream read starts: gather what it makes for the client (UpstreamConnection)."""
        if self._batch is None and not self._lost:
            self._batch = []

    def flush(self) -> None:
        """The upstream read is relayed: write what it made in one go."""
        self._write_batch()

    def _write_batch(self) -> None:
        batch, self._batch = self._batch, None
        if batch and self.transport is not None:
            self.transport.write(batch[0] if len(batch) == 1 else b"".join(batch))

    def _abort(self) -> None:
        """Drop the connection at once, unsent output and all."""
        self._batch = None
        if self.transport is not None:
            self.transport.abort()

    def upstream_full(self, full: bool) -> None:
        """The space's side of the current request has too much unsent (its body, or tunnel
        bytes): stop reading the client until it drained (UpstreamConnection.pause_writing)."""
        if self.valve is None:
            return
        if full:
            self.valve.close(Valve.PEER_FULL)
        else:
            self.valve.open(Valve.PEER_FULL)

    def _reject(self, status: int, reason: str) -> None:
        """A request we will not forward: answer once, if we still can, and close."""
        if self._closed:
            return  # already closing after a final answer: nothing more may be written
        _rejected.labels(str(status)).inc()
        ex = self._parsing or self._active
        _log.info(
            "rejected request from {client}: {status} {reason}",
            client=self._client,
            status=status,
            reason=reason,
        )
        assert self.transport is not None
        if ex is not None and ex is self._active and ex.response_started:
            self._abort()
            return
        if self._active is not None and self._active is not ex:
            # A pipelined request is bad while another is served: stop reading; close after.
            self._active.close_after = True
            self._parser = None
            return
        STATS.count("invalid", status)
        if ex is not None and ex.upstream is not None:
            # (A body over LCHAT_MAX_BODY, say: the space never sees the end of this request.)
            ex.upstream.abort()
            ex.upstream = None
        self._send(simple_response(status, f"{status} {reason}\n".encode(), close=True))
        self._closing(linger=True)

    def _observe(self, ex: Exchange) -> None:
        """The request is routed to its target: take the target's in-flight ticket, if it has
        one (an awake hibernating space), until :meth:`_end_observed`."""
        target = ex.target
        if type(target) is LocalSocket and target.inflight is not None and not ex.observed:
            ex.observed = True
            try:
                target.inflight.request_started(ex.upgrade)
            except Exception:
                _log.failure("in-flight ticket of {host} failed", host=target.host)

    def _end_observed(self, ex: Exchange) -> None:
        target = ex.target
        if ex.observed and isinstance(target, LocalSocket) and target.inflight is not None:
            ex.observed = False
            try:
                target.inflight.request_ended(ex.upgrade)
            except Exception:
                _log.failure("in-flight ticket of {host} failed", host=target.host)

    def _log_access(self, ex: Exchange) -> None:
        target = ex.target
        host_class: str
        if type(target) is LocalSocket:
            host_class = target.kind
        elif isinstance(target, RemotePeer):
            host_class = "peer"
        elif isinstance(target, LocalResponse):
            host_class = target.label
        else:
            host_class = "none"
        STATS.count(host_class, ex.status)
        if self.cfg.access_log and ex.head is not None:
            _log.info(
                'access {client} {host} "{method} {target} HTTP/{version}" {status} {bytes} {ms}ms',
                client=self._client,
                host=ex.head.host,
                method=ex.method.decode("latin-1"),
                target=ex.head.target.decode("latin-1")[:512],
                version=ex.version,
                status=ex.status,
                bytes=ex.bytes_out,
                ms=round((self.proxy.reactor.seconds() - ex.started) * 1000, 1),
            )

    # -- timers ---------------------------------------------------------------------------------

    def _arm(self, seconds: float, action: Callable[[Downstream], None]) -> None:
        """One deadline at a time: ``action`` (a method of this class, unbound) runs at most once
        when ``seconds`` have passed without another _arm or _disarm."""
        self._deadline = self.proxy.reactor.seconds() + seconds
        self._timer_action = action

    def _disarm(self) -> None:
        self._deadline = None
        self._timer_action = None

    def check_deadlines(self, now: float) -> None:
        """Called by the factory's sweep: fire whichever deadline has passed."""
        if self._linger_until is not None and now >= self._linger_until:
            self._linger_until = None
            self._abort()  # (everything we sent went out long ago, or the send timeout acts)
            return
        if self._output_paused or self._closed:
            self._check_send(now)
        elif self._spliced and now - self._tunnel_moved >= self.cfg.tunnel_idle_timeout:
            self._tunnel_idle(now)
        if self._body_deadline is not None and now >= self._body_deadline:
            self._body_deadline = None
            self._body_timed_out()
        if self._deadline is not None and now >= self._deadline and not self._closed:
            action = self._timer_action
            self._disarm()
            if action is not None:
                action(self)

    def _tunnel_idle(self, now: float) -> None:
        """No byte either way through an upgraded tunnel for LCHAT_TUNNEL_IDLE_TIMEOUT: close
        both sides (a chat WebSocket pings well within it; a dead one holds two sockets)."""
        _tunnel_idle_closes.inc()
        ex = self._active
        _log.info(
            "tunnel from {client} to {host} idle for {seconds:.0f}s: closing it"
            " (LCHAT_TUNNEL_IDLE_TIMEOUT)",
            client=self._client,
            host=ex.head.host if ex is not None and ex.head is not None else "?",
            seconds=now - self._tunnel_moved,
        )
        if ex is not None and ex.upstream is not None:
            upstream, ex.upstream = ex.upstream, None
            upstream.handler = None  # its close is ours, not news
            upstream.close()
        self._closing()

    def _header_timed_out(self) -> None:
        if self._output_paused:
            # We stopped reading (the client's output is full), so the head cannot be complete:
            # not the client's delay; the send timeout governs a client that does not read.
            self._arm(self.cfg.header_timeout, Downstream._header_timed_out)
            return
        if self._parsing is not None:
            _rejected.labels("408").inc()
            assert self.transport is not None
            self._send(simple_response(408, b"408 Request Timeout\n", close=True))
        self._closing()

    def _idle_timed_out(self) -> None:
        self._closing()

    def _upstream_timed_out(self) -> None:
        ex = self._active
        if ex is None or ex.response_started:
            return
        _log.warn(
            "upstream for {host} did not answer in time", host=ex.head.host if ex.head else "?"
        )
        self._answer_locally(ex, plain(504, "504 Gateway Timeout", label="timeout"))

    # -- the client's output: backpressure and the send timeout ----------------------------------

    def pause_writing(self) -> None:
        """The transport has more than its high-water mark unsent: make nothing more for this
        client until it has read it."""
        if self._output_paused or self._closed:
            return
        self._output_paused = True
        _output_paused.inc()
        _output_pauses.inc()
        self._watch_send()
        if not self._spliced:
            assert self.valve is not None
            self.valve.close("output")  # no more requests (the rest of this read still parses)
        ex = self._active
        if ex is not None and ex.response_started:
            # (An answer not yet started is still read up to its head, which pauses it then:
            # the upstream timeout is the space's time to answer, not the client's to read.)
            self._pause_upstream(ex)

    def resume_writing(self) -> None:
        """The unsent output drained (to the low-water mark): carry on where pause_writing
        stopped."""
        if not self._output_paused:
            return
        self._output_paused = False
        _output_paused.dec()
        ex = self._active
        if ex is not None and ex.upstream is not None and ex.upstream.valve is not None:
            ex.upstream.valve.open(Valve.PEER_FULL)
        assert self.valve is not None
        self.valve.open("output")
        if self._active is None and self._waiting and not self._closed:
            self._serve_waiting()

    def _pause_upstream(self, ex: Exchange) -> None:
        if ex.upstream is not None and ex.upstream.valve is not None:
            ex.upstream.valve.close(Valve.PEER_FULL)

    def _watch_send(self) -> None:
        """Start timing the unsent output (a pause, or a close): it must keep moving."""
        self._send_moved_at = self.proxy.reactor.seconds()
        self._send_buffered = None

    def _check_send(self, now: float) -> None:
        """Abort the connection if its unsent output has not moved for ``send_timeout``: a
        client that stopped reading would otherwise hold it, its space connection and the
        buffered bytes forever (nginx: send_timeout)."""
        buffered = self.transport.get_write_buffer_size() if self.transport is not None else None
        moved = _delivered(self.transport)
        if moved is None:
            moved = buffered  # not TCP: the unsent output itself must change
        if moved is not None and moved != self._send_buffered:
            self._send_buffered = moved
            self._send_moved_at = now
            return
        if now - self._send_moved_at < self.cfg.send_timeout:
            return
        _send_timeouts.inc()
        if buffered == 0:
            # Everything went out; what is missing is the client's answer to our TLS close.
            what = "did not answer our close"
        else:
            unsent = "?" if buffered is None else str(buffered)
            what = f"read nothing ({unsent} bytes unsent{', closing' if self._closed else ''})"
        _log.info(
            "client {client} {what} for {seconds:.1f}s: aborting its connection"
            " (LCHAT_SEND_TIMEOUT)",
            client=self._client,
            what=what,
            seconds=now - self._send_moved_at,
        )
        self._send_moved_at = now  # the abort completes in a moment; not twice meanwhile
        assert self.transport is not None
        self._abort()


# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, the bytes the peer's kernel has taken.
_TCP_INFO_BYTES_ACKED = 120


def _delivered(transport: asyncio.Transport | None) -> int | None:
    """How many bytes the client's side has taken so far on a TCP connection (None otherwise).

    What moves when a client reads, whatever the layers: under TLS the transport's own unsent
    count leaves out what sits in the TCP layer's buffer (up to its high-water mark), and the
    kernel's send queue refills to the same size as it drains."""
    if transport is None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 128)
    except OSError:
        return None
    if len(info) < _TCP_INFO_BYTES_ACKED + 8:
        return None
    return int(struct.unpack_from("=Q", info, _TCP_INFO_BYTES_ACKED)[0])


class ProxyFactory:
    """Builds a :class:`Downstream` per client connection (it is the protocol factory handed to
    the loop: ``loop.create_server(factory, ...)``); holds what they share.

    ``reactor`` is the clock (``seconds``, ``callLater``): the asyncio reactor whose loop runs
    the connections, or a fake clock in tests of the timing logic."""

    def __init__(
        self,
        reactor: Any,
        router: Routes,
        cfg: ProxyConfig | None = None,
        pool: UpstreamPool | None = None,
        secure: bool = False,
    ) -> None:
        self.reactor = reactor
        self.router = router
        self.cfg = cfg or ProxyConfig()
        self.pool = pool or UpstreamPool(reactor, dial_retry=self.cfg.dial_retry)
        self.secure = secure
        self.scheme = b"https" if secure else b"http"  # X-Forwarded-Proto
        self.connections: set[Downstream] = set()
        self.draining = False  # close() was called: the router is stopping
        self._quiet: list[Deferred[None]] = []  # quiesced() waiters
        # Host header value -> normalised name, for values seen recently (parse_host).
        self.host_names: dict[bytes, str] = {}
        # Deadlines are checked a few times per shortest timeout; the sweep runs only while
        # there are connections, so an idle router (or a finished test) has no pending call.
        shortest = min(
            self.cfg.header_timeout,
            self.cfg.keepalive_timeout,
            self.cfg.upstream_timeout,
            self.cfg.send_timeout,
            self.cfg.tunnel_idle_timeout,
        )
        self._tick = min(0.5, shortest / 5)
        self._sweep: LoopingCall | None = None

    def add_connection(self, conn: Downstream) -> None:
        self.connections.add(conn)
        if self._sweep is None:
            self._sweep = LoopingCall(self._check)
            self._sweep.clock = self.reactor
            self._sweep.start(self._tick, now=False)

    def remove_connection(self, conn: Downstream) -> None:
        self.connections.discard(conn)
        if not self.connections and self._sweep is not None:
            if self._sweep.running:
                self._sweep.stop()
            self._sweep = None
        if not self.connections:
            quiet, self._quiet = self._quiet, []
            for d in quiet:
                if not d.called:
                    d.callback(None)

    def _check(self) -> None:
        now = self.reactor.seconds()
        for conn in list(self.connections):
            try:
                conn.check_deadlines(now)
            except Exception:
                _log.failure("deadline handling failed")

    def parse_host(self, raw: bytes) -> str:
        """``Host`` header -> normalised name, remembering recent answers (it is hot and pure)."""
        host = self.host_names.get(raw)
        if host is None:
            try:
                # ASCII only: a byte over 0x7f must never be folded onto a registered name
                # (IDNA mapping would turn "\xaa.test" into "a.test"); nginx refuses them too.
                host = hosts.parse_host_header(raw.decode("ascii"))
            except (UnicodeDecodeError, hosts.InvalidHost):
                raise _Reject(400, "malformed Host header") from None
            if len(self.host_names) >= 4096:
                self.host_names.clear()
            self.host_names[raw] = host
        return host

    def count(self, host_class: str, status: int) -> None:
        STATS.count(host_class, status)

    def buildProtocol(self, addr: Any) -> Downstream:
        return Downstream(self)

    def __call__(self) -> Downstream:
        return self.buildProtocol(None)

    def close(self) -> Deferred[None]:
        """Shutdown: from now on every answer closes its connection (no more keep-alive); client
        connections idle between requests are closed now (Downstream.drain), and idle upstream
        connections too."""
        self.draining = True
        for conn in list(self.connections):
            conn.drain()
        return self.pool.close()

    def quiesced(self, grace: float) -> Deferred[None]:
        """Fires once every client connection has closed, or after ``grace`` seconds, when the
        ones left are aborted (and then once they are gone)."""
        if not self.connections:
            return succeed(None)
        done: Deferred[None] = Deferred()
        self._quiet.append(done)

        def give_up() -> None:
            if done.called:
                return
            _log.warn(
                "{count} client connections still open {grace:g}s into the drain: aborting them",
                count=len(self.connections),
                grace=grace,
            )
            for conn in list(self.connections):
                conn._abort()

        timer = self.reactor.callLater(grace, give_up)
        done.addBoth(lambda result: timer.cancel() if timer.active() else None)
        return done

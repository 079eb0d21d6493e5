"""The downstream side: one client connection, parsed with httptools, streamed to its target.

Requests on a connection are served one at a time, in order (pipelined ones wait, paused). For each:
validate the head (no ambiguity ever reaches a space), ask the router for a target, dial (with the
pool's retry window), write the head, stream the body with backpressure both ways, relay the response,
and on ``101`` splice raw bytes until either side closes. Every failure ends in a clear status or a
closed connection, never a stuck handler or a leaked upstream connection.

The protocol in three layers: :class:`Downstream` reads requests (this module),
:class:`~lchat.proxy.relay.Relay` serves each and relays its response,
:class:`~lchat.proxy.client.ClientConnection` owns the connection's output, deadlines and close;
what one request is and the pure checks and heads around it are :mod:`lchat.proxy.exchange`.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httptools
from prometheus_client import Counter
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import hosts
from lchat.config import ProxyConfig
from lchat.proxy import oneread
from lchat.proxy.bulk import MIN_BULK, BulkReader
from lchat.proxy.client import HIGH_WATER
from lchat.proxy.exchange import (
    Reject,
    StopReading,
    hop_origin,
    plain_upstream_head,
    validate,
)
from lchat.proxy.hot import Exchange
from lchat.proxy.http import LAST_CHUNK, Valve, chunk
from lchat.proxy.relay import REFUSALS, Relay
from lchat.proxy.state import FrontDoorState
from lchat.proxy.upstream import UpstreamPool
from lchat.router import RequestHead, Routes

_log = Logger(namespace="lchat.proxy")

_pipeline_limited = Counter(
    "lchat_http_pipeline_limit_total",
    "Client connections closed after the most pipelined requests one may queue",
)


class Downstream(Relay):
    """A client connection read with httptools (and :mod:`oneread`'s recogniser for a whole
    request in one read): its protocol, on the reactor's uvloop loop."""

    __slots__ = ()  # (ClientConnection has them all)

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TLS transport has a Transport's methods without being a subclass.)
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        # The high-water mark, set explicitly: uvloop's TLS transport defaults to 512 KiB.
        transport.set_write_buffer_limits(high=HIGH_WATER)
        stats = self._stats
        stats.connections += 1
        stats.accepted += 1
        if self.proxy.secure:
            # uvloop makes the protocol once the handshake is done: was it a resumed session?
            ssl_object = transport.get_extra_info("ssl_object")
            if ssl_object is not None:
                if ssl_object.session_reused:
                    stats.tls_resumed += 1
                else:
                    stats.tls_full += 1
        self.proxy.add_connection(self)
        self.valve = Valve(transport)
        self._parser = httptools.HttpRequestParser(self)
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "unix"
        self._client_bytes = self._client.encode("latin-1")
        # A fresh connection must send a request head promptly: the slowloris guard.
        self._arm(self.cfg.header_timeout, Downstream._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._batch = None
        self._stats.connections -= 1
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
            self._observe(ex, started=False)
            if ex is self._active and not ex.response_complete:
                self._stats.in_flight -= 1
        if self._spliced:
            self._stats.upgraded -= 1
        self._output_unpaused()
        self._active = None
        self._waiting.clear()

    def _received(self, data: bytes) -> None:
        """A read the one-read path (ClientCore.data_received) did not serve."""
        if self._closed:
            return
        if self._spliced:
            ex = self._active
            if ex is not None and ex.upstream is not None:
                self._stats.bytes_up += len(data)
                self._tunnel_moved = self.proxy.reactor.seconds()
                ex.upstream.write(data)
            return
        if self._parser is None:
            return  # parsing stopped after a bad pipelined request; closing after the current one
        if self._body_left:
            self._body_read(data)
            return
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
            if isinstance(cause, StopReading):
                self._parser = None  # the connection closes after the current response
            elif isinstance(cause, Reject):
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
        except StopReading:
            self._parser = None  # the connection closes after the current response
            return
        except Reject as e:
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
                self._bulk = BulkReader(self, self._buffers)
                self.transport.set_protocol(self._bulk)

    def bulk_received(self, nbytes: int) -> None:
        """A read into our buffers' ``view`` while a big request body streams (BulkReader): the middle
        of the body goes upstream as a slice of the buffer, as ``_body_read`` would have sent it;
        anything else goes the general way, as ``bytes``, with this object the protocol again."""
        view = self._buffers.view
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
                    self._stats.bytes_up += nbytes
                    self._body_deadline = self.proxy.reactor.seconds() + self.cfg.keepalive_timeout
                    transport.write(view[:nbytes])
                    upstream.bulk_written += nbytes
                    if transport.get_write_buffer_size():
                        self._buffers.lend(
                            transport, upstream
                        )  # uvloop kept a view of the unsent rest
                    return
        self._bulk = None
        if self.transport is not None:
            self.transport.set_protocol(self)
        self.data_received(bytes(view[:nbytes]))

    def _whole_head(self, whole: oneread.WholeRequest) -> RequestHead | None:
        """A new request recognised whole (ClientCore._serve_whole): remembered as the last one,
        with its head, or None when its Host is malformed (the general path refuses it)."""
        proxy = self.proxy
        self._last_whole = whole
        self._last_head = self._last_request = None
        host = proxy.host_names.get(whole.host)
        if host is None:
            try:
                host = proxy.parse_host(whole.host)
            except Reject:
                return None
        head = self._last_head = RequestHead(
            whole.method, whole.target, host, self._client, proxy.secure
        )
        return head

    def _upstream_request(self, whole: oneread.WholeRequest) -> bytes:
        return plain_upstream_head(
            whole.method, whole.target, whole.lines, self._client_bytes, self.proxy.scheme
        )

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

    # -- parser callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._progress = True
        if self._closed:
            raise StopReading()  # we already answered with "Connection: close" in this read
        self._parsing = Exchange(self.proxy.reactor.seconds())

    def on_url(self, url: bytes) -> None:
        self._progress = True
        ex = self._parsing
        assert ex is not None
        ex.url += url
        ex.header_bytes += len(url)
        if ex.header_bytes > self.cfg.max_header_bytes:
            raise Reject(414, "request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._progress = True
        ex = self._parsing
        if ex is None or ex.head is not None:
            return  # trailers of a chunked body: dropped
        ex.headers.append((name, value))
        ex.header_bytes += len(name) + len(value) + 4
        if ex.header_bytes > self.cfg.max_header_bytes:
            raise Reject(431, "request headers too large")
        if len(ex.headers) > self.cfg.max_headers:
            raise Reject(431, "too many request headers")

    def on_headers_complete(self) -> None:
        self._progress = True
        ex = self._parsing
        assert ex is not None and self._parser is not None
        ex.method = self._parser.get_method()
        ex.version = self._parser.get_http_version()
        ex.keep_alive = bool(self._parser.should_keep_alive())
        ex.client_closes = not ex.keep_alive
        ex.head = validate(
            ex, self.proxy.parse_host, self._client, self.proxy.secure, self.cfg.max_body
        )
        if self.proxy.trusted_hop:
            # The control process's hop socket: the request's client is the worker's.
            ex.head, ex.origin = hop_origin(ex, ex.head)
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
            raise Reject(413, f"request body over {self.cfg.max_body} bytes (LCHAT_MAX_BODY)")
        self._stats.bytes_up += len(data)
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
            # A peer refused it before its body was all here: now it is.
            why = ex.refused_why
            self._reroute(ex, ex.refused_by, why, f"refused it unprocessed ({REFUSALS[why]})")
        if ex is self._active and ex.response_complete:
            self._finish(ex)
        elif self._active is None and not self._waiting and not self._closed:
            # Answered before its (empty) message ended, e.g. locally: now it is idle keep-alive.
            self._arm(self.cfg.keepalive_timeout, Downstream._idle_timed_out)
        if not ex.keep_alive:
            raise StopReading()


class HopDownstream(Downstream):
    """A connection to the control process's hop socket (``ProxyFactory(trusted_hop=True)``):
    every request is read the general way, which takes its client from the worker's forwarding
    headers (exchange.hop_origin). The one-read path would serve it as this socket's peer's, and
    never could anyway: a worker's request always carries X-Forwarded-For, which the recognisers
    decline (lchat.proxy.http.REQUEST_SPECIAL)."""

    __slots__ = ()

    def _serve_whole(self, data: bytes) -> bool:
        return False


class ProxyFactory:
    """Builds a :class:`Downstream` per client connection (it is the protocol factory handed to
    the loop: ``loop.create_server(factory, ...)``); holds what they share.

    ``reactor`` is the clock (``seconds``, ``callLater``): the asyncio reactor whose loop runs
    the connections, or a fake clock in tests of the timing logic. ``trusted_hop``: the control
    process's hop socket, where only its worker processes connect (lchat.controlhop) and each
    request's client and scheme are the ones its X-Forwarded-For (last element) and
    X-Forwarded-Proto name; a request without them is refused (400)."""

    def __init__(
        self,
        reactor: IReactorTime,
        router: Routes,
        cfg: ProxyConfig | None = None,
        pool: UpstreamPool | None = None,
        secure: bool = False,
        state: FrontDoorState | None = None,
        trusted_hop: bool = False,
    ) -> None:
        self.reactor = reactor
        self.trusted_hop = trusted_hop
        # What every connection shares (lchat.proxy.state): the pool's, unless given.
        self.state = state or (pool.state if pool is not None else FrontDoorState())
        self.router = router
        self.cfg = cfg or ProxyConfig()
        self.pool = pool or UpstreamPool(reactor, dial_retry=self.cfg.dial_retry, state=self.state)
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
                raise Reject(400, "malformed Host header") from None
            if len(self.host_names) >= 4096:
                self.host_names.clear()
            self.host_names[raw] = host
        return host

    def buildProtocol(self, addr: Any) -> Downstream:
        if self.trusted_hop:
            return HopDownstream(self)
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

"""One client connection's own ground: its output (batched writes, backpressure, the send
timeout), its deadlines, and how it closes; the state every layer of the connection shares
(lchat.proxy.downstream names the layers). Nothing here knows HTTP beyond answering a refusal and
closing.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httptools
from prometheus_client import Counter, Gauge
from twisted.logger import Logger

from lchat.proxy import oneread
from lchat.proxy.bulk import BulkReader
from lchat.proxy.hot import ClientCore, Exchange
from lchat.proxy.http import Valve, simple_response
from lchat.router import RequestHead

if TYPE_CHECKING:
    from lchat.proxy.downstream import ProxyFactory

_log = Logger(namespace="lchat.proxy")

# After refusing a request whose client may still be sending, how long what it sends is read and
# dropped before the connection closes (ClientConnection._closing).
LINGER = 2.0
# Unsent output on a client connection beyond which nothing more is made for it (pause_writing);
# it resumes at a quarter of it (asyncio's default low-water mark).
HIGH_WATER = 64 * 1024
# A final answer written with our close_notify in one TCP write at most this long (beyond, it
# goes first and the close_notify after: _close_tls_now): with its records' overhead, well below
# HIGH_WATER, so that writing it while the SSL layer holds its output never pauses us.
CLOSE_NOW_LIMIT = 32 * 1024

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


class ClientConnection(ClientCore, asyncio.Protocol):
    """One client connection (an asyncio Protocol on the reactor's uvloop loop).

    Its transport pauses it (``pause_writing``) when more than the high-water mark (64 KiB) is
    unsent, and resumes it (``resume_writing``) once the output drained to the low-water mark.
    While paused nothing more is made for the client: it is not read, no queued request is
    served, and the upstream of the response (or tunnel) is not read either. The factory's sweep
    aborts a connection whose unsent output has not moved for ``send_timeout``, paused or closing.

    What one upstream read makes for the client (a response head and its body, often the whole
    response) goes out in one write: between ``begin_batch`` and ``flush`` writes are gathered.
    """

    __slots__ = ()  # (ClientCore has them all: lchat.proxy.hot)

    def __init__(self, factory: ProxyFactory) -> None:
        self.proxy = factory
        self.cfg = factory.cfg
        self.transport: asyncio.Transport | None = None
        # Under TLS, the TCP transport below uvloop's SSL one (TLSAcceptor sets it): a close
        # the client asked for closes it once our close_notify is with it (_closing, quick).
        self.raw_transport: asyncio.Transport | None = None
        self.valve: Valve | None = None
        self._batch: list[bytes] | None = None  # writes gathered during an upstream read
        self._tunnel_moved = 0.0  # an upgraded tunnel's last byte, either way
        self._parser: httptools.HttpRequestParser | None = None
        self._parsing: Exchange | None = None  # the request the parser is inside
        self._active: Exchange | None = None  # the request being served
        self._waiting: deque[Exchange] = deque()  # pipelined requests not yet served
        # Deadlines, checked by the factory's sweep: cheaper than a callLater per request.
        self._deadline: float | None = None
        self._timer_action: Callable[[Any], None] | None = None
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
        self.bulk_written = 0  # bytes written to the client from our buffers (lchat.proxy.bulk)
        self._stats = factory.state.stats
        self._buffers = factory.state.buffers
        cfg = self.cfg
        self._pool = factory.pool
        self._route = factory.router.route
        self._seconds = factory.reactor.seconds
        self._keepalive_timeout = cfg.keepalive_timeout
        self._upstream_timeout = cfg.upstream_timeout
        self._max_header_bytes = cfg.max_header_bytes
        self._max_headers = cfg.max_headers
        self._access_log = cfg.access_log
        self._upstream_action = type(self)._upstream_timed_out
        self._idle_action = type(self)._idle_timed_out

    # -- the connection ------------------------------------------------------------------------

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

    # -- writing to the client -----------------------------------------------------------------

    def _abort(self) -> None:
        """Drop the connection at once, unsent output and all."""
        self._batch = None
        if self.transport is not None:
            self.transport.abort()

    def _close_tls_now(self, last: bytes = b"") -> bool:
        """Under TLS (a connection :class:`~lchat.proxy.tls_accept.TLSAcceptor` set up, which
        gave us its TCP transport): write ``last`` (a final answer) and our close_notify after
        it, in one TCP write, and close the TCP connection once that is out — as nginx does
        (``SSL_shutdown`` once, not waiting for the client's). uvloop's own close of the SSL
        transport would read on until the client's close_notify came: a timer, read-and-discard
        exceptions, a write and a read more per connection, a few % of a new TLS connection's
        CPU (docs/performance.md, "Issue 33: the TLS close").

        Only for a client that said it closes (it sends nothing more: RFC 9112 §9.6, so nothing
        unread can turn the close into a reset), and only when nothing waits in either
        transport (then the SSL transport's own close flushes it first). True once done, or
        done already; False, having done nothing, otherwise."""
        raw = self.raw_transport
        transport = self.transport
        if raw is None or transport is None:
            return False
        if raw.is_closing():
            return True
        if (
            transport.get_write_buffer_size()
            or raw.get_write_buffer_size()
            or len(last) > CLOSE_NOW_LIMIT
        ):
            return False
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None:
            return False
        protocol = raw.get_protocol()
        # Paused as its TCP transport pauses it over its high-water mark, the SSL layer keeps
        # the records it makes until resume_writing, which writes them at once. (With the TCP
        # buffer empty it is not paused now; were it, uvloop asserts, and the ordinary close
        # waits for the output.)
        try:
            protocol.pause_writing()
        except AssertionError:
            return False
        try:
            if last:
                transport.write(last)
            try:
                ssl_object.unwrap()  # our close_notify, after the answer
            except ssl.SSLWantReadError:
                pass  # (the client's is not waited for)
            except ssl.SSLError as e:
                _log.debug("tls: close_notify to {client} not sent: {e}", client=self._client, e=e)
        finally:
            protocol.resume_writing()
        raw.close()
        self._stats.tls_closed_at_once += 1
        return True

    def upstream_full(self, full: bool) -> None:
        """The space's side of the current request has too much unsent (its body, or tunnel
        bytes): stop reading the client until it drained (UpstreamConnection.pause_writing)."""
        if self.valve is None:
            return
        if full:
            self.valve.close(Valve.PEER_FULL)
        else:
            self.valve.open(Valve.PEER_FULL)

    def _closing(self, linger: bool = False, quick: bool = False) -> None:
        """Close once the unsent output is out (what a batch gathered goes first). The transport
        stops reading (TLS still reads the client's answer to its close, inside the transport).
        The sweep aborts a close that does not finish (output that does not move, or a TLS peer
        that never answers the close) within ``send_timeout``.

        ``linger`` (after a refusal, when the client may still be sending): only our sending
        side closes, and what the client still sends is read and dropped for up to
        :data:`LINGER` seconds. Closing with unread bytes would reset the connection, and a
        reset can destroy our answer before the client read it (nginx: lingering_close).

        ``quick`` (the client's request said it closes, and all of it was read): under TLS the
        close does not wait for the client's close_notify (:meth:`_close_tls_now`)."""
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
            raw = self.raw_transport
            if raw is not None and raw.is_closing():
                pass  # closed at once already (_close_tls_now), or lost
            elif not (quick and self._close_tls_now()):
                self.transport.close()
        if first and not self._output_paused:
            self._watch_send()  # (a paused client's clock is already running)

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
        if ex is not None and ex is self._active and ex.response_started:
            self._abort()
            return
        if self._active is not None and self._active is not ex:
            # A pipelined request is bad while another is served: stop reading; close after.
            self._active.close_after = True
            self._parser = None
            return
        self._stats.count("invalid", status)
        if ex is not None and ex.upstream is not None:
            # (A body over LCHAT_MAX_BODY, say: the space never sees the end of this request.)
            ex.upstream.abort()
            ex.upstream = None
        self._send(simple_response(status, f"{status} {reason}\n".encode(), close=True))
        self._closing(linger=True)

    # -- timers --------------------------------------------------------------------------------

    def _arm(self, seconds: float, action: Callable[[Any], None]) -> None:
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
        if ex is not None and ex.upstream is not None:
            ex.upstream.abort()
            ex.upstream = None
        if ex is not None and not ex.response_started:
            self._send(simple_response(408, b"408 Request Timeout\n", close=True))
        self._closing()

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
            self._arm(self.cfg.header_timeout, ClientConnection._header_timed_out)
            return
        if self._parsing is not None:
            _rejected.labels("408").inc()
            self._send(simple_response(408, b"408 Request Timeout\n", close=True))
        self._closing()

    def _idle_timed_out(self) -> None:
        self._closing()

    def _upstream_timed_out(self) -> None:
        """The space did not answer within upstream_timeout (the subclass's: Relay)."""
        raise NotImplementedError

    # -- the client's output: backpressure and the send timeout --------------------------------

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

    def _output_unpaused(self) -> bool:
        """Count the output as no longer paused (resume_writing, or the connection is gone);
        False if it was not."""
        if not self._output_paused:
            return False
        self._output_paused = False
        _output_paused.dec()
        return True

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
        if buffered is not None and self.raw_transport is not None:
            buffered += self.raw_transport.get_write_buffer_size()  # (under TLS, after it)
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

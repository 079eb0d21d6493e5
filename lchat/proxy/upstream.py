"""The upstream side: connections to spaces (unix sockets) and peers (TLS), pooled, with dial retry.

asyncio Protocols on the reactor's own (uvloop) loop. A connection carries one exchange at a time
(no pipelining upstream). It parses the response with httptools and reports to its handler (the
client's :class:`~lchat.proxy.relay.Relay`): informational heads, the final head, body bytes,
completion, a switch to raw bytes after ``101``, or failure; and, at the end of every read,
``flush`` (the handler may batch what one read makes into one write to its client).

A response head that needs no rewriting (no hop-by-hop or internal header, ``Content-Length``
framing, HTTP/1.1, the whole head in the exchange's first read) is also handed over byte for byte
(``raw_head``): the handler may forward it as it is instead of building it again. The hop-by-hop
lines servers send on ordinary answers (``Connection: keep-alive``, ``Keep-Alive``, an offered
``Upgrade``: lchat.proxy.http.RESPONSE_SPLICED) do not make a head need rewriting: its raw head
is the one it came as with those lines taken out.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
from typing import TYPE_CHECKING, Any, cast

import httptools
from prometheus_client import Counter
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.backoff import Backoff
from lchat.proxy.bulk import MIN_BULK, BulkReader
from lchat.proxy.hot import PoolCore, UpstreamCore
from lchat.proxy.http import (
    RESPONSE_SPECIAL,
    RESPONSE_SPLICED,
    RESPONSE_SPLICED_TOKENS,
    Header,
    Valve,
    connection_tokens,
    without_lines,
)
from lchat.proxy.state import FrontDoorState
from lchat.router import LocalSocket, RemotePeer

if TYPE_CHECKING:
    from lchat.proxy.relay import Relay

_log = Logger(namespace="lchat.proxy")

_dial_retries = Counter(
    "lchat_upstream_dial_retries_total", "Upstream dials retried (socket refused or missing)"
)
_dial_failures = Counter(
    "lchat_upstream_dial_failures_total", "Upstream dials given up after the retry window"
)
Key = str | tuple[Any, ...]  # a unix socket's path, or (scheme, address, port, server name)


class _HeadDone(Exception):
    """Stops the parser after a HEAD response's head: its Content-Length promises no body."""


class UpstreamConnection(UpstreamCore, asyncio.Protocol):
    """One connection to a space or peer; see the module docstring."""

    __slots__ = ()  # (UpstreamCore has them all: lchat.proxy.hot)

    def __init__(self, pool: UpstreamPool, key: Key) -> None:
        self.pool = pool
        self.key = key
        self._stats = pool.state.stats
        self.transport: asyncio.Transport | None = None
        self.handler: Relay | None = None
        self.valve: Valve | None = None
        self.reused = 0
        self.connected = False
        self.unreachable = False  # aborted because its peer went out of reach (abort_peer)
        self._parser: httptools.HttpResponseParser | None = None
        self._method = b""
        self._headers: list[Header] = []
        self._status = 0
        self._reason = b""
        self._final = False  # the final (non-1xx) head arrived
        self._complete = False
        self._close_delimited = False
        self._spliced = False
        self._got_bytes = False
        self._in_head = False
        self._first_read: bytes | None = None  # the exchange's first read, while it is parsed
        self.request_sent = False  # the whole request (head and body) has been written
        self.reusable = True
        self.idle_since = 0.0
        # The client's side wants to hear when our output is over the high-water mark (its
        # request body, or tunnel bytes, must then wait): Downstream.upstream_full.
        self.backpressure: Relay | None = None
        self.write_paused = False
        # Bytes of a Content-Length response body still to come (counted from the head on); once
        # the read that brought the head is parsed, the rest of the body goes past the parser.
        self._body_left = 0
        self._past_parser = False
        self._bulk: BulkReader | None = None  # the transport's protocol while a body streams
        self.bulk_written = 0  # bytes written to the space from our buffers (lchat.proxy.bulk)

    # -- lifecycle ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TLS transport has a Transport's methods without being a subclass.)
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        # Room for a request body's reads in flight towards the space (an upload arrives in
        # reads of up to 256 KiB); uvloop's TLS default (512 KiB) is lowered for peers too.
        transport.set_write_buffer_limits(high=UPSTREAM_HIGH_WATER)
        self.connected = True
        self.valve = Valve(transport)

    def splice(self) -> None:
        """After 101: everything from now on is raw bytes for the handler."""
        self._spliced = True
        self.reusable = False

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def abort(self) -> None:
        self.reusable = False
        self.handler = None
        self.backpressure = None
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Close when the unsent output is out (an idle or unwanted connection)."""
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    # -- backpressure: our output towards the space ---------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.backpressure is not None:
            self.backpressure.upstream_full(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.backpressure is not None:
            self.backpressure.upstream_full(False)

    # -- bytes from upstream --------------------------------------------------------------------

    def _received(self, data: bytes) -> None:
        """A read the one-read path (UpstreamCore.data_received) did not relay."""
        handler = self.handler
        if handler is None:
            # Bytes while idle in the pool, or after we gave up: the stream is out of step.
            self.reusable = False
            if self.transport is not None:
                self.transport.close()
            return
        if self._past_parser:
            self._body_read(data)
            return
        handler.begin_batch()
        try:
            if self._spliced:
                handler.upstream_data(data)
                return
            if not self._got_bytes:
                self._first_read = data
            self._got_bytes = True
            assert self._parser is not None
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                offset = int(e.args[0]) if e.args else len(data)
                if self._status == 101 and self._final:
                    self.splice()
                    handler.switched(self._reason, self._headers, data[offset:])
                else:
                    self._fail("upstream asked to switch protocols unasked")
            except httptools.HttpParserCallbackError as e:
                if isinstance(e.__context__, _HeadDone):
                    self.reusable = False  # we cannot tell where the next response would start
                    self._finish()
                else:
                    _log.failure("proxy response handler failed", Failure(e.__context__ or e))
                    self._fail("internal error")
            except httptools.HttpParserError as e:
                self._fail(f"malformed response: {e}")
            else:
                if self._body_left > 0 and self.handler is not None and not self._complete:
                    self._past_parser = True  # a Content-Length body under way: _body_read
            finally:
                self._first_read = None
        finally:
            handler.flush()

    def _body_read(self, data: bytes) -> None:
        """A read while a ``Content-Length`` body is under way: its bytes go to ``on_body`` as
        they came, past the parser (it would copy each read into a new object); at the body's
        end, what the parser would have done at the message's end, with a fresh parser for what
        follows (the old one still counts the body)."""
        handler = self.handler
        assert handler is not None
        left = self._body_left
        if len(data) <= left:
            body, rest = data, b""
        else:
            body, rest = data[:left], data[left:]
        handler.begin_batch()
        try:
            self.on_body(body)
            if not self._body_left:
                self._past_parser = False
                self._parser = httptools.HttpResponseParser(self)
                self.on_message_complete()
        except Exception:
            _log.failure("proxy response handler failed")
            self._fail("internal error")
            return
        finally:
            handler.flush()
        if rest:
            self.data_received(rest)  # (nobody asked for it: the stream is out of step)
        elif self._body_left >= MIN_BULK and self._bulk is None and self.transport is not None:
            # The middle of a big body: read it into our own buffers (lchat.proxy.bulk).
            self._bulk = BulkReader(self, self.pool.state.buffers)
            self.transport.set_protocol(self._bulk)

    def bulk_received(self, nbytes: int) -> None:
        """A read into the pool's buffers (``view``) while a big response body streams (BulkReader): the middle
        of the body goes to the handler as a slice of the buffer; anything else goes the general
        way, as ``bytes``, with this object the protocol again."""
        view = self.pool.state.buffers.view
        handler = self.handler
        if (
            nbytes < self._body_left
            and handler is not None
            and self._past_parser
            and handler.response_view(view, nbytes)
        ):
            self._body_left -= nbytes
            return
        self._bulk = None
        if self.transport is not None:
            self.transport.set_protocol(self)
        self.data_received(bytes(view[:nbytes]))

    def on_message_begin(self) -> None:
        if self.handler is None:
            # A response begins that nobody asked for (bytes after the one that completed, in
            # the same read): the stream is out of step; never reuse it.
            self.reusable = False
            if self.transport is not None:
                self.transport.close()
        self._headers = []
        self._reason = b""
        self._in_head = True

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # trailers come after the head; they are dropped
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        if parser is None or self.handler is None:
            self.reusable = False  # a response nobody asked for: the stream is out of step
            return
        status = parser.get_status_code()
        self._status = status
        if 100 <= status < 200 and status != 101:
            self._first_read = None  # a later head is not at the start of the first read
            self.handler.informational(status, self._reason, self._headers)
            return
        self._final = True
        if status == 101:
            return  # the upgrade exception follows the message end
        length: int | None = None
        chunked = False
        plain = True  # nothing to drop or rewrite in this head, but perhaps lines to take out
        spliced = False  # lines to take out (RESPONSE_SPLICED: a server's usual hop-by-hop ones)
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = value.strip().lower().endswith(b"chunked")
                plain = False
            elif lower in RESPONSE_SPLICED and (
                lower != b"connection"
                or connection_tokens(((name, value),)) <= RESPONSE_SPLICED_TOKENS
            ):
                spliced = True
            elif lower in RESPONSE_SPECIAL or lower.startswith(b"proxy-") or b"_" in lower:
                plain = False
        no_body = self._method == b"HEAD" or status in (204, 304)
        self._close_delimited = not no_body and length is None and not chunked
        self._body_left = length if length and not no_body and not chunked else 0
        keep_alive = parser.should_keep_alive()
        if not keep_alive or self._close_delimited:
            self.reusable = False
        raw: bytes | None = None
        first = self._first_read
        if plain and length is not None and keep_alive and first is not None:
            end = first.find(b"\r\n\r\n")
            if end >= 0 and first.startswith(b"HTTP/1.1 "):
                raw = first[: end + 4]
                if spliced:  # (None when its lines are not one field each: built again)
                    raw = without_lines(raw, RESPONSE_SPLICED)
        self.handler.response_head(status, self._reason, self._headers, length, chunked, raw)
        if self._method == b"HEAD":
            raise _HeadDone()

    def on_body(self, data: bytes) -> None:
        self._body_left -= len(data)
        if self.handler is not None:
            self.handler.response_body(data)

    def on_message_complete(self) -> None:
        if self._final and self._status != 101:
            self._finish()

    def _finish(self) -> None:
        if self._complete:
            return
        self._complete = True
        handler, self.handler = self.handler, None
        if handler is not None:
            handler.response_complete()

    def _fail(self, why: str) -> None:
        self.reusable = False
        handler, self.handler = self.handler, None
        if self.transport is not None:
            self.transport.abort()
        if handler is not None:
            handler.upstream_failed(why, self._final)

    def eof_received(self) -> bool:
        return False  # the space closed its side: the connection ends (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connected = False
        self.reusable = False
        self.backpressure = None
        self.pool.forget(self)
        handler = self.handler
        if handler is None:
            return
        if self._spliced:
            self.handler = None
            handler.upstream_failed("closed", True)
        elif self._final and self._close_delimited and not self._complete:
            handler.begin_batch()
            try:
                self._finish()  # the close is the end of a close-delimited body
            finally:
                handler.flush()
        elif not self._complete:
            self.handler = None
            why = "closed before responding" if not self._got_bytes else "closed mid-response"
            if self.unreachable and not self._got_bytes:
                why = PEER_UNREACHABLE
            handler.upstream_failed(why, self._final)


class DialFailed(Exception):
    """No connection: ``refused`` when the last attempt was refused (the host is up, nothing
    listens: a peer box whose router is stopping or dead), not silent or timed out."""

    def __init__(self, why: str, *, refused: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.refused = refused


def _retryable(error: BaseException) -> bool:
    """A socket that refuses, does not exist yet, or drops us before the connection is made:
    the space is (re)starting or its accept queue is full. Nothing was sent: safe to retry."""
    if isinstance(error, ConnectionRefusedError | FileNotFoundError | BlockingIOError):
        return True
    if isinstance(error, OSError):
        return error.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.ECONNRESET)
    return False


UPSTREAM_HIGH_WATER = 256 * 1024  # unsent bytes towards a space beyond which its client waits
PEER_DIAL_RETRY = 0.2  # seconds of dial retry towards a mesh peer: a refusing peer is stopping
# A mesh peer that has not accepted the connection and finished the TLS handshake within this long
# is out of reach for a request waiting on it: the mesh routes around it, or refuses at once
# ("refuse fast, never hang": a cut link must not hold every request up for the full timeout).
PEER_CONNECT_TIMEOUT = 0.8
# Why a request on its way to a peer failed when the peer went out of reach (abort_peer): not
# sent again on a new connection (it would wait for a dial that fails).
PEER_UNREACHABLE = "peer out of reach"
# Between dial attempts: 50 ms doubling to 1 s, each shortened by up to 20% at random so that the
# requests queued behind a restarting space do not all dial in the same instant.
DIAL_BACKOFF = Backoff(0.05, 1.0, jitter=(0.8, 1.0))


def target_key(target: LocalSocket | RemotePeer) -> Key:
    if isinstance(target, LocalSocket):
        return target.path  # (a string: no tuple made per request for the common target)
    return ("tls" if target.tls else "tcp", target.address, target.port, target.server_name)


def client_tls_context(ca_file: str | None = None) -> ssl.SSLContext:
    """How we verify a mesh peer: the platform's CAs, plus those in ``ca_file``
    (``LCHAT_MESH_CA_FILE``) when given; the certificate must name the space (checked by the
    ``server_hostname`` of each connection); HTTP/1.1 only."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca_file:
        context.load_verify_locations(ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    return context


class UpstreamPool(PoolCore):
    """Keep-alive connections per upstream, and dialing with the dial-retry window.

    ``reactor`` is the clock (``seconds``, ``callLater``) and must be the asyncio reactor whose
    loop is ``loop`` (the connections are asyncio ones). ``state``: the front door's
    (lchat.proxy.state), where the idle connections are counted and big bodies read into (none
    given: a state of the pool's own, unregistered)."""

    def __init__(
        self,
        reactor: IReactorTime,
        dial_retry: float = 13.0,
        max_idle_per_key: int = 256,
        idle_timeout: float = 55.0,
        connect_timeout: float = 5.0,
        tls_context: ssl.SSLContext | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        state: FrontDoorState | None = None,
    ) -> None:
        self._reactor = reactor
        self._seconds = reactor.seconds
        self.state = state if state is not None else FrontDoorState()
        self._stats = self.state.stats
        self._loop = loop
        self._dial_retry = dial_retry
        self._max_idle = max_idle_per_key
        self._idle_timeout = idle_timeout
        self._connect_timeout = connect_timeout
        self._tls_context = tls_context
        self._idle = {}  # (PoolCore's)
        self._connections: set[UpstreamConnection] = set()
        self._sweep = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_event_loop()
        return self._loop

    # -- public ---------------------------------------------------------------------------------

    def _key_of(self, target: LocalSocket | RemotePeer) -> Key:
        return target_key(target)

    def _start_sweep(self) -> None:
        self._sweep = LoopingCall(self._expire)
        self._sweep.clock = self._reactor
        self._sweep.start(max(self._idle_timeout / 4, 0.05), now=False)

    def _expire(self) -> None:
        cutoff = self._reactor.seconds() - self._idle_timeout
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since <= cutoff]:
                conn.close()
        if self._sweep is not None and not any(self._idle.values()):
            if self._sweep.running:
                self._sweep.stop()
            self._sweep = None

    def forget(self, conn: UpstreamConnection) -> None:
        self._connections.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            self._stats.idle_upstream -= 1

    def drop_idle(self, socket_path: str) -> int:
        """Close the idle connections to one unix socket (its space is stopping: a kept-alive
        connection would only make its drain wait). Returns how many were closed."""
        idle = self._idle.pop(socket_path, [])
        for conn in idle:
            self._stats.idle_upstream -= 1
            conn.close()
        return len(idle)

    def abort_peer(self, address: str, port: int) -> int:
        """Abort every connection, idle or busy, to the mesh peer at ``address``:``port`` (its
        beats go unanswered: a request waiting on it would wait for TCP to give up). Returns how
        many were aborted."""
        doomed = [
            conn
            for conn in self._connections
            if isinstance(conn.key, tuple) and conn.key[1:3] == (address, port)
        ]
        for idle in self._idle.values():
            doomed.extend(c for c in idle if c not in doomed and c.key[1:3] == (address, port))
        for conn in doomed:
            if conn.transport is not None:
                conn.reusable = False
                conn.unreachable = True
                # (connection_lost tells a request in flight that its peer went away.)
                conn.transport.abort()
        return len(doomed)

    def close(self) -> Deferred[None]:
        """Close every idle connection (shutdown)."""
        for idle in self._idle.values():
            for conn in list(idle):
                conn.close()
        if self._sweep is not None:
            if self._sweep.running:
                self._sweep.stop()
            self._sweep = None
        return succeed(None)

    # -- dialing --------------------------------------------------------------------------------

    async def _connect(self, target: LocalSocket | RemotePeer, key: Key) -> UpstreamConnection:
        loop = self.loop

        def build() -> UpstreamConnection:
            return UpstreamConnection(self, key)

        timeout = self._timeout_for(target)
        if isinstance(target, LocalSocket):
            connecting = loop.create_unix_connection(build, target.path)
        elif target.tls:
            if self._tls_context is None:
                self._tls_context = client_tls_context()
            # Pinned to the peer's address, verified against the space's name: no bypass.
            connecting = loop.create_connection(
                build,
                target.address,
                target.port,
                ssl=self._tls_context,
                server_hostname=target.server_name,
                ssl_handshake_timeout=timeout,
            )
        else:
            connecting = loop.create_connection(build, target.address, target.port)
        _, conn = await asyncio.wait_for(connecting, timeout)
        return conn

    def _timeout_for(self, target: LocalSocket | RemotePeer) -> float:
        if isinstance(target, LocalSocket):
            return self._connect_timeout
        return min(self._connect_timeout, PEER_CONNECT_TIMEOUT)

    def dial(self, target: LocalSocket | RemotePeer) -> Deferred[UpstreamConnection]:
        """A new connection to ``target``, dialled again on a refusal within the retry window."""
        key = target_key(target)
        result: Deferred[UpstreamConnection] = Deferred(lambda d: state.update(cancelled=True))
        # A space restarting on this box is worth waiting for; a peer box that refuses is
        # stopping or gone, and the mesh routes around it: retry it only briefly.
        window = self._dial_retry if isinstance(target, LocalSocket) else PEER_DIAL_RETRY
        deadline = self._reactor.seconds() + min(self._dial_retry, window)
        state: dict[str, Any] = {"cancelled": False, "attempts": 0}
        delays = DIAL_BACKOFF.delays()

        def attempt() -> None:
            if state["cancelled"]:
                return
            state["attempts"] += 1
            future = asyncio.ensure_future(self._connect(target, key), loop=self.loop)
            future.add_done_callback(done)

        def done(future: asyncio.Future[UpstreamConnection]) -> None:
            if future.cancelled():  # the loop is shutting down
                failed(asyncio.CancelledError())
                return
            error = future.exception()
            if error is None:
                connected(future.result())
            else:
                failed(error)

        def connected(conn: UpstreamConnection) -> None:
            if state["cancelled"]:
                conn.abort()
                return
            self._connections.add(conn)
            result.callback(conn)

        def failed(error: BaseException) -> None:
            if state["cancelled"]:
                return
            now = self._reactor.seconds()
            if _retryable(error) and now < deadline:
                _dial_retries.inc()
                delay = min(delays.next(), deadline - now)
                self._reactor.callLater(DIAL_BACKOFF.jittered(delay), attempt)
                return
            _dial_failures.inc()
            if isinstance(error, asyncio.TimeoutError | TimeoutError):
                why = f"no connection within {self._timeout_for(target):g}s"
            else:
                why = str(error) or type(error).__name__
            if state["attempts"] > 1:
                why += f" (after {state['attempts']} attempts)"
            refused = isinstance(error, ConnectionRefusedError) or (
                isinstance(error, OSError) and error.errno == errno.ECONNREFUSED
            )
            result.errback(DialFailed(why, refused=refused))

        attempt()
        return result

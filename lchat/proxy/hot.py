"""The data plane's hot state and its one-read path: the objects every request reads and writes
(:class:`HotStats`, :class:`Exchange`), the fields of a client connection (:class:`ClientCore`)
and of an upstream connection (:class:`UpstreamCore`), and what a small request on a kept-alive
connection does with them: recognised whole in one read, written to a pooled connection, its
whole response relayed in one write (:mod:`lchat.proxy.oneread` recognises both).

One source, two builds. Compiled with Cython in pure-Python mode (``hot.pxd`` declares the classes
as ``cdef class``es and types the one-read path's locals; setup.py builds it like the
recognisers), the fields are C struct members: the one-read path reads them without a dictionary
or a descriptor, and calls the pool and the other connection as C functions. That is what brings
the router's own work per request near the floor (docs/performance.md, "Issue 33: the one-read
path compiled"). To the Python subclasses the same fields are slots (member descriptors:
:func:`_expose_slots`). Without a compiler (or with ``LCHAT_PURE_PYTHON=1`` at run time) this
same file runs as Python with ``__slots__``: the same behaviour, slower. ``lchat/proxy/__init__.py``
picks: a compiled module built from another version of this file is never used (its digest does
not match).

Every field is an object in both builds (no C ints or flags): what Python code may store in a
slot, it may store here. Where the compiled code needs a field's type (an :class:`Exchange`, the
pool, the figures), it reads it into a typed local, which checks it: a wrong type is a TypeError,
never a misread struct.

Everything else a connection does (parsing with httptools, routing that waits, dialing, bodies,
upgrades, refusals, timeouts) is the Python subclasses': :class:`~lchat.proxy.downstream.Downstream`
(through :class:`~lchat.proxy.relay.Relay` and :class:`~lchat.proxy.client.ClientConnection`)
and :class:`~lchat.proxy.upstream.UpstreamConnection`. The fast path here declines (returns
False, having changed nothing) whatever it does not finish, and the general path takes it.

Invariant kept by every method here: what the one-read path does to a connection, an exchange and
the figures is what the general path would have done (tests/test_proxy_oneread.py's differential
tests hold the two to the same bytes, compiled and not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httptools
from twisted.python.failure import Failure

from lchat.proxy import oneread
from lchat.router import LocalSocket

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from twisted.internet.defer import Deferred

    from lchat.config import ProxyConfig
    from lchat.proxy.bulk import Buffers, BulkReader
    from lchat.proxy.downstream import ProxyFactory
    from lchat.proxy.http import Header, Valve
    from lchat.proxy.upstream import UpstreamConnection, UpstreamPool
    from lchat.router import RemotePeer, RequestHead, Target

# The line a head gains when its answer ends the connection (with the head's empty line after it).
CLOSE_LINE = b"Connection: close\r\n\r\n"
# The most request body kept after it went upstream (until the response starts), so that a request
# an upstream never processed can be sent again from its first byte: one a mesh peer refused
# because it is stopping, or one a kept-alive connection closed unanswered. Bigger bodies are
# never sent again (the peer's 503, or a 502, is the answer then).
REPLAY_LIMIT = 64 * 1024
_EMPTY: tuple[Any, ...] = ()
# Whether this module is the one Cython compiled from this file (lchat/proxy/__init__.py chooses).
COMPILED = not __file__.endswith(".py")


class HotStats:
    """The figures every request changes, kept as plain numbers and read at scrape time: a
    Prometheus counter takes a lock per change, a few of which per request would cost more than
    the rest of a small request's path (docs/performance.md)."""

    __slots__ = (
        "accepted",
        "bytes_down",
        "bytes_up",
        "connections",
        "idle_upstream",
        "in_flight",
        "one_read",
        "one_read_spliced",
        "requests",
        "tls_closed_at_once",
        "tls_full",
        "tls_resumed",
        "upgraded",
    )

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self.accepted = 0  # client connections ever made (connections: those open now)
        # TLS client connections by their handshake: a resumed session (a ticket) or a full one.
        self.tls_resumed = 0
        self.tls_full = 0
        # TLS client connections closed once the last answer and our close_notify were written,
        # not waiting for the client's (ClientConnection._close_tls_now).
        self.tls_closed_at_once = 0
        self.upgraded = 0
        self.idle_upstream = 0  # idle pooled upstream connections
        # Responses the one-read path relayed (lchat.proxy.oneread.response; the rest of
        # lchat_http_requests went the general way), and those of them whose head had a
        # server's usual hop-by-hop lines taken out (RESPONSE_SPLICED).
        self.one_read = 0
        self.one_read_spliced = 0

    def count(self, host_class: str, status: int) -> None:
        key = (host_class, status)
        self.requests[key] = self.requests.get(key, 0) + 1


class Exchange:
    """One request and its response.

    A request recognised whole in one read (lchat.proxy.oneread, ``parsed=False``) gets none of
    the parser's containers: it has no url pieces, headers or X-Forwarded-For to collect, and no
    body; its ``url`` (``b""``), ``headers``, ``body``, ``forwarded_for`` and ``replay`` are
    shared empty immutable values, which nothing appends to (a body is only ever appended to by
    the parser's callbacks; ``rewind`` makes a new list): an append would fail loudly, never leak
    into another request. (Typed as the parser's containers they stand in for.)
    """

    __slots__ = (
        "body",
        "body_complete",
        "body_size",
        "bytes_out",
        "chunked",
        "client_closes",
        "close_after",
        "forwarded_for",
        "head",
        "header_bytes",
        "headers",
        "hop_waited",
        "keep_alive",
        "length",
        "method",
        "observed",
        "origin",
        "refused_by",
        "refused_why",
        "replay",
        "replay_size",
        "rerouted",
        "response_chunked",
        "response_complete",
        "response_started",
        "retried",
        "started",
        "status",
        "streaming",
        "target",
        "upgrade",
        "upgrade_tail",
        "upstream",
        "upstream_lines",
        "url",
        "version",
    )

    def __init__(self, started: float, method: bytes = b"", parsed: bool = True) -> None:
        self.started = started
        self.method = method
        self.version = "1.1"
        self.head: RequestHead | None = None
        self.target: Target | None = None
        self.keep_alive = True  # what the client asked for, or what we allow (pipelining)
        # The client's own request said it closes (Connection: close, or HTTP/1.0 without
        # keep-alive): after the answer it sends nothing more (RFC 9112 §9.6), so the close
        # need not wait for it (ClientConnection._closing, ``quick``).
        self.client_closes = False
        self.header_bytes = 0
        self.length: int | None = None
        self.body_size = 0  # request body bytes received so far
        self.chunked = False
        self.upgrade = False
        self.body_complete = False
        self.streaming = False  # body goes straight upstream
        self.upgrade_tail = b""  # bytes after an upgrade request's head
        self.upstream_lines = b""  # the client's headers that go upstream, as "name: value" lines
        self.upstream: UpstreamConnection | None = None
        self.response_started = False
        self.response_chunked = False
        self.response_complete = False
        self.close_after = False
        self.status = 0
        self.bytes_out = 0
        self.observed = False
        self.retried = False
        self.rerouted = False  # sent elsewhere once already (a mesh peer failed it)
        self.replay_size = 0
        # A peer that refused the request unprocessed (draining, or not holding the space) before
        # its body was all here: sent elsewhere once it is (on_message_complete), told why.
        self.refused_by: RemotePeer | None = None
        self.refused_why = "stopping"
        # Who sent the request and how, when not this connection's peer and scheme: on the
        # control process's hop socket, the worker's client as the worker forwarded it
        # (hop_origin); None on every other connection.
        self.origin: tuple[bytes, bytes] | None = None
        # Its upstream deadline was extended once already (a hop target's: relay.HOP_SLACK).
        self.hop_waited = False
        # The body already written upstream, kept until the response starts so that the request
        # can be sent again (REPLAY_LIMIT); None once it outgrew the limit, or the response
        # started.
        self.replay: list[bytes] | None
        if parsed:  # (the parser fills these in)
            self.url: bytearray = bytearray()
            self.headers: list[Header] = []
            self.body: list[bytes] = []  # buffered until the upstream is ready
            self.forwarded_for: list[bytes] = []  # the client's own X-Forwarded-For
            self.replay = []
        else:
            self.url = b""  # type: ignore[assignment]
            self.headers = _EMPTY  # type: ignore[assignment]
            self.body = _EMPTY  # type: ignore[assignment]
            self.forwarded_for = _EMPTY  # type: ignore[assignment]
            self.replay = _EMPTY  # type: ignore[assignment]

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
        self.body = [*self.replay, *self.body]  # (a new list: a one-read request's are shared)
        self.replay, self.replay_size = [], 0


class ClientCore:
    """A client connection's fields, and its one-read path (see the module docstring): the base
    of :class:`~lchat.proxy.client.ClientConnection`, which sets them all (and whose subclasses
    add none)."""

    __slots__ = (
        "_access_log",
        "_active",
        "_batch",
        "_body_deadline",
        "_body_left",
        "_buffers",
        "_bulk",
        "_client",
        "_client_bytes",
        "_closed",
        "_completed",
        "_deadline",
        "_idle_action",
        "_keepalive_timeout",
        "_last_head",
        "_last_request",
        "_last_whole",
        "_linger_until",
        "_lost",
        "_max_header_bytes",
        "_max_headers",
        "_output_paused",
        "_parser",
        "_parsing",
        "_pool",
        "_progress",
        "_route",
        "_seconds",
        "_send_buffered",
        "_send_moved_at",
        "_served",
        "_serving_queue",
        "_spliced",
        "_stats",
        "_timer_action",
        "_tunnel_moved",
        "_unreported",
        "_upstream_action",
        "_upstream_timeout",
        "_waiting",
        "bulk_written",
        "cfg",
        "proxy",
        "raw_transport",
        "transport",
        "valve",
    )

    # (Declared for the type checker; ClientConnection.__init__ sets every one.)
    transport: Any
    valve: Valve | None
    proxy: ProxyFactory
    cfg: ProxyConfig
    _batch: list[bytes] | None
    _tunnel_moved: float
    raw_transport: Any
    _parser: Any
    _parsing: Exchange | None
    _active: Exchange | None
    _waiting: deque[Exchange]
    _deadline: float | None
    _timer_action: Callable[[Any], None] | None
    _body_deadline: float | None
    _completed: Exchange | None
    _progress: bool
    _unreported: int
    _spliced: bool
    _closed: bool
    _served: int
    _client: str
    _client_bytes: bytes
    _last_whole: oneread.WholeRequest | None
    _last_head: RequestHead | None
    _last_request: bytes | None
    _body_left: int
    _output_paused: bool
    _serving_queue: bool
    _send_moved_at: float
    _send_buffered: int | None
    _lost: bool
    _linger_until: float | None
    _bulk: BulkReader | None
    bulk_written: int
    _stats: HotStats
    _buffers: Buffers
    # From the factory, once (none changes while a connection lives; ClientConnection.__init__):
    # the pool, the router's route, the clock, what the one-read path reads of the configuration,
    # and the two deadlines' actions (the subclass's methods, unbound).
    _pool: PoolCore
    _route: Callable[[RequestHead], Target | Deferred[Target]]
    _seconds: Callable[[], float]
    _keepalive_timeout: float
    _upstream_timeout: float
    _max_header_bytes: int
    _max_headers: int
    _access_log: bool
    _upstream_action: Callable[[Any], None]
    _idle_action: Callable[[Any], None]

    # -- reading the client --------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if (
            not self._closed
            and not self._spliced
            and not self._body_left
            and self._parser is not None
            and self._parsing is None
            and self._active is None
            and not self._waiting
            and not self._output_paused
            and data.endswith(b"\r\n\r\n")
            and self._serve_whole(data)
        ):
            return  # (the common request: a head without a body, all in this read)
        self._received(data)

    def _received(self, data: bytes) -> None:
        """A read the one-read path did not serve: the subclass's general path."""
        raise NotImplementedError

    def _serve_whole(self, data: bytes) -> bool:
        """Serve ``data`` if it is one whole request without a body (:mod:`oneread`), as the
        parser's callbacks would have, and return True; else False, having done nothing."""
        whole = oneread.request(data, self._max_header_bytes, self._max_headers, self._last_whole)
        if whole is None:
            return False
        head = self._last_head
        if whole is not self._last_whole or head is None:
            head = self._whole_head(whole)
            if head is None:
                return False  # the general path refuses it, as it would any malformed Host
        # (else the same request as the last one served here: its head, an immutable value, again)
        now: float = self._seconds()
        ex = Exchange(now, whole.method, False)  # (not parsed: no containers for the parser)
        ex.upstream_lines = whole.lines
        ex.body_complete = True
        ex.head = head
        if whole.close:
            # Connection: close: nothing more is read, and the answer closes the connection
            # (as the parser's StopReading does on the general path).
            ex.keep_alive = False
            ex.client_closes = True
            self._parser = None
        self._completed = ex
        self._unreported = 0
        self._deadline = self._timer_action = None  # (_disarm, inline)
        # _serve, _routed and _connected, inline for a space on this box with a pooled
        # connection to it (the common case; anything else continues the general way).
        self._active = ex
        stats = self._stats
        stats.in_flight += 1
        try:
            target = self._route(head)
        except Exception:
            self._route_failed(Failure(), ex)
            return True
        if type(target) is LocalSocket and target.inflight is None:
            pool = self._pool
            upstream = pool.take_idle(target)
            if upstream is not None:
                ex.target = target
                ex.upstream = upstream
                upstream.begin(self, whole.method)
                upstream.request_sent = True
                request = self._last_request
                if request is None:
                    request = self._last_request = self._upstream_request(whole)
                transport = upstream.transport
                assert transport is not None
                transport.write(request)
                self._deadline = now + self._upstream_timeout
                self._timer_action = self._upstream_action
                valve = self.valve
                if valve is not None and valve.reasons:
                    valve.open("routing")
                return True
        self._dispatch(target, ex)
        return True

    def _whole_head(self, whole: oneread.WholeRequest) -> RequestHead | None:
        """A new request recognised whole (not the one served last): remember it, and return its
        head, or None when its Host is malformed (the subclass's)."""
        raise NotImplementedError

    def _upstream_request(self, whole: oneread.WholeRequest) -> bytes:
        """The head written upstream for a request recognised whole (the subclass's)."""
        raise NotImplementedError

    def _route_failed(self, failure: Failure, ex: Exchange) -> None:
        raise NotImplementedError

    def _dispatch(self, target: Any, ex: Exchange) -> None:
        raise NotImplementedError

    def _finish(self, ex: Exchange) -> None:
        raise NotImplementedError

    def _close_tls_now(self, last: bytes = b"") -> bool:
        """Write ``last`` and close at once, under TLS (the subclass's)."""
        raise NotImplementedError

    # -- writing to the client -----------------------------------------------------------------

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
        batch = self._batch
        self._batch = None
        if batch and self.transport is not None:
            self.transport.write(batch[0] if len(batch) == 1 else b"".join(batch))

    # -- the response in one read (UpstreamCore's handler interface) ---------------------------

    def response_whole(self, status: int, length: int, data: bytes) -> bool:
        """The whole response in one read, ``length`` bytes of body after its head, and a head
        that may go as it came but for the lines the general path takes out too
        (:func:`oneread.response`: ``data`` is the read with them taken out): relay it in one
        write and complete the request, as response_head, response_body and response_complete
        would, and return True; when the client said ``Connection: close``, with that line added
        last to the head (as response_head adds it) and the connection closed after it.
        False, having done nothing, when this request needs more than that (its answer closes
        the connection for another reason, gets headers added, or may be a mesh peer's
        refusal): the general way."""
        ex = self._active
        if (
            ex is None
            or self.transport is None
            or not ex.body_complete
            or ex.close_after
            or ex.upgrade
            or ex.version != "1.1"
            or self.proxy.draining
        ):
            return False
        target = ex.target
        local = type(target) is LocalSocket
        if local:
            if target.response_headers:  # type: ignore[union-attr]
                return False
        elif status == 503:
            return False  # perhaps a draining peer's refusal (Relay._refused_unprocessed)
        ex.replay = None
        ex.status = status
        ex.response_started = ex.response_complete = True
        ex.bytes_out = length
        stats = self._stats
        stats.bytes_down += length
        stats.one_read += 1
        if ex.keep_alive:
            self.transport.write(data)
        else:
            end = len(data) - length - 2  # (the head's empty line)
            answer = data[:end] + CLOSE_LINE + data[end + 2 :]
            # (Under TLS, with our close_notify in the same write, and closed at once.)
            if not (ex.client_closes and self.raw_transport is not None) or not (
                self._close_tls_now(answer)
            ):
                self.transport.write(answer)
            ex.close_after = True  # (_finish closes)
        upstream = ex.upstream
        ex.upstream = None
        if upstream is not None:
            pool = self._pool
            pool.release(upstream)
        valve = self.valve
        if (
            ex.keep_alive
            and local
            and not ex.observed
            and not self._waiting
            and self._parsing is None
            and not self._closed
            and not self._access_log
            and valve is not None
            and not valve.reasons
        ):
            # _finish, inline for the common case: nothing pipelined, nothing to tell.
            self._active = None
            self._served += 1
            stats.in_flight -= 1
            key = (target.kind, status)  # type: ignore[union-attr]
            requests = stats.requests
            requests[key] = requests.get(key, 0) + 1
            self._deadline = self._seconds() + self._keepalive_timeout
            self._timer_action = self._idle_action
        else:
            self._finish(ex)
        return True


class UpstreamCore:
    """An upstream connection's fields, and its one-read path (see the module docstring): the
    base of :class:`~lchat.proxy.upstream.UpstreamConnection`, which sets them all."""

    __slots__ = (
        "_body_left",
        "_bulk",
        "_close_delimited",
        "_complete",
        "_final",
        "_first_read",
        "_got_bytes",
        "_headers",
        "_in_head",
        "_method",
        "_parser",
        "_past_parser",
        "_reason",
        "_spliced",
        "_stats",
        "_status",
        "backpressure",
        "bulk_written",
        "connected",
        "handler",
        "idle_since",
        "key",
        "pool",
        "request_sent",
        "reusable",
        "reused",
        "transport",
        "unreachable",
        "valve",
        "write_paused",
    )

    # (Declared for the type checker; UpstreamConnection.__init__ sets every one.)
    pool: UpstreamPool
    key: Any
    _stats: HotStats
    transport: Any
    handler: ClientCore | None  # the client's Relay
    valve: Valve | None
    reused: int
    connected: bool
    unreachable: bool
    _parser: httptools.HttpResponseParser | None
    _method: bytes
    _headers: list[Header]
    _status: int
    _reason: bytes
    _final: bool
    _complete: bool
    _close_delimited: bool
    _spliced: bool
    _got_bytes: bool
    _in_head: bool
    _first_read: bytes | None
    request_sent: bool
    reusable: bool
    idle_since: float
    backpressure: Any
    write_paused: bool
    _body_left: int
    _past_parser: bool
    _bulk: BulkReader | None
    bulk_written: int

    def begin(self, handler: ClientCore, method: bytes) -> None:
        """Start an exchange: the caller writes the request next."""
        self.handler = handler
        self._method = method
        if self._parser is None:  # (one per connection: a kept-alive one parses response after
            self._parser = httptools.HttpResponseParser(self)  # response; a HEAD ends reuse)
        # (_headers: each head's are collected from on_message_begin on; nothing reads them before)
        self._final = self._complete = self._close_delimited = self._got_bytes = False
        self.request_sent = False
        self._body_left = 0
        self._past_parser = False

    def data_received(self, data: bytes) -> None:
        client = self.handler
        if (
            client is not None
            and not self._past_parser
            and not self._got_bytes
            and not self._spliced
            and self.request_sent
            and self.reusable
            and self._method != b"HEAD"
        ):
            whole = oneread.response(data)
            if whole is not None:
                status, length, out = whole
                if client.response_whole(status, length, out):
                    # (The common response: all of it in this read, forwarded as it came, or
                    # with the hop-by-hop lines a server sends on an ordinary answer taken out:
                    # those counted here; the relay counts them all.)
                    if out is not data:
                        stats = self._stats
                        stats.one_read_spliced += 1
                    return
        self._received(data)

    def _received(self, data: bytes) -> None:
        """A read the one-read path did not relay: the subclass's general path."""
        raise NotImplementedError


class PoolCore:
    """The upstream pool's idle connections, and taking and handing them back (every request on a
    kept-alive connection does both): the base of :class:`~lchat.proxy.upstream.UpstreamPool`,
    which sets the fields and does everything else (dialing, expiry, closing)."""

    __slots__ = ("_idle", "_max_idle", "_seconds", "_stats", "_sweep")

    # (Declared for the type checker; UpstreamPool.__init__ sets every one.)
    # The idle connections by key (a unix socket's path, or a peer's (scheme, address, port,
    # server name)); their number is the front door's idle_upstream figure.
    _idle: dict[Any, list[UpstreamConnection]]
    _max_idle: int
    _seconds: Callable[[], float]
    _stats: HotStats
    # Idle connections are expired by one sweep, not a timer each (it is on every request's
    # path); it runs only while something is idle (UpstreamPool._start_sweep).
    _sweep: Any

    def take_idle(self, target: LocalSocket | RemotePeer) -> UpstreamConnection | None:
        if type(target) is LocalSocket:
            idle = self._idle.get(target.path)  # (target_key, inline: every request's path)
        else:
            idle = self._idle.get(self._key_of(target))
        stats = self._stats
        while idle:
            conn = idle.pop()
            stats.idle_upstream -= 1
            if conn.connected and conn.reusable:
                conn.reused += 1
                return conn
        return None

    def _key_of(self, target: LocalSocket | RemotePeer) -> Any:
        raise NotImplementedError

    def release(self, conn: UpstreamConnection) -> None:
        """Hand back a connection whose exchange completed cleanly."""
        conn.handler = None
        conn.backpressure = None
        if not conn.connected:
            return
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = []
        if not conn.reusable or len(idle) >= self._max_idle:
            conn.close()
            return
        valve = conn.valve
        if valve is not None and valve.reasons:
            valve.open_all()  # an idle pooled connection must read (to see it close)
        idle.append(conn)
        stats = self._stats
        stats.idle_upstream += 1
        conn.idle_since = self._seconds()
        if self._sweep is None:
            self._start_sweep()

    def _start_sweep(self) -> None:
        raise NotImplementedError


def _expose_slots() -> None:
    """Compiled, each class's fields are C struct members, which Cython shows to Python as
    properties: a property is read several times slower than a slot (CPython specialises a
    slot's member descriptor, not a property), and the general path's Python reads these fields
    hundreds of times a request. So each becomes a member descriptor, as a slot is: its offset
    found by giving a fresh instance's field a fresh object (through the property) and looking
    for it (hot.pxd's C helpers)."""
    for cls in (HotStats, Exchange, ClientCore, UpstreamCore, PoolCore):
        for name in cls.__slots__:
            probe = cls.__new__(cls)
            held = object()
            setattr(probe, name, held)
            offset = lchat_hot_offset(probe, held)  # type: ignore[name-defined]  # noqa: F821
            lchat_hot_expose(cls, name, offset)  # type: ignore[name-defined]  # noqa: F821


if COMPILED:
    _expose_slots()
